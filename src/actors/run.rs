//! `RunActor`: executes one run's loop, from the call that started or resumed it until that call
//! returns. Every move goes to the `StoreActor` before and after each side effect.

use std::{
    any::Any,
    cell::RefCell,
    collections::{BTreeMap, HashSet},
    panic::AssertUnwindSafe,
    rc::Rc,
    sync::Arc,
    time::{Duration, Instant},
};

use actix::{
    Actor, ActorContext, ActorFutureExt, Addr, AsyncContext, Context, Handler, Message, Recipient,
    ResponseActFuture, WrapFuture,
};
use futures_util::FutureExt;
use serde_json::Value;
use tracing::Instrument;

use super::{
    lease_keeper::{Hold, LeaseKeeper, LeaseLost, Lost, Release},
    store::{ApplyMove, ReadState, ReleaseLease, StoreActor, StoreHandle},
};
use crate::{
    agent::{Agent, Cancellation, Decision, ModelError, ModelRequest, Reconciliation, ToolContext},
    error::{Error, Result},
    metrics,
    store::{
        backend::{Durability, MoveKind},
        model::{
            Grant, Holder, ModelOutcome, Resolution, RunSnapshot, StepKind, StepRow, StepState,
            ToolDecision, idempotency_key, wall_millis,
        },
        moves::{self, Move},
    },
    types::{
        ApprovalReason, EventKind, FencingToken, LeaseLostReason, Message as ChatMessage,
        ModelResponse, Outcome, PendingCall, RunId, RunReply, RunState, ToolCall, ToolResult,
    },
};

/// The registry a supervisor hands to its runs: agent name to agent.
pub(crate) type Agents = Arc<BTreeMap<String, Arc<Agent>>>;

/// Executes one run; stops when the call it serves returns.
pub(crate) struct RunActor {
    cancellation: Cancellation,
    /// Set when the lease keeper reports this run's lease lost.
    lease_lost: Rc<RefCell<Option<LeaseLostReason>>>,
}

impl RunActor {
    pub(crate) fn new(cancellation: Cancellation) -> Self {
        RunActor {
            cancellation,
            lease_lost: Rc::default(),
        }
    }
}

impl Actor for RunActor {
    type Context = Context<Self>;
}

impl Handler<LeaseLost> for RunActor {
    type Result = ();

    /// The loop stops before its next side effect; the tool running now is told through its
    /// cancellation signal (its outcome is written only if the lease is still held).
    fn handle(&mut self, msg: LeaseLost, _: &mut Context<Self>) {
        *self.lease_lost.borrow_mut() = Some(msg.reason);
        self.cancellation.fire();
    }
}

/// What the call asks of the run.
pub(crate) enum Job {
    /// Insert the run, then execute it. `started`, when given, hears once the insert is
    /// durable: the insert then commits alone and synced, where a call that waits for the
    /// end commits it with the first model reservation.
    Start {
        agent: String,
        input: Value,
        started: Option<tokio::sync::oneshot::Sender<()>>,
    },
    /// Continue a run that waits for approval, or whose executor died.
    Resume,
    /// Execute a run inserted to wait for a slot, now that its turn came: as a resume, except
    /// that a run cancelled while it waited ends the call cancelled (its start's outcome),
    /// not refused.
    Turn,
}

/// Execute the run; the reply is the call's outcome.
#[derive(Message)]
#[rtype(result = "Result<RunReply>")]
pub(crate) struct Execute {
    pub run_id: RunId,
    pub job: Job,
    pub agents: Agents,
    pub store: StoreHandle,
    pub keeper: Addr<LeaseKeeper>,
    pub holder: Holder,
}

impl Handler<Execute> for RunActor {
    type Result = ResponseActFuture<Self, Result<RunReply>>;

    fn handle(&mut self, msg: Execute, ctx: &mut Context<Self>) -> Self::Result {
        // A resumed run's agent is known once the run is read, and recorded then: the field
        // is declared empty so that it is written once either way. So is the execution's
        // kind (start, resume, takeover) and the fencing token it takes.
        let span = tracing::info_span!(
            "run",
            run_id = %msg.run_id,
            agent = tracing::field::Empty,
            execution = tracing::field::Empty,
            owner = %msg.holder.owner,
            fencing_token = tracing::field::Empty,
            otel.name = tracing::field::Empty,
        );
        if let Job::Start { agent, .. } = &msg.job {
            span.record("agent", agent.as_str());
            #[cfg(feature = "otel")]
            span.record("otel.name", format!("invoke_agent {agent}"));
        }
        // A resume or a takeover joins the trace the run's start began.
        #[cfg(feature = "otel")]
        let joins = (!matches!(msg.job, Job::Start { .. }))
            .then(|| (msg.run_id.clone(), msg.store.clone()));
        let env = Env {
            run_id: msg.run_id.clone(),
            store: msg.store.clone(),
            keeper: msg.keeper.clone(),
            grant: Grant::new(msg.holder),
            recipient: ctx.address().recipient(),
            cancellation: self.cancellation.clone(),
            lease_lost: self.lease_lost.clone(),
        };
        let work = async move {
            let (run_id, store, keeper, grant) = (
                env.run_id.clone(),
                env.store.clone(),
                env.keeper.clone(),
                env.grant.clone(),
            );
            // A panic outside the model's and tools' calls (which are caught where they run)
            // still ends the call like an error: the lease is released below.
            let result = AssertUnwindSafe(RunLoop::prepare(msg.job, msg.agents, env))
                .catch_unwind()
                .await
                .unwrap_or_else(|panic| {
                    Err(Error::Panicked {
                        run_id: run_id.clone(),
                        step: 0,
                        what: "the run loop".into(),
                        message: panic_message(panic),
                    })
                });
            // A loss this call found itself is told to the subscribers; one the keeper told
            // them of first gives the call its reason: both hear the same.
            let result = match result {
                Err(Error::LeaseLost { run_id, reason }) => {
                    let lost = Lost {
                        run_id: run_id.clone(),
                        token: grant.token(),
                        reason: reason.clone(),
                    };
                    let reason = keeper.send(lost).await.unwrap_or(reason);
                    Err(Error::LeaseLost { run_id, reason })
                }
                other => other,
            };
            keeper.do_send(Release {
                run_id: run_id.clone(),
            });
            // A call that acquired nothing has nothing to release.
            if result.is_err() && grant.token() != 0 {
                // Paused and finished runs released the lease in their move; any other return
                // releases it here, so another process need not wait out the TTL.
                let released = store
                    .addr()
                    .send(ReleaseLease {
                        run_id: run_id.clone(),
                        owner: grant.holder.owner.clone(),
                        token: grant.token(),
                    })
                    .await;
                if let Ok(Err(err)) | Err(err) = released.map_err(Error::from) {
                    tracing::warn!(%err, "could not release the lease; it will expire");
                }
            }
            if let Ok(outcome) = &result {
                metrics::run_returned(outcome);
            }
            result.map(|outcome| RunReply { run_id, outcome })
        };
        // The parent is set before the span is first entered: it is fixed from then on.
        #[cfg(feature = "otel")]
        let work = async move {
            if let Some((run_id, store)) = &joins {
                join_trace(&span, run_id, store).await;
            }
            work.instrument(span).await
        };
        #[cfg(not(feature = "otel"))]
        let work = work.instrument(span);
        Box::pin(work.into_actor(self).map(|result, _, ctx| {
            ctx.stop();
            result
        }))
    }
}

