//! Migration 13 rebuilds the event log as a table appended at its end, with no trigger on an
//! insert, migration 15 names each event's run by the run's integer key, and migration 16
//! drops the check of its payloads' JSON: every event keeps its run, place, kind, time and
//! payload, the log's rules still hold (append-only, kept while the run has not finished, one
//! event per place, none of a run that does not exist), a payload that is not JSON is refused
//! when read, and a run's next event follows its last.

use agentrt::{Approval, EventKind, RunId, RunState, SCHEMA_VERSION, Store, testkit::TempStore};

use crate::support::migrations;

/// A schema-12 database: run `r1` waits for a decision on its step 2, with three events, and
/// `r2` has finished, with two; their events were written interleaved in time.
fn schema_12_with_two_logs(db: &TempStore) {
    let rows = r#"
        INSERT INTO steps (run_id, step, kind, state, attempt, call_id, tool, args, waiting_for)
        VALUES ('r1', 2, 'tool', 'waiting', 0, 'c1', 'pay', '{"amount":5}', 'policy');
        INSERT INTO runs (id, agent, input, state, output, created_at, updated_at)
        VALUES ('r2', 'a', '{}', 'SUCCEEDED', 'done', 1, 4);
        INSERT INTO events (run_id, seq, kind, at, payload)
        VALUES ('r2', 1, 'run.started', 1, '{"agent":"a"}');
        INSERT INTO events (run_id, seq, kind, at, step, payload)
        VALUES ('r1', 2, 'step.model_finished', 3, 1, '{"tool_calls":[{"id":"c1"}]}');
        INSERT INTO events (run_id, seq, kind, at, payload)
        VALUES ('r2', 2, 'run.finished', 4, '{"state":"SUCCEEDED"}');
        INSERT INTO events (run_id, seq, kind, at, step, payload)
        VALUES ('r1', 3, 'policy.decided', 5, 2, '{"decision":"approve"}');
    "#;
    migrations::waiting_run_at_schema(&db.path(), 12, rows);
}

fn log(store: &Store, run: &str) -> Vec<(u64, String, Option<u32>, String)> {
    store
        .events(&RunId::from(run))
        .unwrap()
        .into_iter()
        .map(|e| {
            (
                e.seq,
                e.kind.as_str().to_owned(),
                e.step,
                e.payload.to_string(),
            )
        })
        .collect()
}

