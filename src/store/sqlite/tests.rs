//! The SQLite backend's own tests: the conformance suite on a file and on `:memory:`, and
//! what only SQLite has (pragmas, the deferred log sync, the renewal connection, indexes).

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use rusqlite::config::DbConfig;

use super::{
    Options, SCHEMA_VERSION, Sqlite, Synchronous,
    database::lock,
    failure::IoFailure,
    log::LogFile,
    migrations, renewal,
    sql::{self, Sql},
};
use crate::{
    error::{Error, Result},
    store::{
        Store,
        conformance::{Fixture, conformance_suite},
        model::{Now, wall_millis},
    },
    types::RunId,
};

/// SQLite files in a temporary directory.
struct File(tempfile::TempDir);

impl File {
    fn new() -> Self {
        File(tempfile::tempdir().unwrap())
    }

    fn fresh_path(&self) -> PathBuf {
        self.0
            .path()
            .join(format!("{}.sqlite", rand::random::<u64>()))
    }
}

impl Fixture for File {
    fn store(&self) -> Store {
        Store::open(self.fresh_path()).unwrap()
    }

    fn expire_lease(&self, store: &Store, run_id: &RunId) {
        expire(store, run_id);
    }

    fn open_newer_schema(&self) -> Option<Result<Store>> {
        let path = self.fresh_path();
        drop(Store::open(&path).unwrap());
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.pragma_update(None, "user_version", SCHEMA_VERSION + 1)
            .unwrap();
        drop(conn);
        Some(Store::open(&path))
    }
}

/// `:memory:`, whose one connection is the whole database.
struct Memory;

impl Fixture for Memory {
    fn store(&self) -> Store {
        Store::in_memory().unwrap()
    }

    fn expire_lease(&self, store: &Store, run_id: &RunId) {
        expire(store, run_id);
    }

    fn open_newer_schema(&self) -> Option<Result<Store>> {
        None
    }
}

fn expire(store: &Store, run_id: &RunId) {
    let sqlite = Sqlite::of(store).unwrap();
    let changed = lock(&sqlite.writer)
        .execute(
            "UPDATE runs SET lease_expires_at = ?2 WHERE id = ?1",
            rusqlite::params![run_id.as_str(), wall_millis() - 1],
        )
        .unwrap();
    assert_eq!(changed, 1);
}

conformance_suite!(sqlite_file, File::new());
conformance_suite!(sqlite_memory, Memory);

#[test]
fn migrations_are_valid() {
    migrations().validate().unwrap();
    assert_eq!(SCHEMA_VERSION, 16);
}

#[test]
fn listing_purging_by_age_and_due_schedules_read_a_range_of_one_index() {
    let store = Store::in_memory().unwrap();
    let sqlite = Sqlite::of(&store).unwrap();
    let conn = lock(&sqlite.writer);
    // Planned with its parameters unbound, as SQLite plans a statement when it prepares it.
    let plan = |sql: &str| -> String {
        let mut stmt = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
        let mut rows = stmt.raw_query();
        let mut plan = Vec::new();
        while let Some(row) = rows.next().unwrap() {
            plan.push(row.get::<_, String>(3).unwrap());
        }
        plan.join("; ")
    };
    for (agent, state, index) in [
        (false, false, "runs_by_created"),
        (true, false, "runs_by_agent"),
        (false, true, "runs_by_state"),
    ] {
        let found = plan(&sql::list_runs_sql(agent, state));
        assert!(
            found.starts_with(&format!("SEARCH runs USING INDEX {index} ")),
            "{found}"
        );
        assert!(!found.contains("TEMP B-TREE"), "no sort: {found}");
    }
    let found = plan(&sql::finished_runs_sql());
    assert!(
        found.starts_with("SEARCH runs USING INDEX runs_finished "),
        "{found}"
    );
    assert!(!found.contains("TEMP B-TREE"), "no sort: {found}");
    for query in [sql::due_schedules_sql().as_str(), sql::NEXT_SCHEDULED_AT] {
        let found = plan(query);
        // "USING INDEX" or "USING COVERING INDEX": a range per agent, never a scan.
        assert!(
            found.starts_with("SEARCH schedules USING")
                && found.contains("INDEX schedules_due (agent=? AND next_at"),
            "{found}"
        );
        assert!(!found.contains("TEMP B-TREE"), "no sort: {found}");
    }
}

#[test]
fn every_connection_is_hardened() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("db.sqlite")).unwrap();
    let sqlite = Sqlite::of(&store).unwrap();
    let renewal = renewal::SqliteRenewer::open(sqlite, Default::default())
        .unwrap()
        .expect("a file store has a renewal connection");
    for conn in [
        &*lock(&sqlite.writer),
        &*sqlite.connection().unwrap(),
        renewal.connection(),
    ] {
        let trusted: i64 = conn
            .pragma_query_value(None, "trusted_schema", |r| r.get(0))
            .unwrap();
        assert_eq!(trusted, 0);
        assert!(conn.db_config(DbConfig::SQLITE_DBCONFIG_DEFENSIVE).unwrap());
        assert!(
            !conn
                .db_config(DbConfig::SQLITE_DBCONFIG_TRUSTED_SCHEMA)
                .unwrap()
        );
        let fk: i64 = conn
            .pragma_query_value(None, "foreign_keys", |r| r.get(0))
            .unwrap();
        assert_eq!(fk, 1);
    }
    let writer = lock(&sqlite.writer);
    let mode: String = writer
        .pragma_query_value(None, "journal_mode", |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "wal");
    let sync: i64 = writer
        .pragma_query_value(None, "synchronous", |r| r.get(0))
        .unwrap();
    assert_eq!(sync, 2, "FULL by default");
    let memory = Store::in_memory().unwrap();
    let memory = Sqlite::of(&memory).unwrap();
    assert!(
        renewal::SqliteRenewer::open(memory, Default::default())
            .unwrap()
            .is_none(),
        "in memory, renewals go through the writer"
    );
}