/// Makes the trace kept in the run's `run.started` the parent of `span`, the span of this
/// execution, and names the span after the run's agent. A run whose start kept no trace
/// leaves `span` the root of a trace of its own; so does a failed read (the execution's own
/// read of the run then reports the error).
#[cfg(feature = "otel")]
async fn join_trace(span: &tracing::Span, run_id: &RunId, store: &StoreHandle) {
    let id = run_id.clone();
    let read = ReadState::new(move |reads| reads.first_event(&id));
    match send(store.addr(), read).await {
        Ok(Some(started)) => {
            if let Some(agent) = started.payload["agent"].as_str() {
                span.record("otel.name", format!("invoke_agent {agent}"));
            }
            crate::trace_context::set_parent(span, &started.payload);
        }
        Ok(None) => {}
        Err(err) => tracing::debug!(%run_id, %err, "could not read the run's trace context"),
    }
}

/// Where the loop goes next.
enum Next {
    Continue,
    Return(Outcome),
}

/// What a loop works with besides the run itself.
struct Env {
    run_id: RunId,
    store: StoreHandle,
    keeper: Addr<LeaseKeeper>,
    /// The lease this call acquires: its token and its deadline.
    grant: Grant,
    recipient: Recipient<LeaseLost>,
    /// Fires on an operator's cancel and on a lost lease: the tool running is told.
    cancellation: Cancellation,
    lease_lost: Rc<RefCell<Option<LeaseLostReason>>>,
}

/// The state of one run's loop, kept in step with what it has committed.
struct RunLoop {
    env: Env,
    run_id: RunId,
    agent: Arc<Agent>,
    input: Value,
    steps: Vec<StepRow>,
    /// What the model sees: built from the finished steps, in order.
    messages: Vec<ChatMessage>,
    /// Every step before this index is finished.
    cursor: usize,
    /// The ids of the run's tool calls, kept unique.
    call_ids: HashSet<String>,
}

/// A move that no side effect precedes: planned (the policy asked, if it is a decision) before
/// the move it follows commits, so that both commit together.
#[derive(Clone)]
enum Planned {
    /// Reserve model step `step`: its request is the next side effect.
    BeginModel { step: u32 },
    /// Reserve the next attempt of model step `step`, whose attempt `attempt` failed.
    BeginAttempt { step: u32, attempt: u32 },
    /// The run reached its step limit.
    Fail { error: String },
    /// Record the policy's decision on pending tool step `step`, and act on it.
    Decide {
        step: u32,
        call: ToolCall,
        decision: ToolDecision,
    },
    /// A call that cannot run at all (an unknown tool, arguments that are not an object).
    Reject {
        step: u32,
        call: ToolCall,
        error: String,
    },
}

impl Planned {
    /// The durability its commit is answered with. A model call's reservation, the next thing
    /// the loop does once it is written, is answered before its sync ([`Durability::Written`]),
    /// which the next commit (the model's answer, before any tool starts) does. The
    /// reservation is still written before the request, under the lease's guard; what a power
    /// loss before that sync undoes (the reservation, and the outcome or the run's insert
    /// committed with it) is what it undid during the reservation's own sync, and a model call
    /// has no external side effect: a power loss that undoes the reservation only means the
    /// model is asked again.
    fn durability(&self) -> Durability {
        match self {
            Planned::BeginModel { .. } | Planned::BeginAttempt { .. } => Durability::Written,
            _ => Durability::Durable,
        }
    }

    /// Whether its move starts a side effect, and so needs the start margin.
    fn starts(&self) -> bool {
        matches!(
            self,
            Planned::BeginModel { .. }
                | Planned::BeginAttempt { .. }
                | Planned::Decide {
                    decision: ToolDecision::Allow { .. },
                    ..
                }
        )
    }
}

