//! The store: a handle on a backend, read-only inspection, and the operator's moves.

use std::sync::Arc;

use super::{
    backend::{Backend, MoveObserver, Reads, Session, Tx, Watcher},
    health::Health,
    model::Now,
    moves::{self, AnswerQuestion, CancelRun, Cx, DeliverEvent, ForkRun, Move, RecordApproval},
    pulse::{Bell, Pulse},
};
use crate::{
    clock::{Clock, SystemClock},
    error::{Error, Result},
    types::{
        Answer, Approval, Delivered, Delivery, Event, Lease, PendingCall, Run, RunId, RunState,
        Wait, WaitKind,
    },
};

/// A handle on an agentrt database: cheap to clone, shared by a supervisor and its readers.
///
/// [`Store::open`] opens an SQLite file with the default options, [`Store::in_memory`] a
/// private database in memory; [`sqlite::Options`](crate::sqlite::Options) opens one with other
/// settings.
///
/// The inspection methods (`run`, `runs`, `events`, ...) block on the database: call them
/// from a thread that may block, not from an actix arbiter that hosts actors.
#[derive(Clone)]
pub struct Store {
    backend: Arc<dyn Backend>,
    /// Rung by every commit made through this handle and its clones.
    bell: Arc<Bell>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("backend", &self.backend.describe())
            .finish_non_exhaustive()
    }
}

impl Store {
    pub(crate) fn from_backend(backend: Arc<dyn Backend>) -> Store {
        Store {
            backend,
            bell: Arc::default(),
        }
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
        self.backend
            .clone()
            .session(clock, observer, self.bell.clone())
    }

