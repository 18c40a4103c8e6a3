//! The write-ahead log of a file store, synced outside SQLite's commits: the deferred sync of
//! a group commit, and the sync after a read of what another process committed.

use std::{
    path::PathBuf,
    sync::{Mutex, MutexGuard},
};

use super::failure::IoFailure;
use crate::error::{Error, Result};

pub(crate) struct LogFile {
    /// As SQLite names it: the database's full path and `-wal`.
    path: PathBuf,
    /// Opened on first use and kept: Linux reports a failed write-back once to each descriptor
    /// open at the time, so a descriptor opened afresh for each sync could miss one.
    file: Mutex<Option<std::fs::File>>,
}

impl LogFile {
    /// The log at `path`, opened now if it exists (the writer has read the database), else at
    /// the first sync: so that the descriptor is there before the first write-back it must hear
    /// of.
    pub(crate) fn new(path: PathBuf) -> Self {
        let log = LogFile {
            path,
            file: Mutex::new(None),
        };
        drop(log.open());
        log
    }

    #[cfg(any(test, feature = "testkit"))]
    pub(crate) fn path(&self) -> &std::path::Path {
        &self.path
    }

    fn open(&self) -> std::io::Result<MutexGuard<'_, Option<std::fs::File>>> {
        let mut file = self.file.lock().unwrap_or_else(|p| p.into_inner());
        if file.is_none() {
            // Write access: Windows flushes only a handle that may write.
            *file = Some(std::fs::OpenOptions::new().write(true).open(&self.path)?);
        }
        Ok(file)
    }

    /// Syncs the log. A failed write-back marks `failure`: the log may have lost pages that
    /// later commits build on. A log that cannot be opened fails this sync only: nothing was
    /// synced, nor lost, and the next sync tries again.
    pub(crate) fn sync(&self, failure: &IoFailure) -> Result<()> {
        let file = match self.open() {
            Ok(file) => file,
            // No log: nothing was written since the last connection closed.
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(err) => {
                return Err(Error::SyncFailed(format!(
                    "opening {}: {err}",
                    self.path.display()
                )));
            }
        };
        let synced = file.as_ref().map_or(Ok(()), |log| log.sync_data());
        synced.map_err(|err| {
            let why = format!("syncing {}: {err}", self.path.display());
            failure.fail_with(why.clone());
            Error::SyncFailed(why)
        })
    }
}

thread_local! {
    /// The pages in the write-ahead log after the last commit of a writer on this thread.
    static LOG_PAGES: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// The writer's commit hook: notes the log's size for [`log_pages`]. A hook is a plain
/// function, so it keeps what it notes per thread: the writer's thread owns the connection.
pub(super) fn note_log_size(
    _: &rusqlite::hooks::Wal,
    pages: std::ffi::c_int,
) -> rusqlite::Result<()> {
    LOG_PAGES.set(pages.max(0) as u32);
    Ok(())
}

/// The pages in the write-ahead log after the last commit made on this thread.
pub(super) fn log_pages() -> u32 {
    LOG_PAGES.get()
}
