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
    assert_eq!(SCHEMA_VERSION, 8);
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
    assert!(refused.to_string().contains("injected"), "{refused}");
    assert!(matches!(store.runs(None), Err(Error::SyncFailed(_))));
    assert!(matches!(sqlite.sync_log(), Err(Error::SyncFailed(_))));
    // Reopened, the database is usable again (SQLite recovers the log).
    drop(store);
    let reopened = Store::open(dir.path().join("db.sqlite")).unwrap();
    assert_eq!(reopened.runs(None).unwrap(), vec![]);
}

#[test]
fn a_log_that_cannot_be_opened_fails_that_sync_only() {
    let dir = tempfile::tempdir().unwrap();
    // A directory cannot be opened for writing.
    let log = LogFile::new(dir.path().to_path_buf());
    assert!(matches!(log.sync(), Err(Error::SyncFailed(_))));
    assert!(log.refuse_if_failed().is_ok(), "nothing was lost");
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
            let (mut sql, mut now) = (Sql(&tx), Now::new(&clock));
            moves::Move::new(&mut sql, &mut now, id)
                .create_run("a", &serde_json::json!({}), &me)
                .unwrap();
        }
        tx.commit().unwrap();
        conn.trace_v2(
            rusqlite::trace::TraceEventCodes::SQLITE_TRACE_STMT,
            Some(count),
        );
        STATEMENTS.store(0, Ordering::SeqCst);
        let leases: Vec<(RunId, u64)> = ids.iter().map(|id| (id.clone(), me.token())).collect();
        let (owner, ttl) = (&me.holder.owner, me.holder.ttl);
        let renewal = moves::renew(&mut Sql(&conn), owner, &leases, ttl).unwrap();
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
