//! The SQLite store: opening, pragmas, migrations, and read-only inspection.
//!
//! Every write goes through [`Store::transact`], one `BEGIN IMMEDIATE` transaction per move;
//! in a supervisor only the `StoreActor` calls it. All SQL lives in [`sql`].

pub(crate) mod sql;
#[cfg(unix)]
mod wal_vfs;

use std::{
    ops::Deref,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, SystemTime},
};

use rusqlite::{Connection, OpenFlags, Transaction, TransactionBehavior, config::DbConfig};
use rusqlite_migration::{M, Migrations};

use crate::{
    clock::{Clock, SystemClock},
    error::{Error, Result},
    types::{Approval, Event, Lease, PendingCall, Run, RunId, RunState},
};

include!(concat!(env!("OUT_DIR"), "/migrations.rs"));

/// The schema version this build writes: the number of migrations in `migrations/`.
pub const SCHEMA_VERSION: u32 = MIGRATIONS.len() as u32;

/// The migrations, in order, as `rusqlite_migration` applies them.
pub(crate) fn migrations() -> Migrations<'static> {
    Migrations::new(
        MIGRATIONS
            .iter()
            .map(
                |(name, sql)| match REBUILDS.iter().find(|(file, _)| file == name) {
                    // Runs with foreign keys off (see `migrate`): the references of the tables it
                    // touched are checked before it commits.
                    Some((_, tables)) => M::up_with_hook(sql, move |tx: &rusqlite::Transaction| {
                        check_references(tx, tables)
                    }),
                    None => M::up(sql),
                },
            )
            .collect(),
    )
}

/// Migrations that copy a table into a new one (SQLite cannot change a constraint in place):
/// they need foreign keys off while the old table is dropped, and the references from and to
/// the rebuilt table are checked afterwards (only those: the events table may be large).
const REBUILDS: &[(&str, &[&str])] = &[
    ("0006_steps_state_check.sql", &["steps", "approvals"]),
    ("0007_steps_waiting_call_index.sql", &["steps", "approvals"]),
];

/// Fails the migration if a row of `tables` refers to nothing.
fn check_references(tx: &rusqlite::Transaction, tables: &[&str]) -> rusqlite_migration::HookResult {
    for table in tables {
        let mut stmt = tx.prepare(&format!("PRAGMA foreign_key_check({table})"))?;
        if stmt.exists([])? {
            return Err(rusqlite_migration::HookError::Hook(format!(
                "table {table} refers to rows that do not exist"
            )));
        }
    }
    Ok(())
}

/// SQLite's `synchronous` setting: how hard a commit waits for the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
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

/// How a store opens its database.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Durability of commits; default [`Synchronous::Full`].
    pub synchronous: Synchronous,
    /// How long a statement waits for another connection's lock before failing; default 5 s.
    pub busy_timeout: Duration,
    /// Create the file when it is missing (default true); when false a missing file is
    /// [`Error::NoDatabase`] and nothing is created.
    pub create: bool,
    /// Apply the migrations the database lacks (default true); when false an older database is
    /// [`Error::SchemaOutdated`] and is left as it is.
    pub migrate: bool,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            synchronous: Synchronous::Full,
            busy_timeout: Duration::from_secs(5),
            create: true,
            migrate: true,
        }
    }
}

impl StoreOptions {
    /// For operator tools: open only an existing database of the current schema, creating and
    /// migrating nothing.
    pub fn existing_only() -> Self {
        StoreOptions {
            create: false,
            migrate: false,
            ..StoreOptions::default()
        }
    }
}

/// The schema version of a database file, read without changing it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchemaStatus {
    /// The version the file is at (0: an empty database).
    pub found: u32,
    /// The version this build writes.
    pub supported: u32,
}

impl SchemaStatus {
    /// Reads the schema version of the database at `path`, read-only. A missing file is
    /// [`Error::NoDatabase`]; a file that is not a database, [`Error::NotADatabase`].
    pub fn of(path: impl AsRef<Path>) -> Result<SchemaStatus> {
        let path = path.as_ref();
        if !path.exists() {
            return Err(Error::NoDatabase {
                path: path.to_path_buf(),
            });
        }
        let conn = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY)
            .map_err(|err| on_open(err.into(), path))?;
        let found: i64 = conn
            .pragma_query_value(None, "user_version", |row| row.get(0))
            .map_err(|err| on_open(err.into(), path))?;
        Ok(SchemaStatus {
            found: found.clamp(0, u32::MAX.into()) as u32,
            supported: SCHEMA_VERSION,
        })
    }

    /// Migrations this build would apply.
    pub fn pending(&self) -> u32 {
        self.supported.saturating_sub(self.found)
    }
}

