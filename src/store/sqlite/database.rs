//! The SQLite backend's handle on a database: its connections, opening, the log's sync, and
//! the constructors that make a [`Store`] of it.

use std::{
    ops::Deref,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard, atomic::AtomicBool},
    time::Duration,
};

use rusqlite::OpenFlags;

use super::error::Db;
use super::{
    failure::IoFailure,
    log::LogFile,
    open::{
        Role, configure, configure_new, migrate, on_open, open_writing, refuse_other_schema,
        schema_status, user_version,
    },
    options::{Options, Synchronous},
};
use crate::{
    error::{Error, Result},
    store::Store,
};

impl Options {
    /// Opens (creating it if missing, unless told not to) the database file at `path`,
    /// applying the migrations it lacks. A file that is not a database, a damaged one, or a
    /// database of a newer schema version, is refused and left unchanged, with nothing created
    /// beside it. `":memory:"` is [`in_memory`](Self::in_memory).
    pub fn open(self, path: impl AsRef<Path>) -> Result<Store> {
        let path = path.as_ref();
        if path.as_os_str() == ":memory:" {
            return self.in_memory();
        }
        Ok(Store::from_backend(Arc::new(Sqlite::open(path, self)?)))
    }

    /// A new database in memory, gone with the last clone of the store. It has one
    /// connection, which is the whole database: renewals go through the writer, and the
    /// application's own queries go to a copy (see [`Sqlite::connection`]).
    pub fn in_memory(self) -> Result<Store> {
        Ok(Store::from_backend(Arc::new(Sqlite::in_memory(self)?)))
    }
}

/// The SQLite backend of a [`Store`]: reach it with [`Sqlite::of`].
pub struct Sqlite {
    pub(super) path: Option<PathBuf>,
    pub(super) options: Options,
    /// The one connection that writes; for `:memory:` also the one that reads.
    pub(super) writer: Mutex<rusqlite::Connection>,
    /// The keys of the runs the writer moves; used under the writer's lock only.
    pub(super) keys: Mutex<super::keys::RunKeys>,
    /// File stores: a connection for inspection and the application's own queries.
    pub(super) reader: Option<Mutex<rusqlite::Connection>>,
    /// File stores: the write-ahead log, for the syncs done outside SQLite's commits.
    pub(super) log: Option<LogFile>,
    /// Set by the first I/O error of a write, a sync or a checkpoint: every later write and
    /// durable read is refused. Shared with the lease keeper's connection.
    pub(super) failure: Arc<IoFailure>,
    /// A deferred group switched the writer to `synchronous = NORMAL` and it was not switched
    /// back yet (the group is being applied, or its restore failed, or it panicked): the next
    /// use of the writer restores the store's setting first.
    pub(super) writer_lowered: AtomicBool,
    /// The test seam: counted syncs, injected failures.
    #[cfg(any(test, feature = "testkit"))]
    pub(crate) faults: super::faults::Faults,
}

impl Drop for Sqlite {
    fn drop(&mut self) {
        use super::failure::keep_log_on_close;
        keep_log_on_close(&self.failure, &lock(&self.writer));
        if let Some(reader) = &self.reader {
            keep_log_on_close(&self.failure, &lock(reader));
        }
    }
}

