//! The sticky failure of a store: once a write, a sync or a checkpoint of its database failed
//! with an I/O error, what is on disk is no longer what SQLite believes (a commit's frames may
//! be in the log unsynced, or not at all; a copied page may be half written), so the store
//! writes nothing more until the database is opened again, when SQLite reads the files afresh.

use std::sync::Mutex;

use super::error::{noted_io_error, take_io_error};
use crate::error::{Error, Result};

/// Why the store stopped writing, once it has; shared by every connection that writes.
#[derive(Debug, Default)]
pub(crate) struct IoFailure {
    why: Mutex<Option<String>>,
}

impl IoFailure {
    /// [`Error::DiskStateUnknown`] once an I/O error was met.
    pub(crate) fn refuse_if_failed(&self) -> Result<()> {
        match &*self.lock() {
            Some(why) => Err(Error::DiskStateUnknown(why.clone())),
            None => Ok(()),
        }
    }

    /// Marks the store failed, unless it already was (the first error is the cause).
    pub(crate) fn fail_with(&self, why: String) {
        tracing::error!(%why, "an I/O error: the store refuses every later write");
        self.lock().get_or_insert(why);
    }

    /// Marks the store failed if an I/O error was noted on this thread (see
    /// [`take_io_error`]) since the connection was taken: `during` says what was being done.
    pub(crate) fn fail_if_noted(&self, during: &str) {
        if let Some(why) = take_io_error() {
            self.fail_with(format!("{during}: {why}"));
        }
    }

    /// Whether an I/O error was met.
    pub(crate) fn has_failed(&self) -> bool {
        self.lock().is_some()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        self.why.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Leaves the log as it is when `conn` closes, if the store failed: the last connection to
/// close a database would otherwise copy the log into the file and delete it, writing to a disk
/// whose state is unknown what the next open is to recover from.
pub(super) fn keep_log_on_close(failure: &IoFailure, conn: &rusqlite::Connection) {
    if !failure.has_failed() {
        return;
    }
    let kept = conn.set_db_config(
        rusqlite::config::DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE,
        true,
    );
    if let Err(err) = kept {
        tracing::warn!(%err, "the log may be checkpointed as the failed store closes");
    }
}

/// The result of a statement that commits alone: an I/O error it met (noted on this thread)
/// leaves its fate unknown.
pub(super) fn of_unknown_fate<R>(what: &str, done: Result<R>) -> Result<R> {
    match done {
        Err(err) if noted_io_error().is_some() => {
            Err(Error::CommitUnknown(format!("{what}: {err}")))
        }
        done => done,
    }
}