/// What a connection is for; decides which pragmas of [`pragmas`] it gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// The one connection that writes (also the whole database, for `:memory:`).
    Writer,
    /// The connection for inspection and the consumer's own queries.
    Reader,
    /// The lease keeper's connection: one UPDATE per renewal, outside any transaction.
    Renewal,
}

/// The pragmas applied at every open, whatever the connection. Kept apart from migrations:
/// they are per-connection settings, not schema.
fn pragmas(options: &StoreOptions, file: bool, role: Role) -> Vec<(&'static str, &'static str)> {
    let mut pragmas = vec![
        // A schema object (trigger, view, CHECK) cannot call functions with side effects.
        ("trusted_schema", "OFF"),
        ("foreign_keys", "ON"),
    ];
    if file && role == Role::Writer {
        // Readers never block the writer, and the writer never blocks readers.
        pragmas.push(("journal_mode", "WAL"));
    }
    if file && role != Role::Reader {
        // The store actor checkpoints on its own schedule (between groups, once per period),
        // not inside whichever commit (a move, a renewal) takes the log past 1,000 pages.
        pragmas.push(("wal_autocheckpoint", "0"));
    }
    if role != Role::Reader {
        pragmas.push(("synchronous", options.synchronous.as_str()));
    }
    if role == Role::Writer {
        // 64 MiB of page cache: the pages every move touches (the tails of the events and steps
        // trees, the runs being moved) stay in memory instead of being read back from the OS.
        pragmas.push(("cache_size", "-65536"));
        // The savepoint of each move journals the pages it changes: in memory, not in a
        // temporary file written through the kernel.
        pragmas.push(("temp_store", "MEMORY"));
    }
    if role == Role::Reader {
        // Inspection and the consumer's queries cannot write behind the StoreActor's back.
        pragmas.push(("query_only", "ON"));
    }
    pragmas
}

/// Prepared statements kept per connection.
const STATEMENT_CACHE: usize = 128;

/// Opens a connection that writes to a database file: through the VFS that hands each commit's
/// log frames to the file in one write per 124 KiB, where there is one.
fn open_writing(path: &Path, flags: OpenFlags) -> rusqlite::Result<Connection> {
    #[cfg(unix)]
    if wal_vfs::register() {
        return Connection::open_with_flags_and_vfs(path, flags, wal_vfs::NAME);
    }
    Connection::open_with_flags(path, flags)
}

/// Applies the hardening and the pragmas every connection gets.
fn configure(conn: &Connection, options: &StoreOptions, file: bool, role: Role) -> Result<()> {
    conn.busy_timeout(options.busy_timeout)?;
    // Every statement agentrt runs stays prepared (rusqlite keeps 16 by default; the moves
    // alone use more).
    conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
    // Defensive mode: no writes to the schema table or other ways to corrupt the file from SQL.
    conn.set_db_config(DbConfig::SQLITE_DBCONFIG_DEFENSIVE, true)?;
    conn.set_db_config(DbConfig::SQLITE_DBCONFIG_TRUSTED_SCHEMA, false)?;
    for (name, value) in pragmas(options, file, role) {
        // journal_mode answers with a row; pragma_update_and_check reads it.
        conn.pragma_update_and_check(None, name, value, |_| Ok(()))
            .or_else(|err| match err {
                rusqlite::Error::QueryReturnedNoRows => Ok(()),
                err => Err(err),
            })?;
    }
    Ok(())
}

struct Inner {
    path: Option<PathBuf>,
    options: StoreOptions,
    /// The one connection that writes; for `:memory:` also the one that reads.
    writer: Mutex<Connection>,
    /// File stores: a connection for inspection and the consumer's own queries.
    reader: Option<Mutex<Connection>>,
    /// File stores: the write-ahead log, for [`Store::sync_log`].
    log: Option<LogFile>,
    /// A deferred group switched the writer to `synchronous = NORMAL` and it was not switched
    /// back yet (the group is being applied, or its restore failed, or it panicked): the next
    /// use of the writer restores the store's setting first.
    writer_lowered: AtomicBool,
}

/// The write-ahead log of a file store, synced outside SQLite's commits.
struct LogFile {
    /// As SQLite names it: the database's full path and `-wal`.
    path: PathBuf,
    /// Opened on first use and kept: Linux reports a failed write-back once to each descriptor
    /// open at the time, so a descriptor opened afresh for each sync could miss one.
    file: Mutex<Option<std::fs::File>>,
    /// Why a sync failed, once one has: the log may have lost pages that later commits build
    /// on, so this store refuses every later write and durable read.
    failed: Mutex<Option<String>>,
    /// Syncs done, for tests.
    #[cfg(test)]
    syncs: std::sync::atomic::AtomicUsize,
}

