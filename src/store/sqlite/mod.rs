//! The SQLite backend: a database file (or `:memory:`), the embedded default.
//!
//! Everything SQLite-specific lives in this module: the pragmas and migrations, the SQL of
//! every primitive the moves are made of, group commit with savepoints, the deferred log sync
//! and the answer once written, checkpoints, the lease keeper's connection, and the VFS that
//! gathers a commit's log writes (see `docs/persistence.md`).
//!
//! Its knobs are [`Options`]; [`Sqlite`] reaches a store's database connection for the
//! application's own queries:
//!
//! ```
//! use agentrt::{Store, sqlite::{Options, Sqlite, Synchronous}};
//!
//! let dir = tempfile::tempdir().unwrap();
//! let store: Store = Options::new()
//!     .synchronous(Synchronous::Normal)
//!     .open(dir.path().join("agents.db"))?;
//! let conn = Sqlite::of(&store).expect("an SQLite store").connection()?;
//! let runs: i64 = conn.query_row("SELECT count(*) FROM runs", [], |row| row.get(0))?;
//! assert_eq!(runs, 0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod boundary;
mod database;
mod error;
mod failure;
#[cfg(any(test, feature = "testkit"))]
pub(crate) mod faults;
mod held;
mod keys;
mod log;
mod open;
mod options;
mod read_only;
mod renewal;
mod space;
pub(crate) mod sql;
#[cfg(unix)]
mod wal_vfs;
mod watcher;
mod writer;

#[cfg(any(test, feature = "testkit"))]
pub(crate) use self::open::migrations;
pub use self::{
    database::{Connection, Sqlite},
    options::{DEFAULT_COMMIT_SPIN, DEFAULT_MAX_GROUP, Options, Synchronous},
    read_only::{quick_check, schema_status},
};
/// The schema version this build writes (the same on either backend).
pub use super::SCHEMA_VERSION;

#[cfg(test)]
mod tests;