impl std::fmt::Debug for Sqlite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sqlite")
            .field("path", &self.path)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl Sqlite {
    /// The SQLite backend of `store`, if it has that one.
    pub fn of(store: &Store) -> Option<&Sqlite> {
        store.backend().as_any().downcast_ref()
    }

    /// The database file, or `None` in memory.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The options it was opened with.
    pub fn options(&self) -> &Options {
        &self.options
    }

    /// A read-only connection for the application's own queries.
    ///
    /// On a file store it is the store's inspection connection: hold it briefly, since the
    /// store's inspection reads wait for it (moves and lease renewals do not: they have
    /// connections of their own). On `:memory:`, whose one connection is the writer's, it is
    /// a connection to a copy of the database taken now: holding it holds up nothing, not a
    /// move and not a renewal, and it sees nothing committed after this call. The copy costs
    /// about the database's size in memory and time.
    pub fn connection(&self) -> Result<Connection<'_>> {
        match &self.reader {
            Some(reader) => Ok(Connection(Held::Shared(lock(reader)))),
            None => {
                let mut copy = rusqlite::Connection::open_in_memory().db()?;
                {
                    let writer = lock(&self.writer);
                    let backup = rusqlite::backup::Backup::new(&writer, &mut copy).db()?;
                    backup
                        .run_to_completion(i32::MAX, Duration::ZERO, None)
                        .db()?;
                }
                configure(&copy, &self.options, false, Role::Reader)?;
                Ok(Connection(Held::Copy(copy)))
            }
        }
    }

    fn open(path: &Path, options: Options) -> Result<Sqlite> {
        let path = path.to_path_buf();
        // Version 0: a file created empty, or one no agentrt has written yet.
        let new = match schema_status(&path) {
            Ok(status) => {
                refuse_other_schema(&path, status.found, options.migrate)?;
                status.found == 0
            }
            Err(Error::NoDatabase { .. }) if options.create => true,
            Err(err) => return Err(err),
        };
        let mut flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        if options.create {
            flags |= OpenFlags::SQLITE_OPEN_CREATE;
        }
        let mut writer = open_writing(&path, flags, &options).map_err(|err| on_open(err, &path))?;
        // Keyed by the name SQLite gives the files, so that its VFS finds this store's faults;
        // before the first write, so that the open's own writes can be failed too.
        #[cfg(any(test, feature = "testkit"))]
        let faults = super::faults::Faults::of_database(writer.path().unwrap_or_default(), &path);
        if new {
            configure_new(&writer).map_err(|err| named(err, &path))?;
        }
        configure(&writer, &options, true, Role::Writer).map_err(|err| named(err, &path))?;
        // After the pragmas: `wal_autocheckpoint` installs a hook of its own.
        writer.wal_hook(Some(super::log::note_log_size));
        if options.migrate {
            migrate(&mut writer, &path)?;
        } else {
            // Read again, now under SQLite's locks: another process may have upgraded the file
            // since its version was first read.
            let found = user_version(&writer).map_err(|err| on_open(err, &path))?;
            refuse_other_schema(&path, found, false)?;
        }
        let reader = rusqlite::Connection::open_with_flags(
            &path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .db()?;
        configure(&reader, &options, true, Role::Reader)?;
        let log = writer
            .path()
            .map(|db| LogFile::new(PathBuf::from(format!("{db}-wal"))));
        Ok(Sqlite {
            path: Some(path),
            options,
            writer: Mutex::new(writer),
            keys: Mutex::default(),
            reader: Some(Mutex::new(reader)),
            log,
            failure: Arc::default(),
            writer_lowered: AtomicBool::new(false),
            #[cfg(any(test, feature = "testkit"))]
            faults,
        })
    }

    fn in_memory(options: Options) -> Result<Sqlite> {
        let mut conn = rusqlite::Connection::open_in_memory().db()?;
        configure_new(&conn)?;
        configure(&conn, &options, false, Role::Writer)?;
        migrate(&mut conn, Path::new(":memory:"))?;
        Ok(Sqlite {
            path: None,
            options,
            writer: Mutex::new(conn),
            keys: Mutex::default(),
            reader: None,
            log: None,
            failure: Arc::default(),
            writer_lowered: AtomicBool::new(false),
            #[cfg(any(test, feature = "testkit"))]
            faults: Default::default(),
        })
    }

    /// The connection of inspection reads: the reader on a file, the writer in memory.
    pub(super) fn inspection(&self) -> MutexGuard<'_, rusqlite::Connection> {
        lock(self.reader.as_ref().unwrap_or(&self.writer))
    }

    /// Syncs the log after a read if what it read may be a commit not yet durable (see
    /// [`LogFile::may_hold_unsynced`]), unless this store does not ask for durability beyond
    /// a crash of the process (`NORMAL`). Once a write failed, it fails as every write does.
    pub(crate) fn sync_after_read(&self) -> Result<()> {
        if self.options.synchronous == Synchronous::Normal {
            return Ok(());
        }
        let Some(log) = &self.log else {
            return self.sync_log();
        };
        if !log.may_hold_unsynced() {
            return self.failure.refuse_if_failed();
        }
        // Reads that saw the same commit share one sync: the later waits for the earlier's,
        // then finds the commit covered.
        let _turn = log.read_sync_turn();
        if log.may_hold_unsynced() {
            self.sync_log()
        } else {
            self.failure.refuse_if_failed()
        }
    }

    /// Whether a read now would sync the log: it may see a commit not yet durable.
    #[cfg(test)]
    pub(crate) fn log_may_hold_unsynced(&self) -> bool {
        self.log.as_ref().is_some_and(|log| log.may_hold_unsynced())
    }

    /// Syncs the write-ahead log to disk: every commit written to it so far (by any connection
    /// or process) becomes durable, as if it had synced in its own commit. Nothing to do in
    /// memory. Once a sync failed (or any other write of this store), this and every later
    /// write through this store fail.
    pub(crate) fn sync_log(&self) -> Result<()> {
        self.failure.refuse_if_failed()?;
        let Some(log) = &self.log else {
            return Ok(());
        };
        #[cfg(any(test, feature = "testkit"))]
        if let Some(err) = self.faults.before_sync() {
            self.failure
                .fail_with(format!("syncing {}: {err}", log.path().display()));
            return Err(Error::SyncFailed(err));
        }
        log.sync(&self.failure)
    }

    /// The writer connection, held: the crash explorer holds a dead supervisor's, so that
    /// nothing of it commits while its runs recover.
    #[cfg(feature = "testkit")]
    pub(crate) fn writer_lock(&self) -> MutexGuard<'_, rusqlite::Connection> {
        lock(&self.writer)
    }
}

/// Names the file in the error of a connection's set-up that found it damaged.
fn named(err: Error, path: &Path) -> Error {
    match err {
        Error::Database(db) => match std::error::Error::source(&db)
            .and_then(|source| source.downcast_ref::<rusqlite::Error>())
        {
            Some(rusqlite::Error::SqliteFailure(failure, message)) => on_open(
                rusqlite::Error::SqliteFailure(*failure, message.clone()),
                path,
            ),
            _ => Error::Database(db),
        },
        other => other,
    }
}

/// A connection handed to the application; see [`Sqlite::connection`].
pub struct Connection<'a>(Held<'a>);

enum Held<'a> {
    /// A file store's inspection connection.
    Shared(MutexGuard<'a, rusqlite::Connection>),
    /// A copy of an in-memory database.
    Copy(rusqlite::Connection),
}

impl Deref for Connection<'_> {
    type Target = rusqlite::Connection;

    fn deref(&self) -> &rusqlite::Connection {
        match &self.0 {
            Held::Shared(conn) => conn,
            Held::Copy(conn) => conn,
        }
    }
}

/// A panic while a connection was held cannot leave a transaction open (rusqlite rolls back on
/// drop), so a poisoned lock still guards a usable connection.
pub(super) fn lock(mutex: &Mutex<rusqlite::Connection>) -> MutexGuard<'_, rusqlite::Connection> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
