//! The SQLite backend: a database file (or `:memory:`), the embedded default.
//!
//! Everything SQLite-specific lives in this module: the pragmas and migrations, the SQL of
//! every primitive the moves are made of, group commit with savepoints, the deferred log sync
//! and the answer once written, checkpoints, the lease keeper's connection, and the VFS that
//! gathers a commit's log writes (see `docs/persistence.md`).
//!
//! Its knobs are [`Options`]; [`Sqlite`] reaches a store's database connection for the
//! application's own queries:
//!
//! ```
//! use agentrt::{Store, sqlite::{Options, Sqlite, Synchronous}};
//!
//! let dir = tempfile::tempdir().unwrap();
//! let store: Store = Options::new()
//!     .synchronous(Synchronous::Normal)
//!     .open(dir.path().join("agents.db"))?;
//! let conn = Sqlite::of(&store).expect("an SQLite store").connection()?;
//! let runs: i64 = conn.query_row("SELECT count(*) FROM runs", [], |row| row.get(0))?;
//! assert_eq!(runs, 0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#[cfg(any(test, feature = "testkit"))]
pub(crate) mod faults;
mod log;
mod open;
mod renewal;
pub(crate) mod sql;
#[cfg(unix)]
mod wal_vfs;
mod writer;

use std::{
    any::Any,
    ops::Deref,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard, atomic::AtomicBool},
    time::Duration,
};

use rusqlite::{OpenFlags, config::DbConfig};

pub(crate) use self::open::migration_count;
#[cfg(any(test, feature = "testkit"))]
pub(crate) use self::open::migrations;
use self::{
    log::LogFile,
    open::{Role, configure, migrate, on_open, open_writing, user_version},
    sql::Sql,
};
use super::{
    Health, SCHEMA_VERSION, SchemaStatus, Store,
    backend::{Backend, MoveObserver, Reads, Session, Tx},
    model::{Now, wall_millis},
};
use crate::{
    clock::Clock,
    error::{DatabaseError, Error, Result},
};

/// The one place an SQLite error becomes agentrt's: opaque, with SQLite's as its source.
pub(crate) fn db_error(err: rusqlite::Error) -> Error {
    let busy = matches!(
        &err,
        rusqlite::Error::SqliteFailure(failure, _)
            if matches!(failure.code, rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
    );
    Error::Database(DatabaseError::new(busy, err))
}

impl From<rusqlite::Error> for Error {
    fn from(err: rusqlite::Error) -> Self {
        db_error(err)
    }
}

/// SQLite's `synchronous` setting: how hard a commit waits for the disk. JSON: `"NORMAL"`,
/// `"FULL"` or `"EXTRA"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Synchronous {
    /// A commit survives a crash of the process, not necessarily of the machine.
    Normal,
    /// A commit survives a power loss (the default).
    #[default]
    Full,
    /// As `Full`, and the directory is synced too.
    Extra,
}

impl Synchronous {
    /// The value of SQLite's `synchronous` pragma: `NORMAL`, `FULL` or `EXTRA`.
    pub fn as_str(self) -> &'static str {
        match self {
            Synchronous::Normal => "NORMAL",
            Synchronous::Full => "FULL",
            Synchronous::Extra => "EXTRA",
        }
    }
}

/// The watch for the next move after a commit when [`Options::commit_spin`] is not set: 50 µs.
pub const DEFAULT_COMMIT_SPIN: Duration = Duration::from_micros(50);

/// How a store opens an SQLite database, and how its supervisors write to it.
///
/// ```no_run
/// use agentrt::sqlite::{Options, Synchronous};
///
/// let store = Options::new()
///     .synchronous(Synchronous::Normal)
///     .open("agentrt.db")?;
/// # Ok::<(), agentrt::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Options {
    synchronous: Synchronous,
    busy_timeout: Duration,
    create: bool,
    migrate: bool,
    group_commit: bool,
    commit_spin: Duration,
    log_vfs: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            synchronous: Synchronous::Full,
            busy_timeout: Duration::from_secs(5),
            create: true,
            migrate: true,
            group_commit: true,
            commit_spin: DEFAULT_COMMIT_SPIN,
            log_vfs: true,
        }
    }
}

impl Options {
    /// The defaults: `synchronous=FULL`, a 5 s busy timeout, create and migrate, group commit,
    /// a [`DEFAULT_COMMIT_SPIN`] watch, the log-gathering VFS where it is supported.
    pub fn new() -> Self {
        Options::default()
    }

    /// For operator tools: open only an existing database of the current schema, creating and
    /// migrating nothing.
    pub fn existing_only() -> Self {
        Options::default().create(false).migrate(false)
    }

