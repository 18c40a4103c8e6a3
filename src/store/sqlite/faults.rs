//! The fault-injection seam of the SQLite backend, built only with the `testkit` feature (and
//! in the crate's own tests): it counts the log syncs done outside SQLite's commits and can
//! make the next one fail, as a failed write-back would; it counts and fails the writes, syncs
//! and truncations SQLite makes of a store's files through the log-gathering VFS, per store;
//! and ([`vfs`]) it counts and fails that VFS's gathered log writes, per thread.

use std::{
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
};

/// A write, a sync or a truncation that SQLite makes of a store's files, for
/// [`Faults::fail_next`] to fail. Faults of these kinds reach only the connections that go
/// through agentrt's log-gathering VFS (the writer's and the lease keeper's, on the SQLite
/// releases it was written for, with [`Options::log_vfs`](crate::sqlite::Options::log_vfs)
/// on).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FaultKind {
    /// A write to the write-ahead log: a commit's frames (a commit sends them in one write,
    /// with its commit frame), or the log's header when it starts over after a checkpoint.
    /// Fails with `SQLITE_IOERR_WRITE`, writing nothing. Not the zeros that extend a short log
    /// as it starts: a write of them that fails fails nothing (the log is cut back).
    LogWrite,
    /// A sync of the write-ahead log by SQLite: in each commit at `FULL`, and before a
    /// checkpoint copies the log. The sync is done, then reported failed with
    /// `SQLITE_IOERR_FSYNC`, as a failed write-back is: what it was to sync may or may not be
    /// on disk.
    LogSync,
    /// A truncation of the write-ahead log (`PRAGMA wal_checkpoint(TRUNCATE)`, a journal size
    /// limit). Fails with `SQLITE_IOERR_TRUNCATE`, truncating nothing.
    LogTruncate,
    /// A write to the database file: a checkpoint's copy of a page. Fails with
    /// `SQLITE_IOERR_WRITE`, writing nothing.
    DatabaseWrite,
    /// A sync of the database file, at the end of a checkpoint. Done, then reported failed
    /// with `SQLITE_IOERR_FSYNC`.
    DatabaseSync,
    /// A truncation of the database file: a checkpoint that copied the whole log sets the
    /// file's size to the database's. Fails with `SQLITE_IOERR_TRUNCATE`, truncating nothing.
    DatabaseTruncate,
}

impl FaultKind {
    const ALL: [FaultKind; 6] = [
        FaultKind::LogWrite,
        FaultKind::LogSync,
        FaultKind::LogTruncate,
        FaultKind::DatabaseWrite,
        FaultKind::DatabaseSync,
        FaultKind::DatabaseTruncate,
    ];

    fn index(self) -> usize {
        self as usize
    }
}

/// Faults to inject into one SQLite store, and what it did; see
/// [`testkit::faults`](crate::testkit::faults).
#[derive(Debug, Default)]
pub struct Faults {
    syncs: AtomicUsize,
    fail_next_sync: AtomicBool,
    files: Arc<FileFaults>,
}

/// The switches and counts of a store's files, which its VFS finds by the database's name.
#[derive(Debug, Default)]
pub(crate) struct FileFaults {
    done: [AtomicUsize; FaultKind::ALL.len()],
    /// Per kind, the call to fail, counted from 1 (the next); 0 for none.
    armed: [AtomicUsize; FaultKind::ALL.len()],
    injected: AtomicUsize,
}

impl FileFaults {
    /// Counts one `kind` of call, and says whether to fail it.
    fn hit(&self, kind: FaultKind) -> bool {
        self.done[kind.index()].fetch_add(1, Ordering::SeqCst);
        let armed = self.armed[kind.index()]
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .unwrap_or_else(|n| n);
        let fail = armed == 1;
        if fail {
            self.injected.fetch_add(1, Ordering::SeqCst);
        }
        fail
    }
}

/// The files of the stores open now, by the name SQLite gives their database file. A store
/// opened again at the same path replaces its entry.
static STORES: Mutex<Vec<(String, Weak<FileFaults>)>> = Mutex::new(Vec::new());

/// Faults armed for the next store opened at a path (as the open was given it): the kind, and
/// how many calls of it pass first.
static AT_OPEN: Mutex<Vec<(PathBuf, FaultKind, usize)>> = Mutex::new(Vec::new());