/// A handle on an agentrt database: cheap to clone, shared by a supervisor and its readers.
///
/// Inspection methods (`run`, `runs`, `events`, `pending_calls`) block on SQLite: call them
/// from a thread that may block, not from an actix arbiter that hosts actors.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("path", &self.inner.path)
            .finish_non_exhaustive()
    }
}

impl Store {
    /// Opens (creating it if missing) the database file at `path`, with default options.
    pub fn open(path: impl AsRef<Path>) -> Result<Store> {
        Store::open_with(path, StoreOptions::default())
    }

    /// Opens (creating it if missing) the database file at `path`, applying the migrations it
    /// lacks. A file that is not a database, or a database of a newer schema version, is
    /// refused and left unchanged.
    pub fn open_with(path: impl AsRef<Path>, options: StoreOptions) -> Result<Store> {
        let path = path.as_ref().to_path_buf();
        if path.as_os_str() == ":memory:" {
            // SQLite's name for a private in-memory database: one connection, the whole database.
            return Store::in_memory_with(options);
        }
        match SchemaStatus::of(&path) {
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
        let mut writer = open_writing(&path, flags).map_err(|err| on_open(err.into(), &path))?;
        configure(&writer, &options, true, Role::Writer).map_err(|err| on_open(err, &path))?;
        // After the pragmas: `wal_autocheckpoint` installs a hook of its own.
        writer.wal_hook(Some(note_log_size));
        if options.migrate {
            migrate(&mut writer, &path)?;
        }
        let reader = Connection::open_with_flags(
            &path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        configure(&reader, &options, true, Role::Reader)?;
        let log = writer.path().map(|db| LogFile {
            path: PathBuf::from(format!("{db}-wal")),
            file: Mutex::new(None),
            failed: Mutex::new(None),
            #[cfg(test)]
            syncs: Default::default(),
        });
        if let Some(log) = &log {
            // Opened now if the log exists (the writer has read the database); else at the
            // first sync.
            drop(log.open());
        }
        Ok(Store {
            inner: Arc::new(Inner {
                path: Some(path),
                options,
                writer: Mutex::new(writer),
                reader: Some(Mutex::new(reader)),
                log,
                writer_lowered: AtomicBool::new(false),
            }),
        })
    }

    /// A new database in memory, gone with the last clone of this handle. It has one
    /// connection, which is the whole database.
    pub fn in_memory() -> Result<Store> {
        Store::in_memory_with(StoreOptions::default())
    }

    /// [`Store::in_memory`] with options.
    pub fn in_memory_with(options: StoreOptions) -> Result<Store> {
        let mut conn = Connection::open_in_memory()?;
        configure(&conn, &options, false, Role::Writer)?;
        migrate(&mut conn, Path::new(":memory:"))?;
        Ok(Store {
            inner: Arc::new(Inner {
                path: None,
                options,
                writer: Mutex::new(conn),
                reader: None,
                log: None,
                writer_lowered: AtomicBool::new(false),
            }),
        })
    }

    /// The database file, or `None` in memory.
    pub fn path(&self) -> Option<&Path> {
        self.inner.path.as_deref()
    }

    /// The schema version of this database.
    pub fn schema_version(&self) -> Result<u32> {
        Ok(self
            .connection()
            .pragma_query_value(None, "user_version", |row| row.get(0))?)
    }

    /// A connection for your own queries (read-only on a file store).
    ///
    /// Hold it briefly: the inspection methods of this store wait for it, and on `:memory:` it
    /// is the writer's connection, so every move waits for it too.
    pub fn connection(&self) -> StoreConnection<'_> {
        let mutex = self.inner.reader.as_ref().unwrap_or(&self.inner.writer);
        StoreConnection(lock(mutex))
    }

    /// A run.
    pub fn run(&self, run_id: &RunId) -> Result<Run> {
        self.durable(|conn| sql::run(conn, run_id))
    }

    /// The runs, oldest first; only those in `state` when given.
    pub fn runs(&self, state: Option<RunState>) -> Result<Vec<Run>> {
        self.durable(|conn| sql::runs(conn, state))
    }

    /// A run's events, in order.
    pub fn events(&self, run_id: &RunId) -> Result<Vec<Event>> {
        self.durable(|conn| sql::events(conn, run_id))
    }

    /// The tool calls of a run that wait for an approval not yet recorded.
    pub fn pending_calls(&self, run_id: &RunId) -> Result<Vec<PendingCall>> {
        self.durable(|conn| sql::pending_calls(conn, run_id))
    }

    /// The stored lease of a run: its owner and expiry, read without taking or changing it.
    /// `None` when nobody holds it (the run is paused, finished, or was released by the call
    /// that executed it). A lease whose expiry has passed is stale, not released: a resume
    /// takes such a run over.
    pub fn lease(&self, run_id: &RunId) -> Result<Option<Lease>> {
        self.durable(|conn| sql::lease(conn, run_id))
    }

    /// A connection of its own for lease renewal, hardened like every other; `None` in memory,
    /// where the writer's connection is the whole database and renewals go through it.
    pub(crate) fn renewal_connection(&self, busy_timeout: Duration) -> Result<Option<Connection>> {
        let Some(path) = &self.inner.path else {
            return Ok(None);
        };
        let conn = open_writing(
            path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        let options = StoreOptions {
            busy_timeout,
            ..self.inner.options.clone()
        };
        configure(&conn, &options, true, Role::Renewal)?;
        Ok(Some(conn))
    }

    /// A run's events after sequence number `after`, in order: how a follower tails the log.
    pub fn events_after(&self, run_id: &RunId, after: u64) -> Result<Vec<Event>> {
        self.durable(|conn| sql::events_after(conn, run_id, after))
    }

    /// An operator's cancel, from outside a supervisor (a command-line tool, say), stamped by
    /// the system clock. A supervisor executing the run learns it at its next lease renewal:
    /// its loop stops at its next write, and a tool running then has its outcome recorded late.
    pub fn cancel(&self, run_id: &RunId, reason: &str) -> Result<()> {
        self.transact(&SystemClock, |tx, now| {
            sql::cancel_run(tx, now, run_id, reason)
        })
    }

    /// Records an operator's approval or denial of a waiting call, from outside a supervisor,
    /// stamped by the system clock. Resume the run afterwards.
    pub fn record_approval(&self, approval: &Approval) -> Result<()> {
        self.transact(&SystemClock, |tx, now| {
            sql::record_approval(tx, now, approval)
        })
    }

    /// A health report: schema version, connection settings, SQLite's integrity check, and
    /// the leases an operator should know about.
    pub fn health(&self) -> Result<Health> {
        let conn = self.connection();
        let pragma = |name: &str| -> Result<String> {
            Ok(conn
                .pragma_query_value(None, name, |row| row.get::<_, rusqlite::types::Value>(0))
                .map(|value| match value {
                    rusqlite::types::Value::Integer(n) => n.to_string(),
                    rusqlite::types::Value::Text(text) => text,
                    other => format!("{other:?}"),
                })?)
        };
        let settings = [
            "journal_mode",
            "synchronous",
            "foreign_keys",
            "trusted_schema",
            "busy_timeout",
        ]
        .into_iter()
        .map(|name| Ok((name.to_owned(), pragma(name)?)))
        .collect::<Result<Vec<_>>>()?;
        let (stale_leases, unleased) = sql::lease_report(&conn, wall_millis())?;
        Ok(Health {
            schema: SchemaStatus {
                found: pragma("user_version")?.parse().unwrap_or(0),
                supported: SCHEMA_VERSION,
            },
            settings,
            defensive: conn.db_config(DbConfig::SQLITE_DBCONFIG_DEFENSIVE)?,
            integrity: sql::integrity_check(&conn)?,
            stale_leases,
            running_without_lease: unleased,
        })
    }

    /// Runs `f` as one `BEGIN IMMEDIATE` transaction on the writer connection: committed when
    /// it returns `Ok`, rolled back otherwise. The clock is read at most once, when `f` first
    /// asks for the time, so a move refused by its guard reads no time.
    pub(crate) fn transact<R>(
        &self,
        clock: &dyn Clock,
        f: impl FnOnce(&Transaction<'_>, &mut Now<'_>) -> Result<R>,
    ) -> Result<R> {
        let mut conn = self.writer()?;
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let mut now = Now { clock, read: None };
        let value = f(&tx, &mut now)?;
        tx.commit()?;
        Ok(value)
    }

    /// Runs `moves` as one group commit: one `BEGIN IMMEDIATE` transaction and one commit
    /// for all, each move all-or-nothing. They are first applied straight into the transaction,
    /// which is all it takes when none is refused (the usual case); if one is, the transaction
    /// is rolled back and the group applied again with each move in a savepoint of its own, so
    /// that a refused move is rolled back alone. `apply` must therefore give the same result
    /// when called again on the same state. An error means nothing was committed.
    ///
    /// With [`LogSync::Deferred`] (and a store that [defers syncs](Self::defers_sync)), the
    /// commit writes the log without syncing it: the caller must [`sync_log`](Self::sync_log)
    /// before it tells anyone of these moves.
    pub(crate) fn transact_group<T>(
        &self,
        moves: &mut [T],
        sync: LogSync,
        mut apply: impl FnMut(&mut T, &Transaction<'_>, Isolation) -> bool,
    ) -> Result<()> {
        let mut conn = self.writer()?;
        let defer = sync == LogSync::Deferred && self.defers_sync();
        if defer {
            // Set first: should anything below panic or fail, the next use of the writer puts
            // the setting back before it commits.
            self.inner.writer_lowered.store(true, Ordering::SeqCst);
            conn.prepare_cached("PRAGMA synchronous = NORMAL")?
                .execute([])?;
        }
        let committed = (|| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            if moves
                .iter_mut()
                .all(|group_move| apply(group_move, &tx, Isolation::Shared))
            {
                return Ok(tx.commit()?);
            }
            drop(tx); // rolls back
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            for group_move in moves.iter_mut() {
                tx.prepare_cached("SAVEPOINT agentrt_move")?.execute([])?;
                if !apply(group_move, &tx, Isolation::Savepoint) {
                    tx.prepare_cached("ROLLBACK TO agentrt_move")?.execute([])?;
                }
                tx.prepare_cached("RELEASE agentrt_move")?.execute([])?;
            }
            Ok(tx.commit()?)
        })();
        if defer && let Err(err) = self.restore_synchronous(&conn) {
            // The group's own outcome stands (its sync is the caller's); the next use of the
            // writer tries again, and refuses to commit until it succeeds.
            tracing::error!(%err, "restoring the writer's synchronous setting failed");
        }
        committed
    }

    /// The writer connection, at the store's own `synchronous` setting.
    fn writer(&self) -> Result<MutexGuard<'_, Connection>> {
        if let Some(log) = &self.inner.log {
            log.refuse_if_failed()?;
        }
        let conn = lock(&self.inner.writer);
        if self.inner.writer_lowered.load(Ordering::SeqCst) {
            self.restore_synchronous(&conn)?;
        }
        Ok(conn)
    }

    fn restore_synchronous(&self, conn: &Connection) -> Result<()> {
        let pragma = format!(
            "PRAGMA synchronous = {}",
            self.inner.options.synchronous.as_str()
        );
        conn.prepare_cached(&pragma)
            .and_then(|mut restore| restore.execute([]))
            .map_err(|err| {
                Error::SyncFailed(format!("restoring the writer's `{pragma}`: {err}"))
            })?;
        self.inner.writer_lowered.store(false, Ordering::SeqCst);
        Ok(())
    }

    /// The syncs of the log done outside SQLite's commits so far.
    #[cfg(test)]
    pub(crate) fn log_syncs(&self) -> usize {
        self.inner
            .log
            .as_ref()
            .map_or(0, |log| log.syncs.load(Ordering::SeqCst))
    }

    /// The writer connection, held: the crash explorer holds a dead supervisor's, so that
    /// nothing of it commits while its runs recover.
    #[cfg(feature = "testkit")]
    pub(crate) fn writer_lock(&self) -> MutexGuard<'_, Connection> {
        lock(&self.inner.writer)
    }

