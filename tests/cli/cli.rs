//! The `agentrt` operator binary, against real database files.

use std::time::Duration;

use agentrt::{
    EventKind, RunId, RunState, Store,
    testkit::{TempStore, database_at_schema},
};
use predicates::prelude::*;
use serde_json::{Value, json};

use crate::support::cli::{agentrt, fixture};

use crate::support::files;

fn json_of(output: &[u8]) -> Value {
    serde_json::from_slice(output)
        .unwrap_or_else(|err| panic!("{err}: {}", String::from_utf8_lossy(output)))
}

#[test]
fn runs_lists_every_run_and_filters_by_state() {
    let db = fixture();
    agentrt(db.path()).arg("runs").assert().success().stdout(
        predicate::str::contains("done")
            .and(predicate::str::contains("wait"))
            .and(predicate::str::contains("SUCCEEDED")),
    );
    let out = agentrt(db.path())
        .args(["--json", "runs", "--state", "WAITING_FOR_APPROVAL"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let page = json_of(&out.stdout);
    assert_eq!(page["next"], json!(null), "one page holds them all");
    let runs = &page["runs"];
    assert_eq!(runs.as_array().unwrap().len(), 1);
    assert_eq!(runs[0]["id"], json!("wait"));
    assert_eq!(runs[0]["state"], json!("WAITING_FOR_APPROVAL"));
    // Each run in the library's JSON shape.
    let stored = db.open().run(&RunId::from("wait")).unwrap();
    assert_eq!(runs[0], serde_json::to_value(&stored).unwrap());
}

#[test]
fn show_names_the_pending_call_and_the_lease() {
    let db = fixture();
    agentrt(db.path())
        .args(["show", "wait"])
        .assert()
        .success()
        .stdout(
            predicate::str::contains("WAITING_FOR_APPROVAL").and(predicate::str::contains("pay-1")),
        );
    let out = agentrt(db.path())
        .args(["show", "wait", "--json"])
        .output()
        .unwrap();
    let shown = json_of(&out.stdout);
    assert_eq!(shown["pending_calls"][0]["call_id"], json!("pay-1"));
    assert_eq!(shown["lease"], Value::Null);
}

#[test]
fn show_gives_the_runs_token_totals() {
    let db = fixture();
    agentrt(db.path())
        .args(["show", "done"])
        .assert()
        .success()
        .stdout(predicate::str::contains(
            "model     tokens 30 in, 5 out; 2 answers, 2 attempts (scripted-1)",
        ));
    let out = agentrt(db.path())
        .args(["show", "done", "--json"])
        .output()
        .unwrap();
    let usage = &json_of(&out.stdout)["usage"];
    assert_eq!(
        usage,
        &json!({"input_tokens": 30, "output_tokens": 5, "answers": 2, "attempts": 2, "models": ["scripted-1"]})
    );
    assert_eq!(
        serde_json::from_value::<agentrt::RunUsage>(usage.clone()).unwrap(),
        db.open().usage(&RunId::from("done")).unwrap()
    );
}

#[test]
fn events_prints_the_log_after_a_sequence_number_and_follows_until_the_run_finishes() {
    let db = fixture();
    agentrt(db.path())
        .args(["events", "done"])
        .assert()
        .success()
        .stdout(predicate::str::contains("run.finished"));
    let out = agentrt(db.path())
        .args(["--json", "events", "done", "--after", "2"])
        .output()
        .unwrap();
    let lines: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[0]["seq"], json!(3));
    assert_eq!(lines.last().unwrap()["kind"], json!("run.finished"));
    // Each event in the library's JSON shape.
    let stored = db.open().events_after(&RunId::from("done"), 2).unwrap();
    assert_eq!(
        lines,
        serde_json::to_value(&stored)
            .unwrap()
            .as_array()
            .unwrap()
            .clone()
    );
    // A finished run: --follow prints what is there and ends.
    agentrt(db.path())
        .args(["events", "done", "--follow"])
        .timeout(Duration::from_secs(20))
        .assert()
        .success();
}

#[test]
fn lease_shows_a_stale_lease_of_a_dead_process() {
    let db = fixture();
    agentrt(db.path())
        .args(["lease", "done"])
        .assert()
        .success()
        .stdout("none\n");
    let out = agentrt(db.path())
        .args(["--json", "lease", "crashed"])
        .output()
        .unwrap();
    let lease = json_of(&out.stdout);
    assert_eq!(lease["lease"]["expired"], json!(true));
    agentrt(db.path())
        .args(["lease", "crashed"])
        .assert()
        .success()
        .stdout(predicate::str::contains("stale"));
}

#[test]
fn cancel_approve_and_deny_write_what_they_say() {
    let db = fixture();
    agentrt(db.path())
        .args(["approve", "wait", "pay-1", "--by", "alice", "--note", "ok"])
        .assert()
        .success()
        .stdout(predicate::str::contains("approved"));
    let store = db.open();
    let events = store.events(&RunId::from("wait")).unwrap();
    let recorded = events
        .iter()
        .find(|e| e.kind == EventKind::ApprovalRecorded)
        .unwrap();
    assert_eq!(recorded.payload["decided_by"], json!("alice"));

    // Deciding twice is refused, with one line and a failure code; nothing is written.
    agentrt(db.path())
        .args(["deny", "wait", "pay-1", "--by", "bob"])
        .assert()
        .failure()
        .stderr(
            predicate::str::contains("already decided")
                .and(predicate::str::is_match("^agentrt: [^\n]*\n$").unwrap()),
        );
    assert_eq!(
        store.events(&RunId::from("wait")).unwrap().len(),
        events.len()
    );

    let out = agentrt(db.path())
        .args(["--json", "cancel", "wait", "--reason", "duplicate order"])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(json_of(&out.stdout)["state"], json!("CANCELLED"));
    let run = store.run(&RunId::from("wait")).unwrap();
    assert_eq!(
        (run.state, run.error.as_deref()),
        (RunState::Cancelled, Some("duplicate order"))
    );
}

#[test]
fn fork_writes_a_new_run_and_prints_its_id_without_executing_it() {
    let db = fixture();
    let out = agentrt(db.path())
        .args(["fork", "done", "--at", "1"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let id = String::from_utf8(out.stdout).unwrap();
    let run_id = RunId::from(id.trim_end());
    assert_eq!(id.lines().count(), 1, "the id alone: {id}");
    let store = db.open();
    let run = store.run(&run_id).unwrap();
    assert_eq!(
        (run.state, run.agent.as_str()),
        (RunState::Running, "plain")
    );
    assert_eq!(
        store.lease(&run_id).unwrap(),
        None,
        "nobody executes it yet"
    );
    let events = store.events(&run_id).unwrap();
    assert_eq!(
        events.iter().map(|e| e.kind).collect::<Vec<_>>(),
        [EventKind::RunStarted, EventKind::RunForked]
    );
    assert_eq!(
        events[1].payload,
        json!({"origin": "done", "at": 1, "steps_copied": 0})
    );

    let out = agentrt(db.path())
        .args(["--json", "fork", "done", "--at", "3", "--id", "again"])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(
        json_of(&out.stdout),
        json!({"run_id": "again", "origin": "done", "at": 3})
    );
    assert_eq!(store.events(&RunId::from("again")).unwrap().len(), 2 + 5);

    // A refusal is one line, and writes nothing.
    let runs = store.runs(None).unwrap().len();
    for (args, expected) in [
        (&["fork", "done", "--at", "2"][..], "is a tool call"),
        (
            &["fork", "done", "--at", "1", "--id", "wait"][..],
            "already exists",
        ),
        (
            &["fork", "nope", "--at", "1"][..],
            "no run with id \"nope\"",
        ),
    ] {
        agentrt(db.path()).args(args).assert().failure().stderr(
            predicate::str::contains(expected)
                .and(predicate::str::is_match("^agentrt: [^\n]*\n$").unwrap()),
        );
    }
    assert_eq!(store.runs(None).unwrap().len(), runs);
}

#[test]
fn deny_records_a_denial() {
    let db = fixture();
    agentrt(db.path())
        .args(["--json", "deny", "wait", "pay-1", "--by", "bob"])
        .assert()
        .success();
    let events = db.open().events(&RunId::from("wait")).unwrap();
    assert_eq!(events.last().unwrap().payload["approved"], json!(false));
}

#[test]
fn doctor_reports_schema_settings_integrity_and_stale_leases() {
    let db = fixture();
    agentrt(db.path()).arg("doctor").assert().success().stdout(
        predicate::str::contains("integrity       ok")
            .and(predicate::str::contains("crashed"))
            .and(predicate::str::contains("synchronous     FULL\n")),
    );
    let out = agentrt(db.path())
        .args(["doctor", "--json"])
        .output()
        .unwrap();
    let report = json_of(&out.stdout);
    assert_eq!(report["ok"], json!(true));
    assert_eq!(report["stale_leases"][0]["run_id"], json!("crashed"));
    assert_eq!(report["settings"]["trusted_schema"], json!("0"));
    assert_eq!(report["settings"]["synchronous"], json!("FULL"));
    // Each stale lease in the library's JSON shape, beside its run's id.
    let lease = db.open().lease(&RunId::from("crashed")).unwrap().unwrap();
    let mut stale = serde_json::to_value(&lease).unwrap();
    stale["run_id"] = json!("crashed");
    assert_eq!(report["stale_leases"], json!([stale]));
}

#[test]
fn migrate_reports_and_applies_only_on_request() {
    let db = TempStore::sqlite();
    database_at_schema(&db.path(), 4);
    let bytes = std::fs::read(db.path()).unwrap();
    agentrt(db.path())
        .arg("migrate")
        .assert()
        .success()
        .stdout(predicate::str::contains(format!(
            "{} migration(s) pending",
            agentrt::SCHEMA_VERSION - 4
        )));
    assert_eq!(
        std::fs::read(db.path()).unwrap(),
        bytes,
        "a report writes nothing"
    );
    // Other commands refuse an old schema rather than migrate it.
    agentrt(db.path())
        .arg("runs")
        .assert()
        .failure()
        .stderr(predicate::str::contains("migrate"));
    assert_eq!(std::fs::read(db.path()).unwrap(), bytes);

    let out = agentrt(db.path())
        .args(["--json", "migrate", "--apply"])
        .output()
        .unwrap();
    let report = json_of(&out.stdout);
    assert_eq!(
        (
            report["found"].clone(),
            report["now"].clone(),
            report["applied"].clone()
        ),
        (json!(4), json!(agentrt::SCHEMA_VERSION), json!(true))
    );
    agentrt(db.path())
        .arg("migrate")
        .assert()
        .success()
        .stdout(predicate::str::contains("up to date"));
}

#[test]
fn a_missing_path_is_refused_and_nothing_is_created() {
    let db = TempStore::sqlite();
    for command in [
        vec!["runs"],
        vec!["doctor"],
        vec!["migrate", "--apply"],
        vec!["cancel", "x", "--reason", "r"],
    ] {
        agentrt(db.path())
            .args(&command)
            .assert()
            .failure()
            .stderr(predicate::str::contains("no agentrt database"));
    }
    assert!(!db.path().exists());
    assert_eq!(std::fs::read_dir(db.dir()).unwrap().count(), 0);
}

#[test]
fn a_file_that_is_not_sqlite_or_is_newer_is_refused_unchanged() {
    let db = TempStore::sqlite();
    std::fs::write(
        db.path(),
        b"this is a text file, not a database; it is long enough to look like one",
    )
    .unwrap();
    let bytes = std::fs::read(db.path()).unwrap();
    for command in [vec!["runs"], vec!["doctor"], vec!["migrate", "--apply"]] {
        agentrt(db.path())
            .args(&command)
            .assert()
            .failure()
            .stderr(predicate::str::contains("not an SQLite database"));
    }
    assert_eq!(std::fs::read(db.path()).unwrap(), bytes);

    let newer = TempStore::sqlite();
    rusqlite::Connection::open(newer.path())
        .unwrap()
        .execute_batch("CREATE TABLE t (x); PRAGMA user_version = 99")
        .unwrap();
    let bytes = std::fs::read(newer.path()).unwrap();
    for command in [vec!["runs"], vec!["doctor"], vec!["migrate", "--apply"]] {
        agentrt(newer.path())
            .args(&command)
            .assert()
            .failure()
            .stderr(predicate::str::contains("newer"));
    }
    assert_eq!(std::fs::read(newer.path()).unwrap(), bytes);
}

#[test]
fn unknown_runs_and_calls_are_named_in_one_line() {
    let db = fixture();
    let events_before = Store::open(db.path())
        .unwrap()
        .events(&RunId::from("wait"))
        .unwrap()
        .len();
    for (command, expected) in [
        (vec!["show", "nope"], "no run with id \"nope\""),
        (vec!["events", "nope"], "no run with id \"nope\""),
        (vec!["lease", "nope"], "no run with id \"nope\""),
        (
            vec!["cancel", "nope", "--reason", "r"],
            "no run with id \"nope\"",
        ),
        (
            vec!["approve", "nope", "pay-1", "--by", "a"],
            "no run with id \"nope\"",
        ),
        (
            vec!["approve", "wait", "nope", "--by", "a"],
            "no tool call with id \"nope\"",
        ),
        (vec!["approve", "done", "pay-1", "--by", "a"], "not waiting"),
        (vec!["cancel", "done", "--reason", "r"], "SUCCEEDED"),
    ] {
        agentrt(db.path()).args(&command).assert().failure().stderr(
            predicate::str::contains(expected)
                .and(predicate::str::is_match("^agentrt: [^\n]*\n$").unwrap()),
        );
    }
    let store = db.open();
    assert_eq!(
        store.run(&RunId::from("wait")).unwrap().state,
        RunState::WaitingForApproval
    );
    assert_eq!(
        store.run(&RunId::from("done")).unwrap().state,
        RunState::Succeeded
    );
    assert_eq!(
        store.events(&RunId::from("wait")).unwrap().len(),
        events_before,
        "nothing written"
    );
}

#[test]
fn a_blank_decider_or_reason_and_a_directory_are_refused_with_what_they_are() {
    let db = fixture();
    let before = std::fs::read(db.path()).unwrap();
    for command in [
        vec!["approve", "wait", "c1", "--by", ""],
        vec!["deny", "wait", "c1", "--by", "  "],
        vec!["cancel", "wait", "--reason", ""],
    ] {
        agentrt(db.path())
            .args(&command)
            .assert()
            .failure()
            .stderr(predicate::str::contains("must not be empty"));
    }
    assert_eq!(
        std::fs::read(db.path()).unwrap(),
        before,
        "nothing was written"
    );
    agentrt(db.dir())
        .arg("runs")
        .assert()
        .failure()
        .stderr(predicate::str::contains(
            "is a directory, not a database file",
        ));
}

#[test]
fn purge_deletes_the_finished_runs_and_prints_what_and_the_file_sizes() {
    let db = fixture();
    let before = files(db.dir());
    agentrt(db.path())
        .args(["purge", "--dry-run", "--finished-before", "0s"])
        .assert()
        .success()
        .stdout(
            predicate::str::contains("would purge 1 run (")
                .and(predicate::str::contains("  done\n"))
                .and(predicate::str::contains("a dry run changes nothing")),
        );
    assert_eq!(files(db.dir()), before, "a dry run writes nothing");

    let out = agentrt(db.path())
        .args(["--json", "purge", "--finished-before", "0s"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report = json_of(&out.stdout);
    assert_eq!(report["runs"], json!(1));
    assert_eq!(report["run_ids"], json!(["done"]));
    assert_eq!(report["dry_run"], json!(false));
    assert!(report["events"].as_u64().unwrap() > 0);
    assert!(report["file_bytes_after"].as_u64().unwrap() > 0);
    assert_eq!(report["space"]["returns_space"], json!(true));
    let store = db.open();
    assert!(store.run(&RunId::from("done")).unwrap_err().is_not_found());
    for kept in ["wait", "crashed"] {
        assert!(!store.run(&RunId::from(kept)).unwrap().state.is_finished());
        assert!(!store.events(&RunId::from(kept)).unwrap().is_empty());
    }
    drop(store);
    agentrt(db.path())
        .args(["purge", "--finished-before", "0s"])
        .assert()
        .success()
        .stdout(predicate::str::contains("purged 0 runs").and(predicate::str::contains(" -> ")));
}

#[test]
fn purge_refuses_bad_input_and_live_or_unknown_runs_and_changes_nothing() {
    let db = fixture();
    // The seed's crashed supervisor closes its connections as its threads wind down; the last
    // connection to close copies the log into the file, which then stands alone.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while {
        drop(db.open());
        std::fs::read_dir(db.dir()).unwrap().count() > 1
    } {
        assert!(
            std::time::Instant::now() < deadline,
            "the log stays beside the file"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let before = files(db.dir());
    for (args, says) in [
        (vec!["purge"], "say which runs to purge"),
        (vec!["purge", "--dry-run"], "say which runs to purge"),
        (
            vec!["purge", "--finished-before", "30x"],
            "is neither an age (90s, 12h, 30d) nor an RFC 3339 time",
        ),
        (
            vec!["purge", "--finished-before", "1d", "--run", "done"],
            "not both",
        ),
        (
            vec!["purge", "--run", "done", "--run", "wait"],
            "run wait is WAITING_FOR_APPROVAL",
        ),
        (
            vec!["purge", "--run", "crashed"],
            "only a finished run can be purged",
        ),
        (
            vec!["purge", "--run", "done", "--run", "nope"],
            "no run with id \"nope\"",
        ),
        (
            vec!["purge", "--dry-run", "--run", "done", "--run", "nope"],
            "no run with id \"nope\"",
        ),
        (
            vec!["purge", "--run", "done", "--batch", "0"],
            "a purge batch of 0 runs",
        ),
    ] {
        agentrt(db.path())
            .args(&args)
            .assert()
            .failure()
            .stderr(predicate::str::starts_with("agentrt: ").and(predicate::str::contains(says)));
        assert!(files(db.dir()) == before, "{args:?}: nothing changed");
    }
    assert_eq!(
        db.open().run(&RunId::from("done")).unwrap().state,
        RunState::Succeeded
    );
}

#[test]
fn vacuum_rewrites_the_file_and_doctor_reports_its_free_space() {
    let db = fixture();
    agentrt(db.path()).arg("doctor").assert().success().stdout(
        predicate::str::contains("auto_vacuum     incremental")
            .and(predicate::str::contains("freelist_count")),
    );
    agentrt(db.path())
        .arg("vacuum")
        .assert()
        .success()
        .stdout(predicate::str::contains("file ").and(predicate::str::contains(" -> ")));
    assert_eq!(db.open().runs(None).unwrap().len(), 3, "every run kept");
}

#[test]
fn runs_pages_with_a_cursor_and_filters_by_agent_and_age() {
    let db = fixture();
    let all: Vec<String> = db
        .open()
        .runs(None)
        .unwrap()
        .into_iter()
        .map(|run| run.id.to_string())
        .collect();
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let mut args = vec![
            "--json".to_owned(),
            "runs".into(),
            "--limit".into(),
            "2".into(),
        ];
        if let Some(cursor) = &after {
            args.extend(["--after".into(), cursor.clone()]);
        }
        let out = agentrt(db.path()).args(&args).output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let page = json_of(&out.stdout);
        for run in page["runs"].as_array().unwrap() {
            seen.push(run["id"].as_str().unwrap().to_owned());
        }
        match page["next"].as_str() {
            Some(next) => after = Some(next.to_owned()),
            None => break,
        }
    }
    assert_eq!(seen, all, "each run once, in order");
    // The table says where the next page starts, on stderr.
    agentrt(db.path())
        .args(["runs", "--limit", "1"])
        .assert()
        .success()
        .stderr(predicate::str::contains(
            "more runs follow: the next page is `--after ",
        ));
    let out = agentrt(db.path())
        .args(["--json", "runs", "--agent", "waits", "--since", "1h"])
        .output()
        .unwrap();
    let page = json_of(&out.stdout);
    assert_eq!(page["runs"].as_array().unwrap().len(), 1);
    assert_eq!(page["runs"][0]["id"], json!("wait"));
    let out = agentrt(db.path())
        .args(["--json", "runs", "--since", "2999-01-01T00:00:00Z"])
        .output()
        .unwrap();
    assert_eq!(json_of(&out.stdout)["runs"], json!([]));
    for (args, says) in [
        (
            vec!["runs", "--after", "bogus"],
            "is not a cursor of a page of runs",
        ),
        (vec!["runs", "--limit", "0"], "give a limit from 1 to 1000"),
        (vec!["runs", "--since", "soon"], "is neither an age"),
    ] {
        agentrt(db.path())
            .args(&args)
            .assert()
            .failure()
            .stderr(predicate::str::contains(says));
    }
}

#[test]
fn events_after_a_seq_past_the_largest_a_store_holds_are_refused_not_wrapped_round() {
    let db = fixture();
    agentrt(db.path())
        .args(["events", "done", "--after", &i64::MAX.to_string()])
        .assert()
        .success()
        .stdout("");
    for after in [i64::MAX as u64 + 1, u64::MAX] {
        agentrt(db.path())
            .args(["events", "done", "--after", &after.to_string()])
            .assert()
            .failure()
            .stdout("")
            .stderr(predicate::str::contains("9223372036854775807"));
    }
}

#[test]
fn fork_refuses_a_new_id_that_names_no_run_and_writes_nothing() {
    let db = fixture();
    let before = std::fs::read(db.path()).unwrap();
    let long = "x".repeat(RunId::MAX_LEN + 1);
    for id in [
        "",
        ".",
        "..",
        "a\nb",
        "\u{1b}[31mred",
        "invoice\u{202E}fdp.exe",
        "\u{2066}x\u{2069}",
        long.as_str(),
    ] {
        agentrt(db.path())
            .args(["fork", "done", "--at", "1", "--id", id])
            .assert()
            .failure()
            .stdout("")
            .stderr(predicate::str::contains("a run id"));
    }
    assert_eq!(
        std::fs::read(db.path()).unwrap(),
        before,
        "nothing was written"
    );
    assert_eq!(db.open().runs(None).unwrap().len(), 3);
}
