//! The one place an SQLite error becomes agentrt's.

use std::cell::RefCell;

use crate::error::{DatabaseError, Error};

thread_local! {
    /// The last I/O error that became agentrt's on this thread, until taken: a move that
    /// keeps its statement's error as its own refusal still leaves it here for the writer.
    static IO_ERROR: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// The one place an SQLite error becomes agentrt's: opaque, with SQLite's as its source. An
/// I/O error is also noted for [`take_io_error`].
pub(crate) fn db_error(err: rusqlite::Error) -> Error {
    let busy = matches!(
        &err,
        rusqlite::Error::SqliteFailure(failure, _)
            if matches!(failure.code, rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
    );
    if is_io(&err) {
        IO_ERROR.with_borrow_mut(|noted| *noted = Some(err.to_string()));
    }
    Error::Database(DatabaseError::new(busy, err))
}

/// Whether SQLite's error is an I/O error that may have left the files other than SQLite
/// believes them: a failed write, sync, truncation, lock or the like, or a full disk. Not a
/// failed read (nothing on disk changed), nor one of memory.
pub(super) fn is_io(err: &rusqlite::Error) -> bool {
    use rusqlite::ffi;
    match err {
        rusqlite::Error::SqliteFailure(failure, _) => match failure.code {
            rusqlite::ErrorCode::DiskFull => true,
            rusqlite::ErrorCode::SystemIoFailure => !matches!(
                failure.extended_code,
                ffi::SQLITE_IOERR_READ | ffi::SQLITE_IOERR_SHORT_READ | ffi::SQLITE_IOERR_NOMEM
            ),
            _ => false,
        },
        _ => false,
    }
}

/// The I/O error noted on this thread since the last call, if any.
pub(super) fn take_io_error() -> Option<String> {
    IO_ERROR.with_borrow_mut(Option::take)
}

/// The I/O error noted on this thread and not yet taken, if any.
pub(super) fn noted_io_error() -> Option<String> {
    IO_ERROR.with_borrow(Clone::clone)
}

/// `?` for SQLite's results in this backend: agentrt's error type has no conversion from
/// rusqlite's, so that no driver type shows in its public API.
pub(super) trait Db<T> {
    /// The result, its error made agentrt's by [`db_error`].
    fn db(self) -> Result<T, Error>;
}

impl<T> Db<T> for rusqlite::Result<T> {
    fn db(self) -> Result<T, Error> {
        self.map_err(db_error)
    }
}
