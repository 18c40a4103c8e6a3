//! The moves, written once for every backend against the guarded primitives of [`Tx`]: which
//! guard each write carries, which events it appends, with which payloads. A guard that
//! matches no row changes nothing, and [`Move::refused`] says why.
//!
//! Also the reads and lease operations built on [`Reads`] and [`LeaseWrites`].

use std::{
    collections::HashSet,
    time::{Duration, Instant},
};

use serde_json::{Value, json};

use super::{
    backend::{LeaseWrites, NewRun, Reads, RunUpdate, StepUpdate, Tx},
    model::{
        Grant, LeaseReport, ModelOutcome, Now, Renewal, Resolution, RunSnapshot, StepKind,
        StepState, ToolDecision, from_millis, idempotency_key, wall_millis,
    },
};
use crate::{
    error::{Error, Result},
    types::{
        Approval, ApprovalReason, Event, EventKind, Lease, LeaseLostReason, PendingCall, Run,
        RunId, RunState, RunUsage, ToolCall, ToolResult, Usage,
    },
};

// ---------------------------------------------------------------------------------------------
// Guards and the log

/// The fencing token of a run's first lease, taken by its insert.
pub(crate) const FIRST_TOKEN: u64 = 1;

/// What a loop's move needs of its lease. Moves that start a side effect need the start
/// margin left, by the loop's own deadline and by the stored expiry; the others need it held
/// (nobody took it over since this loop acquired it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Need {
    Held,
    Margin,
}

/// A move of one run being applied: its transaction, its time (read from the clock on first
/// use), and the run. Each move is a method; a loop's moves take the lease they run under.
pub(crate) struct Move<'a, 'c> {
    tx: &'a mut dyn Tx,
    now: &'a mut Now<'c>,
    run_id: &'a RunId,
    /// The W3C `traceparent` a new run's `run.started` keeps, for its later executions to
    /// join the same trace.
    trace: Option<&'a str>,
}

/// A move of a run between states. Leaving RUNNING releases the lease in the same write;
/// entering it takes the lease for `take`.
struct RunMove<'a> {
    from: &'a [RunState],
    to: RunState,
    output: Option<&'a str>,
    error: Option<&'a str>,
    /// The grant the run's lease must be (a loop's move); `None` for an operator's.
    guard: Option<&'a Grant>,
    /// The grant that takes the lease (entering RUNNING).
    take: Option<&'a Grant>,
    what: &'a str,
}

impl<'a> RunMove<'a> {
    fn new(from: &'a [RunState], to: RunState, what: &'a str) -> Self {
        RunMove {
            from,
            to,
            output: None,
            error: None,
            guard: None,
            take: None,
            what,
        }
    }
}

impl<'a, 'c> Move<'a, 'c> {
    /// A move of `run_id` in `tx`, at the time `now` reads.
    pub(crate) fn new(tx: &'a mut dyn Tx, now: &'a mut Now<'c>, run_id: &'a RunId) -> Self {
        Move {
            tx,
            now,
            run_id,
            trace: None,
        }
    }

    /// Keeps `traceparent` in the `run.started` of the run this move inserts.
    pub(crate) fn traced(mut self, traceparent: Option<&'a str>) -> Self {
        self.trace = traceparent;
        self
    }

    /// Appends `run.started`, with the trace context when there is one.
    fn append_started(&mut self, mut payload: Value) -> Result<()> {
        if let (Some(traceparent), Some(fields)) = (self.trace, payload.as_object_mut()) {
            fields.insert("trace".into(), json!({ "traceparent": traceparent }));
        }
        self.append(EventKind::RunStarted, None, &payload)
    }

    /// Explains a guard that matched no row: the run does not exist, is in another state, or
    /// (for a loop's move) its lease is another owner's, released, or expired.
    fn refused(&mut self, grant: Option<&Grant>, reason: &str) -> Error {
        let run_id = self.run_id;
        let row = match self.tx.lease_row(run_id) {
            Ok(Some(row)) => row,
            Ok(None) => return Error::RunNotFound(run_id.clone()),
            Err(err) => return err,
        };
        match (row.state, grant, row.owner) {
            (RunState::Running, Some(grant), Some(owner))
                if *owner != *grant.holder.owner || row.epoch != grant.token() =>
            {
                Error::RunLeased {
                    run_id: run_id.clone(),
                    owner,
                    expires_at: from_millis(row.expires_at.unwrap_or_default()),
                }
            }
            (RunState::Running, Some(_), Some(_)) => Error::LeaseLost {
                run_id: run_id.clone(),
                reason: LeaseLostReason::Expired,
            },
            (RunState::Running, Some(_), None) => Error::LeaseLost {
                run_id: run_id.clone(),
                reason: LeaseLostReason::ReleasedOrCancelled,
            },
            // A loop's run was moved by someone else than an operator's cancel: only an owner
            // that took it over can have done that.
            (state, Some(_), _) if state != RunState::Cancelled => Error::LeaseLost {
                run_id: run_id.clone(),
                reason: LeaseLostReason::ReleasedOrCancelled,
            },
            (state, ..) => Error::RunState {
                run_id: run_id.clone(),
                state,
                reason: reason.to_owned(),
            },
        }
    }

