//! Migration 6 rebuilds the steps table with its constraints spelled as comparisons: every row,
//! key and reference survives, the constraints still refuse what they refused, and writing a
//! step no longer builds a temporary table.

use agentrt::{Approval, RunId, RunState, SCHEMA_VERSION, Store, testkit::TempStore};

use crate::support::migrations;

/// A schema-5 database holding a run that waits for an approval of its step 2, with one
/// approval already recorded for an earlier attempt.
fn schema_5_with_a_waiting_run(db: &TempStore) {
    let rows = r#"
        INSERT INTO steps (run_id, step, kind, state, attempt, call_id, tool, args, waiting_for)
        VALUES ('r1', 2, 'tool', 'waiting', 1, 'c1', 'pay', '{"amount":5}', 'reconcile');
        INSERT INTO approvals (run_id, step, attempt, approved, decided_by, at)
        VALUES ('r1', 2, 1, 0, 'alice', 2);
    "#;
    migrations::waiting_run_at_schema(&db.path(), 5, rows);
}

#[test]
fn the_steps_table_is_rebuilt_with_every_row_and_reference_kept() {
    let db = TempStore::sqlite();
    schema_5_with_a_waiting_run(&db);
    let store = Store::open(db.path()).unwrap();
    assert_eq!(store.schema_version().unwrap(), SCHEMA_VERSION);
    assert_eq!(
        store.run(&RunId::from("r1")).unwrap().state,
        RunState::WaitingForApproval
    );
    let pending = store.pending_calls(&RunId::from("r1")).unwrap();
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].call_id, "c1");
    assert_eq!(pending[0].args["amount"], 5);
    // The approvals still refer to the steps: one for the current attempt is accepted.
    store
        .record_approval(&Approval::approve(RunId::from("r1"), "c1", "bob"))
        .unwrap();
    let conn = rusqlite::Connection::open(db.path()).unwrap();
    conn.pragma_update(None, "foreign_keys", true).unwrap();
    assert_eq!(migrations::foreign_key_violations(&conn), 0);
    let refused = conn.execute(
        "INSERT INTO approvals (run_id, step, attempt, approved, decided_by, at)
         VALUES ('r1', 9, 1, 1, 'eve', 3)",
        [],
    );
    assert!(
        refused.is_err(),
        "an approval of a step that does not exist"
    );
}

#[test]
fn the_rebuilt_constraints_refuse_what_they_refused() {
    let db = TempStore::sqlite();
    drop(Store::open(db.path()).unwrap());
    let conn = rusqlite::Connection::open(db.path()).unwrap();
    conn.execute(
        "INSERT INTO runs (id, agent, input, state, created_at, updated_at)
         VALUES ('r1', 'a', '{}', 'RUNNING', 1, 1)",
        [],
    )
    .unwrap();
    for (kind, state, waiting_for) in [
        ("model", "sleeping", None),
        ("plan", "pending", None),
        ("tool", "waiting", Some("operator")),
    ] {
        let refused = conn.execute(
            "INSERT INTO steps (run_id, step, kind, state, attempt, waiting_for)
             VALUES ('r1', 1, ?1, ?2, 0, ?3)",
            rusqlite::params![kind, state, waiting_for],
        );
        assert!(
            refused.is_err(),
            "{kind} {state} {waiting_for:?} is refused"
        );
    }
    conn.execute(
        "INSERT INTO steps (run_id, step, kind, state, attempt, waiting_for)
         VALUES ('r1', 1, 'tool', 'waiting', 0, 'policy')",
        [],
    )
    .unwrap();
}

#[test]
fn writing_a_step_builds_no_temporary_table() {
    let db = TempStore::sqlite();
    drop(Store::open(db.path()).unwrap());
    let conn = rusqlite::Connection::open(db.path()).unwrap();
    for sql in [
        "INSERT INTO steps (run_id, step, kind, state, attempt) VALUES (?1, ?2, 'model', 'in_flight', 1)",
        "UPDATE steps SET state = ?3, waiting_for = ?4 WHERE run_id = ?1 AND step = ?2",
    ] {
        let mut stmt = conn.prepare(&format!("EXPLAIN {sql}")).unwrap();
        // EXPLAIN lists the program; its parameters need no values.
        let mut rows = stmt.raw_query();
        let mut opcodes = Vec::new();
        while let Some(row) = rows.next().unwrap() {
            opcodes.push(row.get::<_, String>(1).unwrap());
        }
        assert!(
            !opcodes.iter().any(|op| op == "OpenEphemeral"),
            "{sql}: {opcodes:?}"
        );
    }
}

#[test]
fn a_database_with_a_dangling_reference_is_not_migrated_and_left_at_its_version() {
    let db = TempStore::sqlite();
    schema_5_with_a_waiting_run(&db);
    let conn = migrations::a_dangling_approval_stops_the_migration(&db.path(), 5);
    let steps: i64 = conn
        .query_row("SELECT count(*) FROM steps", [], |r| r.get(0))
        .unwrap();
    assert_eq!(steps, 2, "the old table is intact");
}
