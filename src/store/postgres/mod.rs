//! The PostgreSQL backend: one database that the supervisors of several hosts share.
//!
//! Everything PostgreSQL-specific lives in this module: the connections and their timeouts,
//! the migrations (applied under an advisory lock), the SQL of every primitive the moves are
//! made of, the writer's lanes (moves of different runs commit in parallel over several
//! connections, those of one run in order, each lane committing what queued behind it as one
//! group), the lease keeper's connection, and the change feed read through LISTEN/NOTIFY.
//!
//! Leases are stamped and judged by the server's clock: a lease taken or renewed expires at
//! the server's `now()` plus the TTL, and every guard and takeover compares with the server's
//! `now()`, so no two hosts' clocks need to agree (see `docs/postgres.md`).
//!
//! ```no_run
//! use agentrt::{Store, postgres::Options};
//!
//! let store: Store = Options::new()
//!     .writers(2)
//!     .open("postgres://agentrt@db.internal/agents")?;
//! // Or, with the default options, by URL:
//! let same = Store::connect("postgres://agentrt@db.internal/agents")?;
//! # Ok::<(), agentrt::Error>(())
//! ```

mod boundary;
mod conn;
mod held;
mod lanes;
mod link;
mod open;
mod options;
mod pipe;
mod sql;
#[cfg(any(test, feature = "testkit"))]
pub(crate) mod testing;
mod watcher;
mod writer;

pub use self::{
    open::{SCHEMA_VERSION, migrations_pending, schema_status},
    options::{DEFAULT_SPILL_AT, DEFAULT_WRITERS, Options},
};

/// Whether `location` names a PostgreSQL database (a `postgres://` or `postgresql://` URL)
/// rather than an SQLite file.
pub fn is_url(location: &str) -> bool {
    super::resolver::Kind::of(location) == super::resolver::Kind::Postgres
}

/// A PostgreSQL store's backend: its options and the connections it keeps for inspection.
pub(crate) struct Postgres {
    pub(super) options: Options,
    pub(super) config: tokio_postgres::Config,
    /// The URL without its password, for messages.
    pub(super) shown: String,
    /// The schema the store's tables are in (the connection's `search_path`).
    pub(super) schema: String,
    /// Idle connections for inspection reads and operators' moves.
    pub(super) idle: std::sync::Mutex<Vec<conn::Conn>>,
    /// True once the store's writes were stopped (the testkit's crashes); every write
    /// transaction holds it shared while it is open (see `writer.rs`).
    pub(super) stopped: std::sync::RwLock<bool>,
}

#[cfg(test)]
mod tests;