#[test]
fn the_reader_cannot_write() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("db.sqlite")).unwrap();
    let err = Sqlite::of(&store)
        .unwrap()
        .connection()
        .unwrap()
        .execute("DELETE FROM runs", [])
        .unwrap_err();
    assert!(err.to_string().contains("readonly"), "{err}");
}

#[test]
fn the_path_memory_opens_an_in_memory_store() {
    let store = Store::open(":memory:").unwrap();
    assert_eq!(Sqlite::of(&store).unwrap().path(), None);
    assert!(!Path::new(":memory:").exists());
    assert_eq!(store.schema_version().unwrap(), SCHEMA_VERSION);
}

#[test]
fn millis_round_trip() {
    use crate::store::model::{from_millis, to_millis};
    for millis in [0, 1, -1, 1_700_000_000_123, -86_400_000] {
        assert_eq!(to_millis(from_millis(millis)), millis);
    }
}

#[test]
fn the_synchronous_setting_is_reported_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let store = Options::new()
        .synchronous(Synchronous::Normal)
        .open(dir.path().join("db.sqlite"))
        .unwrap();
    let health = store.health().unwrap();
    // What the store's writers commit with, by name.
    assert_eq!(health.setting("synchronous"), Some("NORMAL"));
    assert_eq!(health.setting("defensive"), Some("1"));
}

#[test]
fn after_a_failed_log_sync_the_store_refuses_to_write_or_vouch_for_reads() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("db.sqlite")).unwrap();
    let sqlite = Sqlite::of(&store).unwrap();
    sqlite.sync_log().unwrap();
    sqlite.faults.fail_next_sync();
    assert!(matches!(sqlite.sync_log(), Err(Error::SyncFailed(_))));
    let refused = store.cancel(&RunId::from("r"), "x").unwrap_err();
    assert!(matches!(refused, Error::DiskStateUnknown(_)), "{refused}");
    assert!(refused.to_string().contains("injected"), "{refused}");
    assert!(matches!(store.runs(None), Err(Error::DiskStateUnknown(_))));
    assert!(matches!(sqlite.sync_log(), Err(Error::DiskStateUnknown(_))));
    // Reopened, the database is usable again (SQLite recovers the log).
    drop(store);
    let reopened = Store::open(dir.path().join("db.sqlite")).unwrap();
    assert_eq!(reopened.runs(None).unwrap(), vec![]);
}

#[test]
fn a_read_syncs_the_log_only_when_it_may_have_seen_a_commit_not_yet_durable() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db.sqlite");
    let store = Store::open(&path).unwrap();
    let sqlite = Sqlite::of(&store).unwrap();
    let syncs = || sqlite.faults.syncs();
    let known = syncs();
    // A move of the store's writer syncs in its commit: reading it syncs nothing again.
    create_run(&store, &RunId::from("r"), "me/1", Duration::from_secs(30)).unwrap();
    assert_eq!(store.runs(None).unwrap().len(), 1);
    assert_eq!(syncs(), known, "the writer's commit synced its own log");
    store.runs(None).unwrap();
    assert_eq!(syncs(), known, "nothing committed since");
    // Another connection's commit, left unsynced as another process's deferred group is: the
    // read that sees it syncs, and the one after does not.
    let other = rusqlite::Connection::open(&path).unwrap();
    other
        .execute_batch(
            "PRAGMA synchronous = OFF; UPDATE runs SET updated_at = updated_at + 1 WHERE id = 'r'",
        )
        .unwrap();
    store.runs(None).unwrap();
    assert_eq!(syncs(), known + 1, "a read of an unsynced commit synced it");
    store.runs(None).unwrap();
    assert_eq!(syncs(), known + 1);
    // Each later unsynced commit is caught the same way, by the header of the log's index.
    other
        .execute_batch("UPDATE runs SET updated_at = updated_at + 1 WHERE id = 'r'")
        .unwrap();
    drop(other);
    store.runs(None).unwrap();
    assert_eq!(syncs(), known + 2);
    // Reads at once that each see the same unsynced commit sync it once between them.
    let other = rusqlite::Connection::open(&path).unwrap();
    other
        .execute_batch(
            "PRAGMA synchronous = OFF; UPDATE runs SET updated_at = updated_at + 1 WHERE id = 'r'",
        )
        .unwrap();
    drop(other);
    let together = std::sync::Barrier::new(8);
    std::thread::scope(|scope| {
        for _ in 0..8 {
            scope.spawn(|| {
                together.wait();
                store.runs(None).unwrap();
            });
        }
    });
    assert_eq!(syncs(), known + 3, "racing reads shared one sync");
    // A store that has read nothing and written nothing yet cannot tell what the log holds:
    // its first read syncs.
    let reopened = Store::open(&path).unwrap();
    let sqlite = Sqlite::of(&reopened).unwrap();
    let before = sqlite.faults.syncs();
    reopened.runs(None).unwrap();
    reopened.runs(None).unwrap();
    assert_eq!(sqlite.faults.syncs(), before + 1);
}

