//! The loop: what it knows of the run (its unfinished steps and the conversation built from
//! every finished one), what
//! it plans next, and how a move is committed, alone or paired with the planned move that
//! follows it when no side effect lies between them.

use std::{cell::RefCell, collections::HashSet, panic::AssertUnwindSafe, rc::Rc, sync::Arc};

use actix::{Addr, Recipient};
use serde_json::Value;

use crate::{
    actors::{
        lease_keeper::{Hold, LeaseKeeper, LeaseLost, Release},
        store::StoreHandle,
    },
    agent::{Agent, Cancellation, Decision, ModelRequest},
    error::{Error, Result},
    store::{
        backend::Durability,
        model::{Grant, RunSnapshot, StepRow, ToolDecision},
        moves::{BeginModelAttempt, BeginModelStep, DecideTool, FailRun, Leased, Move, RejectTool},
    },
    types::{
        ApprovalReason, ChatMessage, LeaseLostReason, ModelResponse, Outcome, PendingCall, RunId,
        StepKind, StepState, ToolCall, ToolResult,
    },
};

/// Where the loop goes next.
pub(super) enum Next {
    Continue,
    Return(Outcome),
}

/// What a loop works with besides the run itself.
pub(super) struct Env {
    pub(super) run_id: RunId,
    pub(super) store: StoreHandle,
    pub(super) keeper: Addr<LeaseKeeper>,
    /// The lease this call acquires: its token and its deadline.
    pub(super) grant: Grant,
    pub(super) recipient: Recipient<LeaseLost>,
    /// Fires on an operator's cancel and on a lost lease: the tool running is told.
    pub(super) cancellation: Cancellation,
    pub(super) lease_lost: Rc<RefCell<Option<LeaseLostReason>>>,
    /// Fires when the supervisor drains: the loop hands the run over at its next step
    /// boundary. A tool running is not told (it runs to its end); a model call is abandoned.
    pub(super) draining: super::DrainSignal,
    /// `Config::clock`: a timer's time is reckoned by it.
    pub(super) clock: Arc<dyn crate::clock::Clock>,
}

/// The state of one run's loop, kept in step with what it has committed.
pub(super) struct RunLoop {
    env: Env,
    run_id: RunId,
    agent: Arc<Agent>,
    input: Value,
    /// The steps after the first `finished`, in order: a finished step is dropped once every
    /// step before it is finished too, as the conversation holds all the loop needs of it.
    steps: Vec<StepRow>,
    /// What the model sees: built from the finished steps, in order.
    messages: Vec<ChatMessage>,
    /// How many steps, from the first, are finished and dropped from `steps`.
    finished: usize,
    /// The ids of the run's tool calls, kept unique.
    call_ids: HashSet<String>,
}

/// A move that no side effect precedes: planned (the policy asked, if it is a decision) before
/// the move it follows commits, so that both commit together.
#[derive(Clone)]
pub(super) enum Planned {
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
    /// The run.
    pub(super) fn run_id(&self) -> &RunId {
        &self.run_id
    }

    /// The run's agent: its model, tools and policies.
    pub(super) fn agent(&self) -> &Agent {
        &self.agent
    }

    /// The lease this call holds.
    pub(super) fn grant(&self) -> &Grant {
        &self.env.grant
    }

    /// Fires on an operator's cancel and on a lost lease.
    pub(super) fn cancellation(&self) -> &Cancellation {
        &self.env.cancellation
    }

    /// The way to the store actor.
    pub(super) fn store(&self) -> &StoreHandle {
        &self.env.store
    }

    /// Whether the supervisor drains: the run is handed over at its next step boundary.
    pub(super) fn draining(&self) -> bool {
        self.env.draining.started.is_cancelled()
    }

    /// Completes when the supervisor starts to drain.
    pub(super) async fn drained(&self) {
        self.env.draining.started.cancelled().await
    }

    /// Completes at the drain's deadline: the tool call running gets its signal.
    pub(super) async fn drain_cut(&self) {
        self.env.draining.cut.cancelled().await
    }

    /// The time by `Config::clock`, in milliseconds.
    pub(super) fn now_millis(&self) -> i64 {
        crate::clock::to_millis(self.env.clock.now())
    }

    /// Why the keeper reported the lease lost, if it did.
    pub(super) fn lease_lost(&self) -> Option<LeaseLostReason> {
        self.env.lease_lost.borrow().clone()
    }

    /// How many steps the run has.
    pub(super) fn step_count(&self) -> usize {
        self.finished + self.steps.len()
    }