    fn run_state(&mut self) -> Result<Option<RunState>> {
        Ok(self.tx.lease_row(self.run_id)?.map(|row| row.state))
    }

    /// A state error about this run, or not found if it does not exist.
    fn state_error(&mut self, reason: String) -> Error {
        match self.run_state() {
            Ok(Some(state)) => Error::RunState {
                run_id: self.run_id.clone(),
                state,
                reason,
            },
            Ok(None) => Error::RunNotFound(self.run_id.clone()),
            Err(err) => err,
        }
    }

    /// Stamps a RUNNING run whose lease is `grant`'s as moved now; refuses it otherwise. A
    /// move that starts a side effect is refused with `LeaseLost` (expired) when less than the
    /// start margin is left by the grant's deadline, before anything is written: the loop
    /// waits for a renewal, or stops.
    fn touch_held(&mut self, grant: &Grant, need: Need, what: &str) -> Result<()> {
        let unexpired_at = match need {
            Need::Held => None,
            Need::Margin if !grant.has_margin() => return Err(self.short_of_margin(grant, what)),
            Need::Margin => {
                self.tx.lock_run(self.run_id)?;
                Some(grant.holder.start_by(self.tx.lease_wall()?))
            }
        };
        let at = self.now.millis();
        let (owner, token) = (&grant.holder.owner, grant.token());
        if self
            .tx
            .touch_run(self.run_id, at, owner, token, unexpired_at)?
        {
            Ok(())
        } else {
            Err(self.refused(Some(grant), what))
        }
    }

    /// Why a start was refused for want of the margin: the lease lost (expired), when the run
    /// is still under `grant`'s lease; what else refuses it otherwise.
    fn short_of_margin(&mut self, grant: &Grant, what: &str) -> Error {
        match self.tx.lease_row(self.run_id) {
            Ok(Some(row))
                if row.state == RunState::Running
                    && row.owner.as_deref() == Some(&*grant.holder.owner)
                    && row.epoch == grant.token() =>
            {
                Error::LeaseLost {
                    run_id: self.run_id.clone(),
                    reason: LeaseLostReason::Expired,
                }
            }
            _ => self.refused(Some(grant), what),
        }
    }

    /// Applies a [`RunMove`]; returns the expiry of the lease it took, if any, and gives the
    /// taking grant its token.
    fn move_run(&mut self, m: RunMove<'_>) -> Result<Option<i64>> {
        // Read before the wall clock: the grant's deadline is then no later than the expiry.
        let sent = m.take.map(|_| Instant::now());
        let expires_at = match m.take {
            Some(grant) => Some(grant.holder.expiry(self.tx.lease_wall()?)),
            None => None,
        };
        let update = RunUpdate {
            from: m.from,
            to: m.to,
            output: m.output,
            error: m.error,
            at: self.now.millis(),
            owner: m.take.map(|grant| &*grant.holder.owner),
            expires_at,
            guard: m.guard.map(|grant| (&*grant.holder.owner, grant.token())),
        };
        match self.tx.update_run(self.run_id, &update)? {
            Some(epoch) => {
                if let (Some(grant), Some(sent)) = (m.take, sent) {
                    grant.acquired(epoch, sent);
                }
                Ok(expires_at)
            }
            None => Err(self.refused(m.guard, m.what)),
        }
    }

    /// Moves one step out of the state (and attempt) its executor saw. A step found elsewhere
    /// means another executor got there first, and nothing changes.
    fn move_step(&mut self, step: u32, update: StepUpdate<'_>) -> Result<()> {
        if self.tx.update_step(self.run_id, step, &update)? {
            return Ok(());
        }
        let (from, attempt) = (update.from.as_str(), update.attempt);
        let state = self
            .run_state()?
            .ok_or_else(|| Error::RunNotFound(self.run_id.clone()))?;
        Err(Error::RunState {
            run_id: self.run_id.clone(),
            state,
            reason: format!("step {step} is no longer {from} at attempt {attempt}"),
        })
    }

    /// Finishes a step (with its result, if any) from the state and attempt its executor saw.
    fn close_step(
        &mut self,
        step: u32,
        from: StepState,
        attempt: u32,
        result: Option<&Value>,
    ) -> Result<()> {
        let update = StepUpdate {
            from,
            attempt,
            to: StepState::Finished,
            starts: false,
            result,
            waiting_for: None,
        };
        self.move_step(step, update)
    }

    /// Moves a step in flight as its next attempt.
    fn start_attempt(&mut self, step: u32, from: StepState, attempt: u32) -> Result<()> {
        let update = StepUpdate {
            from,
            attempt,
            to: StepState::InFlight,
            starts: true,
            result: None,
            waiting_for: None,
        };
        self.move_step(step, update)
    }