impl Faults {
    /// The faults of a store whose database file SQLite names `name` (its full path), opened
    /// at `path`: the VFS finds them by that name. Takes the faults armed for `path` by
    /// [`Faults::fail_next_at_open`].
    pub(crate) fn of_database(name: &str, path: &Path) -> Faults {
        let faults = Faults::default();
        AT_OPEN
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(at, kind, passing)| {
                let mine = at == path;
                if mine {
                    faults.files.armed[kind.index()].store(passing + 1, Ordering::SeqCst);
                }
                !mine
            });
        let mut stores = STORES.lock().unwrap_or_else(|p| p.into_inner());
        stores.retain(|(held, files)| held != name && files.strong_count() > 0);
        stores.push((name.to_owned(), Arc::downgrade(&faults.files)));
        faults
    }

    /// Makes a call of `kind` that SQLite makes of the files of the next store opened at
    /// `path` (as given to the open) fail: the first `passing` such calls pass, the next one
    /// fails. Counted from the moment the store's writer has the database open, so the open's
    /// own writes and syncs (a new file's settings, its switch to WAL mode, the migrations)
    /// can be failed, which [`fail_next`](Self::fail_next) comes too late for. If the open
    /// makes fewer calls, the fault stays armed on the store it opened.
    pub fn fail_at_open(path: impl AsRef<Path>, kind: FaultKind, passing: usize) {
        let path = path.as_ref().to_path_buf();
        AT_OPEN
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((path, kind, passing));
    }

    /// The log syncs done outside SQLite's commits so far (a group's deferred sync, the sync
    /// after a read, the sync of a reservation answered once written).
    pub fn syncs(&self) -> usize {
        self.syncs.load(Ordering::SeqCst)
    }

    /// Makes the next log sync done outside SQLite's commits fail as a failed write-back does:
    /// the store then refuses every later write and durable read until it is reopened.
    pub fn fail_next_sync(&self) {
        self.fail_next_sync.store(true, Ordering::SeqCst);
    }

    /// Makes the next call of `kind` that SQLite makes of this store's files fail, on
    /// whichever of the store's connections makes it (the supervisor's writer, the lease
    /// keeper's): the store then refuses every later write and durable read until it is
    /// reopened.
    pub fn fail_next(&self, kind: FaultKind) {
        self.files.armed[kind.index()].store(1, Ordering::SeqCst);
    }

    /// The calls of `kind` that SQLite made of this store's files so far.
    pub fn count(&self, kind: FaultKind) -> usize {
        self.files.done[kind.index()].load(Ordering::SeqCst)
    }

    /// The faults injected so far, of every kind (a failed log sync among them).
    pub fn injected(&self) -> usize {
        self.files.injected.load(Ordering::SeqCst)
    }

    /// Called before each sync: counts it, and says why it fails if asked to.
    pub(crate) fn before_sync(&self) -> Option<String> {
        self.syncs.fetch_add(1, Ordering::SeqCst);
        if self.fail_next_sync.swap(false, Ordering::SeqCst) {
            self.files.injected.fetch_add(1, Ordering::SeqCst);
            return Some("an injected write-back failure".into());
        }
        None
    }
}

/// The seam of the log-gathering VFS: its write path calls [`vfs::before_log_write`] before
/// each write of gathered bytes, and its barrier [`vfs::at_barrier`]. The state is per thread
/// (SQLite calls a VFS on the thread of the connection), so that tests running at once do not
/// see each other's writes.
#[cfg(unix)]
pub(crate) mod vfs {
    use std::{cell::Cell, ffi::CStr, sync::Arc};

    use rusqlite::ffi;

    use super::{FaultKind, FileFaults, STORES};

    /// What the VFS does to a file, for [`FileSeam::fails`].
    #[derive(Debug, Clone, Copy)]
    pub(crate) enum Op {
        Write,
        Sync,
        Truncate,
    }

    /// The per-store seam of one file the VFS opened: a database file or its log.
    pub(crate) struct FileSeam {
        /// Whether it is the log, and the name of its database file; `None` for other files.
        file: Option<(bool, String)>,
        /// The store's faults, once found.
        faults: Option<Arc<FileFaults>>,
    }

    impl FileSeam {
        /// The seam of the file SQLite opens as `name` with `flags`.
        ///
        /// # Safety
        ///
        /// `name` is the name SQLite passed to `xOpen` with these flags.
        pub(crate) unsafe fn new(name: ffi::sqlite3_filename, flags: std::ffi::c_int) -> Self {
            let log = flags & ffi::SQLITE_OPEN_WAL != 0;
            let db = if name.is_null() {
                None
            } else if log {
                // SAFETY: a log's name, as SQLite passed it to `xOpen`.
                Some(unsafe { ffi::sqlite3_filename_database(name) })
            } else if flags & ffi::SQLITE_OPEN_MAIN_DB != 0 {
                Some(name)
            } else {
                None
            };
            let file = db.filter(|db| !db.is_null()).map(|db| {
                // SAFETY: SQLite's file names are NUL-terminated.
                let db = unsafe { CStr::from_ptr(db) };
                (log, db.to_string_lossy().into_owned())
            });
            FileSeam { file, faults: None }
        }