    /// Whether a group commit may leave its log sync to [`sync_log`](Self::sync_log): a file
    /// store at [`Synchronous::Full`] (whose log is synced at each commit otherwise), on Unix
    /// (where the deferred sync is tested).
    pub(crate) fn defers_sync(&self) -> bool {
        cfg!(unix)
            && self.inner.log.is_some()
            && self.inner.options.synchronous == Synchronous::Full
    }

    /// Syncs the write-ahead log to disk: every commit written to it so far (by any connection
    /// or process) becomes durable, as if it had synced in its own commit. Nothing to do in
    /// memory. Once a sync failed, this and every later write through this store fail.
    pub(crate) fn sync_log(&self) -> Result<()> {
        match &self.inner.log {
            Some(log) => log.sync(),
            None => Ok(()),
        }
    }

    /// An inspection read, returned once every move it could have seen is durable: a group
    /// commit's moves are readable from the moment they are committed, up to a log sync before
    /// they are durable, and a reader must not act on a move that a power loss would undo.
    fn durable<R>(&self, read: impl FnOnce(&Connection) -> Result<R>) -> Result<R> {
        let value = read(&self.connection())?;
        // The connection is released: the sync holds nobody up.
        self.sync_after_read()?;
        Ok(value)
    }

    /// Syncs the log after a read, unless this store does not ask for durability beyond a
    /// crash of the process (`NORMAL`).
    pub(crate) fn sync_after_read(&self) -> Result<()> {
        if self.inner.options.synchronous == Synchronous::Normal {
            return Ok(());
        }
        self.sync_log()
    }

