//! The moves, written once for every backend against the guarded primitives of [`Tx`]. Each
//! move is one typed value ([`Move`]): it names its kind, its output, and how it applies (which
//! guard each write carries, which events it appends, with which payloads), in one place. A
//! guard that matches no row changes nothing, and the refusal says why.
//!
//! The families, one file each:
//! - [`lifecycle`]: a run's insert, its failure, an operator's cancel, a fork;
//! - [`model`]: a model call's reservation, its attempts and its answer;
//! - [`tool`]: the policy's decision on a tool call, its rejection, its progress, its timeout,
//!   its outcome;
//! - [`decision`]: an operator's decision, and the resume that acts on it;
//! - [`recovery`]: the takeover of a run whose owner died, and the reconciliation of its
//!   interrupted steps;
//! - [`handover`]: a draining supervisor's release of a run, for another replica to take up;
//! - [`wait`]: a call that waits for an answer, an event, a time or a child run, what wakes
//!   it, and the resume that goes on with what came;
//! - [`schedule`]: an operator's put, pause, resume and delete of a schedule, and the start
//!   (or skip) of its due occurrence.
//!
//! Also the reads ([`reads`]) and the lease's writes outside any move ([`lease`]).

mod decision;
mod guard;
mod handover;
mod lease;
mod lifecycle;
mod model;
mod reads;
mod recovery;
mod schedule;
mod tool;
mod wait;

pub(crate) use decision::{RecordApproval, ResumeWaiting};
pub(crate) use guard::{Cx, FIRST_TOKEN, model_failure};
pub(crate) use handover::HandOver;
pub(crate) use lease::renew;
pub(crate) use lifecycle::{CancelRun, CreateRun, FailRun, ForkRun, QueueRun};
pub(crate) use model::{BeginModelAttempt, BeginModelStep, FailModelAttempt, FinishModelStep};
pub(crate) use reads::{events_after, lease, lease_report, load, pending_calls, run, usage};
pub(crate) use recovery::{Reconcile, TakeOver};
pub(crate) use schedule::{
    AdvanceSchedule, Advanced, DeleteSchedule, PauseSchedule, PutSchedule, ResumeSchedule,
};
pub(crate) use tool::{DecideTool, FinishTool, RecordProgress, RejectTool, TimeOutTool, TimedOut};
pub(crate) use wait::{
    AnswerQuestion, Began, BeginWait, DeliverEvent, ResumeWait, Resumed, WaitRequest,
};

use super::{backend::MoveKind, model::Grant};
use crate::{error::Result, types::RunId};

/// One move of one run: what it changes, all or nothing, in a transaction.
///
/// A move may be applied more than once before it commits (a group applied again with
/// savepoints, a transaction retried after a conflict), each time on the same state and with
/// the same reading of the store's clock: `apply` takes `&self`, and what an attempt leaves
/// behind is only what the next attempt overwrites (a grant's acquisition, stamped again by the
/// attempt that commits). The lease's wall clock is read afresh by each attempt.
pub(crate) trait Move: Send + Sync + 'static {
    /// What the move returns once applied.
    type Output: Send + 'static;

    /// What the move does, as [`MoveObserver`](crate::MoveObserver)s and metrics name it.
    fn kind(&self) -> MoveKind;

    /// The run it moves.
    fn run_id(&self) -> &RunId;

    /// Applies the move in `cx`'s transaction.
    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<Self::Output>;
}

/// Moves of different kinds with one output, where one value may be any of them (the move a
/// run's loop plans next).
impl<O: Send + 'static> Move for Box<dyn Move<Output = O>> {
    type Output = O;

    fn kind(&self) -> MoveKind {
        (**self).kind()
    }

    fn run_id(&self) -> &RunId {
        (**self).run_id()
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<O> {
        (**self).apply(cx)
    }
}

/// A move of a run's own loop: made under the lease the loop holds, and refused once that
/// lease is another owner's, released, or (for a move that starts a side effect) short of its
/// start margin.
pub(crate) struct Leased {
    /// The run.
    pub run_id: RunId,
    /// The lease its loop holds (or, for the move that acquires it, is acquiring).
    pub grant: Grant,
}

impl Leased {
    /// The loop of `run_id`, under `grant`.
    pub(crate) fn new(run_id: &RunId, grant: &Grant) -> Self {
        Leased {
            run_id: run_id.clone(),
            grant: grant.clone(),
        }
    }
}
