//! The write-ahead log of a file store, synced outside SQLite's commits: the deferred sync of
//! a group commit, and the sync after a read of what another process committed.
//!
//! A read syncs only when it may have seen a commit that is not yet durable. The log's index
//! (the `-shm` file every connection to the database maps, in every process) starts with a
//! header that says how many frames the log's committed transactions fill, and which
//! generation of the log they are in (its salt, new each time the log starts over). The
//! store keeps the header as it was when a sync of the log began, or right after a commit of
//! its writer that synced in its commit: every frame up to it is durable. A read that finds
//! the header still within that mark saw nothing a power loss could take back, and syncs
//! nothing; any other commit (another process's, a lease renewal's, a group whose sync is
//! deferred) moves the header past the mark, and the next read syncs.

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
    /// The log's index, the database's full path and `-shm`, opened for reading on first use.
    index: Index,
    /// The header of the log's index up to which every commit is known durable.
    durable: Mutex<Option<Mark>>,
    /// Held by a read from its check of the mark to the end of its sync.
    read_sync: Mutex<()>,
}

/// Where the committed part of the log ends: the generation of the log (its two salts) and
/// the frames its committed transactions fill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Mark {
    salt: [u32; 2],
    frames: u32,
}

/// The version of the log's index that SQLite writes in its header.
#[cfg(unix)]
const INDEX_VERSION: u32 = 3_007_000;

/// SQLite's checksum of the index header, over its words in the host's byte order.
#[cfg(unix)]
fn checksum(bytes: &[u8]) -> [u32; 2] {
    let (mut s1, mut s2) = (0u32, 0u32);
    for pair in bytes.chunks_exact(8) {
        let word = |at: usize| u32::from_ne_bytes(pair[at..at + 4].try_into().expect("4 bytes"));
        s1 = s1.wrapping_add(word(0)).wrapping_add(s2);
        s2 = s2.wrapping_add(word(4)).wrapping_add(s1);
    }
    [s1, s2]
}

/// The log's index file, read for its header.
struct Index {
    path: PathBuf,
    file: Mutex<Option<std::fs::File>>,
}

impl Index {
    /// The header as it stands, or `None` when it cannot be told (no index yet, one being
    /// rewritten, a platform where it is not read): the caller then syncs.
    #[cfg(unix)]
    fn mark(&self) -> Option<Mark> {
        use std::os::unix::fs::FileExt;
        // The index header's two copies, each of 48 bytes, in the host's byte order: SQLite
        // writes the second copy, then the first, and a reader that finds them unequal read
        // it mid-change.
        const HEADER: usize = 48;
        let mut file = self.file.lock().unwrap_or_else(|p| p.into_inner());
        if file.is_none() {
            *file = Some(std::fs::File::open(&self.path).ok()?);
        }
        let mut both = [0u8; 2 * HEADER];
        file.as_ref()?.read_exact_at(&mut both, 0).ok()?;
        let (first, second) = both.split_at(HEADER);
        let word = |at: usize| u32::from_ne_bytes(first[at..at + 4].try_into().expect("4 bytes"));
        // As SQLite's own reader checks it: the index's version, `isInit` (offset 12: 1 once a
        // connection has built the index), and the checksum of the first 40 bytes.
        let valid = first == second
            && word(0) == INDEX_VERSION
            && first[12] == 1
            && checksum(&first[..40]) == [word(40), word(44)];
        valid.then(|| Mark {
            salt: [word(32), word(36)],
            frames: word(16),
        })
    }

    #[cfg(not(unix))]
    fn mark(&self) -> Option<Mark> {
        None
    }
}

