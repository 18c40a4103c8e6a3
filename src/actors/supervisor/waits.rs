//! Waking waiting runs: due timers read once per pass through the index of ready waits (a
//! pass each second, and at the time of the next one this supervisor knows of), woken waits
//! heard on the change feed, and the child run a parent just started waiting for, executed at
//! once.

use std::time::Duration;

use actix::{ActorFutureExt, AsyncContext, Context, Handler, Message, SpawnHandle, WrapFuture};

use super::Supervisor;
use crate::{
    actors::{run::Job, store::ReadState},
    clock::to_millis,
    error::Result,
    types::{Answer, Delivered, Delivery, Outcome, RunId, RunReply, WaitKind},
};

/// The most ready waits one pass resumes: a full page makes another pass at once, which reads
/// on after the page's last wait.
const PASS_LIMIT: usize = 256;

/// The longest a supervisor that wakes runs goes without a pass: a timer set by another
/// replica, or by a test clock that runs faster than time, is found by then.
const MAX_TIMER_SLEEP: Duration = Duration::from_secs(1);

/// What a supervisor keeps of the waits it wakes.
#[derive(Default)]
pub(super) struct Waking {
    /// A pass is reading.
    reading: bool,
    /// The next pass this supervisor set, and the time (by `Config::clock`) it is for.
    next: Option<(i64, SpawnHandle)>,
    /// Where the next pass reads on, after a full page: the last wait it read (its ready time
    /// and run). The runs of that page stay in the index until their resumes commit, so a
    /// pass from the start would only read them again while the next ones wait.
    after: Option<(i64, RunId)>,
}

impl Supervisor {
    /// Whether this supervisor hears of woken waits and due timers: it watches the change
    /// feed (a configured watch, or recovery).
    fn wakes(&self) -> bool {
        self.recovery.is_some() || self.watching.polls()
    }

    /// Starts the passes over the ready waits, if this supervisor wakes runs: one now, and
    /// one each [`MAX_TIMER_SLEEP`] from a ticker task, so that a timer no pass of this
    /// supervisor knows of (set by a replica gone since: nothing on the change feed tells of
    /// a timer) falls due here too. The ticker holds only a weak address: a supervisor nobody
    /// holds stops, its passes with it.
    pub(super) fn start_waking(&mut self, ctx: &mut Context<Self>) {
        self.wake_pass(ctx);
        if !self.wakes() {
            return;
        }
        let supervisor = ctx.address().downgrade();
        actix_rt::spawn(async move {
            loop {
                actix_rt::time::sleep(MAX_TIMER_SLEEP).await;
                match supervisor.upgrade() {
                    Some(supervisor) if supervisor.connected() => supervisor.do_send(WakePass),
                    _ => return,
                }
            }
        });
    }

    /// Resumes the runs of this supervisor's agents whose waits are ready (timers due, waits
    /// woken while nobody heard), through the index of ready waits, and sets a pass for the
    /// next timer it finds, if it falls due before the ticker's next pass.
    pub(super) fn wake_pass(&mut self, ctx: &mut Context<Self>) {
        if self.waking.reading || self.draining.is_on() || !self.wakes() {
            return;
        }
        self.waking.reading = true;
        let agents: Vec<String> = self.agents.keys().cloned().collect();
        let now = to_millis(self.clock.now());
        let after = self.waking.after.clone();
        let read = self.store_actor.addr().send(ReadState::new(move |reads| {
            let agents: Vec<&str> = agents.iter().map(String::as_str).collect();
            let after = after.as_ref().map(|(at, run_id)| (*at, run_id));
            let ready = reads.ready_waits(now, &agents, after, PASS_LIMIT)?;
            let next = reads.next_ready_at(now, &agents)?;
            Ok((ready, next))
        }));
        let pass = actix::fut::wrap_future::<_, Self>(read).map(move |read, this, ctx| {
            this.waking.reading = false;
            let (ready, next) = match read {
                Ok(Ok(found)) => found,
                Ok(Err(err)) => {
                    // Tried again in a while: a busy store must not cost a timer its wake-up.
                    tracing::warn!(%err, "could not read the waits that are due");
                    this.wake_at(now + MAX_TIMER_SLEEP.as_millis() as i64, ctx);
                    return;
                }
                Err(_) => return,
            };
            let full = ready.len() >= PASS_LIMIT;
            // A page that is not full ends the reading on: the next pass starts over, and
            // finds any wait left ready (a resume that failed, a run busy here).
            this.waking.after = ready
                .last()
                .filter(|_| full)
                .map(|(run_id, at)| (*at, run_id.clone()));
            for (run_id, _) in ready {
                this.wake(run_id, ctx);
            }
            if full {
                // More are due: read on, after this page's last.
                this.wake_at(now, ctx);
            } else if let Some(next) = next {
                this.wake_at(next, ctx);
            }
        });
        ctx.spawn(pass);
    }

    /// Sets a pass for time `at` (by `Config::clock`), unless one is set before it. A pass
    /// set keeps the supervisor alive until it runs: one is set at most [`MAX_TIMER_SLEEP`]
    /// ahead, and a timer further away is left to the ticker.
    fn wake_at(&mut self, at: i64, ctx: &mut Context<Self>) {
        // A timer due before where the reading on stands would be passed over: start over.
        if self
            .waking
            .after
            .as_ref()
            .is_some_and(|(after, _)| at < *after)
        {
            self.waking.after = None;
        }
        let now = to_millis(self.clock.now());
        if at - now > MAX_TIMER_SLEEP.as_millis() as i64 {
            return;
        }
        if self
            .waking
            .next
            .as_ref()
            .is_some_and(|(next, _)| *next <= at)
        {
            return;
        }
        if let Some((_, handle)) = self.waking.next.take() {
            ctx.cancel_future(handle);
        }
        let delay = Duration::from_millis((at - now).max(0) as u64);
        let handle = ctx.run_later(delay, |this, ctx| {
            this.waking.next = None;
            this.wake_pass(ctx);
        });
        self.waking.next = Some((at, handle));
    }

