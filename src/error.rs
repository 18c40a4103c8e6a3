//! The one error type of the crate.

use std::{path::PathBuf, time::SystemTime};

use crate::{
    clock::to_millis,
    types::{LeaseLostReason, RunId, RunState},
};

/// An error of the database itself, as its backend reported it: opaque, with the driver's
/// error as its [`source`](std::error::Error::source).
#[derive(Debug)]
pub struct DatabaseError {
    busy: bool,
    source: Box<dyn std::error::Error + Send + Sync>,
}

impl DatabaseError {
    /// Wraps a backend's error; `busy` when the database was locked by another connection.
    pub(crate) fn new(busy: bool, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        DatabaseError {
            busy,
            source: Box::new(source),
        }
    }

    /// True when the database was locked by another connection, and waiting gave up.
    pub fn is_busy(&self) -> bool {
        self.busy
    }
}

impl std::fmt::Display for DatabaseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.source.fmt(f)
    }
}

impl std::error::Error for DatabaseError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}

/// `Result` with agentrt's [`Error`] as the default error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in agentrt.
///
/// Match on the predicates ([`Error::is_run_state`], [`Error::is_not_found`]) rather than on
/// variants where you can: variants may be added.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No run with this id exists.
    #[error("no run with id \"{0}\"; check the id (the list of runs shows the existing ones)")]
    RunNotFound(RunId),

    /// No schedule of this name exists.
    #[error("no schedule named {0:?}; check the name (`agentrt schedules` lists them)")]
    ScheduleNotFound(String),

    /// The run exists but has no tool call with this id.
    #[error("run {run_id} has no tool call with id {call_id:?}")]
    CallNotFound {
        /// The run that was asked.
        run_id: RunId,
        /// The call id that matched nothing.
        call_id: String,
    },

    /// No agent of this name is registered on the supervisor.
    #[error(
        "no agent named {0:?} is registered on this supervisor; register it with \
         `Supervisor::builder(..).agent(name, agent)` before starting or resuming its runs"
    )]
    UnknownAgent(String),

    /// The run is not in a state that allows what was asked. Nothing was changed.
    #[error("run {run_id} is {state}: {reason}")]
    RunState {
        /// The run that was asked.
        run_id: RunId,
        /// The state it was found in.
        state: RunState,
        /// What could not be done, and why.
        reason: String,
    },

    /// A run id that already exists was given to `StartRun`. Nothing was written.
    #[error("run {0} already exists; a run id can be started once (use ResumeRun to continue it)")]
    RunExists(RunId),

    /// The run is being executed under a live lease: by another process, by this supervisor
    /// in another call, or by a process that died less than a TTL ago. Nothing was changed.
    ///
    /// Not a failure of the run: retry after `expires_at` (a live owner will have renewed by
    /// then, and the error comes again), or report it. Do not cancel the run because of it.
    #[error(
        "run {run_id} is leased by {owner} until {} ms after the Unix epoch; it is being \
         executed elsewhere (or its executor died less than a lease TTL ago): retry after that",
        to_millis(*expires_at)
    )]
    RunLeased {
        /// The run.
        run_id: RunId,
        /// The owner of the lease, as stored.
        owner: String,
        /// When the lease expires unless renewed.
        expires_at: SystemTime,
    },

    /// The call's loop lost the run's lease, and stopped before its next side effect. The run
    /// is the next owner's to resume (or was cancelled).
    #[error(
        "run {run_id}: this supervisor lost the run's lease ({reason}); it started nothing more"
    )]
    LeaseLost {
        /// The run.
        run_id: RunId,
        /// Why.
        reason: LeaseLostReason,
    },

    /// The supervisor is draining (it was sent [`Drain`](crate::Drain)): it admits no run,
    /// starts or resumes nothing, and hands its runs over to the other replicas. Nothing was
    /// written: send the request to another replica.
    #[error("this supervisor is draining: it starts and resumes no run; ask another replica")]
    Draining,

    /// A draining supervisor stopped the run at a step boundary, with nothing in flight, and
    /// released its lease (`run.released`): another replica continues it at once, with
    /// nothing to reconcile.
    #[error(
        "run {run_id} was handed over: this supervisor is draining; another replica continues it"
    )]
    HandedOver {
        /// The run.
        run_id: RunId,
    },

    /// The input was not acceptable; nothing was written.
    #[error("invalid input: {0}")]
    InvalidInput(String),

    /// A tool or the model panicked. The step stays in flight: resuming the run reconciles it.
    #[error(
        "run {run_id}: {what} panicked at step {step}: {message}; the step stays in flight and \
         a resume reconciles it"
    )]
    Panicked {
        /// The run whose loop panicked.
        run_id: RunId,
        /// The step in flight.
        step: u32,
        /// "the model" or "tool NAME".
        what: String,
        /// The panic's message.
        message: String,
    },

    /// The file exists but is not an SQLite database. It was not changed.
    #[error("{} is not an SQLite database; it was left unchanged", path.display())]
    NotADatabase {
        /// The file that was opened.
        path: PathBuf,
    },

    /// The file is an SQLite database whose pages are damaged or cut short (a truncated copy,
    /// a disk fault). Nothing was written to it.
    #[error(
        "{} is damaged ({detail}); nothing was written to it: restore it from a backup, or \
         check what can be read with `agentrt doctor`",
        path.display()
    )]
    DatabaseCorrupt {
        /// The file that was opened.
        path: PathBuf,
        /// What the database reported.
        detail: String,
    },

    /// There is no database file at this path, and none was created.
    #[error("there is no agentrt database at {}; nothing was created", path.display())]
    NoDatabase {
        /// The path given.
        path: PathBuf,
    },

    /// The database cannot be written: its file or its directory is read-only, or the store
    /// was opened for reading only. Nothing was written.
    #[error("{} is read-only: {why}; nothing was written", path.display())]
    ReadOnly {
        /// The database file.
        path: PathBuf,
        /// What makes it read-only.
        why: String,
    },

    /// The file a read-only store opened was deleted, replaced by another file, or can no
    /// longer be read.
    #[error("{} {why}; nothing more can be read of the database that was opened", path.display())]
    DatabaseGone {
        /// The database file.
        path: PathBuf,
        /// What became of it.
        why: String,
    },

    /// The database file could not be put in write-ahead-log mode, which a store that writes
    /// needs: the switch (a commit of its own, on a new file) failed with an I/O error, or
    /// SQLite left the file in another journal mode (a file system that gives it no shared
    /// memory, say). The store was not opened: opened again, SQLite reads the file afresh and
    /// tries the switch again.
    #[error(
        "{} could not be put in WAL mode ({why}); the store was not opened: check the disk, and \
         that the file is on a local file system (WAL mode needs shared memory), then open it \
         again",
        path.display()
    )]
    WalModeFailed {
        /// The database file.
        path: PathBuf,
        /// What SQLite reported, or the journal mode it left the file in.
        why: String,
    },

    /// The database has an older schema, and migrating was not asked for. It was not changed.
    #[error(
        "{} has schema version {found}, older than the {supported} this agentrt writes; it was \
         left unchanged: migrate it first (`agentrt migrate --apply`)",
        path.display()
    )]
    SchemaOutdated {
        /// The file that was opened.
        path: PathBuf,
        /// The version found in the file.
        found: u32,
        /// The version this build writes.
        supported: u32,
    },

    /// The database was written by a newer agentrt. It was not changed.
    #[error(
        "{} has schema version {found}, newer than the {supported} this agentrt knows; it was \
         left unchanged: open it with a newer agentrt",
        path.display()
    )]
    SchemaTooNew {
        /// The file that was opened.
        path: PathBuf,
        /// The version found in the file.
        found: u32,
        /// The newest version this build knows.
        supported: u32,
    },

    /// Applying the migrations failed; the migration's transaction was rolled back.
    #[error("migrating the database failed: {0}")]
    Migration(String),

    /// A stored value could not be read back (a row written by something else than agentrt).
    #[error("corrupt stored data: {0}")]
    Corrupt(String),

    /// What would have answered is gone: the store actor (its actix system stopped), or the
    /// writer thread a move was handed to (it stopped, as a store that met an I/O error or whose
    /// system stopped does). A move answered so may or may not have been committed.
    #[error(
        "the store's writer is not running (was its actix system stopped, or its writer thread?)"
    )]
    StoreUnavailable,

    /// A group of moves could not be committed: none of them was applied.
    #[error("committing the moves failed, nothing was written: {0}")]
    CommitFailed(String),

    /// Committing the moves failed with an I/O error once they may have reached the disk (a
    /// failed write or sync of the commit itself): they may or may not have been written, and
    /// reopening the database tells which (each move is there whole or not at all). A run
    /// whose move got this error stops, and the store refuses every later write with
    /// [`Error::DiskStateUnknown`].
    #[error(
        "committing the moves failed with an I/O error; they may or may not have been written \
         (reopen the database to see which): {0}"
    )]
    CommitUnknown(String),

    /// Syncing the write-ahead log to disk failed. The moves of the groups that sync covered
    /// are committed: visible to readers, they survive a crash of the process but may not
    /// survive a power loss. A run whose move got this error stops. After a failed write-back
    /// (not a log that could not be opened, which fails that sync only), the store refuses
    /// every later write with [`Error::DiskStateUnknown`].
    #[error("syncing the database's log to disk failed; the moves may not be durable: {0}")]
    SyncFailed(String),

    /// The store refused a write, or a read it would have had to sync: an earlier write, sync
    /// or checkpoint of this database failed with an I/O error, which leaves what is on disk
    /// unknown. Nothing was written. Every write through the store (a supervisor's moves, its
    /// lease renewals and releases, an operator's moves) and every read that syncs is refused
    /// so until the database is opened again: reopen it once the disk is sound (SQLite
    /// recovers its log), and resume the runs, which reconciles whatever they had started.
    #[error(
        "the store refused to write: an earlier I/O error ({0}) left the database's state on \
         disk unknown; reopen the database once the disk is sound, and resume the runs"
    )]
    DiskStateUnknown(String),

    /// The database server could not be reached, or refused the connection. Nothing was
    /// written.
    #[error("the database server at {location} did not answer ({why}); nothing was written")]
    ServerUnreachable {
        /// The server, as given (without its password).
        location: String,
        /// What the connection attempt reported.
        why: String,
    },

    /// The location names a backend that this build of agentrt does not compile in: a
    /// PostgreSQL URL without the `postgres` feature, a path or `:memory:` without `sqlite`.
    /// Nothing was opened.
    #[error(
        "this build of agentrt has no {backend} backend for {location:?}: enable agentrt's cargo \
         feature `{feature}`"
    )]
    BackendNotBuilt {
        /// The location, as given (a URL without its user and password).
        location: String,
        /// The backend it names: `SQLite` or `PostgreSQL`.
        backend: &'static str,
        /// The cargo feature that compiles that backend in.
        feature: &'static str,
    },

    /// The database failed; its backend's error is the source.
    #[error("database error: {0}")]
    Database(#[source] DatabaseError),
}

impl Error {
    /// True when the run exists but was not in a state that allowed what was asked (including a
    /// start with an id that exists, and [`Error::RunLeased`]). Nothing was changed.
    pub fn is_run_state(&self) -> bool {
        matches!(
            self,
            Error::RunState { .. } | Error::RunExists(_) | Error::RunLeased { .. }
        )
    }

    /// True when the database was locked by another connection, and waiting gave up.
    pub fn is_busy(&self) -> bool {
        matches!(self, Error::Database(err) if err.is_busy())
    }

    /// True when a run, a call or a schedule named by the caller does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(
            self,
            Error::RunNotFound(_) | Error::CallNotFound { .. } | Error::ScheduleNotFound(_)
        )
    }
}

impl From<actix::MailboxError> for Error {
    fn from(_: actix::MailboxError) -> Self {
        Error::StoreUnavailable
    }
}