impl RunLoop {
    /// Starts or resumes the run (the first move, which takes the lease), then drives it.
    async fn prepare(job: Job, agents: Agents, env: Env) -> Result<Outcome> {
        let find = |name: &str| {
            agents
                .get(name)
                .cloned()
                .ok_or_else(|| Error::UnknownAgent(name.to_owned()))
        };
        let run_id = env.run_id.clone();
        // Where the loop goes after its first move, when it already made its second.
        let mut first_next = Ok(Next::Continue);
        let mut run = match job {
            Job::Start {
                agent,
                input,
                started,
            } => {
                let found = find(&agent)?;
                let (id, name, value, grant) = (
                    run_id.clone(),
                    agent.clone(),
                    input.clone(),
                    env.grant.clone(),
                );
                let trace = crate::trace_context::started();
                let create = ApplyMove::new(MoveKind::CreateRun, &run_id, move |tx, now| {
                    Move::new(tx, now, &id)
                        .traced(trace.as_deref())
                        .create_run(&name, &value, &grant)
                });
                let mut run = RunLoop::new(env, found, input, Vec::new());
                match started {
                    // Answered once durable: the loop plans its first model call after.
                    // A failed insert drops `started`: the caller reads the error from the call.
                    Some(started) => {
                        run.env.store.apply(create, Durability::Durable).await?;
                        let _ = started.send(());
                    }
                    None => {
                        // The first model step's reservation commits with the insert.
                        let next = run.plan();
                        let (_, next) = run.commit_with(create, next, |_| true).await?;
                        first_next = next;
                    }
                }
                run.taken("start");
                tracing::info!(
                    %run_id,
                    agent = %agent,
                    owner = %run.env.grant.holder.owner,
                    fencing_token = run.env.grant.token(),
                    "run started"
                );
                run.hold();
                run
            }
            job @ (Job::Resume | Job::Turn) => {
                let id = run_id.clone();
                let snapshot = send(
                    env.store.addr(),
                    ReadState::new(move |reads| moves::load(reads, &id)),
                )
                .await?;
                tracing::Span::current().record("agent", snapshot.run.agent.as_str());
                let agent = find(&snapshot.run.agent)?;
                match snapshot.run.state {
                    RunState::WaitingForApproval => {
                        let mut run = RunLoop::from_snapshot(&snapshot, agent, env);
                        if let Some(outcome) = run.resume_waiting(&snapshot).await? {
                            // Nothing was decided: it waits as it did.
                            run.ended(&Ok(outcome.clone()));
                            return Ok(outcome);
                        }
                        run
                    }
                    RunState::Running => {
                        let (id, grant) = (run_id.clone(), env.grant.clone());
                        let take = ApplyMove::new(MoveKind::TakeOver, &run_id, move |tx, now| {
                            // Whose lease it was, for the record: none for a run that waited
                            // for a slot, or a fork.
                            let previous = tx.lease_row(&id)?.and_then(|row| row.owner);
                            let (interrupted, _, held) =
                                Move::new(tx, now, &id).take_over(&grant)?;
                            // The steps as the takeover leaves them, read in its transaction:
                            // an owner whose lease lapsed may have written an outcome since
                            // the read above, and that step must not run again.
                            Ok((interrupted.len(), previous, held, moves::load(tx, &id)?))
                        });
                        let (interrupted, previous, held, snapshot) =
                            env.store.apply(take, Durability::Durable).await?;
                        // A run nobody held (a fork, a queued run's turn) is not taken from
                        // anyone.
                        if held {
                            metrics::taken_over();
                        }
                        let run = RunLoop::from_snapshot(&snapshot, agent, env);
                        run.hold();
                        run.taken("takeover");
                        tracing::info!(
                            %run_id,
                            previous_owner = %previous.as_deref().unwrap_or("none"),
                            owner = %run.env.grant.holder.owner,
                            fencing_token = run.env.grant.token(),
                            interrupted,
                            "run taken over"
                        );
                        run
                    }
                    RunState::Cancelled if matches!(job, Job::Turn) => {
                        return Ok(Outcome::Cancelled {
                            reason: snapshot.run.error.unwrap_or_default(),
                        });
                    }
                    state => {
                        return Err(Error::RunState {
                            run_id,
                            state,
                            reason: "a finished run cannot be resumed".into(),
                        });
                    }
                }
            }
        };
        let result = match first_next {
            Ok(Next::Continue) => run.drive().await,
            Ok(Next::Return(outcome)) => Ok(outcome),
            Err(err) => Err(err),
        };
        let result = match result {
            // An operator cancelled the run: the loop stops at its next write.
            Err(Error::RunState {
                state: RunState::Cancelled,
                ..
            }) => run.cancelled().await,
            // Another owner took the run over while this loop was between writes.
            Err(Error::RunLeased { run_id, owner, .. }) => Err(Error::LeaseLost {
                run_id,
                reason: LeaseLostReason::TakenBy(owner),
            }),
            other => other,
        };
        run.ended(&result);
        result
    }

    /// Records on this execution's span how it took the lease, and with which fencing token.
    fn taken(&self, execution: &str) {
        let span = tracing::Span::current();
        span.record("execution", execution);
        // Signed: an OpenTelemetry layer keeps unsigned integers as text.
        span.record("fencing_token", self.env.grant.token() as i64);
    }

    /// Logs where this execution left the run, for an operator: waiting for an approval,
    /// finished, failed, cancelled, or stopped by an error. A lost lease is logged where it is
    /// found.
    fn ended(&self, result: &Result<Outcome>) {
        let (run_id, steps) = (&self.run_id, self.steps.len());
        match result {
            Ok(Outcome::WaitingForApproval { pending }) => tracing::info!(
                %run_id,
                step = pending.step,
                call_id = %pending.call_id,
                tool = %pending.tool,
                reason = %pending.reason.as_str(),
                "run waiting for approval"
            ),
            Ok(Outcome::Succeeded { .. }) => {
                tracing::info!(%run_id, state = %RunState::Succeeded, steps, "run finished")
            }
            Ok(Outcome::Failed { error }) => {
                tracing::info!(%run_id, state = %RunState::Failed, steps, %error, "run failed")
            }
            Ok(Outcome::Cancelled { reason }) => {
                tracing::info!(%run_id, state = %RunState::Cancelled, steps, %reason, "run finished")
            }
            Err(Error::LeaseLost { .. }) => {}
            // It stays RUNNING, for a resume or another process's recovery.
            Err(err) => tracing::warn!(%run_id, steps, error = %err, "run stopped"),
        }
    }

    /// Asks the keeper to renew the lease just taken.
    fn hold(&self) {
        let recipient = self.env.recipient.clone();
        self.env.keeper.do_send(Hold {
            run_id: self.run_id.clone(),
            grant: self.env.grant.clone(),
            recipient,
        });
    }

    /// The loop learnt its lease was lost: the call ends cancelled if an operator cancelled
    /// the run, with `LeaseLost` otherwise.
    async fn stopped(&self) -> Result<Outcome> {
        let run = self.read_run().await?;
        if run.state == RunState::Cancelled {
            return Ok(Outcome::Cancelled {
                reason: run.error.unwrap_or_default(),
            });
        }
        let reason = self
            .env
            .lease_lost
            .borrow()
            .clone()
            .unwrap_or(LeaseLostReason::Expired);
        Err(Error::LeaseLost {
            run_id: self.run_id.clone(),
            reason,
        })
    }

    async fn read_run(&self) -> Result<crate::types::Run> {
        let id = self.run_id.clone();
        send(
            self.env.store.addr(),
            ReadState::new(move |reads| moves::run(reads, &id)),
        )
        .await
    }

    fn new(env: Env, agent: Arc<Agent>, input: Value, steps: Vec<StepRow>) -> Self {
        let run_id = env.run_id.clone();
        let messages = agent.opening(&input);
        let mut run = RunLoop {
            env,
            run_id,
            agent,
            input,
            steps: Vec::new(),
            messages,
            cursor: 0,
            call_ids: HashSet::new(),
        };
        for step in steps {
            run.push_step(step);
        }
        run
    }

    fn from_snapshot(snapshot: &RunSnapshot, agent: Arc<Agent>, env: Env) -> Self {
        RunLoop::new(
            env,
            agent,
            snapshot.run.input.clone(),
            snapshot.steps.clone(),
        )
    }

    /// Adds a step; a finished one joins the conversation.
    fn push_step(&mut self, step: StepRow) {
        if let Some(call) = &step.call {
            self.call_ids.insert(call.id.clone());
        }
        self.steps.push(step);
        self.on_finished(self.steps.len() - 1);
    }