#[test]
fn a_failed_store_closes_leaving_every_file_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db.sqlite");
    let store = Store::open(&path).unwrap();
    create_run(
        &store,
        &RunId::from("r"),
        "me/000000000001",
        Duration::from_secs(30),
    )
    .unwrap();
    let sqlite = Sqlite::of(&store).unwrap();
    sqlite.faults.fail_next_sync();
    assert!(sqlite.sync_log().is_err());
    let files = || -> Vec<(String, Vec<u8>)> {
        let mut files: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|entry| {
                let path = entry.unwrap().path();
                let name = path.file_name().unwrap().to_string_lossy().into_owned();
                (name, std::fs::read(&path).unwrap())
            })
            .collect();
        files.sort();
        files
    };
    let before = files();
    assert!(before.iter().any(|(name, _)| name.ends_with("-wal")));
    // The last connection to close would copy the log into the file and delete it.
    drop(store);
    assert_eq!(
        files(),
        before,
        "nothing written as the failed store closed"
    );
    let reopened = Store::open(&path).unwrap();
    assert_eq!(reopened.runs(None).unwrap().len(), 1);
}

#[test]
fn a_log_that_cannot_be_opened_fails_that_sync_only() {
    let dir = tempfile::tempdir().unwrap();
    // A directory cannot be opened for writing.
    let log = LogFile::new(dir.path().to_path_buf());
    let failure = IoFailure::default();
    assert!(matches!(log.sync(&failure), Err(Error::SyncFailed(_))));
    assert!(failure.refuse_if_failed().is_ok(), "nothing was lost");
}

#[test]
fn the_waiting_call_of_an_approval_is_found_through_its_index() {
    let store = Store::in_memory().unwrap();
    let sqlite = Sqlite::of(&store).unwrap();
    let conn = lock(&sqlite.writer);
    let mut stmt = conn
        .prepare(&format!("EXPLAIN QUERY PLAN {}", sql::WAITING_CALL))
        .unwrap();
    let plan: Vec<String> = stmt
        .query_map(["r", "c"], |row| row.get::<_, String>(3))
        .unwrap()
        .collect::<rusqlite::Result<_>>()
        .unwrap();
    // "USING INDEX" or "USING COVERING INDEX", never a scan of the run's steps.
    assert!(
        plan.iter()
            .any(|line| line.contains("INDEX steps_waiting_call")),
        "{plan:?}"
    );
}

#[test]
fn due_waits_are_found_through_the_index_of_ready_waits() {
    let store = Store::in_memory().unwrap();
    let sqlite = Sqlite::of(&store).unwrap();
    let conn = lock(&sqlite.writer);
    for (statement, params, index) in [
        (
            sql::READY_WAITS,
            rusqlite::params_from_iter(vec!["a", "0", "0", "", "10"]),
            "waits_ready",
        ),
        (
            sql::NEXT_READY,
            rusqlite::params_from_iter(vec!["a", "0"]),
            "waits_ready",
        ),
        (
            sql::WOKEN_WAITS,
            rusqlite::params_from_iter(Vec::<&str>::new()),
            "waits_woken",
        ),
    ] {
        let mut stmt = conn
            .prepare(&format!("EXPLAIN QUERY PLAN {statement}"))
            .unwrap();
        let plan: Vec<String> = stmt
            .query_map(params, |row| row.get::<_, String>(3))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        // The index (a range of it, or the whole of a partial one), never a scan of every
        // wait, nor a sort.
        assert!(
            plan.iter().all(
                |line| (!line.starts_with("SCAN") || line.contains("USING INDEX"))
                    && !line.contains("TEMP B-TREE")
            ),
            "{statement}: {plan:?}"
        );
        assert!(
            plan.iter()
                .any(|line| line.contains(&format!("INDEX {index}"))),
            "{statement}: {plan:?}"
        );
    }
}

#[test]
fn a_renewal_tick_is_one_statement_whatever_the_number_of_runs_held() {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use crate::store::{
        model::{Grant, Holder},
        moves,
    };

    static STATEMENTS: AtomicUsize = AtomicUsize::new(0);
    fn count(event: rusqlite::trace::TraceEvent<'_>) {
        if let rusqlite::trace::TraceEvent::Stmt(..) = event {
            STATEMENTS.fetch_add(1, Ordering::SeqCst);
        }
    }
    let me = Grant::new(Holder {
        owner: "me/000000000001".into(),
        ttl: Duration::from_secs(30),
        margin: Duration::ZERO,
    });
    for held in [1, 100, 10_000] {
        let mut conn = rusqlite::Connection::open_in_memory().unwrap();
        migrations().to_latest(&mut conn).unwrap();
        let tx = conn.transaction().unwrap();
        let ids: Vec<RunId> = (0..held).map(|i| RunId::from(format!("r{i}"))).collect();
        for id in &ids {
            let clock = crate::clock::SystemClock;
            let (mut sql, mut now) = (Sql::of(&tx), Now::new(&clock));
            let create = moves::CreateRun {
                by: moves::Leased::new(id, &me),
                agent: "a".into(),
                input: serde_json::json!({}),
                trace: None,
            };
            moves::Move::apply(&create, &mut moves::Cx::new(&mut sql, &mut now, id)).unwrap();
        }
        tx.commit().unwrap();
        conn.trace_v2(
            rusqlite::trace::TraceEventCodes::SQLITE_TRACE_STMT,
            Some(count),
        );
        STATEMENTS.store(0, Ordering::SeqCst);
        let leases: Vec<(RunId, u64)> = ids.iter().map(|id| (id.clone(), me.token())).collect();
        let (owner, ttl) = (&me.holder.owner, me.holder.ttl);
        let renewal = moves::renew(&mut Sql::of(&conn), owner, &leases, ttl).unwrap();
        conn.trace_v2(rusqlite::trace::TraceEventCodes::empty(), None);
        assert_eq!(renewal.renewed.len(), held);
        assert_eq!(STATEMENTS.load(Ordering::SeqCst), 1, "{held} runs held");
    }
}