    /// Copies what the write-ahead log holds into the database file, without waiting for
    /// readers or blocking writers (a `PASSIVE` checkpoint); nothing to do in memory.
    pub(crate) fn checkpoint(&self) -> Result<()> {
        if self.inner.path.is_some() {
            self.writer()?
                .query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))?;
        }
        Ok(())
    }

    /// Runs `f` on the writer connection outside any move: reads that must see every committed
    /// move, and the lease's single-statement writes (renewal on `:memory:`, release).
    pub(crate) fn read<R>(&self, f: impl FnOnce(&Connection) -> Result<R>) -> Result<R> {
        f(&*self.writer()?)
    }
}

/// What [`Store::health`] found.
#[derive(Debug, Clone, PartialEq)]
pub struct Health {
    /// The schema version.
    pub schema: SchemaStatus,
    /// Settings of the inspection connection, as SQLite reports them (name, value).
    pub settings: Vec<(String, String)>,
    /// Whether SQLite's defensive mode is on.
    pub defensive: bool,
    /// What `PRAGMA integrity_check` said: `["ok"]` for a sound file.
    pub integrity: Vec<String>,
    /// RUNNING runs whose lease has expired: their executor died or stalled; a resume takes
    /// them over.
    pub stale_leases: Vec<(RunId, Lease)>,
    /// RUNNING runs nobody holds: their call returned with an error; a resume takes them over.
    pub running_without_lease: Vec<RunId>,
}

