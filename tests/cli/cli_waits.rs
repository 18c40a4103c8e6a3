//! The command line over runs that wait: `waits` lists them and `show` says what each waits
//! for, both writing nothing; `answer` refuses an answer off its question's schema unchanged
//! and records one that fits; `signal` wakes a run, keeps an event for later, or finds it a
//! duplicate; and a supervisor that watches the database resumes the runs they wake.

use std::time::Duration;

use agentrt::{
    Agent, Answer, Config, EventKind, ModelResponse, RunId, RunState, SpawnRun, ToolCall, WaitKind,
    Watch,
    testkit::{ScriptedModel, TempStore, with_system},
};
use predicates::prelude::*;
use serde_json::{Value, json};

use crate::support::{
    cli::{QUESTION, agentrt, waits_fixture},
    files, until_state,
};

fn json_of(output: &[u8]) -> Value {
    serde_json::from_slice(output)
        .unwrap_or_else(|err| panic!("{err}: {}", String::from_utf8_lossy(output)))
}

/// The command's stdout, once it succeeded.
fn stdout_of(db: &TempStore, args: &[&str]) -> String {
    let out = agentrt(db.path()).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The command fails with one line on stderr saying `says`.
fn refused(db: &TempStore, args: &[&str], says: &str) {
    agentrt(db.path()).args(args).assert().failure().stderr(
        predicate::str::contains(says)
            .and(predicate::str::is_match("^agentrt: [^\n]*\n$").unwrap()),
    );
}

#[test]
fn waits_lists_the_waiting_runs_by_kind_and_show_says_what_each_waits_for_writing_nothing() {
    let db = waits_fixture();
    let dir = db.path().parent().unwrap().to_owned();
    let before = files(&dir);

    let table = stdout_of(&db, &["waits"]);
    for seen in [
        "question",
        QUESTION,
        "payment",
        "check tomorrow",
        "parent/2",
        "KIND",
    ] {
        assert!(table.contains(seen), "{seen}: {table}");
    }
    assert_eq!(table.lines().count(), 6, "a header and five waits: {table}");

    let listed = json_of(stdout_of(&db, &["--json", "waits", "--kind", "answer"]).as_bytes());
    let stored = db.open().waits(Some(WaitKind::Answer), None, 10).unwrap();
    assert_eq!(stored.len(), 2);
    assert_eq!(
        listed,
        json!({"waits": serde_json::to_value(&stored).unwrap(), "more": false})
    );
    let timers = json_of(stdout_of(&db, &["--json", "waits", "--kind", "timer"]).as_bytes());
    assert_eq!(timers["waits"][0]["run_id"], "nap");
    assert!(timers["waits"][0]["due_at"].is_u64());

    // A full page says on stderr that more follow.
    let out = agentrt(db.path())
        .args(["--json", "waits", "--limit", "2"])
        .output()
        .unwrap();
    assert_eq!(json_of(&out.stdout)["waits"].as_array().unwrap().len(), 2);
    assert_eq!(json_of(&out.stdout)["more"], true);
    agentrt(db.path())
        .args(["waits", "--limit", "2"])
        .assert()
        .success()
        .stderr(predicate::str::contains("more waits follow"));
    agentrt(db.path())
        .args(["waits", "--limit", "0"])
        .assert()
        .failure();

    let shown = stdout_of(&db, &["show", "question"]);
    assert!(shown.contains("WAITING_FOR_ANSWER"), "{shown}");
    assert!(
        shown.contains("waits     for an answer since ") && shown.contains("(call c1, step 2)"),
        "{shown}"
    );
    assert!(shown.contains(&format!("question  {QUESTION}")), "{shown}");
    assert!(shown.contains(r#"schema    {"#), "{shown}");
    let shown = json_of(stdout_of(&db, &["--json", "show", "question"]).as_bytes());
    let wait = db.open().wait(&RunId::from("question")).unwrap().unwrap();
    assert_eq!(shown["wait"], serde_json::to_value(&wait).unwrap());
    assert!(
        stdout_of(&db, &["show", "payment"]).contains(r#"waits     for event "payment" since"#)
    );
    let nap = stdout_of(&db, &["show", "nap"]);
    assert!(
        nap.contains("waits     until ") && nap.contains(": check tomorrow, since"),
        "{nap}"
    );
    assert!(
        stdout_of(&db, &["show", "parent"])
            .contains("waits     for child run parent/2 (agent researcher) since")
    );
    // The child runs, and waits for nothing.
    let child = json_of(stdout_of(&db, &["--json", "show", "parent/2"]).as_bytes());
    assert_eq!(child["state"], "RUNNING");
    assert_eq!(child["wait"], Value::Null);
    // The runs list takes the waiting states.
    let page =
        json_of(stdout_of(&db, &["--json", "runs", "--state", "WAITING_FOR_TIMER"]).as_bytes());
    assert_eq!(page["runs"][0]["id"], "nap");

    assert_eq!(files(&dir), before, "every file as it was, and no new one");
}

#[test]
fn answer_refuses_an_answer_off_its_schema_unchanged_and_records_one_that_fits() {
    let db = waits_fixture();
    let store = db.open();
    let question = RunId::from("question");
    let events = store.events(&question).unwrap().len();
    for (args, says) in [
        (
            vec!["answer", "question", "c1", r#"{"acct": 7}"#],
            "does not match the question's schema",
        ),
        (
            vec!["answer", "question", "c1", "savings"],
            "does not match the question's schema",
        ),
        (
            vec!["answer", "question", "c1", r#"{"account": savings}"#],
            "starts as JSON but is not JSON",
        ),
        (vec!["answer", "question", "c1", " "], "the answer is empty"),
        (
            vec!["answer", "question", "c9", r#""x""#],
            "has no tool call with id \"c9\"",
        ),
        (vec!["answer", "nobody", "c1", "yes"], "no run with id"),
        (
            vec!["answer", "payment", "c1", "yes"],
            "does not wait for an answer",
        ),
        (
            vec!["answer", "question", "c1", "{}", "--by", ""],
            "must not be empty",
        ),
    ] {
        if args.contains(&"--by") {
            // clap's own usage error, not one line.
            agentrt(db.path())
                .args(&args)
                .assert()
                .failure()
                .stderr(predicate::str::contains(says));
        } else {
            refused(&db, &args, says);
        }
    }
    assert_eq!(
        store.events(&question).unwrap().len(),
        events,
        "a refusal writes nothing"
    );

    let out = stdout_of(
        &db,
        &[
            "--json",
            "answer",
            "question",
            "c1",
            r#"{"account": "savings"}"#,
            "--by",
            "alice",
        ],
    );
    let recorded = Answer {
        run_id: question.clone(),
        call_id: "c1".into(),
        answer: json!({"account": "savings"}),
        by: "alice".into(),
    };
    assert_eq!(
        json_of(out.as_bytes()),
        serde_json::to_value(&recorded).unwrap()
    );
    let woken = store.events(&question).unwrap().pop().unwrap();
    assert_eq!(woken.kind, EventKind::WaitWoken);
    assert_eq!(woken.payload["answer"], json!({"account": "savings"}));
    assert_eq!(woken.payload["answered_by"], "alice");
    refused(
        &db,
        &["answer", "question", "c1", r#"{"account": "x"}"#],
        "already answered",
    );

    // Text from stdin is a JSON string; without --by, the answer is the local operator's.
    agentrt(db.path())
        .args(["answer", "confirm", "c1", "-"])
        .write_stdin("yes, go ahead\n")
        .assert()
        .success()
        .stdout(predicate::str::contains("answered by local"));
    let woken = store
        .events(&RunId::from("confirm"))
        .unwrap()
        .pop()
        .unwrap();
    assert_eq!(woken.payload["answer"], json!("yes, go ahead"));
    assert_eq!(woken.payload["answered_by"], "local");
}

#[test]
fn signal_wakes_a_waiting_run_keeps_an_event_for_later_and_finds_a_duplicate() {
    let db = waits_fixture();
    let store = db.open();
    let payment = RunId::from("payment");
    let signal = |run: &str, id: &str, payload: &str| {
        stdout_of(
            &db,
            &["signal", run, "payment", "--id", id, "--payload", payload],
        )
    };
    assert_eq!(signal("payment", "evt-1", r#"{"amount": 10}"#), "woke\n");
    assert_eq!(
        signal("payment", "evt-1", r#"{"amount": 99}"#),
        "duplicate\n"
    );
    let woken = store.events(&payment).unwrap();
    let woken: Vec<_> = woken
        .iter()
        .filter(|e| e.kind == EventKind::WaitWoken)
        .collect();
    assert_eq!(woken.len(), 1, "a duplicate writes nothing");
    assert_eq!(woken[0].payload["event_id"], "evt-1");

    // A run that does not wait for it keeps it; the payload may come from stdin.
    let out = agentrt(db.path())
        .args([
            "--json",
            "signal",
            "question",
            "payment",
            "--id",
            "evt-2",
            "--payload",
            "-",
        ])
        .write_stdin(r#"{"amount": 20}"#)
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(
        json_of(&out.stdout),
        json!({"run_id": "question", "name": "payment", "event_id": "evt-2", "delivered": "kept"})
    );

    let events = store.events(&payment).unwrap().len();
    for (args, says) in [
        (
            vec![
                "signal",
                "payment",
                "payment",
                "--id",
                "e",
                "--payload",
                "ten",
            ],
            "--payload is not JSON",
        ),
        (
            vec!["signal", "nobody", "payment", "--id", "e"],
            "no run with id",
        ),
    ] {
        refused(&db, &args, says);
    }
    assert_eq!(store.events(&payment).unwrap().len(), events);
    agentrt(db.path())
        .args(["signal", "payment", "payment", "--id", ""])
        .assert()
        .failure()
        .stderr(predicate::str::contains("must not be empty"));
}

#[test]
fn a_watching_supervisor_resumes_the_runs_an_answer_and_a_signal_wake() {
    let db = TempStore::sqlite();
    let model = |tool: &str, args: Value| {
        ScriptedModel::new(vec![
            ModelResponse::calls(vec![ToolCall::new("c1", tool, args)]),
            ModelResponse::answer("done"),
        ])
    };
    let (asks, listens) = (
        Agent::new(model("ask_person", json!({"question": "Go ahead?"}))).ask_person(),
        Agent::new(model("wait_for_event", json!({"name": "paid"}))).wait_for_event(),
    );
    let (store, path) = (db.open(), db.path());
    with_system(|| async move {
        let config = Config::default()
            .lease_ttl(Duration::from_secs(2))
            .watch(Watch::default().every(Duration::from_millis(20)));
        let supervisor = agentrt::Supervisor::builder(store.clone())
            .config(config)
            .agent("asks", asks)
            .agent("listens", listens)
            .start()
            .unwrap();
        for (agent, id) in [("asks", "q"), ("listens", "e")] {
            supervisor
                .send(SpawnRun::new(agent, json!({})).with_id(id))
                .await
                .unwrap()
                .unwrap();
        }
        until_state(&store, &RunId::from("q"), RunState::WaitingForAnswer).await;
        until_state(&store, &RunId::from("e"), RunState::WaitingForEvent).await;
        // The binary, off the actix thread: the supervisor keeps running meanwhile.
        let path2 = path.clone();
        actix_rt::task::spawn_blocking(move || {
            agentrt(&path2)
                .args(["answer", "q", "c1", "yes", "--by", "bob"])
                .assert()
                .success();
            agentrt(&path2)
                .args(["signal", "e", "paid", "--id", "evt-1"])
                .assert()
                .success()
                .stdout("woke\n");
        })
        .await
        .unwrap();
        until_state(&store, &RunId::from("q"), RunState::Succeeded).await;
        until_state(&store, &RunId::from("e"), RunState::Succeeded).await;
        drop(supervisor);
    });
}
