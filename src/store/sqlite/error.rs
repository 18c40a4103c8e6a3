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