    /// Starts the next attempt of a tool step and writes its `step.tool_started`, with the
    /// fencing token the attempt runs under.
    fn start_tool_attempt(
        &mut self,
        grant: &Grant,
        step: u32,
        from: StepState,
        attempt: u32,
        call: &ToolCall,
    ) -> Result<()> {
        self.start_attempt(step, from, attempt)?;
        let payload = json!({
            "call_id": call.id,
            "tool": call.name,
            "args": call.args,
            "attempt": attempt + 1,
            "idempotency_key": idempotency_key(self.run_id, step),
            "fencing_token": grant.token(),
        });
        self.append(EventKind::ToolStarted, Some(step), &payload)
    }

    fn append(&mut self, kind: EventKind, step: Option<u32>, payload: &Value) -> Result<()> {
        let at = self.now.millis();
        self.tx.append_event(self.run_id, kind, at, step, payload)
    }

    // -----------------------------------------------------------------------------------------
    // The moves

    /// Inserts a new RUNNING run and its `run.started`. An existing id is refused unchanged.
    /// The lease is stamped in the insert, with the first fencing token; returns its expiry.
    pub(crate) fn create_run(&mut self, agent: &str, input: &Value, grant: &Grant) -> Result<i64> {
        if self.run_state()?.is_some() {
            return Err(Error::RunExists(self.run_id.clone()));
        }
        let sent = Instant::now();
        let expires_at = grant.holder.expiry(self.tx.lease_wall()?);
        self.tx.insert_run(&NewRun {
            run_id: self.run_id,
            agent,
            input,
            at: self.now.millis(),
            lease: Some((&grant.holder.owner, expires_at)),
        })?;
        grant.acquired(FIRST_TOKEN, sent);
        let payload = json!({ "agent": agent, "input": input, "fencing_token": FIRST_TOKEN });
        self.append_started(payload)?;
        Ok(expires_at)
    }

    /// Inserts a new RUNNING run that nobody holds yet, and its `run.started` (marked
    /// `queued`, fencing token 0): a run that waits for a free slot of its supervisor. Whoever
    /// executes it first takes it over, with the first fencing token; a crash leaves it to any
    /// recovering supervisor. An existing id is refused unchanged.
    pub(crate) fn queue_run(&mut self, agent: &str, input: &Value) -> Result<()> {
        if self.run_state()?.is_some() {
            return Err(Error::RunExists(self.run_id.clone()));
        }
        self.tx.insert_run(&NewRun {
            run_id: self.run_id,
            agent,
            input,
            at: self.now.millis(),
            lease: None,
        })?;
        let payload = json!({ "agent": agent, "input": input, "fencing_token": 0, "queued": true });
        self.append_started(payload)
    }

    /// Reserves model step `step` before the request is dispatched.
    pub(crate) fn begin_model_step(&mut self, grant: &Grant, step: u32) -> Result<()> {
        self.touch_held(grant, Need::Margin, "a model call cannot start")?;
        let (kind, state) = (StepKind::Model, StepState::InFlight);
        self.tx
            .insert_step(self.run_id, step, kind, state, 1, None)?;
        self.append(
            EventKind::ModelStarted,
            Some(step),
            &json!({ "attempt": 1 }),
        )
    }

    /// Records an attempt of model step `step` that failed with an error the agent's model
    /// policy tries again after `retry_in`. The step stays in flight: a crash before the next
    /// attempt leaves it for a takeover to dispatch again.
    pub(crate) fn fail_model_attempt(
        &mut self,
        grant: &Grant,
        step: u32,
        attempt: u32,
        error: &str,
        retry_in: Duration,
    ) -> Result<()> {
        self.touch_held(
            grant,
            Need::Held,
            "a model attempt's failure cannot be recorded",
        )?;
        let retry_in_ms = i64::try_from(retry_in.as_millis()).unwrap_or(i64::MAX);
        // By the wall clock leases are read from: a process that takes the run over during
        // the backoff waits out what is left of it.
        let payload = json!({
            "attempt": attempt,
            "error": error,
            "retry_in_ms": retry_in_ms,
            "retry_at": wall_millis().saturating_add(retry_in_ms),
        });
        self.append(EventKind::ModelAttemptFailed, Some(step), &payload)
    }

    /// Starts the next attempt of model step `step`, whose attempt `attempt` failed, before
    /// its request is dispatched.
    pub(crate) fn begin_model_attempt(
        &mut self,
        grant: &Grant,
        step: u32,
        attempt: u32,
    ) -> Result<()> {
        self.touch_held(grant, Need::Margin, "a model call cannot start")?;
        self.start_attempt(step, StepState::InFlight, attempt)?;
        let payload = json!({ "attempt": attempt + 1 });
        self.append(EventKind::ModelStarted, Some(step), &payload)
    }

