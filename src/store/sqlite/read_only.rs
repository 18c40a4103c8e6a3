//! Reading a database file without writing anything: no `-wal` or `-shm` created beside it,
//! no byte of the file, its log or its index changed, every write refused.
//!
//! How it reads depends on what lies beside the file, looked at again before each read:
//!
//! - No log, a WAL database: no connection has it open (SQLite creates the log at a
//!   connection's first read and deletes it at the last close), so the file is the whole
//!   database, read as immutable: no lock taken, nothing created. A log that appears later
//!   (a process opened the database) makes the next read open again, and a read that raced it
//!   is read again.
//! - No log, a rollback-journal database: SQLite's read-only connection, under its locks,
//!   which creates nothing.
//! - A log and its index (`-shm`): SQLite reads under its locks with the index mapped
//!   read-only (`readonly_shm`). With a live process, that is the process's index, kept
//!   current by it; without one (it died), SQLite reads the log into private memory.
//! - A log without its index (a copied database, say): SQLite could only read it by creating
//!   the index, so the file and its log are copied into a private temporary directory and
//!   read there.
//!
//! Another process may open or close the database at any moment: its last close removes the
//! log and the index, its open may find the log to recover, which only a writer can. An open
//! or a read that fails while what lies beside the file changes, or while the log waits for
//! that recovery, looks again and reads as things are then (a few tries, a few milliseconds
//! apart), rather than fail.

use std::{
    any::Any,
    io::Read,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard},
    time::SystemTime,
};

use rusqlite::{OpenFlags, config::DbConfig};

use super::error::Db;
use super::{
    boundary,
    open::{
        Role, configure, on_open, read_schema_version, refuse_other_schema, uri_path, user_version,
    },
    options::Options,
    sql::in_snapshot,
};
use crate::{
    clock::Clock,
    error::{DatabaseError, Error, Result},
    store::{
        Health, SCHEMA_VERSION, SchemaStatus, Space, Store,
        backend::{Backend, MoveObserver, Reads, Session, Tx, Watcher},
        model::Now,
        pulse::Pulse,
    },
};

/// Reads the schema version of the database file at `path` without changing it or creating
/// anything beside it. A missing file is [`Error::NoDatabase`]; a file that is not a
/// database, [`Error::NotADatabase`]; a database cut short or whose schema pages are damaged,
/// [`Error::DatabaseCorrupt`].
pub fn schema_status(path: impl AsRef<Path>) -> Result<SchemaStatus> {
    let path = path.as_ref();
    let found = read_schema_version(path, |real| version_beside_log(path, real))?;
    Ok(SchemaStatus {
        found,
        supported: SCHEMA_VERSION,
    })
}

/// SQLite's quick integrity check (`PRAGMA quick_check`) of the database file at `path`, read
/// as a read-only store reads (see [`Options::open_read_only`]): `["ok"]` for a sound
/// database, else what it found. A database of any schema version is checked. A check that
/// stops on damage answers with what SQLite said.
pub fn quick_check(path: impl AsRef<Path>) -> Result<Vec<String>> {
    let path = path.as_ref();
    schema_status(path)?;
    let db = ReadOnly::new(path, Options::default())?;
    db.on_connection(|opened| {
        let found = opened
            .conn
            .prepare("PRAGMA quick_check")
            .and_then(|mut check| {
                check
                    .query_map([], |row| row.get(0))?
                    .collect::<rusqlite::Result<Vec<String>>>()
            });
        match found {
            Ok(found) => Ok(found),
            // Damage stops the check: that is what it found. Any other error (a busy database,
            // say) is no finding, and is the check's error.
            Err(err) if is_damage(&err) => Ok(vec![err.to_string()]),
            Err(err) => Err(err).db(),
        }
    })
}

/// SQLite's answer for a file that is not a database or is damaged.
fn is_damage(err: &rusqlite::Error) -> bool {
    matches!(
        err.sqlite_error_code(),
        Some(rusqlite::ErrorCode::DatabaseCorrupt | rusqlite::ErrorCode::NotADatabase)
    )
}

/// The schema version of a database that has a log beside it, read without changing anything.
fn version_beside_log(path: &Path, real: &Path) -> Result<u32> {
    let beside = look(real).map_err(|err| unreadable(path, err))?;
    let opened = Opened::open(path, real, &Options::default(), beside)?;
    user_version(&opened.conn).map_err(|err| on_open(err, path))
}

impl Store {
    /// Opens the existing database file at `path` for reading only, with the default
    /// [`Options`]: see [`Options::open_read_only`].
    pub fn open_read_only(path: impl AsRef<Path>) -> Result<Store> {
        Options::default().open_read_only(path)
    }
}