/// The name of the VFS a connection opened its main database through.
fn vfs_name(conn: &rusqlite::Connection) -> String {
    use rusqlite::ffi;
    let mut vfs: *mut ffi::sqlite3_vfs = std::ptr::null_mut();
    // SAFETY: the handle is open; SQLITE_FCNTL_VFS_POINTER writes the connection's VFS (which
    // lives as long as the process) to `vfs`.
    unsafe {
        let rc = ffi::sqlite3_file_control(
            conn.handle(),
            c"main".as_ptr(),
            ffi::SQLITE_FCNTL_VFS_POINTER,
            (&mut vfs as *mut *mut ffi::sqlite3_vfs).cast(),
        );
        assert_eq!(rc, ffi::SQLITE_OK);
        std::ffi::CStr::from_ptr((*vfs).zName)
            .to_str()
            .unwrap()
            .to_owned()
    }
}

#[test]
fn the_log_vfs_switch_decides_the_vfs_of_every_connection_that_writes() {
    // SAFETY: SQLite's default VFS lives as long as the process.
    let default = unsafe {
        assert_eq!(
            rusqlite::ffi::sqlite3_initialize(),
            rusqlite::ffi::SQLITE_OK
        );
        let vfs = rusqlite::ffi::sqlite3_vfs_find(std::ptr::null());
        std::ffi::CStr::from_ptr((*vfs).zName)
            .to_str()
            .unwrap()
            .to_owned()
    };
    #[cfg(unix)]
    let on = {
        assert!(
            super::wal_vfs::register(),
            "the bundled SQLite is the one it was written for"
        );
        super::wal_vfs::NAME.to_str().unwrap().to_owned()
    };
    #[cfg(not(unix))]
    let on = default.clone();
    assert_ne!(cfg!(unix), on == default);
    for (options, expected) in [
        (Options::new(), &on),
        (Options::new().log_vfs(false), &default),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let store = options.clone().open(dir.path().join("db.sqlite")).unwrap();
        let sqlite = Sqlite::of(&store).unwrap();
        let renewal = renewal::SqliteRenewer::open(sqlite, Default::default())
            .unwrap()
            .unwrap();
        assert_eq!(&vfs_name(&lock(&sqlite.writer)), expected, "{options:?}");
        assert_eq!(&vfs_name(renewal.connection()), expected, "{options:?}");
        // The reader never writes: it keeps SQLite's default.
        assert_eq!(
            vfs_name(&sqlite.connection().unwrap()),
            default,
            "{options:?}"
        );
    }
}

/// A run created by `owner`, leased for `ttl`.
fn create_run(store: &Store, run_id: &RunId, owner: &str, ttl: Duration) -> Result<()> {
    use crate::store::{
        model::{Grant, Holder},
        moves,
    };
    let holder = Grant::new(Holder {
        owner: owner.into(),
        ttl,
        margin: Duration::ZERO,
    });
    let create = moves::CreateRun {
        by: moves::Leased::new(run_id, &holder),
        agent: "a".into(),
        input: serde_json::json!({}),
        trace: None,
    };
    store.apply(&crate::clock::SystemClock, create).map(drop)
}

#[test]
fn sqlite_an_error_other_than_of_io_leaves_the_store_writing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db.sqlite");
    let store = Options::new()
        .busy_timeout(Duration::from_millis(10))
        .open(&path)
        .unwrap();
    let (me, ttl) = ("me/000000000001", Duration::from_secs(30));
    create_run(&store, &RunId::from("r"), me, ttl).unwrap();
    // A refused move, a constraint, a database locked by another connection.
    let missing = store.cancel(&RunId::from("nope"), "x").unwrap_err();
    assert!(missing.is_not_found(), "{missing}");
    let exists = create_run(&store, &RunId::from("r"), me, ttl).unwrap_err();
    assert!(exists.is_run_state(), "{exists}");
    let other = rusqlite::Connection::open(&path).unwrap();
    other.execute_batch("BEGIN IMMEDIATE").unwrap();
    let busy = store.cancel(&RunId::from("r"), "x").unwrap_err();
    assert!(busy.is_busy(), "{busy}");
    other.execute_batch("ROLLBACK").unwrap();
    store.cancel(&RunId::from("r"), "x").unwrap();
    assert!(store.runs(None).is_ok());
}