    /// Durability of commits; default [`Synchronous::Full`].
    pub fn synchronous(mut self, synchronous: Synchronous) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// How long a statement waits for another connection's lock before failing; default 5 s.
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// Create the file when it is missing (default true); when false a missing file is
    /// [`Error::NoDatabase`] and nothing is created.
    pub fn create(mut self, create: bool) -> Self {
        self.create = create;
        self
    }

    /// Apply the migrations the database lacks (default true); when false an older database is
    /// [`Error::SchemaOutdated`] and is left as it is.
    pub fn migrate(mut self, migrate: bool) -> Self {
        self.migrate = migrate;
        self
    }

    /// Commit the moves that arrive together (from different runs) in one transaction, each in
    /// a savepoint of its own and each caller answered after the commit (default true). Off,
    /// every move is a transaction and a commit of its own.
    pub fn group_commit(mut self, on: bool) -> Self {
        self.group_commit = on;
        self
    }

    /// How long a supervisor's writer keeps watching for the next move after a commit before
    /// it parks its thread (default [`DEFAULT_COMMIT_SPIN`]; zero parks at once). A run's loop
    /// sends its next move a few microseconds after its reply; catching it without a thread
    /// wake-up makes a lone run faster, for at most this much CPU per commit. A model
    /// reservation answered once written (see `docs/runs.md`) shares its sync with the
    /// model's answer only if that answer arrives within this watch; after it, the writer
    /// syncs the reservation alone.
    pub fn commit_spin(mut self, spin: Duration) -> Self {
        self.commit_spin = spin;
        self
    }

    /// Write a commit's log frames in one system call per 124 KiB, through agentrt's VFS
    /// (default true). It is used on Unix with the SQLite release it was written for (3.53,
    /// which rusqlite's `bundled` feature builds); with another, SQLite's default VFS is used
    /// and a warning says so, once per process; on other platforms, SQLite's default VFS. Off,
    /// SQLite's default VFS writes the log, and the VFS is not even registered.
    pub fn log_vfs(mut self, on: bool) -> Self {
        self.log_vfs = on;
        self
    }

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

/// Whether connections that write go through the log-gathering VFS.
fn wal_vfs_on(options: &Options) -> bool {
    #[cfg(unix)]
    {
        options.log_vfs && wal_vfs::register()
    }
    #[cfg(not(unix))]
    {
        let _ = options;
        false
    }
}

/// Reads the schema version of the database file at `path` without changing it or creating
/// anything beside it. A missing file is [`Error::NoDatabase`]; a file that is not a
/// database, [`Error::NotADatabase`]; a database cut short or whose schema pages are damaged,
/// [`Error::DatabaseCorrupt`].
pub fn schema_status(path: impl AsRef<Path>) -> Result<SchemaStatus> {
    let path = path.as_ref();
    let found = read_schema_version(path)?;
    Ok(SchemaStatus {
        found,
        supported: SCHEMA_VERSION,
    })
}

/// The offsets in an SQLite file's 100-byte header that the checks below read.
mod header {
    pub const MAGIC: &[u8; 16] = b"SQLite format 3\0";
    pub const PAGE_SIZE: usize = 16;
    pub const CHANGE_COUNTER: usize = 24;
    pub const PAGE_COUNT: usize = 28;
    pub const USER_VERSION: usize = 60;
    pub const VALID_FOR: usize = 92;
    pub const LEN: usize = 100;
}

fn be_u32(bytes: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(bytes[at..at + 4].try_into().expect("four bytes"))
}

/// The schema version of a database file, found without creating a `-wal` or `-shm` beside it
/// (SQLite's read-only connections create both for a database in WAL mode). A file whose log
/// holds commits is read through SQLite, since they may change the version; otherwise the
/// header says it, and a connection that treats the file as immutable checks the schema's
/// pages.
fn read_schema_version(path: &Path) -> Result<u32> {
    use std::io::Read;

    let corrupt = |detail: String| Error::DatabaseCorrupt {
        path: path.to_path_buf(),
        detail,
    };
    let mut file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::NoDatabase {
                path: path.to_path_buf(),
            });
        }
        Err(err) => return Err(corrupt(format!("it cannot be read: {err}"))),
    };
    let len = file
        .metadata()
        .map_err(|err| corrupt(format!("it cannot be read: {err}")))?
        .len();
    if len == 0 {
        // SQLite's empty database: a file created and never written.
        return Ok(0);
    }
    let mut head = [0u8; header::LEN];
    if len < header::LEN as u64
        || file.read_exact(&mut head).is_err()
        || &head[..16] != header::MAGIC
    {
        return Err(Error::NotADatabase {
            path: path.to_path_buf(),
        });
    }
    let log_has_commits =
        std::fs::metadata(format!("{}-wal", path.display())).is_ok_and(|log| log.len() > 0);
    if log_has_commits {
        let conn = rusqlite::Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(|err| on_open(err, path))?;
        return user_version(&conn).map_err(|err| on_open(err, path));
    }
    let page_size = match u32::from(u16::from_be_bytes([head[header::PAGE_SIZE], head[17]])) {
        1 => 65_536,
        size => size,
    };
    // The page count is valid only when written by the version that last changed the file.
    if be_u32(&head, header::VALID_FOR) == be_u32(&head, header::CHANGE_COUNTER) {
        let expected = u64::from(page_size) * u64::from(be_u32(&head, header::PAGE_COUNT));
        if len < expected {
            return Err(corrupt(format!(
                "it holds {len} bytes of the {expected} its header promises: it was cut short"
            )));
        }
    }
    // Nothing is in the log, so the file is the whole database: reading it as immutable takes
    // no lock and creates nothing, and reading the schema finds damaged pages.
    let uri = format!("file:{}?immutable=1", uri_path(path));
    let conn = rusqlite::Connection::open_with_flags(
        uri,
        OpenFlags::SQLITE_OPEN_READ_ONLY
            | OpenFlags::SQLITE_OPEN_NO_MUTEX
            | OpenFlags::SQLITE_OPEN_URI,
    )
    .map_err(|err| on_open(err, path))?;
    conn.query_row("SELECT count(*) FROM sqlite_schema", [], |_| Ok(()))
        .map_err(|err| on_open(err, path))?;
    Ok(be_u32(&head, header::USER_VERSION))
}