impl Options {
    /// Opens the existing database file at `path` for reading only: nothing is created beside
    /// it and no byte of it, of its log or of its log's index changes, however the last
    /// process left it. Every write through the store (a cancel, an approval, a supervisor)
    /// is refused with [`Error::ReadOnly`]. Of the options, only the busy timeout applies.
    ///
    /// The errors of [`Options::existing_only`]'s open: a missing file, one that is not a
    /// database or is damaged, and a schema other than the current one are refused.
    ///
    /// It reads the file it opened: once that is deleted or replaced, reads fail with
    /// [`Error::DatabaseGone`]. With a process writing the database, it reads that process's
    /// commits as they come, under SQLite's locks, with the log's index mapped read-only
    /// (SQLite may fall back to taking a read mark in the index, as every reader does, when no
    /// mark fits its snapshot). A database whose log lies beside it without its index is read
    /// from a private copy, taken again whenever the file or its log changes. Its reads do not
    /// sync the log: what it shows may be a commit the writing process has not yet synced.
    pub fn open_read_only(self, path: impl AsRef<Path>) -> Result<Store> {
        let path = path.as_ref();
        if path.as_os_str() == ":memory:" {
            return Err(Error::InvalidInput(
                "an in-memory database cannot be opened read-only: it is new and empty".into(),
            ));
        }
        schema_status(path)?;
        let db = ReadOnly::new(path, self)?;
        // Read through the store's own connection: a process may have upgraded the file since
        // its version was first read.
        refuse_other_schema(path, db.schema_version()?, false)?;
        Ok(Store::from_backend(Arc::new(db)))
    }
}

/// The backend of a store opened by [`Options::open_read_only`].
pub(crate) struct ReadOnly {
    /// As given, for messages.
    path: PathBuf,
    /// Symbolic links resolved, as SQLite resolves them, so that the log looked for is the one
    /// SQLite would use.
    real: PathBuf,
    options: Options,
    /// The file opened: a file found at the path later is another database.
    file: FileId,
    opened: Mutex<Opened>,
}

impl ReadOnly {
    fn new(path: &Path, options: Options) -> Result<ReadOnly> {
        let real = std::fs::canonicalize(path).map_err(|err| match err.kind() {
            std::io::ErrorKind::NotFound => Error::NoDatabase {
                path: path.to_path_buf(),
            },
            _ => unreadable(path, err),
        })?;
        let beside = look(&real).map_err(|err| unreadable(path, err))?;
        let opened = Opened::open(path, &real, &options, beside)?;
        Ok(ReadOnly {
            path: path.to_path_buf(),
            file: beside.db.id,
            real,
            options,
            opened: Mutex::new(opened),
        })
    }

    fn gone(&self, why: String) -> Error {
        Error::DatabaseGone {
            path: self.path.clone(),
            why,
        }
    }

    /// What lies beside the file now; an error once the file opened is gone.
    fn look(&self) -> Result<Beside> {
        let gone = |why: &str| self.gone(why.to_owned());
        let beside = look(&self.real).map_err(|err| match err.kind() {
            std::io::ErrorKind::NotFound => gone("was deleted or moved away"),
            _ => gone(&format!("can no longer be read ({err})")),
        })?;
        if beside.db.id != self.file {
            return Err(gone("was replaced by another file"));
        }
        Ok(beside)
    }

    /// The connection, opened again first if what lies beside the file changed in a way that
    /// its way of reading does not follow.
    /// Runs `f` on the connection as things are now: with a read mark taken the ordinary way
    /// when the live index has none that fits, and again when a process opening the database
    /// may have raced it (its checkpoint rewrites the file, under a read of the file alone or
    /// of a copy). A read still raced after three tries is refused as busy, never answered.
    fn on_connection<R>(&self, mut f: impl FnMut(&Opened) -> Result<R>) -> Result<R> {
        for _ in 0..10 {
            let mut opened = self.current()?;
            let mut result = f(&opened);
            if result.as_ref().is_err_and(no_read_mark) && !opened.marks {
                *opened = opened.taking_marks(&self.path, &self.real, &self.options)?;
                result = f(&opened);
            }
            if result.as_ref().is_err_and(log_recovering) {
                std::thread::sleep(RECOVERY_PAUSE);
                let now = self.look()?;
                *opened = Opened::open(&self.path, &self.real, &self.options, now)?;
                continue;
            }
            let now = self.look()?;
            if result.is_err() && now != opened.seen {
                // A read that failed while the files beside changed (a process opened or
                // closed the database under it) is read again as things are now, whatever
                // the way of reading.
                *opened = Opened::open(&self.path, &self.real, &self.options, now)?;
                continue;
            }
            if !opened.stale(&now) {
                return result;
            }
        }
        Err(busy(format!(
            "{} kept changing while it was being read; try again",
            self.path.display()
        )))
    }