#[cfg(unix)]
#[test]
fn sqlite_after_an_io_error_renewals_and_releases_are_refused_too() {
    use crate::{clock::SystemClock, testkit::FaultKind};

    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("db.sqlite")).unwrap();
    let sqlite = Sqlite::of(&store).unwrap();
    let (me, ttl) = ("me/000000000001", Duration::from_secs(30));
    let run_id = RunId::from("r");
    create_run(&store, &run_id, me, ttl).unwrap();
    let session = store
        .session(std::sync::Arc::new(SystemClock), None)
        .unwrap();
    let (mut writer, mut renewer) = (session.writer, session.renewer.unwrap());
    let held = &[(run_id.clone(), crate::store::moves::FIRST_TOKEN)];
    renewer
        .renew(me, held, ttl, Duration::from_secs(1))
        .unwrap();

    // The renewal's own write fails: its fate is unknown, and the store stops writing. (A
    // longer TTL: a row rewritten with the same bytes writes no page.)
    sqlite.faults.fail_next(FaultKind::LogWrite);
    let failed = renewer
        .renew(me, held, ttl * 2, Duration::from_secs(1))
        .unwrap_err();
    assert!(matches!(failed, Error::CommitUnknown(_)), "{failed}");
    assert!(
        failed
            .to_string()
            .contains("may or may not have been written"),
        "{failed}"
    );
    assert_eq!(sqlite.faults.injected(), 1);
    for refused in [
        renewer
            .renew(me, held, ttl, Duration::from_secs(1))
            .map(|_| ()),
        writer.renew(me, held, ttl).map(|_| ()),
        writer
            .release(&run_id, me, crate::store::moves::FIRST_TOKEN)
            .map(|_| ()),
        store.cancel(&run_id, "x"),
        store.runs(None).map(|_| ()),
        sqlite.checkpoint(),
        sqlite.sync_log(),
    ] {
        let err = refused.unwrap_err();
        assert!(matches!(err, Error::DiskStateUnknown(_)), "{err}");
        assert!(err.to_string().contains("a lease renewal"), "{err}");
    }
    // Reopened, it writes again.
    drop((writer, renewer, store));
    let store = Store::open(dir.path().join("db.sqlite")).unwrap();
    store.cancel(&run_id, "x").unwrap();
}

#[cfg(unix)]
#[test]
fn sqlite_a_failed_write_of_the_log_starting_over_fails_its_commit_as_of_unknown_fate() {
    use crate::testkit::FaultKind;

    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("db.sqlite")).unwrap();
    let sqlite = Sqlite::of(&store).unwrap();
    let (me, ttl) = ("me/000000000001", Duration::from_secs(30));
    create_run(&store, &RunId::from("r1"), me, ttl).unwrap();
    // Everything copied, and no reader: the next commit starts the log over, writing its
    // header with its frames.
    sqlite.checkpoint().unwrap();
    let backfilled: (i64, i64) = lock(&sqlite.writer)
        .query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| {
            Ok((r.get(1)?, r.get(2)?))
        })
        .unwrap();
    assert_eq!(backfilled.0, backfilled.1, "the whole log was copied");
    sqlite.faults.fail_next(FaultKind::LogWrite);
    let err = create_run(&store, &RunId::from("r2"), me, ttl).unwrap_err();
    assert!(matches!(err, Error::CommitUnknown(_)), "{err}");
    assert!(
        err.to_string().contains("may or may not have been written"),
        "{err}"
    );
    let refused = create_run(&store, &RunId::from("r3"), me, ttl).unwrap_err();
    assert!(matches!(refused, Error::DiskStateUnknown(_)), "{refused}");
    drop(store);
    let store = Store::open(dir.path().join("db.sqlite")).unwrap();
    let runs: Vec<String> = store
        .runs(None)
        .unwrap()
        .into_iter()
        .map(|run| run.id.to_string())
        .collect();
    // Nothing of the commit was written.
    assert_eq!(runs, ["r1"]);
}

#[cfg(unix)]
#[test]
fn sqlite_each_kind_of_fault_fails_the_next_call_of_its_kind_on_this_store_only() {
    use crate::testkit::FaultKind;

    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("db.sqlite")).unwrap();
    let other = Store::open(dir.path().join("other.sqlite")).unwrap();
    let sqlite = Sqlite::of(&store).unwrap();
    let (me, ttl) = ("me/000000000001", Duration::from_secs(30));
    create_run(&store, &RunId::from("r1"), me, ttl).unwrap();
    for kind in [FaultKind::LogWrite, FaultKind::LogSync] {
        assert!(sqlite.faults.count(kind) > 0, "{kind:?}");
    }
    sqlite.checkpoint().unwrap();
    for kind in [FaultKind::DatabaseWrite, FaultKind::DatabaseSync] {
        assert!(sqlite.faults.count(kind) > 0, "{kind:?}");
    }
    // A truncation, which agentrt's own checkpoints never ask for.
    sqlite.faults.fail_next(FaultKind::LogTruncate);
    let truncated =
        lock(&sqlite.writer).query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()));
    assert_eq!(
        truncated.unwrap_err().sqlite_error_code(),
        Some(rusqlite::ErrorCode::SystemIoFailure)
    );
    assert_eq!(sqlite.faults.count(FaultKind::LogTruncate), 1);
    // Armed on one store, a fault leaves another alone.
    sqlite.faults.fail_next(FaultKind::LogWrite);
    create_run(&other, &RunId::from("r1"), me, ttl).unwrap();
    assert_eq!(sqlite.faults.injected(), 1);
    assert!(create_run(&store, &RunId::from("r2"), me, ttl).is_err());
    assert_eq!(sqlite.faults.injected(), 2);
}

