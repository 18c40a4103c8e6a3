//! The watch built into a supervisor: a thread of its own polls the store's change feed, so
//! that a decision recorded elsewhere (another process, the CLI, [`Store::record_approval`])
//! resumes the run, and a cancel recorded elsewhere tells the tool running for it at once
//! instead of at the loop's next write.
//!
//! [`Store::record_approval`]: crate::Store::record_approval

use std::{
    collections::{HashMap, HashSet},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use actix::{ActorFutureExt, AsyncContext, Context, Handler, Message, WeakAddr};

use super::Supervisor;
use crate::{
    actors::{run::Job, store::ReadState},
    error::{Error, Result},
    store::{
        backend::{Change, ChangeKind, Changes, Watcher},
        moves,
    },
    types::{Outcome, RunId, RunReply, RunState},
};

/// How a supervisor watches for decisions and cancels recorded elsewhere: set with
/// [`Config::watch`](crate::Config::watch).
///
/// A thread of the supervisor's own polls the store every `every` (50 ms by default). A poll
/// costs one `PRAGMA data_version` when nothing was committed since the last one, and reads
/// only the changes committed since then otherwise, whatever the number of runs. At start it
/// also reads the runs waiting for an approval whose decision is already recorded (decided
/// while no supervisor watched).
///
/// - A **decision** on a run of an agent the supervisor has registered resumes the run, as a
///   [`ResumeRun`](crate::ResumeRun) would: of the supervisors that watch, one wins the
///   resume's compare-and-set and the others write nothing. Its end reaches the
///   [`SubscribeRuns`](crate::SubscribeRuns) subscribers like any other. This holds for a
///   decision recorded through this supervisor's own [`RecordApproval`](crate::RecordApproval)
///   too ([`DecideAndResume`](crate::DecideAndResume) resumes the run itself).
/// - A **cancel** of a run the supervisor executes fires its tool's cancellation signal, as
///   [`CancelRun`](crate::CancelRun) sent to it does.
/// - A **release** of a run by a draining replica ([`Drain`](crate::Drain)) makes the
///   supervisor take the run over at once, if it has its agent and a free slot.
///
/// The delay from the commit to the resume is up to `every` (half of it on average), plus the
/// read and the resume's own commit: see `docs/runs.md`.
///
/// ```
/// use std::time::Duration;
/// use agentrt::{Config, Watch};
///
/// let config = Config::default().watch(Watch::default().every(Duration::from_millis(100)));
/// # let _ = config;
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Watch {
    every: Duration,
}

impl Default for Watch {
    /// A poll every 50 ms.
    fn default() -> Self {
        Watch {
            every: Duration::from_millis(50),
        }
    }
}

impl Watch {
    /// A poll every `every` (at least 1 ms).
    pub fn every(mut self, every: Duration) -> Self {
        self.every = every.max(Duration::from_millis(1));
        self
    }
}

/// What a watching supervisor keeps.
pub(super) struct Watching {
    /// The feed's reader and its period, until the supervisor starts its thread.
    watcher: Option<(Watch, Box<dyn Watcher>)>,
    /// Set when the supervisor is dropped: the thread stops before its next poll.
    stop: Arc<AtomicBool>,
    /// Runs decided whose resume (or the read before it) failed, with how many times in a
    /// row: each is read again, and resumed if it still waits with its decision, after a wait
    /// that doubles, since the feed's cursor has moved past its change.
    failed: HashMap<RunId, u32>,
    /// Runs that a [`DecideAndResume`](crate::DecideAndResume) of this supervisor decides and
    /// then resumes itself (how many at once): the watch leaves them to it.
    claimed: HashMap<RunId, usize>,
    /// Runs decided while this supervisor executed or claimed them: the execution may have
    /// paused for the very call just decided, so its end is looked at.
    deferred: HashSet<RunId>,
    /// Whether decisions are acted on (a configured watch), or only released runs and woken
    /// waits (a supervisor that recovers).
    decisions: bool,
    /// The polling thread was started.
    started: bool,
}

impl Watching {
    /// Whether a thread polls the change feed.
    pub(super) fn polls(&self) -> bool {
        self.watcher.is_some() || self.started
    }

    pub(super) fn new(watcher: Option<(Watch, Box<dyn Watcher>)>, decisions: bool) -> Self {
        Watching {
            watcher,
            stop: Arc::default(),
            failed: HashMap::new(),
            claimed: HashMap::new(),
            deferred: HashSet::new(),
            decisions,
            started: false,
        }
    }
}

impl Drop for Watching {
    fn drop(&mut self) {
        // The thread polls for as long as the supervisor lives, and not a poll longer.
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// The resume of a run decided elsewhere returned: it failed (not for another resumer's
/// win), or not.
#[derive(Message)]
#[rtype(result = "()")]
struct ResumeEnded {
    run_id: RunId,
    failed: bool,
}

impl Handler<ResumeEnded> for Supervisor {
    type Result = ();

    fn handle(&mut self, msg: ResumeEnded, ctx: &mut Context<Self>) {
        if msg.failed {
            self.retry_decided(msg.run_id, ctx);
        } else {
            self.watching.failed.remove(&msg.run_id);
        }
    }
}

/// What a poll of the feed found; sent by the watch thread, which holds only a weak address.
#[derive(Message)]
#[rtype(result = "()")]
pub(super) struct Changed(Changes);

impl Handler<Changed> for Supervisor {
    type Result = ();

    fn handle(&mut self, Changed(changes): Changed, ctx: &mut Context<Self>) {
        if changes.resync {
            self.fire_cancelled(ctx);
            // Released runs whose changes the feed no longer holds: a pass finds them.
            self.recovery_pass(ctx);
        }
        for Change {
            run_id,
            agent,
            kind,
        } in changes.changes
        {
            match kind {
                ChangeKind::Cancelled => {
                    if let Some((_, cancellation)) = self.executing.get(&run_id) {
                        cancellation.fire();
                        tracing::info!(%run_id, "run cancelled elsewhere: its tool is told");
                    }
                }
                ChangeKind::Decided
                    if self.watching.decisions
                        && self.agents.contains_key(&agent)
                        && !self.draining.is_on() =>
                {
                    self.decided(run_id, ctx)
                }
                ChangeKind::Decided => {}
                ChangeKind::Released
                    if self.agents.contains_key(&agent) && !self.draining.is_on() =>
                {
                    self.released(run_id, ctx)
                }
                ChangeKind::Released => {}
                ChangeKind::Woken => self.woken(run_id, &agent, ctx),
            }
        }
    }
}

impl Supervisor {
    /// Starts the watch thread, if the supervisor was configured with one.
    pub(super) fn start_watch(&mut self, ctx: &mut Context<Self>) {
        let Some((watch, watcher)) = self.watching.watcher.take() else {
            return;
        };
        self.watching.started = true;
        let supervisor = ctx.address().downgrade();
        let stop = self.watching.stop.clone();
        let spawned = std::thread::Builder::new()
            .name("agentrt-watch".into())
            .spawn(move || poll_until_stopped(watch, watcher, supervisor, stop));
        if let Err(err) = spawned {
            tracing::error!(%err, "could not start the watch: decisions and cancels recorded elsewhere are not picked up");
        }
    }

    /// A decision on a run of one of this supervisor's agents (or its wait woken).
    pub(super) fn decided(&mut self, run_id: RunId, ctx: &mut Context<Self>) {
        // A resume of it waits for a free slot here: it acts on the decision in its turn.
        if self.admission.holds(&run_id) {
            return;
        }
        if self.executing.contains_key(&run_id) || self.watching.claimed.contains_key(&run_id) {
            self.watching.deferred.insert(run_id);
            return;
        }
        // The watch read it waiting with its decision, a moment ago.
        self.resume_decided(run_id, ctx);
    }

    /// Resumes `run_id` if it waits for a call whose decision is recorded, once read: a
    /// decision heard during an execution of this supervisor may be one that execution acted
    /// on (its own `DecideAndResume`'s), and resuming a run that pauses again for another call
    /// would only settle it twice.
    fn resume_if_decided(&mut self, run_id: RunId, ctx: &mut Context<Self>) {
        let (id, clock) = (run_id.clone(), self.clock.clone());
        let read = self.store_actor.addr().send(ReadState::new(move |reads| {
            let snapshot = moves::load(reads, &id)?;
            let now = crate::clock::to_millis(clock.now());
            Ok(match snapshot.run.state {
                RunState::WaitingForApproval => snapshot.approval.is_some(),
                _ => snapshot.wait.is_some_and(|wait| wait.ready(now)),
            })
        }));
        ctx.spawn(
            actix::fut::wrap_future::<_, Self>(read).map(move |read, this, ctx| match read {
                Ok(Ok(true)) => this.decided_and_read(run_id, ctx),
                // Resumed, cancelled or finished since: nothing left to act on.
                Ok(Ok(false)) => {
                    this.watching.failed.remove(&run_id);
                }
                Ok(Err(err)) => {
                    tracing::warn!(%run_id, %err, "the watch could not read a run decided elsewhere");
                    this.retry_decided(run_id, ctx);
                }
                Err(_) => {}
            }),
        );
    }

    /// A run read waiting with its decision recorded: resumed, unless a call of this
    /// supervisor took it meanwhile (whose end is then looked at).
    fn decided_and_read(&mut self, run_id: RunId, ctx: &mut Context<Self>) {
        if self.executing.contains_key(&run_id) || self.watching.claimed.contains_key(&run_id) {
            self.watching.deferred.insert(run_id);
            return;
        }
        self.resume_decided(run_id, ctx);
    }

    /// The one place the watch executes a run. A resume refused because another resumer won
    /// (another supervisor, an application's `ResumeRun`) or the run moved on (cancelled,
    /// finished) is no failure: it wrote nothing and stays quiet.
    fn resume_decided(&mut self, run_id: RunId, ctx: &mut Context<Self>) {
        let execution = self.execute(run_id.clone(), Job::Resume, ctx);
        let supervisor = ctx.address();
        actix_rt::spawn(async move {
            let failed = match execution.await {
                Ok(reply) => {
                    tracing::info!(%run_id, outcome = ?reply.outcome, "run decided elsewhere resumed");
                    false
                }
                Err(err)
                    if err.is_run_state()
                        || matches!(
                            err,
                            Error::RunNotFound(_)
                                | Error::RunLeased { .. }
                                | Error::Draining
                                | Error::HandedOver { .. }
                        ) =>
                {
                    tracing::debug!(%run_id, %err, "run decided elsewhere resumed by another");
                    false
                }
                // The run may still wait with its decision (a busy store refused the resume, a
                // policy panicked): it is read again later.
                Err(err) => {
                    tracing::warn!(%run_id, %err, "the resume of a run decided elsewhere stopped");
                    true
                }
            };
            supervisor.do_send(ResumeEnded { run_id, failed });
        });
    }

    /// A decision this supervisor could not act on (its resume or the read before it
    /// failed: a busy or failing store, a policy that panics): read again after a wait that
    /// doubles from a second with each failure in a row, up to an hour, and resumed if the run
    /// still waits with it.
    fn retry_decided(&mut self, run_id: RunId, ctx: &mut Context<Self>) {
        let failures = self.watching.failed.entry(run_id.clone()).or_default();
        *failures += 1;
        let wait = (Duration::from_secs(1) * (1 << (*failures - 1).min(12)))
            .min(Duration::from_secs(3600));
        tracing::debug!(%run_id, failures = *failures, ?wait, "reading a decided run again later");
        ctx.run_later(wait, move |this, ctx| this.resume_if_decided(run_id, ctx));
    }

    /// After a poll that may have missed cancels: fires the signal of every run this supervisor
    /// executes that is cancelled.
    fn fire_cancelled(&mut self, ctx: &mut Context<Self>) {
        let running: Vec<RunId> = self.executing.keys().cloned().collect();
        if running.is_empty() {
            return;
        }
        let read = self.store_actor.addr().send(ReadState::new(move |reads| {
            let mut cancelled = Vec::new();
            for run_id in &running {
                if reads
                    .lease_row(run_id)?
                    .is_some_and(|row| row.state == RunState::Cancelled)
                {
                    cancelled.push(run_id.clone());
                }
            }
            Ok(cancelled)
        }));
        ctx.spawn(
            actix::fut::wrap_future::<_, Self>(read).map(|read, this, _| match read {
                Ok(Ok(cancelled)) => {
                    for run_id in cancelled {
                        if let Some((_, cancellation)) = this.executing.get(&run_id) {
                            cancellation.fire();
                        }
                    }
                }
                Ok(Err(err)) => {
                    tracing::warn!(%err, "the watch could not read the runs it executes")
                }
                Err(_) => {}
            }),
        );
    }

    /// A call that executed `run_id` returned: a decision or a wake-up heard meanwhile may be
    /// for the pause or the wait it returned with.
    pub(super) fn watched_execution_ended(
        &mut self,
        run_id: &RunId,
        result: &Result<RunReply>,
        ctx: &mut Context<Self>,
    ) {
        if !self.watching.deferred.remove(run_id) {
            return;
        }
        match result {
            // It may have paused again, for the call decided, or begun a wait that was woken
            // before it returned (an event delivered at once): read, and resumed if so.
            Ok(RunReply {
                outcome: Outcome::WaitingForApproval { .. } | Outcome::Waiting { .. },
                ..
            }) => self.resume_if_decided(run_id.clone(), ctx),
            // It may have stopped before it acted on the decision heard meanwhile.
            Err(_) => self.retry_decided(run_id.clone(), ctx),
            Ok(_) => {}
        }
    }

    /// A `DecideAndResume` is about to record a decision on `run_id` and resume it.
    pub(super) fn claim(&mut self, run_id: &RunId) {
        *self.watching.claimed.entry(run_id.clone()).or_default() += 1;
    }

    /// That `DecideAndResume` recorded its decision (and executes the run now, whose end is
    /// looked at), or failed to: a decision heard meanwhile is then acted on here.
    pub(super) fn unclaim(&mut self, run_id: &RunId, recorded: bool, ctx: &mut Context<Self>) {
        if let Some(claims) = self.watching.claimed.get_mut(run_id) {
            *claims -= 1;
            if *claims == 0 {
                self.watching.claimed.remove(run_id);
            }
        }
        if !recorded
            && !self.watching.claimed.contains_key(run_id)
            && !self.executing.contains_key(run_id)
            && self.watching.deferred.remove(run_id)
        {
            self.resume_if_decided(run_id.clone(), ctx);
        }
    }
}

/// The watch thread: polls every `watch.every` until the supervisor is gone. An error (a busy
/// database, an I/O error) is logged and the poll tried again at the next period.
fn poll_until_stopped(
    watch: Watch,
    mut watcher: Box<dyn Watcher>,
    supervisor: WeakAddr<Supervisor>,
    stop: Arc<AtomicBool>,
) {
    let mut failing = false;
    loop {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Some(addr) = supervisor.upgrade().filter(|addr| addr.connected()) else {
            return;
        };
        match watcher.poll() {
            Ok(changes) => {
                if failing {
                    tracing::info!("the watch reads the store again");
                    failing = false;
                }
                if let Some(changes) = changes {
                    addr.do_send(Changed(changes));
                }
            }
            // Once per streak of failures: a store that stays unreadable is not logged at
            // every poll.
            Err(err) if !failing => {
                tracing::warn!(%err, "the watch could not read the store; trying again at each poll");
                failing = true;
            }
            Err(err) => tracing::debug!(%err, "the watch could not read the store"),
        }
        drop(addr);
        watcher.wait(watch.every);
    }
}