impl LogFile {
    /// The log at `path`, opened now if it exists (the writer has read the database), else at
    /// the first sync: so that the descriptor is there before the first write-back it must hear
    /// of.
    pub(crate) fn new(path: PathBuf) -> Self {
        // SQLite names the index as the log, `-shm` for `-wal`.
        let index = path.to_string_lossy();
        let index = PathBuf::from(format!(
            "{}-shm",
            index.strip_suffix("-wal").unwrap_or(&index)
        ));
        let log = LogFile {
            path,
            file: Mutex::new(None),
            index: Index {
                path: index,
                file: Mutex::new(None),
            },
            durable: Mutex::new(None),
            read_sync: Mutex::new(()),
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
        // Read before the sync: every frame of a commit the header tells of was written
        // before the header, so the sync covers them.
        let before = self.index.mark();
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
        })?;
        if let Some(mark) = before {
            self.note_durable(mark);
        }
        Ok(())
    }

    /// Whether the log may hold a commit that is not yet durable: one past the mark of the
    /// last sync, or any when that cannot be told.
    pub(crate) fn may_hold_unsynced(&self) -> bool {
        match self.index.mark() {
            Some(now) => !self.durable().is_some_and(|mark| mark.covers(now)),
            None => true,
        }
    }

    /// The turn of a read that found the log may hold an unsynced commit: held while it
    /// checks again and syncs, so that reads racing for the same commit sync it once.
    pub(crate) fn read_sync_turn(&self) -> MutexGuard<'_, ()> {
        self.read_sync.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The log's generation now, for [`note_synced_commit`](Self::note_synced_commit): read
    /// before a commit.
    pub(crate) fn generation(&self) -> Option<[u32; 2]> {
        self.index.mark().map(|mark| mark.salt)
    }

    /// After a commit of the writer that synced in its commit and ended the log at `frames`,
    /// begun in generation `before` of the log: the header is the durable mark if it is still
    /// in that generation and ends there. A generation never comes back, so the same one before
    /// and after means the commit was in it, and the header is that commit's, not a later
    /// generation's (another process's, unsynced) that happens to reach as far.
    pub(crate) fn note_synced_commit(&self, frames: u32, before: Option<[u32; 2]>) {
        let Some(now) = self.index.mark() else {
            return;
        };
        if now.frames == frames && before == Some(now.salt) {
            self.note_durable(now);
        }
    }

    fn durable(&self) -> Option<Mark> {
        *self.durable.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records `mark` as durable, unless a later one of its generation already is. A mark of
    /// another generation replaces it: at worst an older one, after which reads sync again.
    fn note_durable(&self, mark: Mark) {
        let mut durable = self.durable.lock().unwrap_or_else(|p| p.into_inner());
        match *durable {
            Some(known) if known.salt == mark.salt && known.frames >= mark.frames => {}
            _ => *durable = Some(mark),
        }
    }
}

impl Mark {
    /// Whether every commit up to `now` is within this mark: the same generation of the log,
    /// ending no later.
    fn covers(self, now: Mark) -> bool {
        self.salt == now.salt && now.frames <= self.frames
    }
}

thread_local! {
    /// The pages in the write-ahead log after the last commit of a writer on this thread.
    static LOG_PAGES: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    /// The same, for [`take_commit_frames`]: `None` once taken.
    static COMMIT_FRAMES: std::cell::Cell<Option<u32>> = const { std::cell::Cell::new(None) };
}

/// The writer's commit hook: notes the log's size for [`log_pages`]. A hook is a plain
/// function, so it keeps what it notes per thread: the writer's thread owns the connection.
pub(super) fn note_log_size(
    _: &rusqlite::hooks::Wal,
    pages: std::ffi::c_int,
) -> rusqlite::Result<()> {
    let pages = pages.max(0) as u32;
    LOG_PAGES.set(pages);
    COMMIT_FRAMES.set(Some(pages));
    Ok(())
}

/// The frames in the log after the last commit made on this thread since the last call, if
/// one was made (a transaction that wrote nothing calls no hook).
pub(super) fn take_commit_frames() -> Option<u32> {
    COMMIT_FRAMES.take()
}

/// The pages in the write-ahead log after the last commit made on this thread.
pub(super) fn log_pages() -> u32 {
    LOG_PAGES.get()
}