#[test]
fn a_watcher_that_fell_behind_the_bounded_feed_reads_the_waiting_runs_instead() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("db.sqlite")).unwrap();
    let mut watcher = store.watcher().unwrap();
    assert!(watcher.poll().unwrap().unwrap().changes.is_empty());
    // More changes than the feed keeps between two polls.
    lock(&Sqlite::of(&store).unwrap().writer)
        .execute_batch(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1100)
             INSERT INTO run_changes (run_id, agent, kind) SELECT 'r' || i, 'a', 'cancelled' FROM n",
        )
        .unwrap();
    let kept: i64 = Sqlite::of(&store)
        .unwrap()
        .connection()
        .unwrap()
        .query_row("SELECT count(*) FROM run_changes", [], |row| row.get(0))
        .unwrap();
    assert_eq!(kept, 1024, "the feed is bounded");
    let behind = watcher.poll().unwrap().unwrap();
    assert!(
        behind.resync,
        "the changes trimmed unread may have been cancels"
    );
    assert_eq!(behind.changes.len(), 1024);
    assert_eq!(behind.changes[0].run_id, RunId::from("r77"));
    assert_eq!(watcher.poll().unwrap(), None);
}

#[test]
fn a_read_sees_one_snapshot_while_another_connection_commits() {
    let file = File::new();
    let path = file.fresh_path();
    let (store, other) = (Store::open(&path).unwrap(), Store::open(&path).unwrap());
    lock(&Sqlite::of(&store).unwrap().writer)
        .execute_batch(
            "INSERT INTO runs (id, agent, input, state, created_at, updated_at)
             VALUES ('r1', 'agent', '{}', 'RUNNING', 0, 0)",
        )
        .unwrap();
    let id = RunId::from("r1");
    let (before, during) = store
        .read(|reads| {
            let before = reads.run(&id)?.unwrap().state;
            // Committed by another connection between two statements of the read.
            other.cancel(&id, "elsewhere")?;
            Ok((before, reads.run(&id)?.unwrap().state))
        })
        .unwrap();
    assert_eq!(before, crate::RunState::Running);
    assert_eq!(
        during, before,
        "the read's second statement sees its first's snapshot"
    );
    assert_eq!(store.run(&id).unwrap().state, crate::RunState::Cancelled);
}

/// A store on a new file of `file`'s, with run `r` started under `grant` and its call `c1`'s
/// tool in flight.
fn with_tool_in_flight(file: &File, grant: &crate::store::model::Grant) -> (Store, PathBuf) {
    with_tools_in_flight(file, grant, &["r"])
}

/// A store on a new file of `file`'s, with each of the runs `names` started under `grant` and
/// its call `c1`'s tool in flight.
fn with_tools_in_flight(
    file: &File,
    grant: &crate::store::model::Grant,
    names: &[&str],
) -> (Store, PathBuf) {
    use crate::store::conformance::{call, create, run, tool_in_flight};
    let path = file.fresh_path();
    let store = Store::open(&path).unwrap();
    for n in names {
        create(&store, &run(n), grant);
        tool_in_flight(&store, &run(n), grant, vec![call("c1")]);
    }
    (store, path)
}

/// An outcome and the reservation after it, paired, write their run's row once; so do a
/// model's answer and the start of the call it asks for, which also insert that call's step
/// already started instead of inserting it and then moving it.
#[test]
fn a_pair_writes_its_runs_row_once_and_a_step_it_inserts_and_starts_once() {
    use crate::{
        store::{
            conformance::{allow, call, in_one_group, me, queued_pair, run},
            model::{ModelOutcome, Rendered},
            moves::{self, Leased},
        },
        types::{ModelResponse, ToolResult},
    };
    let (file, grant) = (File::new(), me());
    let (store, path) = with_tool_in_flight(&file, &grant);
    // Counted by triggers, which the writer's statements fire too.
    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.execute_batch(
        "CREATE TABLE writes (of TEXT PRIMARY KEY, n INTEGER NOT NULL);
         INSERT INTO writes VALUES ('runs', 0), ('steps', 0);
         CREATE TRIGGER runs_written AFTER UPDATE ON runs
         BEGIN UPDATE writes SET n = n + 1 WHERE of = 'runs'; END;
         CREATE TRIGGER steps_written AFTER UPDATE ON steps
         BEGIN UPDATE writes SET n = n + 1 WHERE of = 'steps'; END;",
    )
    .unwrap();
    let writes = || -> (i64, i64) {
        conn.query_row(
            "SELECT (SELECT n FROM writes WHERE of = 'runs'), (SELECT n FROM writes WHERE of = 'steps')",
            [],
            |row| Ok((row.get(0)?, row.get(1)?)),
        )
        .unwrap()
    };
    let by = || Leased::new(&run("r"), &grant);
    let done = ToolResult::Ok(serde_json::json!({"sent": true}));
    let outcome = moves::FinishTool::new(by(), 2, 1, "c1", &done);
    let reservation = moves::BeginModelStep { by: by(), step: 3 };
    let (pair, then) = queued_pair(outcome, reservation);
    assert_eq!(in_one_group(&store, vec![pair]), [true]);
    assert!(matches!(then.recv().unwrap(), Some(Ok(()))));
    // The run's touch once; step 2 finished (step 3 is inserted, not moved).
    assert_eq!(writes(), (1, 1));

    let response = ModelResponse::calls(vec![call("c2")]);
    let answer = moves::FinishModelStep {
        by: by(),
        step: 3,
        attempt: 1,
        outcome: ModelOutcome::Answered {
            recorded: Rendered::new(serde_json::to_value(&response).unwrap()),
            response,
        },
    };
    let start = crate::store::conformance::decide_tool(&run("r"), &grant, 4, &call("c2"), &allow());
    let (pair, then) = queued_pair(answer, start);
    assert_eq!(in_one_group(&store, vec![pair]), [true]);
    assert!(matches!(then.recv().unwrap(), Some(Ok(()))));
    // The run's touch once; step 3 finished; step 4 inserted started, not moved.
    assert_eq!(writes(), (2, 2));
}

