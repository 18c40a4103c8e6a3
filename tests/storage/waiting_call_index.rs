//! Migration 7 drops the steps table's `UNIQUE (run_id, call_id)` constraint, whose index cost
//! a page of every group commit per tool step, for a partial index of the calls that wait for
//! a decision: every row and reference survives, no two waiting calls of a run share an id, and
//! a step that does not wait stays out of the index. (That an approval finds its call through
//! the index is a unit test of the statement, in `src/store/sql.rs`.)

use agentrt::{Approval, Error, RunId, RunState, SCHEMA_VERSION, Store, testkit::TempStore};

use crate::support::migrations;

/// A schema-6 database holding a run that waits for a decision on call `c2` (step 4), after a
/// finished call `c1` (step 2).
fn schema_6_with_a_waiting_run(db: &TempStore) {
    let rows = r#"
        INSERT INTO steps (run_id, step, kind, state, attempt, call_id, tool, args, result)
        VALUES ('r1', 2, 'tool', 'finished', 1, 'c1', 'pay', '{"amount":1}', '{"ok":null}');
        INSERT INTO steps (run_id, step, kind, state, attempt, result)
        VALUES ('r1', 3, 'model', 'finished', 1, '{"tool_calls":[]}');
        INSERT INTO steps (run_id, step, kind, state, attempt, call_id, tool, args, waiting_for)
        VALUES ('r1', 4, 'tool', 'waiting', 0, 'c2', 'pay', '{"amount":5}', 'policy');
    "#;
    migrations::waiting_run_at_schema(&db.path(), 6, rows);
}

/// The indexes of the steps table other than its primary key (a `WITHOUT ROWID` table is its
/// key's b-tree): name, origin (`u` for a `UNIQUE` constraint, `c` for `CREATE INDEX`) and
/// whether it is partial.
fn indexes_of_steps(conn: &rusqlite::Connection) -> Vec<(String, String, bool)> {
    let mut stmt = conn
        .prepare(
            "SELECT name, origin, \"partial\" FROM pragma_index_list('steps')
             WHERE origin <> 'pk' ORDER BY name",
        )
        .unwrap();
    stmt.query_map([], |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

#[test]
fn the_call_id_constraint_gives_way_to_an_index_of_waiting_calls_with_every_row_kept() {
    let db = TempStore::sqlite();
    schema_6_with_a_waiting_run(&db);
    {
        let conn = rusqlite::Connection::open(db.path()).unwrap();
        let before = indexes_of_steps(&conn);
        assert!(
            before.iter().any(|(_, origin, _)| origin == "u"),
            "schema 6 has the unique constraint's index: {before:?}"
        );
    }
    let store = Store::open(db.path()).unwrap();
    assert_eq!(store.schema_version().unwrap(), SCHEMA_VERSION);
    let conn = rusqlite::Connection::open(db.path()).unwrap();
    assert_eq!(
        indexes_of_steps(&conn),
        vec![("steps_waiting_call".to_string(), "c".to_string(), true)]
    );
    let steps: i64 = conn
        .query_row("SELECT count(*) FROM steps", [], |r| r.get(0))
        .unwrap();
    assert_eq!(steps, 4);

    let run = RunId::from("r1");
    assert_eq!(store.run(&run).unwrap().state, RunState::WaitingForApproval);
    let pending = store.pending_calls(&run).unwrap();
    assert_eq!(pending.len(), 1);
    assert_eq!((pending[0].step, pending[0].call_id.as_str()), (4, "c2"));

    // A call that exists but does not wait, and one that does not exist, are told apart.
    let err = store
        .record_approval(&Approval::approve(run.clone(), "c1", "bob"))
        .unwrap_err();
    assert!(matches!(err, Error::RunState { .. }), "{err}");
    assert!(err.to_string().contains("not waiting"), "{err}");
    let err = store
        .record_approval(&Approval::approve(run.clone(), "c9", "bob"))
        .unwrap_err();
    assert!(matches!(err, Error::CallNotFound { .. }), "{err}");
    let err = store
        .record_approval(&Approval::approve(RunId::from("r9"), "c2", "bob"))
        .unwrap_err();
    assert!(matches!(err, Error::RunNotFound(_)), "{err}");

    // The waiting call is found and decided; the approval refers to its step.
    store
        .record_approval(&Approval::approve(run.clone(), "c2", "bob"))
        .unwrap();
    conn.pragma_update(None, "foreign_keys", true).unwrap();
    let (step, attempt): (u32, u32) = conn
        .query_row(
            "SELECT step, attempt FROM approvals WHERE run_id = 'r1'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!((step, attempt), (4, 1));
    assert_eq!(migrations::foreign_key_violations(&conn), 0);
}

fn assert_refused_as_a_repeated_waiting_call(result: rusqlite::Result<usize>) {
    let err = result.unwrap_err().to_string();
    assert!(
        err.contains("UNIQUE constraint failed: steps.run_id, steps.call_id"),
        "{err}"
    );
}

#[test]
fn two_waiting_calls_of_a_run_cannot_share_an_id_and_other_steps_stay_out_of_the_index() {
    let db = TempStore::sqlite();
    schema_6_with_a_waiting_run(&db);
    drop(Store::open(db.path()).unwrap());
    let conn = rusqlite::Connection::open(db.path()).unwrap();
    // A second waiting call with the id of the one that waits is refused by the database.
    let refused = conn.execute(
        "INSERT INTO steps (run_id, step, kind, state, attempt, call_id, tool, args, waiting_for)
         VALUES ('r1', 5, 'tool', 'waiting', 0, 'c2', 'pay', '{}', 'policy')",
        [],
    );
    assert_refused_as_a_repeated_waiting_call(refused);
    // The loop keeps every call id of a run distinct; the database no longer checks the ids of
    // steps that do not wait (their index cost a page per tool step).
    conn.execute(
        "INSERT INTO steps (run_id, step, kind, state, attempt, call_id, tool, args)
         VALUES ('r1', 5, 'tool', 'pending', 0, 'c2', 'pay', '{}')",
        [],
    )
    .unwrap();
    // Moving it to wait while c2 waits is refused too.
    let refused = conn.execute(
        "UPDATE steps SET state = 'waiting', waiting_for = 'policy' WHERE run_id = 'r1' AND step = 5",
        [],
    );
    assert_refused_as_a_repeated_waiting_call(refused);
    // A thousand tool steps that do not wait leave the index with its one waiting call.
    let mut insert = conn
        .prepare(
            "INSERT INTO steps (run_id, step, kind, state, attempt, call_id, tool, args)
             VALUES ('r1', ?1, 'tool', 'finished', 1, 'c' || ?1, 'pay', '{}')",
        )
        .unwrap();
    for step in 6..1006 {
        insert.execute([step]).unwrap();
    }
    let entries: i64 = conn
        .query_row(
            "SELECT sum(ncell) FROM dbstat WHERE name = 'steps_waiting_call' AND pagetype = 'leaf'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(entries, 1);
}

#[test]
fn a_schema_6_database_with_a_dangling_reference_is_not_migrated_and_left_at_its_version() {
    let db = TempStore::sqlite();
    schema_6_with_a_waiting_run(&db);
    let conn = migrations::a_dangling_approval_stops_the_migration(&db.path(), 6);
    assert!(
        indexes_of_steps(&conn)
            .iter()
            .any(|(_, origin, _)| origin == "u"),
        "the old table, with its constraint, is intact"
    );
}