/// `path` as the path of an SQLite URI: the characters a URI gives a meaning to, escaped.
fn uri_path(path: &Path) -> String {
    let mut out = String::new();
    for byte in path.to_string_lossy().bytes() {
        match byte {
            b'?' | b'#' | b'%' => out.push_str(&format!("%{byte:02X}")),
            _ => out.push(byte as char),
        }
    }
    out
}

/// The SQLite backend of a [`Store`]: reach it with [`Sqlite::of`].
pub struct Sqlite {
    path: Option<PathBuf>,
    options: Options,
    /// The one connection that writes; for `:memory:` also the one that reads.
    writer: Mutex<rusqlite::Connection>,
    /// File stores: a connection for inspection and the application's own queries.
    reader: Option<Mutex<rusqlite::Connection>>,
    /// File stores: the write-ahead log, for the syncs done outside SQLite's commits.
    log: Option<LogFile>,
    /// A deferred group switched the writer to `synchronous = NORMAL` and it was not switched
    /// back yet (the group is being applied, or its restore failed, or it panicked): the next
    /// use of the writer restores the store's setting first.
    writer_lowered: AtomicBool,
    /// The test seam: counted syncs, injected failures.
    #[cfg(any(test, feature = "testkit"))]
    pub(crate) faults: faults::Faults,
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
                let mut copy = rusqlite::Connection::open_in_memory()?;
                {
                    let writer = lock(&self.writer);
                    let backup = rusqlite::backup::Backup::new(&writer, &mut copy)?;
                    backup.run_to_completion(i32::MAX, Duration::ZERO, None)?;
                }
                configure(&copy, &self.options, false, Role::Reader)?;
                Ok(Connection(Held::Copy(copy)))
            }
        }
    }

    fn open(path: &Path, options: Options) -> Result<Sqlite> {
        let path = path.to_path_buf();
        match schema_status(&path) {
            Ok(status) if status.found > status.supported => {
                return Err(Error::SchemaTooNew {
                    path,
                    found: status.found,
                    supported: status.supported,
                });
            }
            Ok(status) if status.pending() > 0 && !options.migrate => {
                return Err(Error::SchemaOutdated {
                    path,
                    found: status.found,
                    supported: status.supported,
                });
            }
            Ok(_) => {}
            Err(Error::NoDatabase { .. }) if options.create => {}
            Err(err) => return Err(err),
        }
        let mut flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        if options.create {
            flags |= OpenFlags::SQLITE_OPEN_CREATE;
        }
        let mut writer = open_writing(&path, flags, &options).map_err(|err| on_open(err, &path))?;
        configure(&writer, &options, true, Role::Writer).map_err(|err| named(err, &path))?;
        // After the pragmas: `wal_autocheckpoint` installs a hook of its own.
        writer.wal_hook(Some(writer::note_log_size));
        if options.migrate {
            migrate(&mut writer, &path)?;
        }
        let reader = rusqlite::Connection::open_with_flags(
            &path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        configure(&reader, &options, true, Role::Reader)?;
        let log = writer
            .path()
            .map(|db| LogFile::new(PathBuf::from(format!("{db}-wal"))));
        Ok(Sqlite {
            path: Some(path),
            options,
            writer: Mutex::new(writer),
            reader: Some(Mutex::new(reader)),
            log,
            writer_lowered: AtomicBool::new(false),
            #[cfg(any(test, feature = "testkit"))]
            faults: Default::default(),
        })
    }

    fn in_memory(options: Options) -> Result<Sqlite> {
        let mut conn = rusqlite::Connection::open_in_memory()?;
        configure(&conn, &options, false, Role::Writer)?;
        migrate(&mut conn, Path::new(":memory:"))?;
        Ok(Sqlite {
            path: None,
            options,
            writer: Mutex::new(conn),
            reader: None,
            log: None,
            writer_lowered: AtomicBool::new(false),
            #[cfg(any(test, feature = "testkit"))]
            faults: Default::default(),
        })
    }

    /// The connection of inspection reads: the reader on a file, the writer in memory.
    fn inspection(&self) -> MutexGuard<'_, rusqlite::Connection> {
        lock(self.reader.as_ref().unwrap_or(&self.writer))
    }

    /// Syncs the log after a read, unless this store does not ask for durability beyond a
    /// crash of the process (`NORMAL`): what it read may be a commit not yet durable.
    pub(crate) fn sync_after_read(&self) -> Result<()> {
        if self.options.synchronous == Synchronous::Normal {
            return Ok(());
        }
        self.sync_log()
    }

    /// Syncs the write-ahead log to disk: every commit written to it so far (by any connection
    /// or process) becomes durable, as if it had synced in its own commit. Nothing to do in
    /// memory. Once a sync failed, this and every later write through this store fail.
    pub(crate) fn sync_log(&self) -> Result<()> {
        let Some(log) = &self.log else {
            return Ok(());
        };
        #[cfg(any(test, feature = "testkit"))]
        if let Some(err) = self.faults.before_sync()? {
            log.fail_with(err.to_string());
            return Err(err);
        }
        log.sync()
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

impl Backend for Sqlite {
    fn describe(&self) -> String {
        match &self.path {
            Some(path) => format!("sqlite:{}", path.display()),
            None => "sqlite::memory:".into(),
        }
    }

    fn schema_version(&self) -> Result<u32> {
        Ok(user_version(&self.inspection())?)
    }

    fn read(&self, read: &mut dyn FnMut(&mut dyn Reads) -> Result<()>) -> Result<()> {
        read(&mut Sql(&self.inspection()))?;
        // The connection is released: the sync holds nobody up. A reader must not act on a
        // move that a power loss would undo.
        self.sync_after_read()
    }

    fn transact(
        &self,
        clock: &dyn Clock,
        apply: &mut dyn FnMut(&mut dyn Tx, &mut Now<'_>) -> Result<()>,
    ) -> Result<()> {
        writer::transact(self, clock, apply)
    }

    fn session(
        self: Arc<Self>,
        clock: Arc<dyn Clock>,
        observer: Option<Arc<dyn MoveObserver>>,
    ) -> Result<Session> {
        writer::session(self, clock, observer)
    }

    fn health(&self) -> Result<Health> {
        let conn = self.inspection();
        let pragma = |name: &str| -> Result<String> {
            Ok(conn
                .pragma_query_value(None, name, |row| row.get::<_, rusqlite::types::Value>(0))
                .map(|value| match value {
                    rusqlite::types::Value::Integer(n) => n.to_string(),
                    rusqlite::types::Value::Text(text) => text,
                    other => format!("{other:?}"),
                })?)
        };
        let mut settings = Vec::new();
        for name in [
            "journal_mode",
            "synchronous",
            "foreign_keys",
            "trusted_schema",
            "busy_timeout",
        ] {
            let value = match name {
                // What this store's writers commit with (the inspection connection, which
                // never writes, keeps SQLite's default).
                "synchronous" => self.options.synchronous.as_str().to_owned(),
                _ => pragma(name)?,
            };
            settings.push((name.to_owned(), value));
        }
        let defensive = conn.db_config(DbConfig::SQLITE_DBCONFIG_DEFENSIVE)?;
        settings.push((
            "defensive".to_owned(),
            if defensive { "1" } else { "0" }.into(),
        ));
        let (stale_leases, running_without_lease) = Sql(&conn).lease_report(wall_millis())?;
        Ok(Health {
            schema: SchemaStatus {
                found: user_version(&conn)?,
                supported: SCHEMA_VERSION,
            },
            settings,
            integrity: sql::integrity_check(&conn)?,
            stale_leases,
            running_without_lease,
        })
    }

    fn as_any(&self) -> &dyn Any {
        self
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
fn lock(mutex: &Mutex<rusqlite::Connection>) -> MutexGuard<'_, rusqlite::Connection> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests;