/// The writer numbers a run's events from the number of its last it remembers from one group
/// to the next; an event another connection appended meanwhile makes it forget, and the next is
/// numbered after that event, the log without gaps.
#[test]
fn an_event_appended_by_another_connection_is_numbered_after_without_a_gap() {
    use crate::store::{
        conformance::{in_one_group, me, queued_pair, run},
        moves::{self, Leased},
    };
    let (file, grant) = (File::new(), me());
    let (store, path) = with_tool_in_flight(&file, &grant);
    let by = || Leased::new(&run("r"), &grant);
    let remembered = || {
        let sqlite = Sqlite::of(&store).unwrap();
        let keys = sqlite.keys.lock().unwrap();
        keys.last_event(&run("r"))
    };
    let done = crate::types::ToolResult::Ok(serde_json::json!({"sent": true}));
    let outcome = moves::FinishTool::new(by(), 2, 1, "c1", &done);
    let reservation = moves::BeginModelStep { by: by(), step: 3 };
    let (pair, _) = queued_pair(outcome, reservation);
    assert_eq!(in_one_group(&store, vec![pair]), [true]);
    let known = store.events(&run("r")).unwrap().len() as i64;
    assert_eq!(remembered(), Some(known), "remembered from the group");

    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.execute(
        "INSERT INTO events (run_key, seq, kind, at, step, payload)
         SELECT key, ?2, 'operator.note', 0, NULL, '{}' FROM runs WHERE id = ?1",
        rusqlite::params!["r", known + 1],
    )
    .unwrap();
    let failed = moves::FailModelAttempt {
        by: by(),
        step: 3,
        attempt: 1,
        error: "overloaded".into(),
        retry_in: Duration::from_millis(10),
    };
    let (pending, answer) =
        crate::store::queue::pending(failed, crate::store::backend::Durability::Durable);
    let committed = move || matches!(answer.blocking_recv(), Ok(Ok(())));
    assert_eq!(
        in_one_group(&store, vec![(pending, Box::new(committed))]),
        [true]
    );
    // Numbered after the other connection's event, not in its place: no second attempt.
    assert_eq!(remembered(), Some(known + 2));
    assert_eq!(event_numbers(&conn), (1..=known + 2).collect::<Vec<_>>());
}

/// A move refused after it appended an event, in a group the writer applies again, leaves no
/// number behind it: the next event is numbered after the last one kept.
#[test]
fn a_refused_moves_event_leaves_no_gap_in_the_numbers() {
    use crate::store::{
        conformance::{allow, call, decide_tool, in_one_group, me, queued_pair, run},
        moves::{self, Leased},
    };
    let (file, grant) = (File::new(), me());
    let (store, path) = with_tool_in_flight(&file, &grant);
    let by = || Leased::new(&run("r"), &grant);
    let done = crate::types::ToolResult::Ok(serde_json::json!({"sent": true}));
    let outcome = moves::FinishTool::new(by(), 2, 1, "c1", &done);
    // Step 9 does not exist: the decision appends `policy.decided`, then its step's guard
    // refuses it.
    let decision = decide_tool(&run("r"), &grant, 9, &call("c9"), &allow());
    let (pair, then) = queued_pair(outcome, decision);
    assert_eq!(in_one_group(&store, vec![pair]), [true]);
    assert!(matches!(then.recv().unwrap(), Some(Err(_))));
    let (pair, then) = queued_pair(
        moves::BeginModelStep { by: by(), step: 3 },
        moves::FailRun {
            by: by(),
            error: "stop".into(),
        },
    );
    assert_eq!(in_one_group(&store, vec![pair]), [true]);
    assert!(matches!(then.recv().unwrap(), Some(Ok(()))));
    let conn = rusqlite::Connection::open(&path).unwrap();
    let numbers = event_numbers(&conn);
    assert_eq!(numbers, (1..=numbers.len() as i64).collect::<Vec<_>>());
}

/// The numbers of run `r`'s events, in order.
fn event_numbers(conn: &rusqlite::Connection) -> Vec<i64> {
    conn.prepare(
        "SELECT seq FROM events JOIN runs ON runs.key = events.run_key
         WHERE runs.id = 'r' ORDER BY seq",
    )
    .unwrap()
    .query_map([], |row| row.get(0))
    .unwrap()
    .collect::<rusqlite::Result<_>>()
    .unwrap()
}