impl Health {
    /// True when the file is sound and its schema current.
    pub fn is_ok(&self) -> bool {
        self.integrity == ["ok"] && self.schema.pending() == 0
    }
}

thread_local! {
    /// The pages in the write-ahead log after the last commit of a writer on this thread.
    static LOG_PAGES: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// The writer's commit hook: notes the log's size for [`log_pages`].
fn note_log_size(_: &rusqlite::hooks::Wal, pages: std::ffi::c_int) -> rusqlite::Result<()> {
    LOG_PAGES.set(pages.max(0) as u32);
    Ok(())
}

/// The pages in the write-ahead log after the last commit made on this thread by a writer
/// connection (the store actor's thread: its own commits).
pub(crate) fn log_pages() -> u32 {
    LOG_PAGES.get()
}

/// When a group commit's log reaches the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LogSync {
    /// In the commit, as the store's [`Synchronous`] says.
    InCommit,
    /// Later, by [`Store::sync_log`], before anyone is told of the group's moves.
    Deferred,
}

/// How the moves of a group commit are kept apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isolation {
    /// Straight into the group's transaction: a refusal rolls the whole group back.
    Shared,
    /// In a savepoint of its own: a refusal rolls back this move alone.
    Savepoint,
}

/// The time of one move, read from the clock on first use only.
pub(crate) struct Now<'a> {
    clock: &'a dyn Clock,
    read: Option<i64>,
}

impl<'a> Now<'a> {
    /// The time of a move applied again: the reading it took before, if any.
    pub(crate) fn resume(clock: &'a dyn Clock, read: Option<i64>) -> Self {
        Now { clock, read }
    }

    /// The reading taken, if any.
    pub(crate) fn reading(&self) -> Option<i64> {
        self.read
    }

    /// Milliseconds since the Unix epoch.
    pub(crate) fn millis(&mut self) -> i64 {
        *self.read.get_or_insert_with(|| to_millis(self.clock.now()))
    }
}

/// The wall clock in milliseconds: what lease times are read from, never `Config::clock`.
pub(crate) fn wall_millis() -> i64 {
    to_millis(SystemTime::now())
}

pub(crate) fn to_millis(time: SystemTime) -> i64 {
    match time.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(after) => after.as_millis() as i64,
        Err(before) => -(before.duration().as_millis() as i64),
    }
}

pub(crate) fn from_millis(millis: i64) -> SystemTime {
    let magnitude = Duration::from_millis(millis.unsigned_abs());
    if millis >= 0 {
        SystemTime::UNIX_EPOCH + magnitude
    } else {
        SystemTime::UNIX_EPOCH - magnitude
    }
}

/// A connection handed to the consumer; see [`Store::connection`].
pub struct StoreConnection<'a>(MutexGuard<'a, Connection>);

impl Deref for StoreConnection<'_> {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        &self.0
    }
}

