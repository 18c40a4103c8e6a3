//! Recovery built into a supervisor: at start and then periodically, it takes over the
//! `RUNNING` runs of its agents that nobody holds, or whose lease expired.

use std::{
    collections::{HashMap, HashSet},
    time::{Duration, Instant},
};

use actix::{ActorFutureExt, AsyncContext, Context, Handler, Message};

use super::Supervisor;
use crate::{
    actors::{run::Job, store::ReadState},
    error::Error,
    store::{model::wall_millis, moves},
    types::RunId,
};

/// How a supervisor recovers the runs a dead process left: set with
/// [`Config::recovery`](crate::Config::recovery).
///
/// Each pass reads the `RUNNING` runs whose lease has expired or that nobody holds (one query
/// over the runs' state and lease, then one read of each run found, for its agent), keeps
/// those of agents the supervisor has registered and does not execute, and resumes up to
/// `concurrency` of them at once, each after a random delay of up to `jitter`, so that
/// replicas started together do not take the same runs at the same instant (of two that do,
/// one wins the takeover and the other is told `RunLeased`, writes nothing, and leaves the run
/// to its winner). A slot is taken for the recovered run's whole execution, so more orphans
/// than `concurrency` are recovered in turn. A recovery that ends in an error (a model that
/// panics, a lost lease) is tried again at a later pass, after a wait that doubles from `every`
/// with each failure in a row (an hour at most). The first pass runs at start, the next ones
/// every `every`, give or take a fifth, for as long as the supervisor runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovery {
    every: Duration,
    concurrency: usize,
    jitter: Duration,
}

impl Default for Recovery {
    /// A pass every 10 s; 8 resumes at once; up to 250 ms of jitter.
    fn default() -> Self {
        Recovery {
            every: Duration::from_secs(10),
            concurrency: 8,
            jitter: Duration::from_millis(250),
        }
    }
}

impl Recovery {
    /// A pass every `every` (at least 10 ms).
    pub fn every(mut self, every: Duration) -> Self {
        self.every = every.max(Duration::from_millis(10));
        self
    }

    /// At most `concurrency` recovered runs executing at once (at least 1); the others wait
    /// for a later pass.
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency.max(1);
        self
    }

    /// The most a resume waits after its pass found the run, at random.
    pub fn jitter(mut self, jitter: Duration) -> Self {
        self.jitter = jitter;
        self
    }
}

/// A random part of `most`.
fn random_up_to(most: Duration) -> Duration {
    most.mul_f64(rand::random::<f64>())
}

/// What a recovering supervisor keeps between passes.
#[derive(Default)]
pub(super) struct Recovering {
    /// The runs it resumes now.
    now: HashSet<RunId>,
    /// Runs whose recovery ended in an error (a model that panics, a store error), with how
    /// many times in a row and when a pass may try again: a run that fails every time is
    /// tried less and less often, not at every pass.
    failed: HashMap<RunId, (u32, Instant)>,
    /// A pass's read is in flight: the next pass waits for it.
    reading: bool,
}

/// The longest a run that keeps failing waits between two recoveries.
const MAX_FAILURE_BACKOFF: Duration = Duration::from_secs(3600);

/// Time for the next recovery pass; sent by the supervisor's ticker, which holds only a weak
/// address: a supervisor nobody holds stops, recovery with it.
#[derive(Message)]
#[rtype(result = "()")]
pub(super) struct RecoveryPass;

impl Handler<RecoveryPass> for Supervisor {
    type Result = ();

    fn handle(&mut self, _: RecoveryPass, ctx: &mut Context<Self>) {
        self.recovery_pass(ctx);
    }
}

impl Supervisor {
    /// Starts the recovery passes, if the supervisor was configured with them: the first now,
    /// the next ones from a ticker task that stops when the supervisor does.
    pub(super) fn start_recovery(&mut self, ctx: &mut Context<Self>) {
        let Some(recovery) = self.recovery.clone() else {
            return;
        };
        self.recovery_pass(ctx);
        let supervisor = ctx.address().downgrade();
        actix_rt::spawn(async move {
            loop {
                let next = recovery.every.mul_f64(0.8 + 0.4 * rand::random::<f64>());
                actix_rt::time::sleep(next).await;
                match supervisor.upgrade() {
                    Some(supervisor) if supervisor.connected() => supervisor.do_send(RecoveryPass),
                    _ => return,
                }
            }
        });
    }