    /// Records the model's answer. Tool calls (their ids already unique within the run) become
    /// pending steps numbered after this one; a final answer finishes the run; a model error
    /// fails it.
    pub(crate) fn finish_model_step(
        &mut self,
        grant: &Grant,
        step: u32,
        attempt: u32,
        outcome: &ModelOutcome,
    ) -> Result<()> {
        self.touch_held(grant, Need::Held, "the model's answer cannot be recorded")?;
        let (response, recorded) = match outcome {
            ModelOutcome::Failed { error, attempts } => {
                self.close_step(step, StepState::InFlight, attempt, None)?;
                let payload = json!({ "error": error, "attempt": attempt, "attempts": attempts });
                self.append(EventKind::ModelFinished, Some(step), &payload)?;
                let error = model_failure(error, *attempts);
                return self.finish_run(
                    grant,
                    RunState::Failed,
                    None,
                    Some(&error),
                    Some(*attempts),
                );
            }
            ModelOutcome::Answered { response, recorded } => (response, recorded),
        };
        // The loop made the call ids unique within the run, from every id it read back on
        // resume; the database checks only those of waiting calls.
        for (call, tool_step) in response.tool_calls.iter().zip(step + 1..) {
            let (kind, state) = (StepKind::Tool, StepState::Pending);
            self.tx
                .insert_step(self.run_id, tool_step, kind, state, 0, Some(call))?;
        }
        self.close_step(step, StepState::InFlight, attempt, Some(recorded))?;
        self.append(EventKind::ModelFinished, Some(step), recorded)?;
        if response.tool_calls.is_empty() {
            let output = response.text.clone().unwrap_or_default();
            self.finish_run(grant, RunState::Succeeded, Some(&output), None, None)?;
        }
        Ok(())
    }

    /// Moves a RUNNING run to a finished state and writes `run.finished`.
    fn finish_run(
        &mut self,
        grant: &Grant,
        state: RunState,
        output: Option<&str>,
        error: Option<&str>,
        model_attempts: Option<u32>,
    ) -> Result<()> {
        self.move_run(RunMove {
            output,
            error,
            guard: Some(grant),
            ..RunMove::new(&[RunState::Running], state, "it cannot finish")
        })?;
        let mut payload = json!({ "state": state.as_str() });
        if let Some(output) = output {
            payload["output"] = json!(output);
        }
        if let Some(error) = error {
            payload["error"] = json!(error);
        }
        if let Some(attempts) = model_attempts {
            payload["model_attempts"] = json!(attempts);
        }
        self.append(EventKind::RunFinished, None, &payload)
    }

    /// Fails a RUNNING run (e.g. it reached its step limit).
    pub(crate) fn fail_run(&mut self, grant: &Grant, error: &str) -> Result<()> {
        self.finish_run(grant, RunState::Failed, None, Some(error), None)
    }

    /// Records the policy's decision on a pending tool call and acts on it in the same
    /// transaction: starts the tool, records the denial, or pauses the run.
    pub(crate) fn decide_tool(
        &mut self,
        grant: &Grant,
        step: u32,
        call: &ToolCall,
        decision: &ToolDecision,
    ) -> Result<()> {
        let what = "a tool call cannot be decided";
        match decision {
            ToolDecision::RequireApproval { .. } => self.pause(grant)?,
            ToolDecision::Allow { .. } => self.touch_held(grant, Need::Margin, what)?,
            ToolDecision::Deny { .. } => self.touch_held(grant, Need::Held, what)?,
        }
        let payload = decision.payload(call, "policy");
        self.append(EventKind::PolicyDecided, Some(step), &payload)?;
        let (from, reason) = (StepState::Pending, ApprovalReason::Policy);
        self.apply_decision(grant, step, from, 0, call, decision, reason)
    }

    /// Moves the run to WAITING_FOR_APPROVAL, releasing `grant`'s lease.
    fn pause(&mut self, grant: &Grant) -> Result<()> {
        let to = RunState::WaitingForApproval;
        self.move_run(RunMove {
            guard: Some(grant),
            ..RunMove::new(&[RunState::Running], to, "it cannot pause")
        })?;
        Ok(())
    }

    /// The step's side of a decision: start it, close it with the denial, or make it wait.
    #[allow(clippy::too_many_arguments)]
    fn apply_decision(
        &mut self,
        grant: &Grant,
        step: u32,
        from: StepState,
        attempt: u32,
        call: &ToolCall,
        decision: &ToolDecision,
        reason: ApprovalReason,
    ) -> Result<()> {
        match decision {
            ToolDecision::Allow { .. } => self.start_tool_attempt(grant, step, from, attempt, call),
            ToolDecision::Deny {
                reason: why, note, ..
            } => {
                let error = ToolDecision::denial(why, note.as_deref());
                let result = serde_json::to_value(ToolResult::Error(error.clone())).unwrap();
                self.close_step(step, from, attempt, Some(&result))?;
                if attempt > 0 {
                    // An attempt ran before (and was interrupted): close the step in the log
                    // too.
                    let payload = json!({
                        "call_id": call.id,
                        "attempt": attempt,
                        "error": error,
                        "denied": true,
                    });
                    self.append(EventKind::ToolFinished, Some(step), &payload)?;
                }
                Ok(())
            }
            ToolDecision::RequireApproval { .. } => {
                self.move_step(
                    step,
                    StepUpdate {
                        from,
                        attempt,
                        to: StepState::Waiting,
                        starts: false,
                        result: None,
                        waiting_for: Some(reason),
                    },
                )?;
                let payload =
                    json!({ "call_id": call.id, "tool": call.name, "reason": reason.as_str() });
                self.append(EventKind::RunWaiting, Some(step), &payload)
            }
        }
    }