    /// The backend's name: `sqlite` or `postgres`.
    #[cfg(feature = "web")]
    pub(crate) fn backend_name(&self) -> &'static str {
        if self.backend.describe().starts_with("postgres") {
            "postgres"
        } else {
            "sqlite"
        }
    }

    /// The bell this handle's commits ring: its supervisors' writers ring it after each batch,
    /// and its operator moves after each.
    pub(crate) fn bell(&self) -> &Arc<Bell> {
        &self.bell
    }

    /// A check for commits made to the database by anyone, on a connection of its own.
    #[cfg_attr(not(feature = "web"), allow(dead_code))]
    pub(crate) fn pulse(&self) -> Result<Box<dyn Pulse>> {
        self.backend.clone().pulse()
    }

    /// A watcher of this store's change feed.
    pub(crate) fn watcher(&self) -> Result<Box<dyn Watcher>> {
        self.backend.clone().watcher()
    }

    /// The schema version of this database.
    pub fn schema_version(&self) -> Result<u32> {
        self.backend.schema_version()
    }

    /// An inspection read, returned once every move it could have seen is durable.
    pub(crate) fn read<R: Send>(
        &self,
        mut read: impl FnMut(&mut dyn Reads) -> Result<R> + Send,
    ) -> Result<R> {
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
    pub(crate) fn transact<R: Send>(
        &self,
        clock: &dyn Clock,
        mut apply: impl FnMut(&mut dyn Tx, &mut Now<'_>) -> Result<R> + Send,
    ) -> Result<R> {
        let mut value = None;
        // A backend may apply the move again (a transaction retried after a conflict): the
        // result of the attempt that committed stands.
        self.backend.transact(clock, &mut |tx, now| {
            value = Some(apply(tx, now)?);
            Ok(())
        })?;
        self.bell.ring();
        value.ok_or_else(|| Error::CommitFailed("the backend never applied the move".into()))
    }

    /// One move in a transaction of its own, outside any supervisor (an operator's), stamped
    /// by `clock`.
    pub(crate) fn apply<M: Move>(&self, clock: &dyn Clock, mv: M) -> Result<M::Output> {
        self.transact(clock, |tx, now| {
            mv.apply(&mut Cx::new(tx, now, mv.run_id()))
        })
    }

    /// A run.
    pub fn run(&self, run_id: &RunId) -> Result<Run> {
        self.read(|reads| moves::run(reads, run_id))
    }

    /// The runs, oldest first; only those in `state` when given.
    pub fn runs(&self, state: Option<RunState>) -> Result<Vec<Run>> {
        self.read(|reads| reads.runs(state))
    }

    /// How many runs are in each state: every state, in the order of [`RunState::ALL`], zero
    /// for a state no run is in. One read of an index, however many runs the store holds.
    pub fn count_by_state(&self) -> Result<Vec<(RunState, u64)>> {
        let found = self.read(|reads| reads.count_by_state())?;
        Ok(RunState::ALL
            .iter()
            .map(|&state| {
                let count = found.iter().find(|(s, _)| *s == state).map(|(_, n)| *n);
                (state, count.unwrap_or(0))
            })
            .collect())
    }

    /// A run's events, in order (see `docs/events.md`).
    pub fn events(&self, run_id: &RunId) -> Result<Vec<Event>> {
        self.events_after(run_id, 0)
    }

    /// A run's events after sequence number `after`, in order: how a follower tails the log.
    /// A seq is at most `i64::MAX`: a larger `after` is [`Error::InvalidInput`].
    pub fn events_after(&self, run_id: &RunId, after: u64) -> Result<Vec<Event>> {
        self.read(|reads| moves::events_after(reads, run_id, after))
    }

    /// The run's state and its events after `after`, in one snapshot: what an event stream
    /// reads after each commit.
    #[cfg(feature = "web")]
    pub(crate) fn state_and_events_after(
        &self,
        run_id: &RunId,
        after: u64,
    ) -> Result<(RunState, Vec<Event>)> {
        self.read(|reads| {
            let state = moves::run(reads, run_id)?.state;
            Ok((state, moves::events_after(reads, run_id, after)?))
        })
    }

    /// A run with its lease, its waiting calls and its usage, in one snapshot: what the web
    /// API shows of it.
    #[cfg(feature = "web")]
    pub(crate) fn run_shown(
        &self,
        run_id: &RunId,
    ) -> Result<(Run, Option<Lease>, Vec<PendingCall>, crate::RunUsage)> {
        self.read(|reads| {
            Ok((
                moves::run(reads, run_id)?,
                moves::lease(reads, run_id)?,
                moves::pending_calls(reads, run_id)?,
                moves::usage(reads, run_id)?,
            ))
        })
    }

    /// What a run's model calls used: the tokens of every answer, summed, and the attempts
    /// dispatched (see [`RunUsage`](crate::RunUsage)).
    pub fn usage(&self, run_id: &RunId) -> Result<crate::RunUsage> {
        self.read(|reads| moves::usage(reads, run_id))
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
    /// the system clock. A supervisor executing the run with
    /// [`Config::watch`](crate::Config::watch) fires its tool's cancellation signal within
    /// about a poll; one without learns it at its next lease renewal or write. Either way its
    /// loop stops at its next write, and a tool running then has its outcome recorded late.
    pub fn cancel(&self, run_id: &RunId, reason: &str) -> Result<()> {
        let cancel = CancelRun {
            run_id: run_id.clone(),
            reason: reason.to_owned(),
        };
        self.apply(&SystemClock, cancel).map(|_| ())
    }

    /// Records an operator's approval or denial of a waiting call, from outside a supervisor,
    /// stamped by the system clock. Resume the run afterwards, or let a supervisor with
    /// [`Config::watch`](crate::Config::watch) and the run's agent do it.
    pub fn record_approval(&self, approval: &Approval) -> Result<()> {
        let approval = approval.clone();
        self.apply(&SystemClock, RecordApproval { approval })
    }

    /// Forks run `origin` at step `at` into a new run, from outside a supervisor, stamped by
    /// the system clock, in one transaction: the new run (id `new_id`, or a random one) has the
    /// origin's agent and input, and copies of its steps before `at`, completed tool calls
    /// included, which never run again. It is `RUNNING` and nobody holds it: nothing executes
    /// it until a supervisor with its agent resumes it ([`ResumeRun`](crate::ResumeRun)), whose
    /// loop then asks the model at step `at`. [`ForkRun`](crate::ForkRun) forks and executes
    /// in one call. The origin, in any state, is only read. Returns the new run's id.
    ///
    /// `at` is one of the origin's model steps, or the step after its last (nothing is
    /// dropped); every step before it must have finished. See `docs/runs.md` ("Forking a
    /// run"): `at` 0, a tool step or a step past that one is [`Error::InvalidInput`], an
    /// unfinished step before `at` a state error, an existing `new_id` [`Error::RunExists`],
    /// and nothing is written.
    pub fn fork(&self, origin: &RunId, at: u32, new_id: Option<RunId>) -> Result<RunId> {
        let run_id = new_id.unwrap_or_else(RunId::random);
        let fork = ForkRun {
            trace: crate::trace_context::forked(&run_id, origin, at),
            run_id: run_id.clone(),
            origin: origin.clone(),
            at,
            agents: None,
        };
        self.apply(&SystemClock, fork)?;
        Ok(run_id)
    }

    /// Answers a run's question (its `ask_person` call), from outside a supervisor, stamped by
    /// the system clock. The answer is checked against the question's schema, if it has one:
    /// one that does not match is [`Error::InvalidInput`] saying what is wrong, and nothing
    /// is written. A call that does not wait for an answer, or is answered already, is a state
    /// error; an unknown call [`Error::CallNotFound`]. A supervisor with the run's agent and
    /// [`Config::watch`](crate::Config::watch) or [`Config::recovery`](crate::Config::recovery)
    /// resumes the run. See `docs/waits.md`.
    pub fn answer(&self, answer: &Answer) -> Result<()> {
        let answer = answer.clone();
        self.apply(&SystemClock, AnswerQuestion { answer })
    }

    /// Delivers an event to a run, from outside a supervisor, stamped by the system clock. A
    /// run that waits for an event of its name is woken with its payload as the waiting call's
    /// result ([`Delivered::Woke`]); any other run that has not finished keeps it for its first
    /// wait on that name ([`Delivered::Kept`]). An event id delivered to the run before is
    /// [`Delivered::Duplicate`], and nothing is written: a sender may retry. An unknown run is
    /// [`Error::RunNotFound`], a finished one a state error.
    pub fn deliver_event(&self, delivery: &Delivery) -> Result<Delivered> {
        let delivery = delivery.clone();
        self.apply(&SystemClock, DeliverEvent { delivery })
    }

    /// What a run waits for, if it waits for an answer, an event, a time or a child run
    /// (an approval's wait is [`pending_calls`](Self::pending_calls)).
    pub fn wait(&self, run_id: &RunId) -> Result<Option<Wait>> {
        self.read(|reads| {
            let run = moves::run(reads, run_id)?;
            if run.state.waits_for().is_none() {
                return Ok(None);
            }
            Ok(reads.wait(run_id)?.map(|row| row.public(run_id)))
        })
    }

    /// At most `limit` (up to [`MAX_PAGE_LIMIT`](crate::MAX_PAGE_LIMIT)) waits of runs, of
    /// `kind` when given, oldest first, after `after` (the last of the previous page): what
    /// the inbox and `agentrt waits` list.
    pub fn waits(
        &self,
        kind: Option<WaitKind>,
        after: Option<&Wait>,
        limit: usize,
    ) -> Result<Vec<Wait>> {
        let limit = limit.clamp(1, crate::MAX_PAGE_LIMIT);
        let after = after.map(|wait| (crate::clock::to_millis(wait.since), wait.run_id.clone()));
        self.read(|reads| {
            let after = after.as_ref().map(|(since, id)| (*since, id));
            Ok(reads
                .list_waits(kind, after, limit)?
                .into_iter()
                .map(|(run_id, row)| row.public(&run_id))
                .collect())
        })
    }

    /// A health report: schema version, the backend's settings, its integrity check, and the
    /// leases an operator should know about.
    pub fn health(&self) -> Result<Health> {
        self.backend.health()
    }
}