    fn current(&self) -> Result<MutexGuard<'_, Opened>> {
        let mut opened = self
            .opened
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let beside = self.look()?;
        if opened.stale(&beside) {
            // Its connection holds no lock between reads, which closing this descriptor could
            // drop.
            if let Err(err) = std::fs::File::open(&self.real) {
                return Err(self.gone(format!("can no longer be read ({err})")));
            }
            *opened = Opened::open(&self.path, &self.real, &self.options, beside)?;
        }
        Ok(opened)
    }

    fn refused(&self) -> Error {
        Error::ReadOnly {
            path: self.path.clone(),
            why: "it was opened for reading only".into(),
        }
    }
}

impl Backend for ReadOnly {
    fn describe(&self) -> String {
        format!("sqlite:{} (read-only)", self.path.display())
    }

    fn schema_version(&self) -> Result<u32> {
        user_version(&self.current()?.conn).db()
    }

    fn read(&self, read: &mut (dyn FnMut(&mut dyn Reads) -> Result<()> + Send)) -> Result<()> {
        self.on_connection(|opened| in_snapshot(&opened.conn, |sql| read(sql)))
    }

    fn transact(
        &self,
        _: &dyn Clock,
        _: &mut (dyn FnMut(&mut dyn Tx, &mut Now<'_>) -> Result<()> + Send),
    ) -> Result<()> {
        Err(self.refused())
    }

    fn session(
        self: Arc<Self>,
        _: Arc<dyn Clock>,
        _: Option<Arc<dyn MoveObserver>>,
    ) -> Result<Session> {
        Err(self.refused())
    }

    fn watcher(self: Arc<Self>) -> Result<Box<dyn Watcher>> {
        // Only a supervisor watches, and it needs a store that writes.
        Err(self.refused())
    }

    fn pulse(self: Arc<Self>) -> Result<Box<dyn Pulse>> {
        Ok(Box::new(ReadOnlyPulse(self)))
    }

    fn health(&self) -> Result<Health> {
        self.on_connection(|opened| {
            // An immutable connection reports the journal mode it reads with, not the file's.
            let journal_mode = (opened.how == How::Immutable).then_some("wal");
            boundary::health(
                &opened.conn,
                self.options.synchronous.as_str(),
                journal_mode,
            )
        })
    }

    fn reclaim(&self) -> Result<Space> {
        Err(self.refused())
    }

    fn vacuum(&self) -> Result<Space> {
        Err(self.refused())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// How a connection reads the database; see the module's documentation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum How {
    /// No log beside a WAL database: the file alone, as immutable.
    Immutable,
    /// No log beside a rollback-journal database: under SQLite's locks.
    Locked,
    /// A log and its index: under SQLite's locks, the index mapped read-only.
    Shared,
    /// A log without its index: a private copy of both files.
    Copy,
}

struct Opened {
    /// Declared first: closed before the copy it may read is removed.
    conn: rusqlite::Connection,
    how: How,
    /// `How::Shared` fell back to SQLite's ordinary read-only connection, which takes a read
    /// mark in the live process's index.
    marks: bool,
    /// What lay beside the file when it was opened.
    seen: Beside,
    /// `How::Copy`: the directory holding the copy.
    _copy: Option<CopyDir>,
}

impl Opened {
    fn open(path: &Path, real: &Path, options: &Options, mut beside: Beside) -> Result<Opened> {
        for _ in 0..10 {
            let how = match (beside.wal.is_some(), beside.shm) {
                (false, _) if wal_mode(real).map_err(|err| unreadable(path, err))? => {
                    How::Immutable
                }
                (false, _) => How::Locked,
                (true, true) => How::Shared,
                (true, false) => How::Copy,
            };
            let uri = |query: &str| format!("file:{}?{query}", uri_path(real));
            // The last process to close the database removes its log and index: an open that
            // raced that looks again, and reads the file as it is now.
            let connected = match how {
                How::Immutable => Some(connect(&uri("mode=ro&immutable=1"), options, path)),
                How::Locked => Some(connect(&uri("mode=ro"), options, path)),
                How::Shared => Some(connect(&uri("mode=ro&readonly_shm=1"), options, path)),
                How::Copy => None,
            };
            let (conn, copy) = match connected {
                Some(Ok(conn)) => (conn, None),
                Some(Err(err)) => match look(real) {
                    Ok(now) if now != beside => {
                        beside = now;
                        continue;
                    }
                    _ => return Err(err),
                },
                None => match CopyDir::of(path, real, beside)? {
                    Copied::Taken(copy) => {
                        let uri = format!("file:{}?mode=ro", uri_path(&copy.db));
                        (connect(&uri, options, path)?, Some(copy))
                    }
                    // A process opened the database meanwhile: read it as things are now.
                    Copied::Changed(now) => {
                        beside = now;
                        continue;
                    }
                },
            };
            let opened = Opened {
                conn,
                how,
                marks: false,
                seen: beside,
                _copy: copy,
            };
            return match opened.check() {
                Err(err) if is_no_read_mark(&err) => opened.taking_marks(path, real, options),
                Err(err) if is_log_recovering(&err) => {
                    drop(opened);
                    std::thread::sleep(RECOVERY_PAUSE);
                    beside = look(real).map_err(|err| unreadable(path, err))?;
                    continue;
                }
                Err(err) => match look(real) {
                    Ok(now) if now != beside => {
                        drop(opened);
                        beside = now;
                        continue;
                    }
                    _ => Err(on_open(err, path)),
                },
                Ok(()) => Ok(opened),
            };
        }
        Err(busy(format!(
            "{} kept changing while it was being opened to be read; try again",
            path.display()
        )))
    }

    /// Reads the schema, which finds a file that is not a database or is damaged.
    fn check(&self) -> rusqlite::Result<()> {
        self.conn
            .query_row("SELECT count(*) FROM sqlite_schema", [], |_| Ok(()))
    }

    /// SQLite's ordinary read-only connection to a database a live process writes: for when
    /// no read mark of that process's index fits the snapshot (SQLite then needs to write one).
    fn taking_marks(&self, path: &Path, real: &Path, options: &Options) -> Result<Opened> {
        let conn = connect(&format!("file:{}?mode=ro", uri_path(real)), options, path)?;
        let opened = Opened {
            conn,
            how: How::Shared,
            marks: true,
            seen: self.seen,
            _copy: None,
        };
        opened.check().map_err(|err| on_open(err, path))?;
        Ok(opened)
    }

    /// Whether what lies beside the file now calls for opening again. Under SQLite's locks
    /// with a log, SQLite follows every change itself.
    fn stale(&self, now: &Beside) -> bool {
        self.how != How::Shared && *now != self.seen
    }
}

/// A connection that reads the database `path` at `uri`, with the hardening every connection
/// gets.
fn connect(uri: &str, options: &Options, path: &Path) -> Result<rusqlite::Connection> {
    let conn = rusqlite::Connection::open_with_flags(
        uri,
        OpenFlags::SQLITE_OPEN_READ_ONLY
            | OpenFlags::SQLITE_OPEN_NO_MUTEX
            | OpenFlags::SQLITE_OPEN_URI,
    )
    .map_err(|err| on_open(err, path))?;
    // The last connection to close copies the log into the file: never this one.
    conn.set_db_config(DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, true)
        .db()?;
    configure(&conn, options, true, Role::Reader)?;
    Ok(conn)
}

/// An error that trying again may not meet.
fn busy(message: String) -> Error {
    Error::Database(DatabaseError::new(true, std::io::Error::other(message)))
}

/// SQLite's answer when no read mark of a live index fits and it may not write one.
fn is_no_read_mark(err: &rusqlite::Error) -> bool {
    matches!(err, rusqlite::Error::SqliteFailure(failure, _)
        if failure.extended_code == rusqlite::ffi::SQLITE_READONLY_CANTINIT)
}

/// SQLite's answer when the log must be recovered first, which only a writer may do: a
/// process is opening the database (or its last one closing it) right now, and a moment
/// later the log is whole again.
fn is_log_recovering(err: &rusqlite::Error) -> bool {
    matches!(err, rusqlite::Error::SqliteFailure(failure, _)
        if failure.extended_code == rusqlite::ffi::SQLITE_READONLY_RECOVERY)
}

fn log_recovering(err: &Error) -> bool {
    match err {
        Error::Database(db) => std::error::Error::source(db)
            .and_then(|source| source.downcast_ref::<rusqlite::Error>())
            .is_some_and(is_log_recovering),
        _ => false,
    }
}

/// How long a read waits for another process's recovery of the log, between two tries.
const RECOVERY_PAUSE: std::time::Duration = std::time::Duration::from_millis(2);

fn no_read_mark(err: &Error) -> bool {
    match err {
        Error::Database(db) => std::error::Error::source(db)
            .and_then(|source| source.downcast_ref::<rusqlite::Error>())
            .is_some_and(is_no_read_mark),
        _ => false,
    }
}

fn unreadable(path: &Path, err: std::io::Error) -> Error {
    Error::DatabaseCorrupt {
        path: path.to_path_buf(),
        detail: format!("it cannot be read: {err}"),
    }
}

/// Whether the file's header says WAL (its read and write versions are 2).
fn wal_mode(real: &Path) -> std::io::Result<bool> {
    let mut head = [0u8; 20];
    std::fs::File::open(real)?.read_exact(&mut head)?;
    Ok(head[18] == 2 && head[19] == 2)
}

/// A file's identity: a file found at the same path later may be another one.
type FileId = (u64, u64);

/// A file as `stat` sees it, read without opening it (a descriptor of this process closed on
/// the database would drop the locks its SQLite connection holds there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    id: FileId,
    len: u64,
    modified: Option<SystemTime>,
}

impl Stamp {
    fn of(metadata: &std::fs::Metadata) -> Stamp {
        #[cfg(unix)]
        let id = {
            use std::os::unix::fs::MetadataExt;
            (metadata.dev(), metadata.ino())
        };
        #[cfg(not(unix))]
        let id = (0, 0);
        Stamp {
            id,
            len: metadata.len(),
            modified: metadata.modified().ok(),
        }
    }
}

/// A read-only store's check for commits: the stamps of the database and its log, which a
/// commit changes, read without opening anything.
struct ReadOnlyPulse(Arc<ReadOnly>);

impl Pulse for ReadOnlyPulse {
    fn marker(&mut self) -> Result<String> {
        Ok(format!("{:?}", self.0.look()?))
    }
}

/// The database file and what lies beside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Beside {
    db: Stamp,
    wal: Option<Stamp>,
    shm: bool,
}

fn look(real: &Path) -> std::io::Result<Beside> {
    let beside = |suffix: &str| {
        let mut name = real.as_os_str().to_owned();
        name.push(suffix);
        match std::fs::metadata(PathBuf::from(name)) {
            Ok(metadata) => Ok(Some(Stamp::of(&metadata))),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(err) => Err(err),
        }
    };
    Ok(Beside {
        db: Stamp::of(&std::fs::metadata(real)?),
        wal: beside("-wal")?,
        shm: beside("-shm")?.is_some(),
    })
}

/// A private temporary directory holding a copy of a database and its log, removed on drop.
struct CopyDir {
    dir: PathBuf,
    db: PathBuf,
}

enum Copied {
    Taken(CopyDir),
    /// The files changed while they were copied: what lies beside the file now.
    Changed(Beside),
}

impl CopyDir {
    /// Copies the file and its log, `beside` being what they were before. Nothing writes them
    /// (a process that opens the database creates the index), unless a process opens the
    /// database meanwhile: then the copy is dropped.
    fn of(path: &Path, real: &Path, beside: Beside) -> Result<Copied> {
        let failed = |err: std::io::Error| {
            Error::Database(DatabaseError::new(
                false,
                std::io::Error::new(
                    err.kind(),
                    format!(
                        "copying {} and its log, to read them without creating their index: {err}",
                        path.display()
                    ),
                ),
            ))
        };
        let dir = std::env::temp_dir().join(format!("agentrt-read-{}", uuid::Uuid::new_v4()));
        // Only this user may read the copy: the file's own directory may be what kept it private.
        let mut private = std::fs::DirBuilder::new();
        #[cfg(unix)]
        std::os::unix::fs::DirBuilderExt::mode(&mut private, 0o700);
        private.create(&dir).map_err(failed)?;
        let copy = CopyDir {
            db: dir.join("copy.db"),
            dir,
        };
        let mut log = real.as_os_str().to_owned();
        log.push("-wal");
        let copied = std::fs::copy(real, &copy.db)
            .and_then(|_| std::fs::copy(PathBuf::from(log), copy.dir.join("copy.db-wal")));
        let after = look(real).map_err(|err| unreadable(path, err))?;
        match copied {
            // The last process to close the database removed its log meanwhile.
            Err(err) if err.kind() == std::io::ErrorKind::NotFound && after != beside => {
                return Ok(Copied::Changed(after));
            }
            copied => copied.map_err(failed)?,
        };
        Ok(if after == beside {
            Copied::Taken(copy)
        } else {
            Copied::Changed(after)
        })
    }
}

impl Drop for CopyDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
