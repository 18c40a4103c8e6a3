//! The one place an SQLite error becomes agentrt's.

use crate::error::{DatabaseError, Error};

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
