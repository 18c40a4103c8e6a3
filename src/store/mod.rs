//! The store: a handle on a backend, and the boundary behind it.
//!
//! The actors reach a backend only through the boundary in [`backend`]; the moves are written
//! once, in [`moves`], against its primitives; the run's domain model is in [`model`]. The
//! SQLite backend lives in [`sqlite`], alone with everything SQLite-specific.

pub(crate) mod backend;
#[cfg(test)]
pub(crate) mod conformance;
mod handle;
mod health;
pub(crate) mod model;
pub(crate) mod moves;
pub mod sqlite;

pub use self::{
    handle::Store,
    health::{Health, SchemaStatus},
    sqlite::SCHEMA_VERSION,
};
