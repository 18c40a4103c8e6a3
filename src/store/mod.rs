//! The store: a handle on a backend, and the boundary behind it.
//!
//! The actors reach a backend only through the boundary in [`backend`]; the moves are written
//! once, in [`moves`], against its primitives; the run's domain model is in [`model`]. The
//! SQLite backend lives in [`sqlite`], alone with everything SQLite-specific.

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
mod retention;
pub mod sqlite;

pub use self::{
    handle::Store,
    health::{Health, SchemaStatus, Space},
    listing::{DEFAULT_PAGE_LIMIT, MAX_PAGE_LIMIT, RunPage, RunQuery},
    retention::{DEFAULT_PURGE_BATCH, MAX_PURGE_BATCH, PURGE_REPORT_IDS, Purge, PurgeReport},
    sqlite::SCHEMA_VERSION,
};