    /// What the model is asked at attempt `attempt` of step `step`: the conversation so far.
    pub(super) fn request(&self, step: u32, attempt: u32) -> ModelRequest<'_> {
        ModelRequest {
            run_id: &self.run_id,
            step,
            attempt,
            input: &self.input,
            messages: &self.messages,
            tools: &self.agent.specs,
        }
    }

    /// Call ids address approvals: they are kept unique within the run. An empty id, or one
    /// an earlier call of the run (or of this response) took, becomes `call-STEP`.
    pub(super) fn make_call_ids_unique(&mut self, step: u32, response: &mut ModelResponse) {
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

    pub(super) fn new(env: Env, agent: Arc<Agent>, input: Value, steps: Vec<StepRow>) -> Self {
        let run_id = env.run_id.clone();
        let messages = agent.opening(&input);
        let mut run = RunLoop {
            env,
            run_id,
            agent,
            input,
            steps: Vec::new(),
            messages,
            finished: 0,
            call_ids: HashSet::new(),
        };
        for step in steps {
            run.push_step(step);
        }
        run
    }

    pub(super) fn from_snapshot(snapshot: &RunSnapshot, agent: Arc<Agent>, env: Env) -> Self {
        RunLoop::new(
            env,
            agent,
            snapshot.run.input.clone(),
            snapshot.steps.clone(),
        )
    }

    /// Adds a step; a finished one joins the conversation, and is not kept when every step
    /// before it is finished too (as a run read back on a resume has many).
    pub(super) fn push_step(&mut self, step: StepRow) {
        if let Some(call) = &step.call {
            self.call_ids.insert(call.id.clone());
        }
        self.steps.push(step);
        self.on_finished(self.steps.len() - 1);
        if self.steps.len() == 1 && self.steps[0].state == StepState::Finished {
            self.steps.clear();
            self.finished += 1;
        }
    }

    /// Brings the conversation up to date with step `index` if it is finished.
    pub(super) fn on_finished(&mut self, index: usize) {
        let step = &mut self.steps[index];
        if step.state != StepState::Finished {
            return;
        }
        // Folded into the conversation, the result is not kept a second time: a run holds
        // its history once, as messages.
        let Some(result) = step.result.take() else {
            return;
        };
        let message =
            match (step.kind, &step.call) {
                (StepKind::Model, _) => serde_json::from_value::<ModelResponse>(result)
                    .ok()
                    .map(ChatMessage::Assistant),
                (StepKind::Tool, Some(call)) => serde_json::from_value::<ToolResult>(result)
                    .ok()
                    .map(|result| ChatMessage::Tool {
                        call_id: call.id.clone(),
                        name: call.name.clone(),
                        result,
                    }),
                _ => None,
            };
        self.messages.extend(message);
    }

    /// Where step `step` is in `steps`: a step the loop changes is never one it dropped.
    pub(super) fn index_of(&self, step: u32) -> usize {
        // Steps are numbered from 1 without gaps, and kept in order.
        let index = (step as usize - 1)
            .checked_sub(self.finished)
            .expect("a dropped step is finished and never changed again");
        debug_assert_eq!(self.steps[index].step, step);
        index
    }

    /// Sets a step's state (and attempt), folding a finished step into the conversation. The
    /// step is one the loop still holds: the first unfinished step as of the last
    /// [`plan`](Self::plan), or one added since.
    pub(super) fn set_step(
        &mut self,
        step: u32,
        state: StepState,
        attempt: u32,
        result: Option<Value>,
    ) {
        let index = self.index_of(step);
        let row = &mut self.steps[index];
        row.state = state;
        row.attempt = attempt;
        if result.is_some() {
            row.result = result;
        }
        self.on_finished(index);
    }

    /// Sets the progress a tool step keeps for its next attempt (a step the loop holds, as for
    /// [`set_step`](Self::set_step)).
    pub(super) fn set_progress(&mut self, step: u32, progress: Value) {
        let index = self.index_of(step);
        self.steps[index].progress = Some(progress);
    }

    /// Who makes this loop's moves: the run, under its lease.
    pub(super) fn leased(&self) -> Leased {
        Leased::new(&self.run_id, &self.env.grant)
    }

    /// Commits one move of this run's loop on its own.
    pub(super) async fn commit<M: Move>(&self, mv: M) -> Result<M::Output> {
        self.env.store.apply(mv, Durability::Durable).await
    }

    /// Executes steps until the run pauses or finishes.
    pub(super) async fn drive(&mut self) -> Result<Outcome> {
        loop {
            // A lost lease stops the loop before its next move: nothing more starts.
            if self.env.lease_lost.borrow().is_some() {
                return Box::pin(self.stopped()).await;
            }
            let next = match self.plan() {
                Err(err) => return Err(err),
                // A drain hands the run over between two steps: nothing is in flight. A model
                // step about to be tried again keeps its failed attempt counted.
                Ok(Some(Planned::BeginAttempt { .. })) if self.draining() => {
                    return Box::pin(self.hand_over_backing_off()).await;
                }
                Ok(Some(_)) if self.draining() => return Box::pin(self.hand_over()).await,
                Ok(Some(planned)) => {
                    if planned.starts() {
                        self.wait_for_margin().await?;
                        if self.draining() {
                            return match planned {
                                Planned::BeginAttempt { .. } => {
                                    Box::pin(self.hand_over_backing_off()).await
                                }
                                _ => Box::pin(self.hand_over()).await,
                            };
                        }
                    }
                    let mv = self.planned_move(&planned);
                    let applied = self.env.store.apply(mv, planned.durability()).await;
                    match self.unless_short(applied).await? {
                        Some(()) => self.after_planned(planned)?,
                        None => Next::Continue,
                    }
                }
                Ok(None) => {
                    let step = self.steps[0].clone();
                    match (step.kind, step.state) {
                        // A reserved model call is abandoned (it has no side effect), and an
                        // interrupted step is left to the next owner's one reconciliation.
                        (StepKind::Model, StepState::InFlight) | (_, StepState::Interrupted)
                            if self.draining() =>
                        {
                            return Box::pin(self.hand_over()).await;
                        }
                        (StepKind::Model, StepState::InFlight) => {
                            Box::pin(self.call_model(step.step, step.attempt)).await?
                        }
                        (StepKind::Tool, StepState::InFlight) => {
                            Box::pin(self.call_tool(&step)).await?
                        }
                        (_, StepState::Interrupted) => Box::pin(self.reconcile(&step)).await?,
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
    pub(super) fn plan(&mut self) -> Result<Option<Planned>> {
        // Finished steps stay finished, and the conversation holds them: drop them.
        let done = self
            .steps
            .iter()
            .take_while(|s| s.state == StepState::Finished)
            .count();
        self.steps.drain(..done);
        self.finished += done;
        let Some(step) = self.steps.first() else {
            let step = self.step_count() as u32 + 1;
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
    pub(super) fn planned_move(&self, planned: &Planned) -> Box<dyn Move<Output = ()>> {
        let by = self.leased();
        match planned.clone() {
            Planned::BeginModel { step } => Box::new(BeginModelStep { by, step }),
            Planned::BeginAttempt { step, attempt } => {
                Box::new(BeginModelAttempt { by, step, attempt })
            }
            Planned::Fail { error } => Box::new(FailRun { by, error }),
            Planned::Decide {
                step,
                call,
                decision,
            } => Box::new(DecideTool {
                by,
                step,
                call,
                decision,
            }),
            Planned::Reject { step, call, error } => Box::new(RejectTool {
                by,
                step,
                call,
                error,
            }),
        }
    }

    /// Brings the loop in step with a committed planned move.
    pub(super) fn after_planned(&mut self, planned: Planned) -> Result<Next> {
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
                    progress: None,
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
    pub(super) async fn commit_with<A: Move>(
        &mut self,
        first: A,
        next: Result<Option<Planned>>,
        proceed: fn(&A::Output) -> bool,
    ) -> Result<(A::Output, Result<Next>)> {
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

    /// Brings the loop in step with a recorded decision.
    pub(super) fn after_decision(
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

    /// Records on this execution's span how it took the lease, and with which fencing token.
    pub(super) fn taken(&self, execution: &str) {
        let span = tracing::Span::current();
        span.record("execution", execution);
        // Signed: an OpenTelemetry layer keeps unsigned integers as text.
        span.record("fencing_token", self.env.grant.token() as i64);
    }

    /// Asks the keeper to renew the lease no more.
    pub(super) fn stop_holding(&self) {
        self.env.keeper.do_send(Release {
            run_id: self.run_id.clone(),
        });
    }

    /// Asks the keeper to renew the lease just taken.
    pub(super) fn hold(&self) {
        let recipient = self.env.recipient.clone();
        self.env.keeper.do_send(Hold {
            run_id: self.run_id.clone(),
            grant: self.env.grant.clone(),
            recipient,
        });
    }
}
