//! Recovery built into a supervisor: at start and then periodically, it takes over the
//! `RUNNING` runs of its agents that nobody holds, or whose lease expired.

use std::{collections::HashSet, time::Duration};

use actix::{ActorFutureExt, AsyncContext, Context};

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
/// Each pass reads the `RUNNING` runs whose lease has expired or that nobody holds (one query,
/// whatever the number of runs), keeps those of agents the supervisor has registered and does
/// not execute, and resumes up to `concurrency` of them at once, each after a random delay of up
/// to `jitter`, so that replicas started together do not take the same runs at the same
/// instant (of two that do, one wins the takeover and the other is told `RunLeased`). A run
/// found leased when its resume comes (another replica took it first) is tried again just after
/// that lease's expiry, in case its new owner dies too. The first pass runs at start, the
/// next ones every `every`, give or take a fifth.
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

/// The runs a recovering supervisor resumes now.
#[derive(Default)]
pub(super) struct Recovering(HashSet<RunId>);

impl Supervisor {
    /// Starts the recovery passes, if the supervisor was configured with them.
    pub(super) fn start_recovery(&mut self, ctx: &mut Context<Self>) {
        if self.recovery.is_some() {
            self.recovery_pass(ctx);
        }
    }

    fn recovery_pass(&mut self, ctx: &mut Context<Self>) {
        let Some(recovery) = self.recovery.clone() else {
            return;
        };
        let next = recovery.every.mul_f64(0.8 + 0.4 * rand::random::<f64>());
        ctx.run_later(next, |this, ctx| this.recovery_pass(ctx));
        let room = recovery.concurrency.saturating_sub(self.recovering.0.len());
        if room == 0 {
            return;
        }
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
            let found = match found {
                Ok(Ok(found)) => found,
                Ok(Err(err)) => {
                    tracing::warn!(%err, "recovery could not read the runs to take over");
                    return;
                }
                Err(_) => return,
            };
            let mut room = room;
            for run_id in found {
                if room == 0 {
                    break;
                }
                if this.executing.contains_key(&run_id) || this.recovering.0.contains(&run_id) {
                    continue;
                }
                room -= 1;
                this.recovering.0.insert(run_id.clone());
                let delay = random_up_to(recovery.jitter);
                ctx.run_later(delay, move |this, ctx| this.recover(run_id, ctx));
            }
        });
        ctx.spawn(pass);
    }

    /// Resumes `run_id`, which a pass found free; once more after the expiry of the lease it
    /// finds, if another owner took it first.
    fn recover(&mut self, run_id: RunId, ctx: &mut Context<Self>) {
        // A call of this supervisor took it meanwhile (a `ResumeRun`): it is that call's.
        if self.executing.contains_key(&run_id) {
            self.recovering.0.remove(&run_id);
            return;
        }
        let execution = self.execute(run_id.clone(), Job::Resume);
        ctx.spawn(
            execution.map(move |result, this: &mut Supervisor, ctx| match result {
                Ok(reply) => {
                    tracing::info!(%run_id, outcome = ?reply.outcome, "run recovered");
                    this.recovering.0.remove(&run_id);
                }
                Err(Error::RunLeased { expires_at, .. }) => {
                    let jitter = this.recovery.as_ref().map_or(Duration::ZERO, |r| r.jitter);
                    let wait = expires_at
                        .duration_since(std::time::SystemTime::now())
                        .unwrap_or_default()
                        + Duration::from_millis(5)
                        + random_up_to(jitter);
                    ctx.run_later(wait, move |this, ctx| this.recover(run_id, ctx));
                }
                Err(err) => {
                    tracing::warn!(%run_id, %err, "could not recover the run");
                    this.recovering.0.remove(&run_id);
                }
            }),
        );
    }
}
