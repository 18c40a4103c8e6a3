//! Retention: a purge deletes exactly the finished runs it selects, with every row of theirs,
//! in batches, and the file shrinks; a run that has not finished keeps every row, even against
//! plain SQL; a dry run writes nothing; a fork outlives its purged origin; a purge beside a
//! running supervisor leaves its runs alone.

use std::{
    collections::BTreeMap,
    pin::pin,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use agentrt::{
    Agent, Approval, Config, DecideAndResume, ModelResponse, Outcome, Purge, RequireApprovalFor,
    ResumeRun, RunId, RunState, StartRun, Store, Supervisor, ToolCall,
    testkit::{Behaviour, FixedClock, RecordingTool, ScriptedModel, TempStore, with_system},
};
use serde_json::{Value, json};

use crate::support::{files, supervise};

/// When the old runs finished: long before the purge's cutoff.
fn long_ago() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_600_000_000)
}

fn cutoff() -> SystemTime {
    long_ago() + Duration::from_secs(24 * 3600)
}

/// A model that asks for one `pay` call, then answers.
fn pays() -> ScriptedModel {
    ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new("pay-1", "pay", json!({"cents": 100}))]),
        ModelResponse::answer("paid"),
    ])
}

/// A big input: a run's row and its `run.started` event each hold it.
fn input(bytes: usize) -> Value {
    json!({ "blob": "x".repeat(bytes) })
}

/// Finishes runs `ids` at `at` (their clock's one time), each with a tool call; `approved`
/// ones wait for an approval of it first, which is recorded and then resumed.
fn finish(db: &TempStore, at: SystemTime, ids: &[&str], approved: &[&str], bytes: usize) {
    let store = db.open();
    let ids: Vec<String> = ids.iter().map(|id| id.to_string()).collect();
    let approved: Vec<String> = approved.iter().map(|id| id.to_string()).collect();
    with_system(|| async move {
        let sup = Supervisor::builder(store)
            .config(Config::default().clock(FixedClock(at)))
            .agent("plain", Agent::new(pays()).tool(RecordingTool::new("pay")))
            .agent(
                "approves",
                Agent::new(pays())
                    .tool(RecordingTool::new("pay"))
                    .policy(RequireApprovalFor::tools(["pay"])),
            )
            .start()
            .unwrap();
        for id in &ids {
            sup.send(StartRun::new("plain", input(bytes)).with_id(id.as_str()))
                .await
                .unwrap()
                .unwrap();
        }
        for id in &approved {
            sup.send(StartRun::new("approves", input(bytes)).with_id(id.as_str()))
                .await
                .unwrap()
                .unwrap();
            let approval = Approval::approve(RunId::from(id.as_str()), "pay-1", "alice");
            let reply = sup.send(DecideAndResume(approval)).await.unwrap().unwrap();
            assert!(matches!(reply.outcome, Outcome::Succeeded { .. }));
        }
    });
}

/// Leaves run `waiting` waiting for an approval and run `running` RUNNING (its process died in
/// its tool call), both moved last at `at`.
fn leave_live(db: &TempStore, at: SystemTime, waiting: &str, running: &str) {
    let store = db.open();
    let stuck = RecordingTool::new("pay").behaviour(Behaviour::Block);
    let probe = stuck.clone();
    let (waiting, running) = (waiting.to_owned(), running.to_owned());
    with_system(|| async move {
        let sup = Supervisor::builder(store)
            .config(Config::default().clock(FixedClock(at)))
            .agent(
                "approves",
                Agent::new(pays())
                    .tool(RecordingTool::new("pay"))
                    .policy(RequireApprovalFor::tools(["pay"])),
            )
            .agent("plain", Agent::new(pays()).tool(stuck))
            .start()
            .unwrap();
        sup.send(StartRun::new("approves", json!({})).with_id(waiting.as_str()))
            .await
            .unwrap()
            .unwrap();
        // The system is torn down once the tool runs: the run stays RUNNING mid-call.
        let started = sup.send(StartRun::new("plain", json!({})).with_id(running.as_str()));
        futures_util::future::select(pin!(started), pin!(probe.wait_executions(1))).await;
    });
}

const OLD_DONE: &[&str] = &["old-1", "old-2", "old-3", "old-4", "old-5"];

/// Old finished runs (one with an approval), a new finished run, and an old waiting and an old
/// running run; the store closed.
fn mixed(db: &TempStore) {
    finish(db, long_ago(), OLD_DONE, &["old-approved"], 100);
    finish(db, SystemTime::now(), &["new-done"], &[], 100);
    leave_live(db, long_ago(), "old-waiting", "old-running");
    closed(db);
}