    /// Closes a pending call the loop cannot execute (unknown tool, arguments not an object):
    /// the model is told why; nothing ran.
    pub(crate) fn reject_tool(
        &mut self,
        grant: &Grant,
        step: u32,
        call: &ToolCall,
        error: &str,
    ) -> Result<()> {
        self.touch_held(grant, Need::Held, "a tool call cannot be rejected")?;
        let result = serde_json::to_value(ToolResult::Error(error.to_owned())).unwrap();
        self.close_step(step, StepState::Pending, 0, Some(&result))?;
        let payload = json!({ "call_id": call.id, "attempt": 0, "error": error, "rejected": true });
        self.append(EventKind::ToolFinished, Some(step), &payload)
    }

    /// Records a tool's outcome. On a RUNNING run it is an ordinary step; on a run an operator
    /// cancelled meanwhile it is recorded as late (the run stays cancelled). Returns whether
    /// late.
    pub(crate) fn finish_tool(
        &mut self,
        grant: &Grant,
        step: u32,
        attempt: u32,
        call_id: &str,
        result: &ToolResult,
        result_json: &Value,
    ) -> Result<bool> {
        // Written only while the loop holds the lease (or, late, once an operator cancelled):
        // otherwise the step stays in flight for the owner that took the run over.
        let what = "the tool's outcome cannot be recorded";
        let late = match self.touch_held(grant, Need::Held, what) {
            Ok(()) => false,
            Err(Error::RunState {
                state: RunState::Cancelled,
                ..
            }) => true,
            Err(err) => return Err(err),
        };
        self.close_step(step, StepState::InFlight, attempt, Some(result_json))?;
        let mut payload = json!({ "call_id": call_id, "attempt": attempt });
        match result {
            ToolResult::Ok(output) => payload["output"] = output.clone(),
            ToolResult::Error(error) => payload["error"] = json!(error),
        }
        if late {
            payload["late"] = json!(true);
        }
        self.append(EventKind::ToolFinished, Some(step), &payload)?;
        Ok(late)
    }

