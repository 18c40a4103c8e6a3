//! The store: a handle on a backend, read-only inspection, and the operator's moves.
//!
//! The actors reach a backend only through the boundary in [`backend`]; the moves are written
//! once, in [`moves`], against its primitives; the run's domain model is in [`model`]. The
//! SQLite backend lives in [`sqlite`], alone with everything SQLite-specific.

pub(crate) mod backend;
#[cfg(test)]
pub(crate) mod conformance;
pub(crate) mod model;
pub(crate) mod moves;
pub mod sqlite;

use crate::store::moves::Move;
use std::{path::Path, sync::Arc};

pub(crate) use self::model::{to_millis, wall_millis};
use self::{
    backend::{Backend, MoveObserver, Reads, Session, Tx},
    model::Now,
};
use crate::{
    clock::{Clock, SystemClock},
    error::{Error, Result},
    types::{Approval, Event, Lease, PendingCall, Run, RunId, RunState},
};

/// The schema version this build writes: the number of migrations it carries.
pub const SCHEMA_VERSION: u32 = sqlite::migration_count() as u32;

/// The schema version of a database, as found and as this build writes it. JSON:
/// `{"found": 7, "supported": 7}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SchemaStatus {
    /// The version the database is at (0: an empty database).
    pub found: u32,
    /// The version this build writes.
    pub supported: u32,
}

impl SchemaStatus {
    /// Migrations this build would apply.
    pub fn pending(&self) -> u32 {
        self.supported.saturating_sub(self.found)
    }
}

/// What [`Store::health`] found. JSON: its fields by name, `settings` as a list of
/// `[name, value]` pairs and each stale lease as `[run_id, lease]`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Health {
    /// The schema version.
    pub schema: SchemaStatus,
    /// The backend's settings, by name, as it reports them (for SQLite: `journal_mode`,
    /// `synchronous` as this store's writers commit with it, by name, and `foreign_keys`,
    /// `trusted_schema`, `busy_timeout`, `defensive` of the inspection connection).
    pub settings: Vec<(String, String)>,
    /// What the backend's integrity check said: `["ok"]` for a sound database.
    pub integrity: Vec<String>,
    /// RUNNING runs whose lease has expired: their executor died or stalled; a resume takes
    /// them over.
    pub stale_leases: Vec<(RunId, Lease)>,
    /// RUNNING runs nobody holds: their call returned with an error; a resume takes them over.
    pub running_without_lease: Vec<RunId>,
}

impl Health {
    /// True when the database is sound and its schema current.
    pub fn is_ok(&self) -> bool {
        self.integrity == ["ok"] && self.schema.pending() == 0
    }

    /// The setting `name`, as the backend reported it.
    pub fn setting(&self, name: &str) -> Option<&str> {
        self.settings
            .iter()
            .find(|(setting, _)| setting == name)
            .map(|(_, value)| value.as_str())
    }
}

/// A handle on an agentrt database: cheap to clone, shared by a supervisor and its readers.
///
/// [`Store::open`] opens an SQLite file with the default options, [`Store::in_memory`] a
/// private database in memory; [`sqlite::Options`] opens one with other settings.
///
/// The inspection methods (`run`, `runs`, `events`, ...) block on the database: call them
/// from a thread that may block, not from an actix arbiter that hosts actors.
#[derive(Clone)]
pub struct Store {
    backend: Arc<dyn Backend>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("backend", &self.backend.describe())
            .finish_non_exhaustive()
    }
}

impl Store {
    /// Opens (creating it if missing) the SQLite database file at `path`, with the default
    /// [`sqlite::Options`]. A file that is not a database, a damaged one, or a database of a
    /// newer schema version is refused and left as it was.
    pub fn open(path: impl AsRef<Path>) -> Result<Store> {
        sqlite::Options::default().open(path)
    }

    /// A new SQLite database in memory, gone with the last clone of this handle.
    pub fn in_memory() -> Result<Store> {
        sqlite::Options::default().in_memory()
    }

    pub(crate) fn from_backend(backend: Arc<dyn Backend>) -> Store {
        Store { backend }
    }

