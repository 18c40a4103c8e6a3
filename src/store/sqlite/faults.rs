//! The fault-injection seam of the SQLite backend, built only with the `testkit` feature (and
//! in the crate's own tests): it counts the log syncs done outside SQLite's commits and can
//! make the next one fail, as a failed write-back would; and ([`vfs`]) it counts and fails the
//! log-gathering VFS's writes.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use crate::error::{Error, Result};

/// Faults to inject into one SQLite store, and what it did; see
/// [`testkit::faults`](crate::testkit::faults).
#[derive(Debug, Default)]
pub struct Faults {
    syncs: AtomicUsize,
    fail_next_sync: AtomicBool,
}

impl Faults {
    /// The log syncs done outside SQLite's commits so far (a group's deferred sync, the sync
    /// after a read, the sync of a reservation answered once written).
    pub fn syncs(&self) -> usize {
        self.syncs.load(Ordering::SeqCst)
    }

    /// Makes the next log sync fail as a failed write-back does: the store then refuses every
    /// later write and durable read until it is reopened.
    pub fn fail_next_sync(&self) {
        self.fail_next_sync.store(true, Ordering::SeqCst);
    }

    /// Called before each sync: counts it, and fails it if asked to.
    pub(crate) fn before_sync(&self) -> Result<Option<Error>> {
        self.syncs.fetch_add(1, Ordering::SeqCst);
        if self.fail_next_sync.swap(false, Ordering::SeqCst) {
            return Ok(Some(Error::SyncFailed(
                "an injected write-back failure".into(),
            )));
        }
        Ok(None)
    }
}

/// The seam of the log-gathering VFS: its write path calls [`vfs::before_log_write`] before
/// each write of gathered bytes, and its barrier [`vfs::at_barrier`]. The state is per thread
/// (SQLite calls a VFS on the thread of the connection), so that tests running at once do not
/// see each other's writes.
#[cfg(unix)]
pub(crate) mod vfs {
    use std::cell::Cell;

    thread_local! {
        /// Writes of gathered bytes to a log file from this thread.
        static LOG_WRITES: Cell<usize> = const { Cell::new(0) };
        /// Makes this thread's writes to a log file fail.
        static FAIL_LOG_WRITES: Cell<bool> = const { Cell::new(false) };
        /// Makes this thread's write to a log file fail when `LOG_WRITES` reaches it (0: none).
        static FAIL_LOG_WRITE_AT: Cell<usize> = const { Cell::new(0) };
        /// A barrier on this thread found bytes still to write, or a failed write.
        static BARRIER_FOUND_BYTES: Cell<bool> = const { Cell::new(false) };
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
