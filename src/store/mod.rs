//! The store: a handle on a backend, and the boundary behind it.
//!
//! The actors reach a backend only through the boundary in [`backend`]; the moves are written
//! once, in [`moves`], against its primitives; the run's domain model is in [`model`]. Each
//! backend lives in a module of its own, alone with everything specific to it (SQLite's in
//! `sqlite`, feature `sqlite`; PostgreSQL's in `postgres`, feature `postgres`), and `resolver`
//! opens a store from a path, `:memory:` or a URL with whichever of them it names.

pub(crate) mod backend;
#[cfg(test)]
pub(crate) mod conformance;
mod feed;
mod handle;
mod health;
mod listing;
pub(crate) mod model;
pub(crate) mod moves;
#[cfg(feature = "postgres")]
pub mod postgres;
pub(crate) mod pulse;
pub(crate) mod queue;
mod resolver;
mod retention;
mod schedules;
#[cfg(feature = "sqlite")]
pub mod sqlite;
pub(crate) mod watch;

pub use self::{
    handle::Store,
    health::{Health, SchemaStatus, Space},
    listing::{DEFAULT_PAGE_LIMIT, MAX_PAGE_LIMIT, RunPage, RunQuery},
    retention::{DEFAULT_PURGE_BATCH, MAX_PURGE_BATCH, PURGE_REPORT_IDS, Purge, PurgeReport},
};

/// The migrations in `migrations/`, embedded in order by the build script: SQLite applies
/// them, and their number is the schema version on either backend.
mod schema {
    include!(concat!(env!("OUT_DIR"), "/migrations.rs"));
}

/// The schema version this build writes, the same on either backend: the number of migrations
/// in `migrations/`. A version names the same tables, guards and change feed in an SQLite file
/// and in a PostgreSQL schema.
pub const SCHEMA_VERSION: u32 = schema::MIGRATIONS.len() as u32;