    /// Brings the conversation up to date with step `index` if it is finished.
    fn on_finished(&mut self, index: usize) {
        let step = &self.steps[index];
        if step.state != StepState::Finished {
            return;
        }
        let message = match (step.kind, &step.call, &step.result) {
            (StepKind::Model, _, Some(result)) => {
                serde_json::from_value::<ModelResponse>(result.clone())
                    .ok()
                    .map(ChatMessage::Assistant)
            }
            (StepKind::Tool, Some(call), Some(result)) => {
                serde_json::from_value::<ToolResult>(result.clone())
                    .ok()
                    .map(|result| ChatMessage::Tool {
                        call_id: call.id.clone(),
                        name: call.name.clone(),
                        result,
                    })
            }
            _ => None,
        };
        self.messages.extend(message);
    }

    fn index_of(&self, step: u32) -> usize {
        // Steps are numbered from 1 without gaps, and kept in order.
        let index = step as usize - 1;
        debug_assert_eq!(self.steps[index].step, step);
        index
    }

    /// Sets a step's state (and attempt), folding a finished step into the conversation.
    fn set_step(&mut self, step: u32, state: StepState, attempt: u32, result: Option<Value>) {
        let index = self.index_of(step);
        let row = &mut self.steps[index];
        row.state = state;
        row.attempt = attempt;
        if result.is_some() {
            row.result = result;
        }
        self.on_finished(index);
    }