/// The kind of run `n`'s last event.
fn last_kind(store: &Store, n: &str) -> Option<crate::types::EventKind> {
    let events = store.events(&RunId::from(n)).unwrap();
    events.last().map(|event| event.kind)
}

/// A group of many runs' moves appends each run's events numbered from 1 without a gap, in
/// the order its moves made them, across the statements the writer sends them in (here 64,
/// 16, 4 and 1 rows), and in its first attempt: each run's row is written once a pair.
#[test]
fn a_group_of_many_runs_numbers_each_runs_events_in_order_across_its_batches() {
    use crate::{
        store::{
            conformance::{in_one_group, me, queued_pair, run},
            moves::{self, Leased},
        },
        types::{EventKind, ToolResult},
    };
    let (file, grant) = (File::new(), me());
    let done = ToolResult::Ok(serde_json::json!({"sent": true}));
    // 45 pairs of two events each: more than one statement's worth of rows.
    let names: Vec<String> = (0..45).map(|i| format!("r{i}")).collect();
    let named: Vec<&str> = names.iter().map(String::as_str).collect();
    let (store, path) = with_tools_in_flight(&file, &grant, &named);
    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.execute_batch(
        "CREATE TABLE touches (n INTEGER NOT NULL); INSERT INTO touches VALUES (0);
         CREATE TRIGGER runs_touched AFTER UPDATE ON runs
         BEGIN UPDATE touches SET n = n + 1; END;",
    )
    .unwrap();
    let touches = || -> i64 {
        conn.query_row("SELECT n FROM touches", [], |row| row.get(0))
            .unwrap()
    };
    let before = store.events(&run("r0")).unwrap().len();
    let (pairs, thens): (Vec<_>, Vec<_>) = names
        .iter()
        .map(|n| {
            let by = || Leased::new(&run(n), &grant);
            let outcome = moves::FinishTool::new(by(), 2, 1, "c1", &done);
            queued_pair(outcome, moves::BeginModelStep { by: by(), step: 3 })
        })
        .unzip();
    assert!(
        in_one_group(&store, pairs)
            .into_iter()
            .all(|committed| committed)
    );
    for then in thens {
        assert!(matches!(then.recv().unwrap(), Some(Ok(()))));
    }
    // Once per pair: a second attempt would have touched each run again.
    assert_eq!(touches(), 45);
    for n in &names {
        let events = store.events(&run(n)).unwrap();
        let numbers: Vec<u64> = events.iter().map(|event| event.seq).collect();
        assert_eq!(numbers, (1..=before as u64 + 2).collect::<Vec<_>>(), "{n}");
        let kinds: Vec<EventKind> = events[before..].iter().map(|event| event.kind).collect();
        assert_eq!(
            kinds,
            [EventKind::ToolFinished, EventKind::ModelStarted],
            "{n}"
        );
        // Appended in the order made: the log's own order agrees with the numbers.
        let ids: Vec<i64> = conn
            .prepare(
                "SELECT events.id FROM events JOIN runs ON runs.key = events.run_key
                 WHERE runs.id = ?1 ORDER BY seq",
            )
            .unwrap()
            .query_map([n], |row| row.get(0))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        assert!(ids.is_sorted(), "{n}: {ids:?}");
    }
}

/// An event the database refuses only when the writer sends it, at the end of the group,
/// fails its own move alone: the other runs' moves of the group commit, and the refused run's
/// numbers go on without a gap.
#[test]
fn an_event_refused_when_its_group_sends_it_fails_its_move_alone() {
    use crate::{
        store::{
            conformance::{in_one_group, me, queued, run},
            moves::{self, Leased},
        },
        types::{EventKind, ToolResult},
    };
    let (file, grant) = (File::new(), me());
    let (store, path) = with_tools_in_flight(&file, &grant, &["r", "s", "t"]);
    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.execute_batch(
        "CREATE TRIGGER refused BEFORE INSERT ON events WHEN NEW.payload LIKE '%refuse me%'
         BEGIN SELECT RAISE(ABORT, 'refused'); END;",
    )
    .unwrap();
    let finish = |n: &str, output: &str| {
        let done = ToolResult::Ok(serde_json::json!({ "note": output }));
        queued(moves::FinishTool::new(
            Leased::new(&run(n), &grant),
            2,
            1,
            "c1",
            &done,
        ))
    };
    // The refused event is the group's last: it is sent when the group ends.
    let group = vec![
        finish("r", "sent"),
        finish("t", "sent"),
        finish("s", "refuse me"),
    ];
    assert_eq!(in_one_group(&store, group), [true, true, false]);
    assert_eq!(last_kind(&store, "r"), Some(EventKind::ToolFinished));
    assert_eq!(last_kind(&store, "s"), Some(EventKind::ToolStarted));
    assert_eq!(last_kind(&store, "t"), Some(EventKind::ToolFinished));
    conn.execute_batch("DROP TRIGGER refused").unwrap();
    assert_eq!(
        in_one_group(&store, vec![finish("s", "sent")]),
        [true],
        "the step was left in flight"
    );
    let numbers: Vec<u64> = (store.events(&run("s")).unwrap().iter())
        .map(|event| event.seq)
        .collect();
    assert_eq!(numbers, (1..=numbers.len() as u64).collect::<Vec<_>>());
}