    /// Resumes a waiting run: back to RUNNING, the resume-time decision recorded and acted on,
    /// in one compare-and-set on the run's state, so of two resumers one wins. Returns the
    /// expiry of the lease it took.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn resume_waiting(
        &mut self,
        grant: &Grant,
        step: u32,
        attempt: u32,
        call: &ToolCall,
        reason: ApprovalReason,
        decision: &ToolDecision,
        source: &str,
    ) -> Result<i64> {
        let what = "only a run waiting for approval can be resumed this way";
        let from = [RunState::WaitingForApproval];
        let expires_at = self
            .move_run(RunMove {
                take: Some(grant),
                ..RunMove::new(&from, RunState::Running, what)
            })?
            .expect("entering RUNNING takes the lease");
        let payload = json!({
            "from": RunState::WaitingForApproval.as_str(),
            "fencing_token": grant.token(),
        });
        self.append(EventKind::RunResumed, None, &payload)?;
        let payload = decision.payload(call, source);
        self.append(EventKind::PolicyDecided, Some(step), &payload)?;
        let from = StepState::Waiting;
        self.apply_decision(grant, step, from, attempt, call, decision, reason)?;
        Ok(expires_at)
    }

    /// Takes over a RUNNING run whose lease expired or is absent: the lease is taken and every
    /// step in flight marked interrupted, in one transaction with `run.resumed` (and
    /// `lease.taken_over` when someone held it). Returns the steps marked, the new expiry, and
    /// whether someone held it.
    ///
    /// A live lease of another owner is refused with `RunLeased` before the clock is read or
    /// anything is written.
    pub(crate) fn take_over(&mut self, grant: &Grant) -> Result<(Vec<u32>, i64, bool)> {
        let holder = &grant.holder;
        let what = "only a RUNNING run can be taken over";
        let run_id = self.run_id;
        let row = self
            .tx
            .lease_row(run_id)?
            .ok_or_else(|| Error::RunNotFound(run_id.clone()))?;
        if row.state != RunState::Running {
            return Err(self.refused(None, what));
        }
        let wall = self.tx.lease_wall()?;
        if let (Some(owner), Some(expires_at)) = (&row.owner, row.expires_at) {
            // This supervisor's own live lease is not refused: the caller checked that it
            // executes no call of this run, so that lease is a leftover.
            if expires_at > wall && **owner != *holder.owner {
                return Err(Error::RunLeased {
                    run_id: run_id.clone(),
                    owner: owner.clone(),
                    expires_at: from_millis(expires_at),
                });
            }
        }
        // Read before the wall clock: the grant's deadline is then no later than the expiry.
        let sent = Instant::now();
        let expires_at = holder.expiry(self.tx.lease_wall()?);
        let at = self.now.millis();
        if !self
            .tx
            .take_lease(run_id, at, &holder.owner, expires_at, &row)?
        {
            return Err(self.refused(None, what));
        }
        grant.acquired(row.epoch + 1, sent);
        let payload = json!({ "from": RunState::Running.as_str(), "fencing_token": row.epoch + 1 });
        self.append(EventKind::RunResumed, None, &payload)?;
        if let Some(previous) = &row.owner {
            let payload = json!({
                "previous_owner": previous,
                "previous_expires_at": row.expires_at,
                "new_owner": &*holder.owner,
                "new_expires_at": expires_at,
            });
            self.append(EventKind::LeaseTakenOver, None, &payload)?;
        }
        let mut interrupted = self.tx.interrupt_steps(run_id)?;
        interrupted.sort_unstable_by_key(|(step, ..)| *step);
        let mut steps = Vec::with_capacity(interrupted.len());
        for (step, kind, attempt) in interrupted {
            let payload = json!({ "kind": kind.as_str(), "attempt": attempt });
            self.append(EventKind::StepInterrupted, Some(step), &payload)?;
            steps.push(step);
        }
        Ok((steps, expires_at, row.owner.is_some()))
    }

    /// Records the one reconciliation of an interrupted step together with what it leads to.
    pub(crate) fn reconcile(
        &mut self,
        grant: &Grant,
        step: u32,
        attempt: u32,
        call: Option<&ToolCall>,
        resolution: &Resolution,
    ) -> Result<()> {
        let what = "an interrupted step cannot be reconciled";
        match resolution {
            Resolution::AwaitApproval { .. } => self.pause(grant)?,
            // Running again starts a side effect: the lease must be unexpired.
            Resolution::Redispatch { .. } | Resolution::Retry { .. } => {
                self.touch_held(grant, Need::Margin, what)?
            }
            Resolution::Applied(_) => self.touch_held(grant, Need::Held, what)?,
            // `finish_run` checks the lease.
            Resolution::GiveUp { .. } => {}
        }
        let from = StepState::Interrupted;
        let (outcome, action) = match resolution {
            Resolution::Redispatch { outcome } => (*outcome, "dispatch_again"),
            Resolution::GiveUp { outcome, .. } => (*outcome, "fail_run"),
            Resolution::Applied(_) => ("applied", "record_output"),
            Resolution::Retry { outcome } => (*outcome, "run_again"),
            Resolution::AwaitApproval { outcome } => (*outcome, "await_approval"),
        };
        let payload = json!({ "attempt": attempt, "outcome": outcome, "action": action });
        self.append(EventKind::StepReconciled, Some(step), &payload)?;
        match (resolution, call) {
            (Resolution::Redispatch { .. }, _) => {
                self.start_attempt(step, from, attempt)?;
                let payload = json!({ "attempt": attempt + 1 });
                self.append(EventKind::ModelStarted, Some(step), &payload)
            }
            (Resolution::GiveUp { error, .. }, _) => {
                self.close_step(step, from, attempt, None)?;
                let payload = json!({ "error": error, "attempt": attempt, "attempts": attempt });
                self.append(EventKind::ModelFinished, Some(step), &payload)?;
                let error = model_failure(error, attempt);
                self.finish_run(grant, RunState::Failed, None, Some(&error), Some(attempt))
            }
            (Resolution::Applied(output), Some(call)) => {
                let result = serde_json::to_value(ToolResult::Ok(output.clone())).unwrap();
                self.close_step(step, from, attempt, Some(&result))?;
                let payload = json!({
                    "call_id": call.id,
                    "attempt": attempt,
                    "output": output,
                    "reconciled": true,
                });
                self.append(EventKind::ToolFinished, Some(step), &payload)
            }
            (Resolution::Retry { .. }, Some(call)) => {
                self.start_tool_attempt(grant, step, from, attempt, call)
            }
            (Resolution::AwaitApproval { .. }, Some(call)) => {
                let decision = ToolDecision::RequireApproval {
                    reason: String::new(),
                };
                let reason = ApprovalReason::Reconcile;
                self.apply_decision(grant, step, from, attempt, call, &decision, reason)
            }
            (_, None) => Err(Error::Corrupt(format!(
                "tool step {step} of run {} has no call",
                self.run_id
            ))),
        }
    }

    /// Records an operator's decision on a call of this run that waits for one. A call that
    /// does not wait, or whose decision is already recorded, is refused unchanged.
    pub(crate) fn record_approval(&mut self, approval: &Approval) -> Result<()> {
        debug_assert_eq!(&approval.run_id, self.run_id);
        let run_id = self.run_id;
        let call_id = approval.call_id.as_str();
        let Some((step, attempt)) = self.tx.waiting_call(run_id, call_id)? else {
            // Which error: a scan of the run's steps, on this path only.
            let known = self.tx.call_exists(run_id, call_id)?;
            return Err(match self.run_state()? {
                None => Error::RunNotFound(run_id.clone()),
                Some(_) if known => {
                    self.state_error(format!("call {call_id:?} is not waiting for an approval"))
                }
                Some(_) => Error::CallNotFound {
                    run_id: run_id.clone(),
                    call_id: call_id.to_owned(),
                },
            });
        };
        let at = self.now.millis();
        if !self.tx.touch_waiting(run_id, at)? {
            let reason = format!("call {call_id:?} cannot be decided: the run is not waiting");
            return Err(self.state_error(reason));
        }
        if !self.tx.insert_approval(step, attempt + 1, approval, at)? {
            return Err(self.state_error(format!("call {call_id:?} is already decided")));
        }
        let mut payload = json!({
            "call_id": call_id,
            "approved": approval.approved,
            "decided_by": approval.by,
        });
        if let Some(note) = &approval.note {
            payload["note"] = json!(note);
        }
        self.append(EventKind::ApprovalRecorded, Some(step), &payload)
    }

    /// An operator's cancel: no lease needed; the run moves to CANCELLED from RUNNING or
    /// WAITING_FOR_APPROVAL, and its lease is released with the move.
    pub(crate) fn cancel_run(&mut self, reason: &str) -> Result<()> {
        let from = [RunState::Running, RunState::WaitingForApproval];
        let what = "a finished run cannot be cancelled";
        self.move_run(RunMove {
            error: Some(reason),
            ..RunMove::new(&from, RunState::Cancelled, what)
        })?;
        let payload = json!({ "state": "CANCELLED", "reason": reason });
        self.append(EventKind::RunFinished, None, &payload)
    }
    /// Forks this new run from `origin` at step `at`: a RUNNING run of the same agent and
    /// input that nobody holds (fencing token 0: the resume that takes it over takes the
    /// first), whose steps before `at` are copies of the origin's, so that its loop asks the
    /// model again at step `at`. Writes `run.started` (with `forked_from`), `run.forked`, and a
    /// copy of each of the origin's events about those steps, in order, each saying which
    /// event it copies. The origin is only read. Returns the number of steps copied.
    ///
    /// Refused unchanged: `at` 0, past the step after the origin's last, or at a tool step
    /// (`InvalidInput`); an unknown origin; an existing id (`RunExists`); a step before `at`
    /// that has not finished (a state error of the origin, naming the step).
    pub(crate) fn fork_run(&mut self, origin: &RunId, at: u32) -> Result<u32> {
        if at == 0 {
            return Err(Error::InvalidInput(
                "steps are numbered from 1: a fork starts at step 1 or later".into(),
            ));
        }
        let source = self
            .tx
            .run(origin)?
            .ok_or_else(|| Error::RunNotFound(origin.clone()))?;
        if self.run_state()?.is_some() {
            return Err(Error::RunExists(self.run_id.clone()));
        }
        let steps = self.tx.steps(origin)?;
        let last = steps.len() as u32;
        if at > last + 1 {
            return Err(Error::InvalidInput(format!(
                "run {origin} has {last} steps: a fork starts at one of its model steps, or at \
                 step {} to keep them all",
                last + 1
            )));
        }
        if let Some(step) = steps.get(at as usize - 1)
            && step.kind != StepKind::Model
        {
            return Err(Error::InvalidInput(format!(
                "step {at} of run {origin} is a tool call: a fork starts at a model step, where \
                 the model is asked again"
            )));
        }
        let copied = &steps[..at as usize - 1];
        if let Some(step) = copied.iter().find(|s| s.state != StepState::Finished) {
            return Err(Error::RunState {
                run_id: origin.clone(),
                state: source.state,
                reason: format!(
                    "its step {} is {}: a fork copies finished steps only; fork at a model \
                     step no later than {}, or once it has finished",
                    step.step,
                    step.state.as_str(),
                    step.step
                ),
            });
        }
        self.tx.insert_run(&NewRun {
            run_id: self.run_id,
            agent: &source.agent,
            input: &source.input,
            at: self.now.millis(),
            lease: None,
        })?;
        for step in copied {
            self.tx.insert_step_row(self.run_id, step)?;
        }
        let payload = json!({
            "agent": source.agent,
            "input": source.input,
            "fencing_token": 0,
            "forked_from": { "run_id": origin, "at": at },
        });
        self.append_started(payload)?;
        let payload = json!({ "origin": origin, "at": at, "steps_copied": at - 1 });
        self.append(EventKind::RunForked, None, &payload)?;
        // The run-level events (resumes, takeovers, the end) were the origin's own: only what
        // its copied steps did is the fork's history.
        for event in self.tx.events_after(origin, 0)? {
            if event.step.is_none_or(|step| step >= at) {
                continue;
            }
            let mut payload = event.payload;
            let Some(fields) = payload.as_object_mut() else {
                return Err(Error::Corrupt(format!(
                    "event {} of run {origin} has a payload that is not an object",
                    event.seq
                )));
            };
            fields.insert(
                "copied_from".into(),
                json!({ "run_id": origin, "seq": event.seq }),
            );
            self.append(event.kind, event.step, &payload)?;
        }
        Ok(at - 1)
    }
}