#[test]
fn every_event_keeps_its_run_place_and_payload_and_the_next_follows_the_last() {
    let db = TempStore::sqlite();
    schema_12_with_two_logs(&db);
    let store = Store::open(db.path()).unwrap();
    assert_eq!(store.schema_version().unwrap(), SCHEMA_VERSION);
    assert_eq!(
        log(&store, "r1"),
        vec![
            (1, "run.started".into(), None, "{}".into()),
            (
                2,
                "step.model_finished".into(),
                Some(1),
                r#"{"tool_calls":[{"id":"c1"}]}"#.into()
            ),
            (
                3,
                "policy.decided".into(),
                Some(2),
                r#"{"decision":"approve"}"#.into()
            ),
        ]
    );
    assert_eq!(
        log(&store, "r2"),
        vec![
            (1, "run.started".into(), None, r#"{"agent":"a"}"#.into()),
            (
                2,
                "run.finished".into(),
                None,
                r#"{"state":"SUCCEEDED"}"#.into()
            ),
        ]
    );
    assert_eq!(
        store.run(&RunId::from("r1")).unwrap().state,
        RunState::WaitingForApproval
    );
    // A decision appends to the waiting run's log, after its last event.
    store
        .record_approval(&Approval::approve(RunId::from("r1"), "c1", "bob"))
        .unwrap();
    let events = store.events(&RunId::from("r1")).unwrap();
    assert_eq!(events.len(), 4);
    assert_eq!(events[3].seq, 4);
    assert_eq!(events[3].kind, EventKind::ApprovalRecorded);
}

#[test]
fn the_rebuilt_log_keeps_the_rules_of_the_old_one() {
    let db = TempStore::sqlite();
    schema_12_with_two_logs(&db);
    drop(Store::open(db.path()).unwrap());
    let conn = rusqlite::Connection::open(db.path()).unwrap();
    conn.pragma_update(None, "foreign_keys", true).unwrap();
    assert_eq!(migrations::foreign_key_violations(&conn), 0);
    let refused = |sql: &str, why: &str| {
        let err = conn.execute(sql, []).unwrap_err();
        assert!(err.to_string().contains(why), "{sql}: {err}");
    };
    refused(
        "UPDATE events SET payload = '{}' WHERE run_key = (SELECT key FROM runs WHERE id = 'r2')",
        "append-only",
    );
    refused(
        "DELETE FROM events WHERE run_key = (SELECT key FROM runs WHERE id = 'r1')",
        "append-only while their run has not finished",
    );
    refused(
        "INSERT INTO events (run_key, seq, kind, at, payload)
         VALUES ((SELECT key FROM runs WHERE id = 'r1'), 3, 'x', 9, '{}')",
        "UNIQUE",
    );
    refused(
        "INSERT INTO events (run_key, seq, kind, at, payload) VALUES (999999, 1, 'x', 9, '{}')",
        "FOREIGN KEY",
    );
    // A finished run's events may still be purged.
    assert_eq!(
        conn.execute(
            "DELETE FROM events WHERE run_key = (SELECT key FROM runs WHERE id = 'r2')",
            []
        )
        .unwrap(),
        2
    );
    // No trigger is left on an insert: the store writes the change of a release itself.
    let on_insert: i64 = conn
        .query_row(
            "SELECT count(*) FROM sqlite_schema WHERE type = 'trigger' AND tbl_name = 'events'
             AND sql LIKE '%INSERT ON events%'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(on_insert, 0);
}

/// The log keeps no check of its payloads' JSON (the store writes only JSON): a payload that
/// is not JSON, written behind the store's back, is refused when read, with a clear error,
/// and the rest of the log is read as before.
#[test]
fn a_payload_that_is_not_json_is_refused_when_read() {
    let db = TempStore::sqlite();
    schema_12_with_two_logs(&db);
    let store = Store::open(db.path()).unwrap();
    let r1 = RunId::from("r1");
    let before = store.events(&r1).unwrap().len();
    let conn = rusqlite::Connection::open(db.path()).unwrap();
    conn.execute(
        "INSERT INTO events (run_key, seq, kind, at, payload)
         VALUES ((SELECT key FROM runs WHERE id = 'r1'), ?1, 'run.finished', 9, 'not json')",
        [before as i64 + 1],
    )
    .unwrap();
    let err = store.events(&r1).unwrap_err().to_string();
    assert!(err.contains("payload"), "{err}");
    assert_eq!(store.events(&RunId::from("r2")).unwrap().len(), 2);
}

#[test]
fn an_event_of_a_run_that_does_not_exist_stops_the_migration_and_leaves_the_file_at_12() {
    let db = TempStore::sqlite();
    schema_12_with_two_logs(&db);
    migrations::a_dangling_row_stops_the_migration(
        &db.path(),
        12,
        "events",
        "INSERT INTO events (run_id, seq, kind, at, payload) VALUES ('ghost', 1, 'x', 1, '{}')",
    );
}

/// The rows of `sql`, each a text and an integer.
fn pairs(conn: &rusqlite::Connection, sql: &str) -> Vec<(String, i64)> {
    let mut stmt = conn.prepare(sql).unwrap();
    stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .collect::<rusqlite::Result<_>>()
        .unwrap()
}

/// Migration 15 gives each run an integer key, its rowid until then, and the event log names its
/// run by that key: every event stays with its run, and a new run's key comes after every key
/// given before, purged or not.
#[test]
fn each_run_keeps_its_rowid_as_its_key_and_its_events_follow_it() {
    let db = TempStore::sqlite();
    schema_12_with_two_logs(&db);
    let rowids = pairs(
        &rusqlite::Connection::open(db.path()).unwrap(),
        "SELECT id, rowid FROM runs ORDER BY id",
    );
    let store = Store::open(db.path()).unwrap();
    assert_eq!(store.schema_version().unwrap(), SCHEMA_VERSION);
    drop(store);
    let conn = rusqlite::Connection::open(db.path()).unwrap();
    let keys = pairs(&conn, "SELECT id, key FROM runs ORDER BY id");
    assert_eq!(keys, rowids);
    let by_run = pairs(
        &conn,
        "SELECT runs.id, count(*) FROM events JOIN runs ON runs.key = events.run_key
         GROUP BY runs.id ORDER BY runs.id",
    );
    assert_eq!(by_run, vec![("r1".into(), 3), ("r2".into(), 2)]);
    // The newest run purged, the next one does not get its key again.
    let newest = keys.iter().map(|(_, key)| *key).max().unwrap();
    conn.execute_batch(
        "PRAGMA foreign_keys = ON;
         DELETE FROM events WHERE run_key = (SELECT key FROM runs WHERE id = 'r2');
         DELETE FROM runs WHERE id = 'r2';
         INSERT INTO runs (id, agent, input, state, created_at, updated_at)
         VALUES ('r3', 'a', '{}', 'RUNNING', 9, 9);",
    )
    .unwrap();
    let r3: i64 = conn
        .query_row("SELECT key FROM runs WHERE id = 'r3'", [], |r| r.get(0))
        .unwrap();
    assert!(r3 > newest, "{r3} after {newest}");
}

#[test]
fn an_event_of_a_run_that_does_not_exist_stops_migration_15_and_leaves_the_file_at_14() {
    let db = TempStore::sqlite();
    migrations::waiting_run_at_schema(&db.path(), 14, "");
    migrations::a_dangling_row_stops_the_migration(
        &db.path(),
        14,
        "events",
        "INSERT INTO events (run_id, seq, kind, at, payload) VALUES ('ghost', 1, 'x', 1, '{}')",
    );
}

/// Migration 16 copies the steps and the event log without their JSON checks: every row stays,
/// and so do the rules the tables' triggers keep.
#[test]
fn migration_16_keeps_every_step_and_event_and_the_rules_of_both() {
    let db = TempStore::sqlite();
    migrations::waiting_run_at_schema(&db.path(), 15, "");
    let conn = rusqlite::Connection::open(db.path()).unwrap();
    let rows = |conn: &rusqlite::Connection| -> (String, i64) {
        conn.query_row(
            "SELECT (SELECT result FROM steps WHERE run_id = 'r1' AND step = 1),
                    (SELECT count(*) FROM events)",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap()
    };
    let before = rows(&conn);
    drop(conn);
    let store = Store::open(db.path()).unwrap();
    assert_eq!(store.schema_version().unwrap(), SCHEMA_VERSION);
    let conn = rusqlite::Connection::open(db.path()).unwrap();
    conn.pragma_update(None, "foreign_keys", true).unwrap();
    assert_eq!(rows(&conn), before);
    assert_eq!(migrations::foreign_key_violations(&conn), 0);
    let err = conn
        .execute("DELETE FROM steps WHERE run_id = 'r1'", [])
        .unwrap_err();
    assert!(err.to_string().contains("cannot be deleted"), "{err}");
    let err = conn
        .execute("UPDATE events SET payload = '{}'", [])
        .unwrap_err();
    assert!(err.to_string().contains("append-only"), "{err}");
}

#[test]
fn a_wait_of_a_step_that_does_not_exist_stops_migration_16_and_leaves_the_file_at_15() {
    let db = TempStore::sqlite();
    migrations::waiting_run_at_schema(&db.path(), 15, "");
    migrations::a_dangling_row_stops_the_migration(
        &db.path(),
        15,
        "waits",
        "INSERT INTO waits (run_id, step, agent, kind, key, detail, since)
         VALUES ('r1', 9, 'a', 'timer', 't', '{}', 1)",
    );
}
