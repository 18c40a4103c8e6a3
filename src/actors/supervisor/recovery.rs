//! Recovery built into a supervisor: at start and then periodically, it takes over the
//! `RUNNING` runs of its agents that nobody holds, or whose lease expired.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use actix::{ActorFutureExt, AsyncContext, Context, Handler, Message};

use super::Supervisor;
use crate::{
    actors::{run::Job, store::ReadState},
    error::{Error, Result},
    types::{RunId, RunReply},
};

/// How a supervisor recovers the runs a dead process left: set with
/// [`Config::recovery`](crate::Config::recovery).
///
/// Each pass reads, oldest first, the `RUNNING` runs of the agents the supervisor has
/// registered whose lease has expired or that nobody holds (one query, which stops at the
/// supervisor's free slots), and resumes those it does not execute, each after a random delay
/// of up to `jitter`, so that replicas started together do not take the same runs at the same
/// instant (of two that do, one wins the takeover and the other is told `RunLeased`, writes
/// nothing, and leaves the run to its winner).
///
/// - A run some process executed (a takeover, which may reconcile side effects in flight):
///   at most `concurrency` of them at once, each holding its place for its whole execution.
/// - A run never executed (one that waited for a slot of a supervisor that died, or a fork):
///   as many as the free slots ([`Config::max_concurrent_runs`](crate::Config::max_concurrent_runs)).
///
/// The two kinds are read apart, so that takeovers waiting for their turn hide no run that
/// needs only a slot. When a pass leaves runs behind for want of room, a freed slot (any
/// execution's end) starts the next pass, at most one each 50 ms, so a backlog drains as fast
/// as the slots free. A recovery that ends in an error
/// (a model that panics, a lost lease) is tried again at a later pass, after a wait that
/// doubles from `every` with each failure in a row (an hour at most). The first pass runs at
/// start, the next ones every `every`, give or take a fifth, for as long as the supervisor
/// runs.
///
/// A supervisor that recovers also polls the store's change feed, as [`Watch`](crate::Watch)
/// does (every 50 ms, unless a watch sets the period), for the runs a draining replica
/// released ([`Drain`](crate::Drain)): it takes each over at once if it has a free slot,
/// rather than at its next pass. It acts on decisions only with a watch.
///
/// It also starts the runs of the [`Schedule`](crate::Schedule)s of its agents: at each pass,
/// and at the time of the next occurrence it knows of (a second later at most), it reads the
/// schedules due through their index, starts each occurrence (of several replicas, one does)
/// and executes its run as one that waited for a slot.
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

    /// At most `concurrency` takeovers of runs some process executed at once (at least 1);
    /// the others wait for a later pass. Runs never executed need only a free slot.
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
    /// The runs it resumes now, each with whether it is a takeover of a run some process
    /// executed (rather than one never executed).
    now: HashMap<RunId, bool>,
    /// Runs whose recovery ended in an error (a model that panics, a store error), with how
    /// many times in a row and when a pass may try again: a run that fails every time is
    /// tried less and less often, not at every pass.
    failed: HashMap<RunId, (u32, Instant)>,
    /// A pass's read is in flight: the next pass waits for it.
    reading: bool,
    /// The last pass left runs it found no room for: a freed slot starts the next.
    more: bool,
    /// A pass started by a freed slot is scheduled.
    chained: bool,
    /// When the last pass read.
    last_pass: Option<Instant>,
}

/// The shortest time between two passes that freed slots start.
const CHAINED_PASS_GAP: Duration = Duration::from_millis(50);

impl Recovering {
    /// How many takeovers of runs some process executed are under way.
    fn takeovers(&self) -> usize {
        self.now.values().filter(|takeover| **takeover).count()
    }
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