    fn recovery_pass(&mut self, ctx: &mut Context<Self>) {
        let Some(recovery) = self.recovery.clone() else {
            return;
        };
        if self.recovering.reading
            || self.recovering.now.len() >= recovery.concurrency
            || self.recovery_room(&recovery) == 0
        {
            return;
        }
        self.recovering.reading = true;
        let agents = self.agents.clone();
        let read = self.store_actor.addr().send(ReadState::new(move |reads| {
            let mut found = Vec::new();
            for (run_id, _) in reads.unleased_runs(wall_millis())? {
                let run = moves::run(reads, &run_id)?;
                if agents.contains_key(&run.agent) {
                    found.push(run_id);
                }
            }
            Ok(found)
        }));
        let pass = actix::fut::wrap_future::<_, Self>(read).map(move |found, this, ctx| {
            this.recovering.reading = false;
            let found = match found {
                Ok(Ok(found)) => found,
                Ok(Err(err)) => {
                    tracing::warn!(%err, "recovery could not read the runs to take over");
                    return;
                }
                Err(_) => return,
            };
            let mut room = this.recovery_room(&recovery);
            let now = Instant::now();
            this.recovering
                .failed
                .retain(|run_id, _| found.contains(run_id));
            for run_id in found {
                if room == 0 {
                    break;
                }
                let backing_off = this
                    .recovering
                    .failed
                    .get(&run_id)
                    .is_some_and(|(_, until)| *until > now);
                if backing_off
                    || this.executing.contains_key(&run_id)
                    || this.admission.holds(&run_id)
                    || this.recovering.now.contains(&run_id)
                {
                    continue;
                }
                room -= 1;
                this.recovering.now.insert(run_id.clone());
                let delay = random_up_to(recovery.jitter);
                ctx.run_later(delay, move |this, ctx| this.recover(run_id, ctx));
            }
        });
        ctx.spawn(pass);
    }

    /// How many runs a pass may take on: what its concurrency leaves, and no more than the
    /// supervisor's free slots, so that orphans wait in the database rather than in memory.
    fn recovery_room(&self, recovery: &Recovery) -> usize {
        let slots = self
            .max_running
            .saturating_sub(self.executing.len() + self.admission.len());
        recovery
            .concurrency
            .saturating_sub(self.recovering.now.len())
            .min(slots)
    }

    /// Resumes `run_id`, which a pass found free. A run another owner took first is left to a
    /// later pass, which finds it again only if that owner dies too.
    fn recover(&mut self, run_id: RunId, ctx: &mut Context<Self>) {
        // A call of this supervisor took it meanwhile (a `ResumeRun`): it is that call's.
        if self.executing.contains_key(&run_id) || self.admission.holds(&run_id) {
            self.recovering.now.remove(&run_id);
            return;
        }
        let execution = self.execute(run_id.clone(), Job::Resume, ctx);
        // One of at most `concurrency` futures in the context: the end updates the pass's
        // bookkeeping.
        let execution = actix::fut::wrap_future::<_, Self>(execution);
        ctx.spawn(execution.map(move |result, this: &mut Supervisor, _| {
            this.recovering.now.remove(&run_id);
            match result {
                Ok(reply) => {
                    tracing::info!(%run_id, outcome = ?reply.outcome, "run recovered");
                    this.recovering.failed.remove(&run_id);
                }
                // Taken by another owner, or no longer RUNNING: nothing to recover.
                Err(Error::RunLeased { .. } | Error::RunState { .. }) => {}
                Err(err) => {
                    let every = this.recovery.as_ref().map_or(Duration::ZERO, |r| r.every);
                    let (failures, until) =
                        this.recovering.failed.entry(run_id.clone()).or_insert((0, Instant::now()));
                    *failures += 1;
                    let wait = every
                        .saturating_mul(1 << (*failures).min(16))
                        .min(MAX_FAILURE_BACKOFF);
                    *until = Instant::now() + wait;
                    tracing::warn!(%run_id, %err, failures = *failures, ?wait, "could not recover the run; trying again later");
                }
            }
        }));
    }
}
