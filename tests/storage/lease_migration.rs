//! A database of schema 4 (before the lease) migrates with its runs: a RUNNING run gets a grace
//! lease of the default TTL, is refused until it passes, then is taken over.

use std::time::{Duration, SystemTime};

use agentrt::{
    Agent, Config, DEFAULT_LEASE_TTL, Error, EventKind, ModelResponse, Outcome, ResumeRun, RunId,
    SCHEMA_VERSION, Store, ToolCall,
    testkit::{
        CountingClock, RecordingTool, ScriptedModel, TempStore, database_at_schema, with_system,
    },
};
use serde_json::json;

use crate::support::supervise;

const PRE_LEASE_OWNER: &str = "agentrt:pre-lease-version";

/// Writes a database as agentrt's schema 4 left it: a run RUNNING with its tool call in flight.
fn write_schema_4_database(path: &std::path::Path) {
    database_at_schema(path, 4);
    let conn = rusqlite::Connection::open(path).unwrap();
    conn.execute_batch(
        r#"
        INSERT INTO runs (id, agent, input, state, created_at, updated_at)
        VALUES ('old-run', 'a', '{}', 'RUNNING', 1000, 1004),
               ('old-done', 'a', '{}', 'SUCCEEDED', 1000, 1001);
        INSERT INTO steps (run_id, step, kind, state, attempt, call_id, tool, args, result) VALUES
            ('old-run', 1, 'model', 'finished', 1, NULL, NULL, NULL,
             '{"tool_calls":[{"id":"c1","name":"sync","args":{}}]}'),
            ('old-run', 2, 'tool', 'in_flight', 1, 'c1', 'sync', '{}', NULL);
        INSERT INTO events (run_id, seq, kind, at, step, payload) VALUES
            ('old-run', 1, 'run.started', 1000, NULL, '{"agent":"a","input":{}}'),
            ('old-run', 2, 'step.model_started', 1001, 1, '{"attempt":1}'),
            ('old-run', 3, 'step.model_finished', 1002, 1,
             '{"tool_calls":[{"id":"c1","name":"sync","args":{}}]}'),
            ('old-run', 4, 'policy.decided', 1003, 2, '{"call_id":"c1","decision":"allow"}'),
            ('old-run', 5, 'step.tool_started', 1004, 2, '{"call_id":"c1","attempt":1}'),
            ('old-done', 1, 'run.started', 1000, NULL, '{"agent":"a","input":{}}');
        PRAGMA user_version = 4;
        "#,
    )
    .unwrap();
}

#[test]
fn a_schema_4_database_migrates_with_its_runs_and_honours_the_grace_lease() {
    let db = TempStore::sqlite();
    write_schema_4_database(&db.path());

    let before_open = SystemTime::now();
    let store = db.open();
    let after_open = SystemTime::now();
    assert_eq!(store.schema_version().unwrap(), SCHEMA_VERSION);

    // The RUNNING run got the grace lease; the finished one holds none.
    let run_id = RunId::from("old-run");
    let grace = store.lease(&run_id).unwrap().expect("a grace lease");
    assert_eq!(grace.owner, PRE_LEASE_OWNER);
    let slack = Duration::from_secs(1);
    assert!(
        grace.expires_at >= before_open + DEFAULT_LEASE_TTL - slack,
        "{grace:?}"
    );
    assert!(
        grace.expires_at <= after_open + DEFAULT_LEASE_TTL + slack,
        "{grace:?}"
    );
    assert_eq!(store.lease(&RunId::from("old-done")).unwrap(), None);
    let events_before = store.events(&run_id).unwrap();

    let sync = RecordingTool::new("sync").idempotent(true);
    let model = ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new("c1", "sync", json!({}))]),
        ModelResponse::answer("synced"),
    ]);
    let agent = Agent::new(model).tool(sync.clone());
    let clock = CountingClock::default();
    let config = Config::default()
        .clock(clock.clone())
        .lease_ttl(Duration::from_millis(300));
    let (refused, clock_reads, resumed) = with_system(|| async move {
        let sup = supervise(store, config, "a", agent);
        let refused = sup.send(ResumeRun::new(run_id.clone())).await.unwrap();
        let clock_reads = clock.reads();
        // Wait out the grace lease: its stored expiry is the condition.
        let wait = grace
            .expires_at
            .duration_since(SystemTime::now())
            .unwrap_or_default();
        actix_rt::time::sleep(wait + Duration::from_millis(5)).await;
        (
            refused,
            clock_reads,
            sup.send(ResumeRun::new(run_id)).await.unwrap(),
        )
    });

    let err = refused.unwrap_err();
    assert!(
        matches!(&err, Error::RunLeased { owner, .. } if owner == PRE_LEASE_OWNER),
        "{err}"
    );
    assert_eq!(clock_reads, 0);
    assert_eq!(
        resumed.unwrap().outcome,
        Outcome::Succeeded {
            output: "synced".into()
        }
    );
    let events = db.open().events(&RunId::from("old-run")).unwrap();
    assert_eq!(
        events[..5],
        events_before[..],
        "the old log is kept as it was"
    );
    let taken = events
        .iter()
        .find(|e| e.kind == EventKind::LeaseTakenOver)
        .unwrap();
    assert_eq!(taken.payload["previous_owner"], json!(PRE_LEASE_OWNER));
    let count = |kind| events.iter().filter(|e| e.kind == kind).count();
    assert_eq!(count(EventKind::StepInterrupted), 1);
    assert_eq!(count(EventKind::StepReconciled), 1);
    assert_eq!(
        sync.executions().len(),
        1,
        "the interrupted idempotent call ran again once"
    );
    assert_eq!(db.open().lease(&RunId::from("old-run")).unwrap(), None);
}

#[test]
fn opening_the_current_schema_again_migrates_nothing() {
    let db = TempStore::sqlite();
    let store = db.open();
    drop(store);
    let store = Store::open(db.path()).unwrap();
    assert_eq!(store.schema_version().unwrap(), SCHEMA_VERSION);
}
