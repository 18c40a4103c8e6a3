//! The fault-injection seam of the SQLite backend, built only with the `testkit` feature (and
//! in the crate's own tests): it counts the log syncs done outside SQLite's commits and can
//! make the next one fail, as a failed write-back would.

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