/// Waits until the database file stands alone: the torn-down supervisor's connections close
/// as its threads wind down, and the last one to close copies the log into the file.
fn closed(db: &TempStore) {
    if agentrt::testkit::on_postgres() {
        return; // nothing of a PostgreSQL store is on disk
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        drop(db.open());
        let names: Vec<_> = std::fs::read_dir(db.dir()).unwrap().collect();
        if names.len() == 1 {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "{names:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_purge_by_age_deletes_exactly_the_old_finished_runs_with_all_their_rows() {
    let db = TempStore::new();
    mixed(&db);
    let purged: Vec<&str> = OLD_DONE.iter().copied().chain(["old-approved"]).collect();
    let kept = ["new-done", "old-waiting", "old-running"];
    let before: BTreeMap<&str, _> = purged
        .iter()
        .chain(&kept)
        .map(|id| (*id, db.rows_of(id)))
        .collect();
    for id in purged.iter().chain(&kept) {
        assert!(!before[id]["events"].is_empty(), "{id} has events");
    }
    assert_eq!(before["old-approved"]["approvals"].len(), 1);
    assert_eq!(
        db.open().run(&RunId::from("old-running")).unwrap().state,
        RunState::Running
    );

    // Batches of two: three transactions delete the six runs (a fourth finds none left).
    let report = db
        .open()
        .purge(&Purge::finished_before(cutoff()).batch(2))
        .unwrap();
    assert_eq!(report.batches, 3);
    assert_eq!(report.runs, 6);
    let mut ids: Vec<String> = report.run_ids.iter().map(|id| id.to_string()).collect();
    ids.sort();
    let mut expected: Vec<String> = purged.iter().map(|id| id.to_string()).collect();
    expected.sort();
    assert_eq!(ids, expected);
    let count =
        |table: &str| -> u64 { purged.iter().map(|id| before[id][table].len() as u64).sum() };
    assert_eq!(
        (report.steps, report.events, report.approvals),
        (count("steps"), count("events"), count("approvals"))
    );
    for id in &purged {
        assert!(
            db.rows_of(id).values().all(Vec::is_empty),
            "{id}: every row gone"
        );
    }
    for id in &kept {
        assert_eq!(db.rows_of(id), before[id], "{id}: untouched");
    }
}

#[test]
fn the_rows_of_a_run_that_has_not_finished_cannot_be_deleted_even_with_sql() {
    let db = TempStore::new();
    leave_live(&db, long_ago(), "waiting", "running");
    finish(&db, long_ago(), &["done"], &[], 10);
    drop(db.open()); // migrated, closed
    for id in ["waiting", "running"] {
        for table in ["approvals", "steps", "events"] {
            let err = db
                .execute(&format!(
                    "DELETE FROM {table} WHERE {}",
                    db.of_run(table, id)
                ))
                .err();
            // A table with no row of the run has nothing to refuse.
            if table != "approvals" {
                let err = err.unwrap_or_else(|| panic!("{table} of {id} deleted"));
                assert!(err.contains("not finished"), "{err}");
            }
        }
        let err = db
            .execute(&format!("DELETE FROM runs WHERE id = '{id}'"))
            .unwrap_err();
        assert!(err.contains("not finished"), "{err}");
    }
    // An event is never rewritten, a finished run's neither.
    let err = db
        .execute(&format!(
            "UPDATE events SET payload = '{{}}' WHERE {}",
            db.of_run("events", "done")
        ))
        .unwrap_err();
    assert!(err.contains("append-only"), "{err}");
    let store = db.open();
    assert!(!store.events(&RunId::from("running")).unwrap().is_empty());
    assert!(!store.events(&RunId::from("waiting")).unwrap().is_empty());
}

#[test]
fn a_dry_run_changes_no_byte_and_creates_nothing_and_counts_what_a_purge_deletes() {
    if agentrt::testkit::on_postgres() {
        return; // the bytes of an SQLite file, opened read-only
    }
    let db = TempStore::new();
    mixed(&db);
    let before = files(db.dir());
    assert_eq!(
        before.len(),
        1,
        "a closed database alone: {:?}",
        before.keys()
    );
    let store = Store::open_read_only(db.path()).unwrap();
    let dry = store
        .purge(&Purge::finished_before(cutoff()).dry_run(true).batch(4))
        .unwrap();
    let by_id = store
        .purge(&Purge::runs(["old-1", "old-approved"]).dry_run(true))
        .unwrap();
    drop(store);
    assert_eq!(
        files(db.dir()),
        before,
        "every byte as it was, no file beside it"
    );
    assert!(dry.dry_run && dry.space.is_none());
    assert_eq!((dry.runs, dry.batches), (6, 2));
    assert_eq!(by_id.runs, 2);
    assert_eq!(by_id.approvals, 1);

    let report = db
        .open()
        .purge(&Purge::finished_before(cutoff()).batch(4))
        .unwrap();
    assert_eq!(
        (report.runs, report.steps, report.events, report.approvals),
        (dry.runs, dry.steps, dry.events, dry.approvals)
    );
    assert_eq!(report.run_ids, dry.run_ids);
}

#[test]
fn the_file_shrinks_after_a_purge() {
    if agentrt::testkit::on_postgres() {
        return; // an SQLite file's size and its auto_vacuum
    }
    let db = TempStore::new();
    let ids: Vec<String> = (0..60).map(|n| format!("big-{n}")).collect();
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    finish(&db, long_ago(), &ids, &[], 32 * 1024);
    finish(&db, SystemTime::now(), &["keep"], &[], 32 * 1024);
    // Measured closed: the last connection copies the log into the file.
    let full = std::fs::metadata(db.path()).unwrap().len();
    assert!(full > 60 * 32 * 1024, "{full} bytes");
    let report = db.open().purge(&Purge::finished_before(cutoff())).unwrap();
    assert_eq!(report.runs, 60);
    let space = report.space.expect("a purge reports the space");
    assert!(space.returns_space, "a new database gives space back");
    assert!(space.bytes_after < space.bytes_before / 4, "{space:?}");
    assert_eq!(space.free_bytes, 0, "{space:?}");
    let after = std::fs::metadata(db.path()).unwrap().len();
    assert!(after < full / 4, "{after} of {full} bytes");
    assert_eq!(after, space.bytes_after);
    let health = db.open().health().unwrap();
    assert_eq!(health.setting("auto_vacuum"), Some("incremental"));
    assert!(health.is_ok(), "{health:?}");
    assert_eq!(
        db.open().run(&RunId::from("keep")).unwrap().state,
        RunState::Succeeded
    );
}

#[test]
fn purging_an_origin_leaves_its_fork_whole_and_resumable() {
    let db = TempStore::new();
    finish(&db, long_ago(), &["origin"], &[], 10);
    let store = db.open();
    // At the model step after the tool call: the fork copies the call and its outcome.
    let fork = store
        .fork(&RunId::from("origin"), 3, Some("fork".into()))
        .unwrap();
    let copied = store.events(&fork).unwrap();
    assert!(
        copied
            .iter()
            .any(|e| e.payload.get("copied_from").is_some())
    );
    let report = store.purge(&Purge::runs(["origin"])).unwrap();
    assert_eq!(report.runs, 1);
    assert!(
        store
            .run(&RunId::from("origin"))
            .unwrap_err()
            .is_not_found()
    );
    assert_eq!(
        store.events(&fork).unwrap(),
        copied,
        "the fork keeps its copies"
    );
    let tool = RecordingTool::new("pay");
    let probe = tool.clone();
    let reply = with_system(|| async move {
        let sup = supervise(
            store,
            Config::default(),
            "plain",
            Agent::new(pays()).tool(tool),
        );
        sup.send(ResumeRun::new(fork)).await.unwrap().unwrap()
    });
    assert_eq!(
        reply.outcome,
        Outcome::Succeeded {
            output: "paid".into()
        }
    );
    assert!(
        probe.executions().is_empty(),
        "the copied call is not run again"
    );
}

#[test]
fn a_purge_beside_a_running_supervisor_leaves_its_runs_alone() {
    let db = TempStore::new();
    finish(&db, long_ago(), OLD_DONE, &[], 1000);
    let store = db.open();
    let tool = RecordingTool::new("pay").behaviour(Behaviour::Block);
    let probe = tool.clone();
    let location = db.location();
    let (report, reply) = with_system(|| async move {
        let sup = supervise(
            store,
            Config::default().clock(FixedClock(long_ago())),
            "plain",
            Agent::new(pays()).tool(tool),
        );
        let running = sup.send(StartRun::new("plain", json!({})).with_id("busy"));
        let mut running = pin!(running);
        let executing = probe.wait_executions(1);
        futures_util::future::select(running.as_mut(), pin!(executing)).await;
        // Another handle, as another process would have, purging while the run is in its tool.
        let report = actix_rt::task::spawn_blocking(move || {
            Store::connect(&location)
                .unwrap()
                .purge(&Purge::finished_before(cutoff()).batch(2))
                .unwrap()
        })
        .await
        .unwrap();
        probe.release();
        (report, running.await.unwrap().unwrap())
    });
    assert_eq!(report.runs, OLD_DONE.len() as u64, "the finished runs only");
    assert_eq!(
        reply.outcome,
        Outcome::Succeeded {
            output: "paid".into()
        }
    );
    let events = db.open().events(&RunId::from("busy")).unwrap();
    let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(
        seqs,
        (1..=events.len() as u64).collect::<Vec<_>>(),
        "a whole log"
    );
}