/// A run's failure for want of a model answer, as `run.finished` and the outcome say it.
pub(crate) fn model_failure(error: &str, attempts: u32) -> String {
    if attempts > 1 {
        format!("the model failed after {attempts} attempts: {error}")
    } else {
        format!("the model failed: {error}")
    }
}

// ---------------------------------------------------------------------------------------------
// The lease outside the moves

/// Renews, in one write outside any transaction, `owner`'s unexpired leases on `held` (each
/// run with the fencing token its lease was acquired with): compare-and-set on the owner and
/// the token. The rows of runs that were not renewed are read afterwards, which happens only
/// when a lease was lost.
pub(crate) fn renew(
    conn: &mut dyn LeaseWrites,
    owner: &str,
    held: &[(RunId, u64)],
    ttl: std::time::Duration,
) -> Result<Renewal> {
    let wall = conn.lease_wall()?;
    let expires_at = wall + ttl.as_millis() as i64;
    let renewed = conn.renew_leases(owner, held, wall, expires_at)?;
    let mut missing = Vec::new();
    if renewed.len() < held.len() {
        let renewed: HashSet<&RunId> = renewed.iter().collect();
        for (run_id, _) in held.iter().filter(|(id, _)| !renewed.contains(id)) {
            missing.push((run_id.clone(), conn.lease_row(run_id)?));
        }
    }
    Ok(Renewal {
        expires_at,
        renewed,
        missing,
    })
}