        /// Called before each write, sync or truncation of the file: counts it for its store,
        /// and says whether to fail it.
        pub(crate) fn fails(&mut self, op: Op) -> bool {
            let Some((log, db)) = &self.file else {
                return false;
            };
            if self.faults.is_none() {
                // Found once the store opened: its writer opens the files before it exists.
                let stores = STORES.lock().unwrap_or_else(|p| p.into_inner());
                self.faults = stores
                    .iter()
                    .find(|(name, _)| name == db)
                    .and_then(|(_, files)| files.upgrade());
            }
            let Some(faults) = &self.faults else {
                return false;
            };
            let kind = match (log, op) {
                (true, Op::Write) => FaultKind::LogWrite,
                (true, Op::Sync) => FaultKind::LogSync,
                (true, Op::Truncate) => FaultKind::LogTruncate,
                (false, Op::Write) => FaultKind::DatabaseWrite,
                (false, Op::Sync) => FaultKind::DatabaseSync,
                (false, Op::Truncate) => FaultKind::DatabaseTruncate,
            };
            faults.hit(kind)
        }
    }

    thread_local! {
        /// Writes of gathered bytes to a log file from this thread.
        static LOG_WRITES: Cell<usize> = const { Cell::new(0) };
        /// Makes this thread's writes to a log file fail.
        static FAIL_LOG_WRITES: Cell<bool> = const { Cell::new(false) };
        /// Makes this thread's write to a log file fail when `LOG_WRITES` reaches it (0: none).
        static FAIL_LOG_WRITE_AT: Cell<usize> = const { Cell::new(0) };
        /// A barrier on this thread found bytes still to write, or a failed write.
        static BARRIER_FOUND_BYTES: Cell<bool> = const { Cell::new(false) };
        /// The extensions of a log from this thread: the file's size before, and after.
        static EXTENSIONS: std::cell::RefCell<Vec<(i64, i64)>> =
            const { std::cell::RefCell::new(Vec::new()) };
        /// Makes this thread's extensions of a log fail.
        static FAIL_EXTENSIONS: Cell<bool> = const { Cell::new(false) };
    }

    /// Called before a log is extended from `from` bytes to `to`: notes it, and says whether
    /// its writes are to fail.
    pub(crate) fn before_extension(from: i64, to: i64) -> bool {
        EXTENSIONS.with_borrow_mut(|done| done.push((from, to)));
        FAIL_EXTENSIONS.get()
    }

    /// The extensions of a log from this thread since the last call: sizes before and after.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn take_extensions() -> Vec<(i64, i64)> {
        EXTENSIONS.with_borrow_mut(std::mem::take)
    }

    /// Makes this thread's extensions of a log fail, or no longer.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn fail_extensions(fail: bool) {
        FAIL_EXTENSIONS.set(fail);
    }

    /// Called before each write of gathered bytes to a log file: counts it, and says whether it
    /// is to fail (as an `SQLITE_IOERR_WRITE`).
    pub(crate) fn before_log_write() -> bool {
        let writes = LOG_WRITES.get() + 1;
        LOG_WRITES.set(writes);
        FAIL_LOG_WRITES.get() || writes == FAIL_LOG_WRITE_AT.get()
    }

    /// Called at each shared-index barrier of a database whose log is gathered: `found` when
    /// bytes were still to write there, or a write had failed.
    pub(crate) fn at_barrier(found: bool) {
        if found {
            BARRIER_FOUND_BYTES.set(true);
        }
    }

    /// The writes of gathered bytes to a log file from this thread so far.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn log_writes() -> usize {
        LOG_WRITES.get()
    }

    /// Makes this thread's writes to a log file fail, or no longer.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn fail_log_writes(fail: bool) {
        FAIL_LOG_WRITES.set(fail);
    }

    /// Makes this thread's write to a log file fail when [`log_writes`] reaches `write`
    /// (`None`: no longer).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn fail_log_write_at(write: Option<usize>) {
        FAIL_LOG_WRITE_AT.set(write.unwrap_or(0));
    }

    /// Whether a barrier on this thread found bytes still to write (or a failed write) since
    /// the last call; clears it.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn take_barrier_found_bytes() -> bool {
        BARRIER_FOUND_BYTES.replace(false)
    }
}