    pub(crate) fn backend(&self) -> &dyn Backend {
        &*self.backend
    }

    /// The write side of a supervisor over this store.
    pub(crate) fn session(
        &self,
        clock: Arc<dyn Clock>,
        observer: Option<Arc<dyn MoveObserver>>,
    ) -> Result<Session> {
        self.backend.clone().session(clock, observer)
    }

    /// The schema version of this database.
    pub fn schema_version(&self) -> Result<u32> {
        self.backend.schema_version()
    }

    /// An inspection read, returned once every move it could have seen is durable.
    pub(crate) fn read<R>(&self, mut read: impl FnMut(&mut dyn Reads) -> Result<R>) -> Result<R> {
        let mut value = None;
        // A backend may read again (after a conflict, say): the last reading stands.
        self.backend.read(&mut |reads| {
            value = Some(read(reads)?);
            Ok(())
        })?;
        value.ok_or_else(|| Error::CommitFailed("the backend never ran the read".into()))
    }

    /// One move in a transaction of its own, outside any supervisor: committed when `apply`
    /// returns `Ok`, rolled back otherwise. The clock is read at most once, when the move first
    /// asks for the time.
    pub(crate) fn transact<R>(
        &self,
        clock: &dyn Clock,
        mut apply: impl FnMut(&mut dyn Tx, &mut Now<'_>) -> Result<R>,
    ) -> Result<R> {
        let mut value = None;
        // A backend may apply the move again (a transaction retried after a conflict): the
        // result of the attempt that committed stands.
        self.backend.transact(clock, &mut |tx, now| {
            value = Some(apply(tx, now)?);
            Ok(())
        })?;
        value.ok_or_else(|| Error::CommitFailed("the backend never applied the move".into()))
    }

    /// A run.
    pub fn run(&self, run_id: &RunId) -> Result<Run> {
        self.read(|reads| moves::run(reads, run_id))
    }

    /// The runs, oldest first; only those in `state` when given.
    pub fn runs(&self, state: Option<RunState>) -> Result<Vec<Run>> {
        self.read(|reads| reads.runs(state))
    }

    /// A run's events, in order (see `docs/events.md`).
    pub fn events(&self, run_id: &RunId) -> Result<Vec<Event>> {
        self.events_after(run_id, 0)
    }

    /// A run's events after sequence number `after`, in order: how a follower tails the log.
    pub fn events_after(&self, run_id: &RunId, after: u64) -> Result<Vec<Event>> {
        self.read(|reads| moves::events_after(reads, run_id, after))
    }

    /// The tool calls of a run that wait for an approval not yet recorded.
    pub fn pending_calls(&self, run_id: &RunId) -> Result<Vec<PendingCall>> {
        self.read(|reads| moves::pending_calls(reads, run_id))
    }

    /// The stored lease of a run: its owner and expiry, read without taking or changing it.
    /// `None` when nobody holds it (the run is paused, finished, or was released by the call
    /// that executed it). A lease whose expiry has passed is stale, not released: a resume
    /// takes such a run over.
    pub fn lease(&self, run_id: &RunId) -> Result<Option<Lease>> {
        self.read(|reads| moves::lease(reads, run_id))
    }

    /// An operator's cancel, from outside a supervisor (a command-line tool, say), stamped by
    /// the system clock. A supervisor executing the run learns it at its next lease renewal:
    /// its loop stops at its next write, and a tool running then has its outcome recorded late.
    pub fn cancel(&self, run_id: &RunId, reason: &str) -> Result<()> {
        self.transact(&SystemClock, |tx, now| {
            Move::new(tx, now, run_id).cancel_run(reason)
        })
    }

    /// Records an operator's approval or denial of a waiting call, from outside a supervisor,
    /// stamped by the system clock. Resume the run afterwards.
    pub fn record_approval(&self, approval: &Approval) -> Result<()> {
        self.transact(&SystemClock, |tx, now| {
            Move::new(tx, now, &approval.run_id).record_approval(approval)
        })
    }

    /// A health report: schema version, the backend's settings, its integrity check, and the
    /// leases an operator should know about.
    pub fn health(&self) -> Result<Health> {
        self.backend.health()
    }
}