// ---------------------------------------------------------------------------------------------
// Reads

/// What a run's model calls used, from its log; an unknown run is not found.
pub(crate) fn usage(reads: &mut dyn Reads, run_id: &RunId) -> Result<RunUsage> {
    run(reads, run_id)?;
    let mut usage = RunUsage::default();
    // A fork's copies were its origin's calls, counted there.
    let events = reads.events_after(run_id, 0)?;
    for event in events
        .iter()
        .filter(|e| e.payload.get("copied_from").is_none())
    {
        match event.kind {
            EventKind::ModelStarted => usage.attempts += 1,
            EventKind::ModelFinished if event.payload.get("error").is_none() => {
                usage.answers += 1;
                if let Some(tokens) = event
                    .payload
                    .get("usage")
                    .and_then(|u| serde_json::from_value::<Usage>(u.clone()).ok())
                {
                    usage.tokens += tokens;
                }
                if let Some(model) = event.payload.get("model").and_then(Value::as_str)
                    && !usage.models.iter().any(|m| m == model)
                {
                    usage.models.push(model.to_owned());
                }
            }
            _ => {}
        }
    }
    Ok(usage)
}

/// A run; an unknown one is not found.
pub(crate) fn run(reads: &mut dyn Reads, run_id: &RunId) -> Result<Run> {
    reads
        .run(run_id)?
        .ok_or_else(|| Error::RunNotFound(run_id.clone()))
}

/// A run's events after `after`; an unknown run is not found (every run has `run.started`).
pub(crate) fn events_after(
    reads: &mut dyn Reads,
    run_id: &RunId,
    after: u64,
) -> Result<Vec<Event>> {
    let events = reads.events_after(run_id, after)?;
    if events.is_empty() {
        run(reads, run_id)?;
    }
    Ok(events)
}

/// The stored lease of a run, read without taking or changing it.
pub(crate) fn lease(reads: &mut dyn Reads, run_id: &RunId) -> Result<Option<Lease>> {
    let row = reads
        .lease_row(run_id)?
        .ok_or_else(|| Error::RunNotFound(run_id.clone()))?;
    Ok(row.lease())
}

/// The run, its steps, and the decision recorded for its waiting step.
pub(crate) fn load(reads: &mut dyn Reads, run_id: &RunId) -> Result<RunSnapshot> {
    let run = run(reads, run_id)?;
    let steps = reads.steps(run_id)?;
    let approval = match steps.iter().find(|s| s.state == StepState::Waiting) {
        Some(waiting) => reads.approval(run_id, waiting.step, waiting.attempt + 1)?,
        None => None,
    };
    Ok(RunSnapshot {
        run,
        steps,
        approval,
    })
}

/// RUNNING runs whose lease expired by wall-clock time `wall`, with that lease; and RUNNING
/// runs nobody holds.
pub(crate) fn lease_report(reads: &mut dyn Reads) -> Result<LeaseReport> {
    let wall = reads.lease_wall()?;
    let (mut stale, mut unleased) = (Vec::new(), Vec::new());
    for (run_id, row) in reads.unleased_runs(wall)? {
        match row.lease() {
            Some(lease) => stale.push((run_id, lease)),
            None => unleased.push(run_id),
        }
    }
    Ok((stale, unleased))
}

/// The calls of a run that wait for a decision not recorded yet.
pub(crate) fn pending_calls(reads: &mut dyn Reads, run_id: &RunId) -> Result<Vec<PendingCall>> {
    let snapshot = load(reads, run_id)?;
    if snapshot.run.state != RunState::WaitingForApproval {
        // A cancelled run keeps its waiting step as it was, but nothing waits any more.
        return Ok(Vec::new());
    }
    Ok(snapshot
        .steps
        .iter()
        .filter(|step| step.state == StepState::Waiting && snapshot.approval.is_none())
        .filter_map(|step| {
            let call = step.call.clone()?;
            Some(PendingCall {
                step: step.step,
                call_id: call.id,
                tool: call.name,
                args: call.args,
                reason: step.waiting_for.unwrap_or(ApprovalReason::Policy),
            })
        })
        .collect())
}