    pub(super) fn recovery_pass(&mut self, ctx: &mut Context<Self>) {
        let Some(recovery) = self.recovery.clone() else {
            return;
        };
        // Due timers and due schedules are read at each pass too, each through its own index.
        self.wake_pass(ctx);
        self.schedule_pass(ctx);
        let slots = self.free_slots();
        if self.recovering.reading || slots == 0 || self.draining.is_on() {
            return;
        }
        self.recovering.reading = true;
        self.recovering.last_pass = Some(Instant::now());
        let agents: Vec<String> = self.agents.keys().cloned().collect();
        // Room for what the pass will skip (runs backing off, or being recovered), so that
        // they do not hide the ones after them; takeovers and runs never executed are read
        // apart, so that takeovers waiting for `concurrency` do not hide the others.
        let skipped = self.recovering.failed.len() + self.recovering.now.len();
        let takeovers = recovery
            .concurrency
            .saturating_sub(self.recovering.takeovers())
            .min(slots);
        let limits = (takeovers + skipped, slots + skipped);
        let read = self.store_actor.addr().send(ReadState::new(move |reads| {
            let agents: Vec<&str> = agents.iter().map(String::as_str).collect();
            let wall = reads.lease_wall()?;
            let mut found = if limits.0 > skipped {
                reads.recoverable_runs(wall, &agents, true, limits.0)?
            } else {
                Vec::new()
            };
            let executed = found.len();
            found.extend(reads.recoverable_runs(wall, &agents, false, limits.1)?);
            Ok((found, executed))
        }));
        let pass = actix::fut::wrap_future::<_, Self>(read).map(move |found, this, ctx| {
            this.recovering.reading = false;
            let (found, executed) = match found {
                Ok(Ok(found)) => found,
                Ok(Err(err)) => {
                    tracing::warn!(%err, "recovery could not read the runs to take over");
                    return;
                }
                Err(_) => return,
            };
            // A full page of either (or takeovers not read, for want of room): more may wait
            // behind it, for the next pass a freed slot starts.
            let takeovers_left = limits.0 <= skipped || executed >= limits.0;
            this.recovering.more = takeovers_left || found.len() - executed >= limits.1;
            let now = Instant::now();
            this.recovering
                .failed
                .retain(|_, (_, until)| *until + MAX_FAILURE_BACKOFF > now);
            let mut slots = this.free_slots();
            let mut takeovers = this.recovering.takeovers();
            for (run_id, lease) in found {
                if slots == 0 {
                    this.recovering.more = true;
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
                    || this.recovering.now.contains_key(&run_id)
                {
                    continue;
                }
                // A run some process executed may have side effects in flight: at most
                // `concurrency` of those are taken over at once. One never executed (it
                // waited for a slot, or is a fork) only needs a slot.
                let takeover = lease.epoch > 0;
                if takeover && takeovers >= recovery.concurrency {
                    this.recovering.more = true;
                    continue;
                }
                takeovers += usize::from(takeover);
                slots -= 1;
                this.recovering.now.insert(run_id.clone(), takeover);
                let delay = random_up_to(recovery.jitter);
                ctx.run_later(delay, move |this, ctx| this.recover(run_id, ctx));
            }
        });
        ctx.spawn(pass);
    }

    /// A slot was freed (an execution returned): runs left behind by the last pass are
    /// recovered as slots free, not a period later, with at most one pass each
    /// `CHAINED_PASS_GAP` so that a busy supervisor's writer is not kept reading.
    pub(super) fn slot_freed(&mut self, ctx: &mut Context<Self>) {
        if !self.recovering.more || self.recovering.chained {
            return;
        }
        let since = self
            .recovering
            .last_pass
            .map_or(CHAINED_PASS_GAP, |last| last.elapsed());
        self.recovering.chained = true;
        ctx.run_later(CHAINED_PASS_GAP.saturating_sub(since), |this, ctx| {
            this.recovering.chained = false;
            this.recovery_pass(ctx);
        });
    }

    /// The slots a pass may fill: those no execution, no run waiting for a slot and no
    /// recovery about to start holds, so that orphans wait in the database rather than in
    /// memory.
    fn free_slots(&self) -> usize {
        let starting = self
            .recovering
            .now
            .keys()
            .filter(|run_id| !self.executing.contains_key(*run_id) && !self.admission.holds(run_id))
            .count();
        self.max_running
            .saturating_sub(self.executing.len() + self.admission.len() + starting)
    }

    /// A draining replica released `run_id` (the change feed said so): it is taken over now,
    /// not at the next pass, if a slot is free; otherwise a freed slot's pass finds it.
    pub(super) fn released(&mut self, run_id: RunId, ctx: &mut Context<Self>) {
        if self.executing.contains_key(&run_id)
            || self.admission.holds(&run_id)
            || self.recovering.now.contains_key(&run_id)
        {
            return;
        }
        if self.free_slots() == 0 {
            self.recovering.more = true;
            return;
        }
        tracing::debug!(%run_id, "run released by a draining replica: taking it over");
        self.recovering.now.insert(run_id.clone(), true);
        self.recover(run_id, ctx);
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
        let supervisor = ctx.address();
        actix_rt::spawn(async move {
            let result = execution.await;
            supervisor.do_send(Recovered { run_id, result });
        });
    }
}

/// A recovered run's execution returned.
#[derive(Message)]
#[rtype(result = "()")]
struct Recovered {
    run_id: RunId,
    result: Result<RunReply>,
}

impl Handler<Recovered> for Supervisor {
    type Result = ();

    fn handle(&mut self, msg: Recovered, ctx: &mut Context<Self>) {
        let Recovered { run_id, result } = msg;
        self.recovering.now.remove(&run_id);
        match result {
            Ok(reply) => {
                tracing::info!(%run_id, outcome = ?reply.outcome, "run recovered");
                self.recovering.failed.remove(&run_id);
            }
            // Taken by another owner, or no longer RUNNING: nothing to recover. A draining
            // supervisor recovers nothing, and hands over what it recovered.
            Err(
                Error::RunLeased { .. }
                | Error::RunState { .. }
                | Error::Draining
                | Error::HandedOver { .. },
            ) => {}
            Err(err) => {
                let every = self.recovery.as_ref().map_or(Duration::ZERO, |r| r.every);
                let (failures, until) = self
                    .recovering
                    .failed
                    .entry(run_id.clone())
                    .or_insert((0, Instant::now()));
                *failures += 1;
                let wait = every
                    .saturating_mul(1 << (*failures).min(16))
                    .min(MAX_FAILURE_BACKOFF);
                *until = Instant::now() + wait;
                tracing::warn!(%run_id, %err, failures = *failures, ?wait, "could not recover the run; trying again later");
            }
        }
        self.slot_freed(ctx);
    }
}
