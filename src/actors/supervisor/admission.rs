//! How many runs a supervisor executes at once: past its limit, a run waits its turn, durably
//! (a new run is inserted before it waits, with no lease, so a crash leaves it to recovery).

use std::collections::{HashSet, VecDeque};

use actix::{AsyncContext, Context, Handler, Message};
use tokio::sync::oneshot;

use super::{Execution, Supervisor};
use crate::{
    actors::run::Job,
    error::{Error, Result},
    metrics,
    store::{backend::Durability, moves::QueueRun},
    types::{RunId, RunReply},
};

/// The number of runs a supervisor executes at once when [`Config::max_concurrent_runs`] is
/// not set: 1,000.
///
/// [`Config::max_concurrent_runs`]: crate::Config::max_concurrent_runs
pub const DEFAULT_MAX_CONCURRENT_RUNS: usize = 1_000;

/// The runs that wait for a free slot, in the order they came, each with the call that waits
/// for its end.
#[derive(Default)]
pub(super) struct Admission {
    waiting: VecDeque<(RunId, Job, oneshot::Sender<Result<RunReply>>)>,
    ids: HashSet<RunId>,
}

impl Drop for Admission {
    /// A supervisor that stops leaves its line: its runs no longer wait here (recovery takes
    /// them).
    fn drop(&mut self) {
        metrics::runs_dequeued(self.waiting.len());
    }
}

impl Admission {
    /// Whether `run_id` waits here for a slot.
    pub(super) fn holds(&self, run_id: &RunId) -> bool {
        self.ids.contains(run_id)
    }

    /// How many runs wait.
    pub(super) fn len(&self) -> usize {
        self.waiting.len()
    }

    /// Empties the line (a drain): each run that waited, with the caller that waits for it.
    pub(super) fn leave(&mut self) -> Vec<(RunId, oneshot::Sender<Result<RunReply>>)> {
        metrics::runs_dequeued(self.waiting.len());
        self.ids.clear();
        self.waiting
            .drain(..)
            .map(|(run_id, _, reply)| (run_id, reply))
            .collect()
    }
}

impl Supervisor {
    /// Whether a run may start executing now.
    pub(super) fn has_room(&self) -> bool {
        self.executing.len() < self.max_running
    }

    /// Executes `run_id` now if a slot is free; otherwise it waits its turn. A new run that
    /// waits is inserted first, with no lease (its caller hears of the insert as of a start),
    /// and then waits as a resume does.
    pub(super) fn admit(&mut self, run_id: RunId, job: Job, ctx: &mut Context<Self>) -> Execution {
        if self.has_room() && self.admission.waiting.is_empty() {
            return self.execute_now(run_id, job, ctx);
        }
        let (agent, input, started) = match job {
            Job::Start {
                agent,
                input,
                started,
            } => (agent, input, started),
            job => return self.wait_turn(run_id, job),
        };
        // Held from now: no other call executes the run while its insert is written.
        self.admission.ids.insert(run_id.clone());
        let insert = QueueRun {
            trace: crate::trace_context::queued(&run_id, &agent),
            run_id: run_id.clone(),
            agent,
            input,
        };
        let insert = self.store_actor.apply(insert, Durability::Durable);
        let supervisor = ctx.address();
        Box::pin(async move {
            let inserted = insert.await;
            if inserted.is_ok()
                && let Some(started) = started
            {
                let _ = started.send(());
            }
            let turn = supervisor
                .send(Queued { run_id, inserted })
                .await
                .map_err(|_| Error::StoreUnavailable)??;
            turn.await.unwrap_or(Err(Error::StoreUnavailable))
        })
    }

    /// Queues a run that exists, for `job` (a resume), answering when its execution returns.
    fn wait_turn(&mut self, run_id: RunId, job: Job) -> Execution {
        let turn = self.queue(run_id, job);
        Box::pin(async move { turn.await.unwrap_or(Err(Error::StoreUnavailable)) })
    }

    fn queue(&mut self, run_id: RunId, job: Job) -> oneshot::Receiver<Result<RunReply>> {
        let (reply, turn) = oneshot::channel();
        self.admission.ids.insert(run_id.clone());
        self.admission.waiting.push_back((run_id, job, reply));
        metrics::run_queued();
        turn
    }

    /// Starts the runs that wait, oldest first, while slots are free. Each one's execution
    /// goes on whether or not its caller still waits: the run is durable and must move on.
    pub(super) fn admit_waiting(&mut self, ctx: &mut Context<Self>) {
        while self.has_room() && !self.draining.is_on() {
            let Some((run_id, job, reply)) = self.admission.waiting.pop_front() else {
                return;
            };
            metrics::runs_dequeued(1);
            self.admission.ids.remove(&run_id);
            let execution = self.execute_now(run_id, job, ctx);
            actix_rt::spawn(async move {
                let _ = reply.send(execution.await);
            });
        }
    }
}

/// A run inserted to wait for a slot (or whose insert failed): it joins the line.
#[derive(Message)]
#[rtype(result = "Result<oneshot::Receiver<Result<RunReply>>>")]
struct Queued {
    run_id: RunId,
    inserted: Result<()>,
}

impl Handler<Queued> for Supervisor {
    type Result = Result<oneshot::Receiver<Result<RunReply>>>;

    fn handle(&mut self, msg: Queued, ctx: &mut Context<Self>) -> Self::Result {
        let Queued { run_id, inserted } = msg;
        if let Err(err) = inserted {
            self.admission.ids.remove(&run_id);
            return Err(err);
        }
        // Inserted as a drain began: it waits in the database for another replica.
        if self.draining.is_on() {
            self.admission.ids.remove(&run_id);
            self.drain_left_queued();
            return Err(Error::HandedOver { run_id });
        }
        tracing::debug!(%run_id, waiting = self.admission.len() + 1, "run queued");
        // Its turn executes it as a resume would; one cancelled meanwhile ends cancelled.
        let turn = self.queue(run_id, Job::Turn);
        // Slots may have freed while the insert was written.
        self.admit_waiting(ctx);
        Ok(turn)
    }
}
