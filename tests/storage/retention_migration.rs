//! A database of schema 8 (before retention) migrates with its runs: its events are kept, a
//! purge deletes its finished runs and never its live ones, and, since it was created without
//! `auto_vacuum`, its file keeps the freed space until `Store::vacuum` gives it back and
//! switches it to giving space back after every purge.

use agentrt::{
    Purge, RunId, RunState, SCHEMA_VERSION,
    testkit::{TempStore, database_at_schema},
};

/// Writes a database as agentrt's schema 8 left it: a finished run with a big input, and a run
/// still RUNNING.
fn write_schema_8_database(path: &std::path::Path) {
    database_at_schema(path, 8);
    let conn = rusqlite::Connection::open(path).unwrap();
    let blob = "x".repeat(64 * 1024);
    let input = serde_json::json!({ "blob": blob }).to_string();
    for n in 0..20 {
        conn.execute(
            "INSERT INTO runs (id, agent, input, state, output, created_at, updated_at)
             VALUES (?1, 'a', ?2, 'SUCCEEDED', 'done', 1000, 1002)",
            rusqlite::params![format!("old-done-{n}"), input],
        )
        .unwrap();
        conn.execute(
            "INSERT INTO events (run_id, seq, kind, at, step, payload) VALUES
                 (?1, 1, 'run.started', 1000, NULL, ?2),
                 (?1, 2, 'run.finished', 1002, NULL, '{\"state\":\"SUCCEEDED\",\"output\":\"done\"}')",
            rusqlite::params![
                format!("old-done-{n}"),
                format!("{{\"agent\":\"a\",\"input\":{input}}}")
            ],
        )
        .unwrap();
    }
    conn.execute_batch(
        r#"
        INSERT INTO runs (id, agent, input, state, created_at, updated_at, lease_owner,
                          lease_expires_at, lease_epoch)
        VALUES ('old-run', 'a', '{}', 'RUNNING', 1000, 1001, 'gone', 1500, 1);
        INSERT INTO steps (run_id, step, kind, state, attempt) VALUES
            ('old-run', 1, 'model', 'in_flight', 1);
        INSERT INTO events (run_id, seq, kind, at, step, payload) VALUES
            ('old-run', 1, 'run.started', 1000, NULL, '{"agent":"a","input":{}}'),
            ('old-run', 2, 'step.model_started', 1001, 1, '{"attempt":1}');
        "#,
    )
    .unwrap();
    let auto_vacuum: i64 = conn
        .query_row("PRAGMA auto_vacuum", [], |row| row.get(0))
        .unwrap();
    assert_eq!(
        auto_vacuum, 0,
        "an older agentrt created it without auto_vacuum"
    );
}

#[test]
fn a_schema_8_database_migrates_keeps_its_events_and_is_purged_then_vacuumed() {
    let db = TempStore::sqlite();
    write_schema_8_database(&db.path());
    let store = db.open();
    assert_eq!(store.schema_version().unwrap(), SCHEMA_VERSION);
    let running = RunId::from("old-run");
    let events = store.events(&running).unwrap();
    assert_eq!(events.len(), 2, "the old log is kept");
    assert_eq!(store.events(&RunId::from("old-done-0")).unwrap().len(), 2);
    let health = store.health().unwrap();
    assert_eq!(health.setting("auto_vacuum"), Some("none"));
    drop(store);
    let full = std::fs::metadata(db.path()).unwrap().len();

    let report = db
        .open()
        .purge(&Purge::finished_before(std::time::SystemTime::now()).batch(7))
        .unwrap();
    assert_eq!((report.runs, report.events, report.batches), (20, 40, 3));
    let space = report.space.unwrap();
    assert!(!space.returns_space, "{space:?}");
    assert!(space.free_bytes > 20 * 64 * 1024, "{space:?}");
    assert_eq!(
        space.bytes_after, space.bytes_before,
        "the file keeps its pages"
    );
    assert_eq!(std::fs::metadata(db.path()).unwrap().len(), full);

    let store = db.open();
    assert_eq!(store.run(&running).unwrap().state, RunState::Running);
    assert_eq!(store.events(&running).unwrap(), events);
    let health = store.health().unwrap();
    assert_ne!(health.setting("freelist_count"), Some("0"));

    let vacuumed = store.vacuum().unwrap();
    assert!(vacuumed.returns_space);
    assert_eq!(vacuumed.free_bytes, 0);
    assert!(vacuumed.bytes_after < full / 4, "{vacuumed:?} of {full}");
    assert_eq!(
        store.health().unwrap().setting("auto_vacuum"),
        Some("incremental")
    );
    assert_eq!(store.events(&running).unwrap(), events);
    drop(store);
    assert!(std::fs::metadata(db.path()).unwrap().len() < full / 4);
}