/// A panic while a connection was held cannot leave a transaction open (rusqlite rolls back on
/// drop), so a poisoned lock still guards a usable connection.
fn lock(mutex: &Mutex<Connection>) -> MutexGuard<'_, Connection> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn migrate(conn: &mut Connection, path: &Path) -> Result<()> {
    // Two processes opening a new file at once: the second waits on the write lock instead of
    // failing to upgrade a read transaction.
    conn.set_transaction_behavior(TransactionBehavior::Immediate);
    // A migration that rebuilds a table needs foreign keys off (they can only be switched
    // outside a transaction) and checks them itself before it commits; the others run with
    // them on.
    let found: u32 = conn
        .pragma_query_value(None, "user_version", |row| row.get(0))
        .map_err(|err| on_open(err.into(), path))?;
    let rebuilds = MIGRATIONS
        .iter()
        .skip(found as usize)
        .any(|(name, _)| REBUILDS.iter().any(|(file, _)| file == name));
    if rebuilds {
        conn.pragma_update(None, "foreign_keys", false)?;
    }
    let result = migrations().to_latest(conn);
    if rebuilds {
        conn.pragma_update(None, "foreign_keys", true)?;
    }
    conn.set_transaction_behavior(TransactionBehavior::Deferred);
    result.map_err(|err| match err {
        rusqlite_migration::Error::RusqliteError { err, .. } => on_open(err.into(), path),
        rusqlite_migration::Error::MigrationDefinition(
            rusqlite_migration::MigrationDefinitionError::DatabaseTooFarAhead,
        ) => Error::SchemaTooNew {
            path: path.to_path_buf(),
            // Another process upgraded the file since it was checked: say what it holds now.
            found: conn
                .pragma_query_value(None, "user_version", |row| row.get(0))
                .unwrap_or(0),
            supported: SCHEMA_VERSION,
        },
        other => Error::Migration(other.to_string()),
    })
}

/// Names the file when SQLite says it is not a database.
fn on_open(err: Error, path: &Path) -> Error {
    match err {
        Error::Database(rusqlite::Error::SqliteFailure(failure, _))
            if failure.code == rusqlite::ErrorCode::NotADatabase =>
        {
            Error::NotADatabase {
                path: path.to_path_buf(),
            }
        }
        other => other,
    }
}

