//! Helpers shared by more than one test file (each file includes this module).

use std::path::Path;

use agentrt::{Store, testkit::database_at_schema};

/// Writes, behind agentrt's back (foreign keys off), an approval of a step that does not exist
/// into the database at `path`, then checks that opening it is refused with an error naming the
/// approvals table and leaves the file at schema `version`. Returns a connection to the file,
/// for checks of what the migration left as it was.
pub fn a_dangling_approval_stops_the_migration(path: &Path, version: u32) -> rusqlite::Connection {
    a_dangling_row_stops_the_migration(
        path,
        version,
        "approvals",
        "INSERT INTO approvals (run_id, step, attempt, approved, decided_by, at)
         VALUES ('r1', 7, 1, 1, 'eve', 3)",
    )
}

/// Writes `insert`, a row of `table` that refers to nothing, into the database at `path`
/// behind agentrt's back (foreign keys off), then checks that opening it is refused with an
/// error naming `table` and leaves the file at schema `version`. Returns a connection to the
/// file, for checks of what the migration left as it was.
pub fn a_dangling_row_stops_the_migration(
    path: &Path,
    version: u32,
    table: &str,
    insert: &str,
) -> rusqlite::Connection {
    let conn = rusqlite::Connection::open(path).unwrap();
    conn.pragma_update(None, "foreign_keys", false).unwrap();
    conn.execute(insert, []).unwrap();
    drop(conn);
    let err = Store::open(path).unwrap_err();
    assert!(err.to_string().contains(table), "{err}");
    let conn = rusqlite::Connection::open(path).unwrap();
    let found: u32 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(found, version);
    conn
}

/// How many rows of the database of `conn` refer to a row that does not exist.
pub fn foreign_key_violations(conn: &rusqlite::Connection) -> i64 {
    conn.query_row("SELECT count(*) FROM pragma_foreign_key_check", [], |r| {
        r.get(0)
    })
    .unwrap()
}

/// Makes the database at `path` one at schema `version` (as that version left it) holding run
/// `r1`, waiting for a decision after a finished model call at step 1, with its first event;
/// then writes `rows`, more SQL, as that version's statements would have.
pub fn waiting_run_at_schema(path: &Path, version: u32, rows: &str) {
    database_at_schema(path, version);
    let conn = rusqlite::Connection::open(path).unwrap();
    // From schema 15 an event names its run by the run's integer key.
    let run = if version >= 15 {
        "run_key, seq, kind, at, payload) VALUES ((SELECT key FROM runs WHERE id = 'r1')"
    } else {
        "run_id, seq, kind, at, payload) VALUES ('r1'"
    };
    conn.execute_batch(&format!(
        r#"
        INSERT INTO runs (id, agent, input, state, created_at, updated_at)
        VALUES ('r1', 'a', '{{}}', 'WAITING_FOR_APPROVAL', 1, 1);
        INSERT INTO steps (run_id, step, kind, state, attempt, result)
        VALUES ('r1', 1, 'model', 'finished', 1, '{{"tool_calls":[]}}');
        {rows}
        INSERT INTO events ({run}, 1, 'run.started', 1, '{{}}');
        "#
    ))
    .unwrap();
}