    /// A run of one of this supervisor's agents has a wait that is ready: resumed, unless an
    /// execution of it is under way here (the watch's rules for a decision apply).
    fn wake(&mut self, run_id: RunId, ctx: &mut Context<Self>) {
        self.decided(run_id, ctx);
    }

    /// A wait woken elsewhere (an answer, an event, a child's end), heard on the change feed.
    pub(super) fn woken(&mut self, run_id: RunId, agent: &str, ctx: &mut Context<Self>) {
        if self.agents.contains_key(agent) && !self.draining.is_on() {
            self.wake(run_id, ctx);
        }
    }

    /// An execution returned with its run waiting: a timer sets a pass for its time, and a
    /// child run of an agent of this supervisor is executed now (any supervisor with its
    /// agent and recovery would take it up otherwise).
    pub(super) fn waiting_execution_ended(
        &mut self,
        result: &Result<RunReply>,
        ctx: &mut Context<Self>,
    ) {
        let Ok(RunReply {
            outcome: Outcome::Waiting { wait },
            ..
        }) = result
        else {
            return;
        };
        match wait.kind {
            WaitKind::Timer if self.wakes() => {
                if let Some(due) = wait.due_at {
                    self.wake_at(to_millis(due), ctx);
                }
            }
            WaitKind::Child => {
                let agent = wait.detail["agent"].as_str().unwrap_or_default();
                let child = RunId::from(wait.key.as_str());
                // A parent resumed again by a wake-up heard late waits for a child that is
                // under way here already.
                let under_way = self.executing.contains_key(&child) || self.admission.holds(&child);
                if self.agents.contains_key(agent) && !self.draining.is_on() && !under_way {
                    self.start_child(wait.run_id.clone(), child, ctx);
                }
            }
            _ => {}
        }
    }

    /// Executes a child run just inserted by its parent's wait. Its end, which woke the parent
    /// in the same transaction, resumes the parent at once, not at the watch's next poll: a
    /// tree of runs on one supervisor goes from child to parent without waiting. A failure is
    /// left to recovery, here or elsewhere: the child is a RUNNING run nobody holds.
    fn start_child(&mut self, parent: RunId, child: RunId, ctx: &mut Context<Self>) {
        let execution = self.execute(child.clone(), Job::Resume, ctx);
        let ended = execution.into_actor(self).map(move |result, this, ctx| match result {
            Ok(reply) => {
                tracing::debug!(run_id = %child, outcome = ?reply.outcome, "child run returned");
                let finished = matches!(
                    reply.outcome,
                    Outcome::Succeeded { .. } | Outcome::Failed { .. } | Outcome::Cancelled { .. }
                );
                if finished && !this.draining.is_on() {
                    this.wake(parent, ctx);
                }
            }
            Err(err) => {
                tracing::debug!(run_id = %child, %err, "child run stopped; recovery takes it up")
            }
        });
        ctx.spawn(ended);
    }
}

/// Time for a pass over the ready waits; sent by the supervisor's ticker, which holds only a
/// weak address.
#[derive(Message)]
#[rtype(result = "()")]
pub(super) struct WakePass;

impl Handler<WakePass> for Supervisor {
    type Result = ();

    fn handle(&mut self, _: WakePass, ctx: &mut Context<Self>) {
        self.wake_pass(ctx);
    }
}

/// Answers a run's question (its `ask_person` call), as [`Store::answer`] does, stamped by
/// this supervisor's clock. A supervisor with the run's agent that watches the change feed
/// resumes the run.
///
/// [`Store::answer`]: crate::Store::answer
#[derive(Debug, Clone, Message)]
#[rtype(result = "Result<()>")]
pub struct AnswerQuestion(pub Answer);

impl Handler<AnswerQuestion> for Supervisor {
    type Result = actix::ResponseActFuture<Self, Result<()>>;

    fn handle(&mut self, msg: AnswerQuestion, _: &mut Context<Self>) -> Self::Result {
        let answer = crate::store::moves::AnswerQuestion { answer: msg.0 };
        let apply = self
            .store_actor
            .apply(answer, crate::store::backend::Durability::Durable);
        Box::pin(apply.into_actor(self))
    }
}

/// Delivers an event to a run, as [`Store::deliver_event`] does, stamped by this supervisor's
/// clock.
///
/// [`Store::deliver_event`]: crate::Store::deliver_event
#[derive(Debug, Clone, Message)]
#[rtype(result = "Result<Delivered>")]
pub struct DeliverEvent(pub Delivery);

impl Handler<DeliverEvent> for Supervisor {
    type Result = actix::ResponseActFuture<Self, Result<Delivered>>;

    fn handle(&mut self, msg: DeliverEvent, _: &mut Context<Self>) -> Self::Result {
        let delivery = crate::store::moves::DeliverEvent { delivery: msg.0 };
        let apply = self
            .store_actor
            .apply(delivery, crate::store::backend::Durability::Durable);
        Box::pin(apply.into_actor(self))
    }
}