    /// A move of this run's loop, under its lease.
    fn move_of<R: Send + 'static>(
        &self,
        kind: MoveKind,
        mut apply: impl FnMut(&mut Move<'_, '_>, &Grant) -> Result<R> + Send + 'static,
    ) -> ApplyMove<R> {
        let (run_id, grant) = (self.run_id.clone(), self.env.grant.clone());
        ApplyMove::new(kind, &self.run_id, move |tx, now| {
            apply(&mut Move::new(tx, now, &run_id), &grant)
        })
    }

    /// Commits one move of this run's loop on its own.
    async fn apply<R: Send + 'static>(
        &self,
        kind: MoveKind,
        apply: impl FnMut(&mut Move<'_, '_>, &Grant) -> Result<R> + Send + 'static,
    ) -> Result<R> {
        self.env
            .store
            .apply(self.move_of(kind, apply), Durability::Durable)
            .await
    }

    /// The cancellation signal fired during a model call (which is dropped, not awaited: it has
    /// no side effect): an operator's cancel, or a lost lease.
    async fn interrupted_by_signal(&self) -> Result<Next> {
        if self.env.lease_lost.borrow().is_some() {
            return self.stopped().await.map(Next::Return);
        }
        self.cancelled().await.map(Next::Return)
    }

    /// The outcome of a run an operator cancelled.
    async fn cancelled(&self) -> Result<Outcome> {
        let run = self.read_run().await?;
        Ok(Outcome::Cancelled {
            reason: run.error.unwrap_or_default(),
        })
    }

    /// Waits until the lease has the start margin left by its deadline: at once when it has,
    /// else for the renewals that give it back. `LeaseLost` when the deadline passes first;
    /// returns early when the keeper reports the lease lost (the loop then stops).
    async fn wait_for_margin(&self) -> Result<()> {
        loop {
            let seen = self.env.grant.renewals();
            if self.env.grant.has_margin() || self.env.cancellation.is_cancelled() {
                return Ok(());
            }
            self.wait_for_renewal(seen).await?;
        }
    }

    /// Waits for a renewal after the `seen`-th (at once if one came already); `LeaseLost` when
    /// the deadline passes first. Returns early when the cancellation signal fires.
    async fn wait_for_renewal(&self, seen: u64) -> Result<()> {
        let grant = &self.env.grant;
        let renewal = grant.renewal();
        let mut renewal = std::pin::pin!(renewal);
        renewal.as_mut().enable();
        if grant.renewed_since(seen) || self.env.cancellation.is_cancelled() {
            return Ok(());
        }
        let left = grant.remaining();
        if left.is_zero() {
            return Err(Error::LeaseLost {
                run_id: self.run_id.clone(),
                reason: LeaseLostReason::Expired,
            });
        }
        tracing::debug!(?left, "short of the start margin; waiting for a renewal");
        futures_util::select_biased! {
            () = renewal.fuse() => Ok(()),
            () = self.env.cancellation.cancelled().fuse() => Ok(()),
            () = actix_rt::time::sleep(left).fuse() => Ok(()),
        }
    }

    /// A start's result: `None` when it was refused for want of the margin (see
    /// [`short_of_margin`](Self::short_of_margin)), once the next renewal came: the loop then
    /// plans it again.
    async fn unless_short<T>(&self, started: Result<T>) -> Result<Option<T>> {
        let seen = self.env.grant.renewals();
        match started {
            Err(err) if self.short_of_margin(&err) => {
                self.wait_for_renewal(seen).await.map(|()| None)
            }
            started => started.map(Some),
        }
    }

    /// Whether a start was refused for want of the margin while the lease is still held by its
    /// deadline: the margin ran short, or the stored expiry disagrees (the wall clock moved).
    /// The loop waits for a renewal, which gives the margin back or finds the lease lost.
    fn short_of_margin(&self, err: &Error) -> bool {
        matches!(
            err,
            Error::LeaseLost {
                reason: LeaseLostReason::Expired,
                ..
            }
        ) && !self.env.cancellation.is_cancelled()
            && !self.env.grant.remaining().is_zero()
    }

    /// Executes steps until the run pauses or finishes.
    async fn drive(&mut self) -> Result<Outcome> {
        loop {
            // A lost lease stops the loop before its next move: nothing more starts.
            if self.env.lease_lost.borrow().is_some() {
                return self.stopped().await;
            }
            let next = match self.plan() {
                Err(err) => return Err(err),
                Ok(Some(planned)) => {
                    if planned.starts() {
                        self.wait_for_margin().await?;
                    }
                    let mv = self.planned_move(&planned);
                    let applied = self.env.store.apply(mv, planned.durability()).await;
                    match self.unless_short(applied).await? {
                        Some(()) => self.after_planned(planned)?,
                        None => Next::Continue,
                    }
                }
                Ok(None) => {
                    let step = self.steps[self.cursor].clone();
                    match (step.kind, step.state) {
                        (StepKind::Model, StepState::InFlight) => {
                            self.call_model(step.step, step.attempt).await?
                        }
                        (StepKind::Tool, StepState::InFlight) => self.call_tool(&step).await?,
                        (_, StepState::Interrupted) => self.reconcile(&step).await?,
                        (kind, state) => {
                            return Err(Error::Corrupt(format!(
                                "run {} is RUNNING with {kind:?} step {} {state:?}",
                                self.run_id, step.step
                            )));
                        }
                    }
                }
            };
            if let Next::Return(outcome) = next {
                return Ok(outcome);
            }
        }
    }

    /// The next move when no side effect comes before it: reserving the next model step (or
    /// failing the run at its step limit), or deciding the next pending tool call (the policy
    /// is asked now). `None` when the next step is a side effect (a call in flight) or a
    /// reconciliation.
    fn plan(&mut self) -> Result<Option<Planned>> {
        // Finished steps stay finished: start the search where the last one left off.
        while self
            .steps
            .get(self.cursor)
            .is_some_and(|s| s.state == StepState::Finished)
        {
            self.cursor += 1;
        }
        let Some(step) = self.steps.get(self.cursor) else {
            let step = self.steps.len() as u32 + 1;
            if step > self.agent.max_steps {
                let error = format!(
                    "the run reached its limit of {} steps without a final answer",
                    self.agent.max_steps
                );
                return Ok(Some(Planned::Fail { error }));
            }
            return Ok(Some(Planned::BeginModel { step }));
        };
        if (step.kind, step.state) == (StepKind::Model, StepState::Pending) {
            return Ok(Some(Planned::BeginAttempt {
                step: step.step,
                attempt: step.attempt,
            }));
        }
        if (step.kind, step.state) != (StepKind::Tool, StepState::Pending) {
            return Ok(None);
        }
        let call = step.call.clone().expect("tool steps have a call");
        let number = step.step;
        let rejection = match self.agent.tools.get(&call.name) {
            None => Some(format!("the agent has no tool named {:?}", call.name)),
            // A string: what a model adapter keeps of arguments that were not JSON.
            Some(_) if call.args.is_string() => {
                let raw = call.args.as_str().unwrap_or_default();
                Some(match serde_json::from_str::<Value>(raw) {
                    Ok(_) => format!(
                        "the arguments of a tool call must be a JSON object, not a string \
                         holding JSON: {}",
                        crate::agent::shortened(raw)
                    ),
                    Err(_) => format!(
                        "the arguments of a tool call must be a JSON object; these are not \
                         JSON: {}",
                        crate::agent::shortened(raw)
                    ),
                })
            }
            Some(_) if !call.args.is_object() => Some(format!(
                "the arguments of a tool call must be a JSON object, not {}",
                crate::agent::shortened(&call.args.to_string())
            )),
            Some(tool) => tool.refuse(&call.args),
        };
        if let Some(error) = rejection {
            return Ok(Some(Planned::Reject {
                step: number,
                call,
                error,
            }));
        }
        let policy = self.agent.policy.clone();
        let decision =
            std::panic::catch_unwind(AssertUnwindSafe(|| policy.decide(&self.run_id, &call)))
                .map_err(|panic| self.panicked(number, "the policy".into(), panic))?;
        let decision = match decision {
            Decision::Allow => ToolDecision::Allow {
                reason: None,
                by: None,
                note: None,
            },
            Decision::Deny(reason) => ToolDecision::Deny {
                reason,
                by: None,
                note: None,
            },
            Decision::RequireApproval(reason) => ToolDecision::RequireApproval { reason },
        };
        Ok(Some(Planned::Decide {
            step: number,
            call,
            decision,
        }))
    }

    /// The move that carries out `planned`, under the run's lease.
    fn planned_move(&self, planned: &Planned) -> ApplyMove<()> {
        match planned.clone() {
            Planned::BeginModel { step } => self
                .move_of(MoveKind::BeginModelStep, move |m, grant| {
                    m.begin_model_step(grant, step)
                }),
            Planned::BeginAttempt { step, attempt } => self
                .move_of(MoveKind::BeginModelAttempt, move |m, grant| {
                    m.begin_model_attempt(grant, step, attempt)
                }),
            Planned::Fail { error } => {
                self.move_of(MoveKind::FailRun, move |m, grant| m.fail_run(grant, &error))
            }
            Planned::Decide {
                step,
                call,
                decision,
            } => self.move_of(MoveKind::DecideTool, move |m, grant| {
                m.decide_tool(grant, step, &call, &decision)
            }),
            Planned::Reject { step, call, error } => self
                .move_of(MoveKind::RejectTool, move |m, grant| {
                    m.reject_tool(grant, step, &call, &error)
                }),
        }
    }

    /// Brings the loop in step with a committed planned move.
    fn after_planned(&mut self, planned: Planned) -> Result<Next> {
        match planned {
            Planned::BeginModel { step } => {
                self.push_step(StepRow {
                    step,
                    kind: StepKind::Model,
                    state: StepState::InFlight,
                    attempt: 1,
                    call: None,
                    result: None,
                    waiting_for: None,
                });
                Ok(Next::Continue)
            }
            Planned::BeginAttempt { step, attempt } => {
                self.set_step(step, StepState::InFlight, attempt + 1, None);
                Ok(Next::Continue)
            }
            Planned::Fail { error } => Ok(Next::Return(Outcome::Failed { error })),
            Planned::Decide {
                step,
                call,
                decision,
            } => self.after_decision(step, 0, call, decision, ApprovalReason::Policy),
            Planned::Reject { step, error, .. } => {
                let result = serde_json::to_value(ToolResult::Error(error)).unwrap();
                self.set_step(step, StepState::Finished, 0, Some(result));
                Ok(Next::Continue)
            }
        }
    }

    /// Commits `first`, the move that ends a side effect, in one transaction with the move
    /// that follows it when that one is planned (`next`, which the loop has already folded
    /// into its state as if `first` committed): no side effect lies between them, so the
    /// run pays one commit for both. When that move reserves a model call, the loop goes on
    /// once they are written, and the answer's commit makes them durable (see
    /// [`Planned::durability`]). The planned move is not attempted when `proceed`
    /// says no of `first`'s result (the caller then acts on that result). Returns `first`'s
    /// result and where the loop goes next: `Err` if the planned move could not be planned or
    /// was refused.
    async fn commit_with<A: Send + 'static>(
        &mut self,
        first: ApplyMove<A>,
        next: Result<Option<Planned>>,
        proceed: fn(&A) -> bool,
    ) -> Result<(A, Result<Next>)> {
        match next {
            // A start short of the margin is not paired: the loop waits for it after `first`.
            // (Before the lease is acquired, `first` is the acquisition: the margin is judged in
            // the transaction, after it.)
            Ok(Some(planned))
                if !planned.starts()
                    || self.env.grant.token() == 0
                    || self.env.grant.has_margin() =>
            {
                let then = self.planned_move(&planned);
                let durability = planned.durability();
                let store = &self.env.store;
                let (value, then) = store.apply_then(first, then, proceed, durability).await?;
                let next = match then {
                    // Planned again by the loop, which waits for the margin first (after a
                    // start's first move, the lease is renewed by then).
                    Some(Err(err)) if self.short_of_margin(&err) => Ok(Next::Continue),
                    Some(then) => then.and_then(|()| self.after_planned(planned)),
                    None => Ok(Next::Continue),
                };
                Ok((value, next))
            }
            Ok(_) => Ok((
                self.env.store.apply(first, Durability::Durable).await?,
                Ok(Next::Continue),
            )),
            // A panicking policy: `first` is still recorded, then the call ends.
            Err(err) => Ok((
                self.env.store.apply(first, Durability::Durable).await?,
                Err(err),
            )),
        }
    }

    /// Dispatches attempt `attempt` of model step `step` (already reserved) and records what
    /// came of it: the answer, with the move that follows it; a failure the model policy
    /// tries again, then the next attempt's reservation; or the failure of the run.
    async fn call_model(&mut self, step: u32, attempt: u32) -> Result<Next> {
        // Signed: an OpenTelemetry layer keeps unsigned integers as text.
        let span = tracing::info_span!(
            "model",
            step = i64::from(step),
            attempt = i64::from(attempt),
            otel.name = tracing::field::Empty,
        );
        #[cfg(feature = "otel")]
        span.record("otel.name", "chat");
        let request = ModelRequest {
            run_id: &self.run_id,
            step,
            attempt,
            input: &self.input,
            messages: &self.messages,
            tools: &self.agent.specs,
        };
        let policy = &self.agent.model_policy;
        let answer = AssertUnwindSafe(self.agent.model.complete(request))
            .catch_unwind()
            .instrument(span);
        let timeout = async {
            match policy.attempt_timeout() {
                Some(limit) => actix_rt::time::sleep(limit).await,
                None => std::future::pending().await,
            }
        };
        let dispatched = Instant::now();
        // A model call has no side effect: on cancel or timeout it is dropped, not awaited.
        let answer = futures_util::select_biased! {
            answer = answer.fuse() => answer,
            _ = self.env.cancellation.cancelled().fuse() => return self.interrupted_by_signal().await,
            () = timeout.fuse() => Ok(Err(ModelError::retryable(format!(
                "no answer within {} s",
                policy.attempt_timeout().unwrap_or_default().as_secs_f64()
            )))),
        };
        metrics::step_took(StepKind::Model, dispatched.elapsed());
        let answer = answer.map_err(|panic| self.panicked(step, "the model".into(), panic))?;
        let mut response = match answer {
            Ok(response) => response,
            Err(error) => return self.model_failed(step, attempt, error).await,
        };
        metrics::model_used(response.usage);
        self.make_call_ids_unique(step, &mut response);
        let stored_json = serde_json::to_value(&response).expect("a response serializes");
        let created: Vec<StepRow> = response
            .tool_calls
            .iter()
            .zip(step + 1..)
            .map(|(call, number)| StepRow {
                step: number,
                kind: StepKind::Tool,
                state: StepState::Pending,
                attempt: 0,
                call: Some(call.clone()),
                result: None,
                waiting_for: None,
            })
            .collect();
        let output = response.text.clone().unwrap_or_default();
        let outcome = ModelOutcome::Answered {
            response,
            recorded: stored_json.clone(),
        };
        let first = self.move_of(MoveKind::FinishModelStep, move |m, grant| {
            m.finish_model_step(grant, step, attempt, &outcome)
        });
        self.set_step(step, StepState::Finished, attempt, Some(stored_json));
        if created.is_empty() {
            self.env.store.apply(first, Durability::Durable).await?;
            return Ok(Next::Return(Outcome::Succeeded { output }));
        }
        for row in created {
            self.push_step(row);
        }
        // The first call's decision (and start) commits with the answer.
        let next = self.plan();
        let ((), next) = self.commit_with(first, next, |_| true).await?;
        next
    }

    /// Attempt `attempt` of model step `step` failed: records it and reserves the next
    /// attempt after the policy's backoff, or fails the run when the policy gives up.
    async fn model_failed(&mut self, step: u32, attempt: u32, error: ModelError) -> Result<Next> {
        let message = error.message().to_owned();
        let next = if error.is_retryable() {
            let unit = rand::random::<f64>();
            self.agent
                .model_policy
                .next_attempt(attempt, error.retry_after_hint(), unit)
        } else {
            Err(None)
        };
        let retry_in = match next {
            Ok(retry_in) => retry_in,
            Err(refused) => {
                let message = match refused {
                    Some(why) => format!("{message} ({why})"),
                    None => message,
                };
                tracing::warn!(step, attempt, error = %message, "the model failed");
                let outcome = ModelOutcome::Failed {
                    error: message.clone(),
                    attempts: attempt,
                };
                self.apply(MoveKind::FinishModelStep, move |m, grant| {
                    m.finish_model_step(grant, step, attempt, &outcome)
                })
                .await?;
                return Ok(Next::Return(Outcome::Failed {
                    error: moves::model_failure(&message, attempt),
                }));
            }
        };
        tracing::info!(step, attempt, error = %message, ?retry_in, "a model attempt failed; trying again");
        let failed = message.clone();
        self.apply(MoveKind::FailModelAttempt, move |m, grant| {
            m.fail_model_attempt(grant, step, attempt, &failed, retry_in)
        })
        .await?;
        if let Some(stopped) = self.back_off(retry_in).await {
            return stopped;
        }
        // Planned as the next move: the loop reserves the next attempt with the start margin.
        // (Stored, the step stays in flight until then.)
        self.set_step(step, StepState::Pending, attempt, None);
        Ok(Next::Continue)
    }

    /// Waits `wait` before a model call's next attempt; `Some` when the cancellation signal
    /// (an operator's cancel, a lost lease) ended the wait, with where the loop goes then.
    async fn back_off(&self, wait: Duration) -> Option<Result<Next>> {
        futures_util::select_biased! {
            _ = self.env.cancellation.cancelled().fuse() => Some(self.interrupted_by_signal().await),
            () = actix_rt::time::sleep(wait).fuse() => None,
        }
    }

    /// Call ids address approvals: they are kept unique within the run. An empty id, or one
    /// an earlier call of the run (or of this response) took, becomes `call-STEP`.
    fn make_call_ids_unique(&mut self, step: u32, response: &mut ModelResponse) {
        for (call, number) in response.tool_calls.iter_mut().zip(step + 1..) {
            if call.id.is_empty() || self.call_ids.contains(&call.id) {
                call.id = format!("call-{number}");
                // Only a model that itself answers with ids like ours gets here.
                let mut suffix = 1;
                while self.call_ids.contains(&call.id) {
                    suffix += 1;
                    call.id = format!("call-{number}-{suffix}");
                }
            }
            self.call_ids.insert(call.id.clone());
        }
    }

    /// Brings the loop in step with a recorded decision.
    fn after_decision(
        &mut self,
        step: u32,
        attempt: u32,
        call: ToolCall,
        decision: ToolDecision,
        reason: ApprovalReason,
    ) -> Result<Next> {
        match decision {
            ToolDecision::Allow { .. } => {
                self.set_step(step, StepState::InFlight, attempt + 1, None);
                Ok(Next::Continue)
            }
            ToolDecision::Deny { reason, note, .. } => {
                let denial = ToolDecision::denial(&reason, note.as_deref());
                let result = serde_json::to_value(ToolResult::Error(denial)).unwrap();
                self.set_step(step, StepState::Finished, attempt, Some(result));
                Ok(Next::Continue)
            }
            ToolDecision::RequireApproval { .. } => Ok(Next::Return(Outcome::WaitingForApproval {
                pending: PendingCall {
                    step,
                    call_id: call.id,
                    tool: call.name,
                    args: call.args,
                    reason,
                },
            })),
        }
    }

    fn tool_context(&self, step: u32, call: &ToolCall, attempt: u32) -> ToolContext {
        ToolContext {
            run_id: self.run_id.clone(),
            step,
            call_id: call.id.clone(),
            attempt,
            idempotency_key: idempotency_key(&self.run_id, step),
            fencing_token: FencingToken::new(self.env.grant.token()),
            cancellation: self.env.cancellation.clone(),
        }
    }

    /// Runs a started tool call and records its outcome, with the move that follows it.
    async fn call_tool(&mut self, step: &StepRow) -> Result<Next> {
        let call = step.call.clone().expect("tool steps have a call");
        let (number, attempt) = (step.step, step.attempt);
        // The start was written under the lease, but its answer came back after the deadline
        // (the process stalled, or the network held the answer up): by now another process may
        // have taken the run over. The call is not made; the takeover reconciles the step.
        if self.env.grant.remaining().is_zero() {
            tracing::warn!(step = number, tool = %call.name, "the lease expired before the tool could start");
            return Err(Error::LeaseLost {
                run_id: self.run_id.clone(),
                reason: LeaseLostReason::Expired,
            });
        }
        let span = tracing::info_span!(
            "tool",
            step = i64::from(number),
            tool = %call.name,
            call_id = %call.id,
            attempt = i64::from(attempt),
            fencing_token = self.env.grant.token() as i64,
            otel.name = tracing::field::Empty,
        );
        #[cfg(feature = "otel")]
        span.record("otel.name", format!("execute_tool {}", call.name));
        let result = match self.agent.tools.get(&call.name).map(|t| t.tool.clone()) {
            // The agent was registered again without this tool since the call started.
            None => {
                metrics::tool_failed();
                ToolResult::Error(format!("the agent has no tool named {:?}", call.name))
            }
            Some(tool) => {
                let ctx = self.tool_context(number, &call, attempt);
                let started = Instant::now();
                // Cancellation is the tool's to honour: its outcome is awaited and recorded.
                let outcome = AssertUnwindSafe(tool.call(&ctx, &call.args))
                    .catch_unwind()
                    .instrument(span)
                    .await;
                metrics::step_took(StepKind::Tool, started.elapsed());
                if !matches!(outcome, Ok(Ok(_))) {
                    metrics::tool_failed();
                }
                match outcome
                    .map_err(|panic| self.panicked(number, format!("tool {}", call.name), panic))?
                {
                    Ok(output) => ToolResult::Ok(output),
                    Err(error) => ToolResult::Error(error.0),
                }
            }
        };
        let result_json = serde_json::to_value(&result).unwrap();
        let (call_id, recorded) = (call.id, result_json.clone());
        let first = self.move_of(MoveKind::FinishTool, move |m, grant| {
            m.finish_tool(grant, number, attempt, &call_id, &result, &recorded)
        });
        self.set_step(number, StepState::Finished, attempt, Some(result_json));
        // A lost lease or an operator's cancel (both fire the signal) plans nothing more: the
        // outcome alone is offered.
        let next = if self.env.cancellation.is_cancelled() {
            Ok(None)
        } else {
            self.plan()
        };
        // A late outcome (an operator cancelled the run) is followed by nothing.
        let (late, next) = self.commit_with(first, next, |late| !late).await?;
        if late {
            return self.cancelled().await.map(Next::Return);
        }
        next
    }

    /// Reconciles an interrupted step, exactly once: the decision and what it leads to are one
    /// move.
    async fn reconcile(&mut self, step: &StepRow) -> Result<Next> {
        let (number, attempt) = (step.step, step.attempt);
        let Some(call) = step.call.clone() else {
            return self.reconcile_model(number, attempt).await;
        };
        let tool = self.agent.tools.get(&call.name).map(|t| t.tool.clone());
        let answer = match &tool {
            Some(tool) => {
                let ctx = self.tool_context(number, &call, attempt);
                AssertUnwindSafe(tool.reconcile(&ctx, &call.args))
                    .catch_unwind()
                    .await
                    .map_err(|panic| {
                        self.panicked(
                            number,
                            format!("the reconcile hook of tool {}", call.name),
                            panic,
                        )
                    })?
            }
            None => None,
        };
        let idempotent = tool.as_ref().is_some_and(|tool| tool.idempotent());
        let unknown = |outcome| {
            if idempotent {
                Resolution::Retry { outcome }
            } else {
                Resolution::AwaitApproval { outcome }
            }
        };
        let resolution = match answer {
            Some(Reconciliation::Applied(output)) => Resolution::Applied(output),
            Some(Reconciliation::NotApplied) => Resolution::Retry {
                outcome: "not_applied",
            },
            Some(Reconciliation::Unknown) => unknown("unknown"),
            None => unknown("no_hook"),
        };
        tracing::info!(
            step = number,
            ?resolution,
            "reconciling an interrupted step"
        );
        if matches!(resolution, Resolution::Retry { .. }) {
            self.wait_for_margin().await?;
        }
        let (c, r) = (call.clone(), resolution.clone());
        let reconciled = self
            .apply(MoveKind::Reconcile, move |m, grant| {
                m.reconcile(grant, number, attempt, Some(&c), &r)
            })
            .await;
        // The hook is asked again once a renewal gave the margin back.
        if self.unless_short(reconciled).await?.is_none() {
            return Ok(Next::Continue);
        }
        match resolution {
            Resolution::Applied(output) => {
                let result = serde_json::to_value(ToolResult::Ok(output)).unwrap();
                self.set_step(number, StepState::Finished, attempt, Some(result));
                Ok(Next::Continue)
            }
            Resolution::Retry { .. }
            | Resolution::Redispatch { .. }
            | Resolution::GiveUp { .. } => {
                self.set_step(number, StepState::InFlight, attempt + 1, None);
                Ok(Next::Continue)
            }
            Resolution::AwaitApproval { .. } => {
                let decision = ToolDecision::RequireApproval {
                    reason: String::new(),
                };
                self.after_decision(number, attempt, call, decision, ApprovalReason::Reconcile)
            }
        }
    }

    /// Reconciles an interrupted model step: dispatched again as its next attempt, once what
    /// is left of a failed attempt's backoff has passed; or, when that attempt was the last
    /// the model policy allows, the run fails.
    async fn reconcile_model(&mut self, number: u32, attempt: u32) -> Result<Next> {
        let id = self.run_id.clone();
        let last = send(
            self.env.store.addr(),
            ReadState::new(move |reads| {
                // The takeover marked the step interrupted: what came before says what it was
                // doing.
                let events = reads.events_after(&id, 0)?;
                Ok(events
                    .into_iter()
                    .rfind(|e| e.step == Some(number) && e.kind != EventKind::StepInterrupted))
            }),
        )
        .await?;
        let failed = last.filter(|e| e.kind == EventKind::ModelAttemptFailed);
        let outcome = if failed.is_some() {
            "attempt_failed"
        } else {
            "model_call"
        };
        let policy = &self.agent.model_policy;
        let resolution = if attempt >= policy.max_attempts_allowed() {
            let error = match failed.as_ref().and_then(|e| e.payload["error"].as_str()) {
                Some(error) => error.to_owned(),
                None => format!(
                    "attempt {attempt}, the last the model policy allows, was cut off before it \
                     answered"
                ),
            };
            Resolution::GiveUp { outcome, error }
        } else {
            let retry_at = failed.as_ref().and_then(|e| e.payload["retry_at"].as_i64());
            if let Some(left) = retry_at
                .map(|at| at - wall_millis())
                .filter(|&left| left > 0)
            {
                // A wall clock far ahead where the failure was written waits no longer than
                // the policy would have.
                let left = Duration::from_millis(left as u64).min(policy.longest_wait());
                if let Some(stopped) = self.back_off(left).await {
                    return stopped;
                }
            }
            self.wait_for_margin().await?;
            Resolution::Redispatch { outcome }
        };
        tracing::info!(
            step = number,
            ?resolution,
            "reconciling an interrupted model step"
        );
        let r = resolution.clone();
        let reconciled = self
            .apply(MoveKind::Reconcile, move |m, grant| {
                m.reconcile(grant, number, attempt, None, &r)
            })
            .await;
        if self.unless_short(reconciled).await?.is_none() {
            return Ok(Next::Continue);
        }
        match resolution {
            Resolution::GiveUp { error, .. } => Ok(Next::Return(Outcome::Failed {
                error: moves::model_failure(&error, attempt),
            })),
            _ => {
                self.set_step(number, StepState::InFlight, attempt + 1, None);
                Ok(Next::Continue)
            }
        }
    }

    /// Resumes a run that waits for an approval: the resume-time decision and what it leads to
    /// are one move. `Some` when the run still waits (and nothing was changed).
    async fn resume_waiting(&mut self, snapshot: &RunSnapshot) -> Result<Option<Outcome>> {
        let waiting = snapshot
            .steps
            .iter()
            .find(|s| s.state == StepState::Waiting)
            .cloned()
            .ok_or_else(|| {
                Error::Corrupt(format!(
                    "run {} waits for approval with no waiting step",
                    self.run_id
                ))
            })?;
        let call = waiting.call.clone().expect("only tool steps wait");
        let reason = waiting.waiting_for.unwrap_or(ApprovalReason::Policy);
        let from_approval = || match &snapshot.approval {
            Some(a) if a.approved => Some(ToolDecision::Allow {
                reason: None,
                by: Some(a.by.clone()),
                note: a.note.clone(),
            }),
            Some(a) => Some(ToolDecision::Deny {
                reason: format!("denied by {}", a.by),
                by: Some(a.by.clone()),
                note: a.note.clone(),
            }),
            None => None,
        };
        // The policy is asked again (it may have changed); an approval settles what it leaves open.
        let policy_decision = match reason {
            ApprovalReason::Policy => {
                let policy = self.agent.policy.clone();
                Some(
                    std::panic::catch_unwind(AssertUnwindSafe(|| {
                        policy.decide(&self.run_id, &call)
                    }))
                    .map_err(|panic| self.panicked(waiting.step, "the policy".into(), panic))?,
                )
            }
            ApprovalReason::Reconcile => None,
        };
        let (decision, source) = match policy_decision {
            Some(Decision::Allow) => (
                Some(ToolDecision::Allow {
                    reason: None,
                    by: None,
                    note: None,
                }),
                "policy",
            ),
            Some(Decision::Deny(reason)) => (
                Some(ToolDecision::Deny {
                    reason,
                    by: None,
                    note: None,
                }),
                "policy",
            ),
            Some(Decision::RequireApproval(_)) | None => (from_approval(), "approval"),
        };
        let Some(decision) = decision else {
            return Ok(Some(Outcome::WaitingForApproval {
                pending: PendingCall {
                    step: waiting.step,
                    call_id: call.id,
                    tool: call.name,
                    args: call.args,
                    reason,
                },
            }));
        };
        let (number, attempt) = (waiting.step, waiting.attempt);
        let (c, d) = (call.clone(), decision.clone());
        self.apply(MoveKind::ResumeWaiting, move |m, grant| {
            m.resume_waiting(grant, number, attempt, &c, reason, &d, source)
        })
        .await?;
        // The resume took the lease: it is renewed from here on, like a start's or a takeover's.
        self.hold();
        self.taken("resume");
        let (approved, by) = match &decision {
            ToolDecision::Allow { by, .. } => (true, by.as_deref()),
            ToolDecision::Deny { by, .. } => (false, by.as_deref()),
            ToolDecision::RequireApproval { .. } => (false, None),
        };
        tracing::info!(
            run_id = %self.run_id,
            step = number,
            call_id = %call.id,
            tool = %call.name,
            approved,
            decided_by = %by.unwrap_or(source),
            owner = %self.env.grant.holder.owner,
            fencing_token = self.env.grant.token(),
            "run resumed"
        );
        match self.after_decision(number, attempt, call, decision, reason)? {
            Next::Continue => Ok(None),
            Next::Return(outcome) => Ok(Some(outcome)),
        }
    }

    /// A panic in the model, a tool or the policy: the step stays as it is for a resume.
    fn panicked(&self, step: u32, what: String, panic: Box<dyn Any + Send>) -> Error {
        let message = panic_message(panic);
        tracing::error!(step, what, message, "panic in a run");
        Error::Panicked {
            run_id: self.run_id.clone(),
            step,
            what,
            message,
        }
    }
}

/// Sends a message to the store actor, flattening its mailbox error into ours.
async fn send<M, R>(store: &Addr<StoreActor>, msg: M) -> Result<R>
where
    M: Message<Result = Result<R>> + Send + 'static,
    R: Send + 'static,
    StoreActor: Handler<M>,
{
    store.send(msg).await?
}

/// The message a panic carried.
fn panic_message(panic: Box<dyn Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with no message".into())
}