impl LogFile {
    fn refuse_if_failed(&self) -> Result<()> {
        match &*self.failed.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(why) => Err(Error::SyncFailed(format!(
                "an earlier sync of {} failed ({why}); this store writes nothing more: \
                 reopen the database (SQLite recovers the log) once the disk is sound",
                self.path.display()
            ))),
            None => Ok(()),
        }
    }

    /// Opens the log for syncs, unless it is open: at the store's open, so that the descriptor
    /// is there before the first write-back it must hear of, or at the first sync.
    fn open(&self) -> std::io::Result<MutexGuard<'_, Option<std::fs::File>>> {
        let mut file = self.file.lock().unwrap_or_else(|p| p.into_inner());
        if file.is_none() {
            // Write access: Windows flushes only a handle that may write.
            *file = Some(std::fs::OpenOptions::new().write(true).open(&self.path)?);
        }
        Ok(file)
    }

    fn sync(&self) -> Result<()> {
        self.refuse_if_failed()?;
        let file = match self.open() {
            Ok(file) => file,
            // No log: nothing was written since the last connection closed.
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            // Nothing was synced, nor lost: the next sync tries again.
            Err(err) => {
                return Err(Error::SyncFailed(format!(
                    "opening {}: {err}",
                    self.path.display()
                )));
            }
        };
        #[cfg(test)]
        self.syncs.fetch_add(1, Ordering::SeqCst);
        let synced = file.as_ref().map_or(Ok(()), |log| log.sync_data());
        synced.map_err(|err| self.fail(err))
    }

    fn fail(&self, err: std::io::Error) -> Error {
        let why = err.to_string();
        *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(why.clone());
        Error::SyncFailed(format!("{}: {why}", self.path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn migrations_are_valid() {
        migrations().validate().unwrap();
        assert_eq!(SCHEMA_VERSION, 7);
    }

    #[test]
    fn every_connection_is_hardened() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("db.sqlite")).unwrap();
        for conn in [&*lock(&store.inner.writer), &*store.connection()] {
            let trusted: i64 = conn
                .pragma_query_value(None, "trusted_schema", |r| r.get(0))
                .unwrap();
            assert_eq!(trusted, 0);
            assert!(conn.db_config(DbConfig::SQLITE_DBCONFIG_DEFENSIVE).unwrap());
            let fk: i64 = conn
                .pragma_query_value(None, "foreign_keys", |r| r.get(0))
                .unwrap();
            assert_eq!(fk, 1);
        }
        let writer = lock(&store.inner.writer);
        let mode: String = writer
            .pragma_query_value(None, "journal_mode", |r| r.get(0))
            .unwrap();
        assert_eq!(mode, "wal");
        let sync: i64 = writer
            .pragma_query_value(None, "synchronous", |r| r.get(0))
            .unwrap();
        assert_eq!(sync, 2, "FULL by default");
    }

    #[test]
    fn a_group_whose_sync_is_deferred_leaves_the_writer_syncing_every_other_commit() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("db.sqlite")).unwrap();
        assert!(store.defers_sync());
        let synchronous = |store: &Store| -> i64 {
            lock(&store.inner.writer)
                .pragma_query_value(None, "synchronous", |r| r.get(0))
                .unwrap()
        };
        for refused in [false, true] {
            store
                .transact_group(&mut [()], LogSync::Deferred, |_, tx, _| {
                    tx.execute_batch("CREATE TABLE IF NOT EXISTS t (x)")
                        .unwrap();
                    !refused
                })
                .unwrap();
            assert_eq!(synchronous(&store), 2, "back to FULL after the group");
        }
        store.sync_log().unwrap();
        // NORMAL and in-memory stores sync as configured, in the commit.
        let normal = Store::open_with(
            dir.path().join("normal.sqlite"),
            StoreOptions {
                synchronous: Synchronous::Normal,
                ..StoreOptions::default()
            },
        )
        .unwrap();
        assert!(!normal.defers_sync());
        assert!(!Store::in_memory().unwrap().defers_sync());
        Store::in_memory().unwrap().sync_log().unwrap();
    }

    #[test]
    fn a_group_that_panics_with_its_sync_deferred_leaves_no_commit_unsynced_after_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("db.sqlite")).unwrap();
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            store.transact_group(&mut [()], LogSync::Deferred, |_, _, _| -> bool {
                panic!("a move panicked")
            })
        }));
        assert!(panicked.is_err());
        // The writer is still at NORMAL; its next use puts FULL back before anything commits.
        let sync: i64 = store
            .read(|conn| Ok(conn.pragma_query_value(None, "synchronous", |r| r.get(0))?))
            .unwrap();
        assert_eq!(sync, 2);
    }

    #[test]
    fn after_a_failed_log_sync_the_store_refuses_to_write_or_vouch_for_reads() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("db.sqlite")).unwrap();
        store.sync_log().unwrap();
        let log = store.inner.log.as_ref().unwrap();
        let err = log.fail(std::io::Error::other("injected write-back error"));
        assert!(matches!(err, Error::SyncFailed(_)));
        let refused = store.transact(&SystemClock, |_, _| Ok(())).unwrap_err();
        assert!(
            refused.to_string().contains("injected write-back error"),
            "{refused}"
        );
        assert!(matches!(
            store.transact_group(&mut [()], LogSync::Deferred, |_, _, _| true),
            Err(Error::SyncFailed(_))
        ));
        assert!(matches!(store.runs(None), Err(Error::SyncFailed(_))));
        assert!(matches!(store.sync_log(), Err(Error::SyncFailed(_))));
        // Reopened, the database is usable again (SQLite recovers the log).
        drop(store);
        let reopened = Store::open(dir.path().join("db.sqlite")).unwrap();
        assert_eq!(reopened.runs(None).unwrap(), vec![]);
    }

    #[test]
    fn the_log_synced_is_sqlites_own_and_is_open_from_the_start() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("db.sqlite")).unwrap();
        let log = store.inner.log.as_ref().unwrap();
        assert_eq!(
            log.path.canonicalize().unwrap(),
            dir.path().join("db.sqlite-wal").canonicalize().unwrap()
        );
        assert!(log.file.lock().unwrap().is_some());
    }

    #[test]
    fn a_log_that_cannot_be_opened_fails_that_sync_only() {
        let dir = tempfile::tempdir().unwrap();
        let log = LogFile {
            // A directory cannot be opened for writing.
            path: dir.path().to_path_buf(),
            file: Mutex::new(None),
            failed: Mutex::new(None),
            syncs: Default::default(),
        };
        assert!(matches!(log.sync(), Err(Error::SyncFailed(_))));
        assert!(log.refuse_if_failed().is_ok(), "nothing was lost");
    }

    #[test]
    fn the_renewal_connection_is_hardened_like_every_other() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("db.sqlite")).unwrap();
        let conn = store
            .renewal_connection(Duration::from_millis(100))
            .unwrap()
            .expect("a file store has one");
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
        assert!(
            Store::in_memory()
                .unwrap()
                .renewal_connection(Duration::from_millis(100))
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn the_reader_cannot_write() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("db.sqlite")).unwrap();
        let err = store
            .connection()
            .execute("DELETE FROM runs", [])
            .unwrap_err();
        assert!(err.to_string().contains("readonly"), "{err}");
    }

    #[test]
    fn the_path_memory_opens_an_in_memory_store() {
        let store = Store::open(":memory:").unwrap();
        assert_eq!(store.path(), None);
        assert!(!Path::new(":memory:").exists());
        assert_eq!(store.schema_version().unwrap(), SCHEMA_VERSION);
    }

    #[test]
    fn millis_round_trip() {
        for millis in [0, 1, -1, 1_700_000_000_123, -86_400_000] {
            assert_eq!(to_millis(from_millis(millis)), millis);
        }
    }
}
