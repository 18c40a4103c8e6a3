//! The guarded primitives the moves are written with: the lease's and the state's guards, the
//! steps' compare-and-sets, and the log.

use std::time::Instant;

use serde_json::{Value, json};

use crate::{
    error::{Error, Result},
    store::{
        backend::{RunUpdate, StepUpdate, Tx},
        model::{Grant, Now, Rendered, ToolDecision, from_millis, idempotency_key},
    },
    types::{
        ApprovalReason, EventKind, LeaseLostReason, RunId, RunState, StepState, ToolCall,
        ToolResult,
    },
};

/// The fencing token of a run's first lease, taken by its insert.
pub(crate) const FIRST_TOKEN: u64 = 1;

/// What a loop's move needs of its lease. Moves that start a side effect need the start
/// margin left, by the loop's own deadline and by the stored expiry; the others need it held
/// (nobody took it over since this loop acquired it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Need {
    Held,
    Margin,
}

/// A move of one run being applied: its transaction, its time (read from the clock on first
/// use), and the run. The moves are written with its guarded primitives.
pub(crate) struct Cx<'a, 'c> {
    pub(super) tx: &'a mut dyn Tx,
    pub(super) now: &'a mut Now<'c>,
    pub(super) run_id: &'a RunId,
}

/// A move of a run between states. Leaving RUNNING releases the lease in the same write;
/// entering it takes the lease for `take`.
pub(super) struct RunMove<'a> {
    pub(super) from: &'a [RunState],
    pub(super) to: RunState,
    pub(super) output: Option<&'a str>,
    pub(super) error: Option<&'a str>,
    /// The grant the run's lease must be (a loop's move); `None` for an operator's.
    pub(super) guard: Option<&'a Grant>,
    /// The grant that takes the lease (entering RUNNING).
    pub(super) take: Option<&'a Grant>,
    pub(super) what: &'a str,
}

impl<'a> RunMove<'a> {
    pub(super) fn new(from: &'a [RunState], to: RunState, what: &'a str) -> Self {
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

impl<'a, 'c> Cx<'a, 'c> {
    /// A move of `run_id` in `tx`, at the time `now` reads.
    pub(in crate::store) fn new(
        tx: &'a mut dyn Tx,
        now: &'a mut Now<'c>,
        run_id: &'a RunId,
    ) -> Self {
        Cx { tx, now, run_id }
    }

    /// Appends `run.started`, with the trace context (a W3C `traceparent`, for the run's later
    /// executions to join the same trace) when there is one.
    pub(super) fn append_started(&mut self, mut payload: Value, trace: Option<&str>) -> Result<()> {
        if let (Some(traceparent), Some(fields)) = (trace, payload.as_object_mut()) {
            fields.insert("trace".into(), json!({ "traceparent": traceparent }));
        }
        self.append(EventKind::RunStarted, None, &payload)
    }

    /// Explains a guard that matched no row: the run does not exist, is in another state, or
    /// (for a loop's move) its lease is another owner's, released, or expired.
    pub(super) fn refused(&mut self, grant: Option<&Grant>, reason: &str) -> Error {
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

    pub(super) fn run_state(&mut self) -> Result<Option<RunState>> {
        Ok(self.tx.lease_row(self.run_id)?.map(|row| row.state))
    }

    /// A state error about this run, or not found if it does not exist.
    pub(super) fn state_error(&mut self, reason: String) -> Error {
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
    pub(super) fn touch_held(&mut self, grant: &Grant, need: Need, what: &str) -> Result<()> {
        if need == Need::Margin && !grant.has_margin() {
            return Err(self.short_of_margin(grant, what));
        }
        let at = self.now.millis();
        let (owner, token) = (&grant.holder.owner, grant.token());
        let touched = match need {
            Need::Held => self.tx.touch_run(self.run_id, at, owner, token, None)?,
            Need::Margin => {
                let margin = grant.holder.margin_millis();
                self.tx
                    .touch_run_with_margin(self.run_id, at, owner, token, margin)?
            }
        };
        if touched {
            Ok(())
        } else {
            Err(self.refused(Some(grant), what))
        }
    }

    /// Why a start was refused for want of the margin: the lease lost (expired), when the run
    /// is still under `grant`'s lease; what else refuses it otherwise.
    pub(super) fn short_of_margin(&mut self, grant: &Grant, what: &str) -> Error {
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
    pub(super) fn move_run(&mut self, m: RunMove<'_>) -> Result<Option<i64>> {
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
    pub(super) fn move_step(&mut self, step: u32, update: StepUpdate<'_>) -> Result<()> {
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
    pub(super) fn close_step(
        &mut self,
        step: u32,
        from: StepState,
        attempt: u32,
        result: Option<&Value>,
    ) -> Result<()> {
        self.finish_step(step, from, attempt, result, None)
    }

    /// Finishes a step as [`Cx::close_step`] does, with a result whose text is made already.
    pub(super) fn close_step_rendered(
        &mut self,
        step: u32,
        from: StepState,
        attempt: u32,
        result: &Rendered,
    ) -> Result<()> {
        self.finish_step(
            step,
            from,
            attempt,
            Some(result.value()),
            Some(result.text()),
        )
    }

    fn finish_step(
        &mut self,
        step: u32,
        from: StepState,
        attempt: u32,
        result: Option<&Value>,
        result_text: Option<&str>,
    ) -> Result<()> {
        let update = StepUpdate {
            from,
            attempt,
            to: StepState::Finished,
            starts: false,
            result,
            result_text,
            waiting_for: None,
        };
        self.move_step(step, update)
    }

    /// Moves a step in flight as its next attempt.
    pub(super) fn start_attempt(&mut self, step: u32, from: StepState, attempt: u32) -> Result<()> {
        let update = StepUpdate {
            from,
            attempt,
            to: StepState::InFlight,
            starts: true,
            result: None,
            result_text: None,
            waiting_for: None,
        };
        self.move_step(step, update)
    }

    /// Starts the next attempt of a tool step and writes its `step.tool_started`, with the
    /// fencing token the attempt runs under.
    pub(super) fn start_tool_attempt(
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

    /// Appends an event whose payload's text is made already.
    pub(super) fn append_rendered(
        &mut self,
        kind: EventKind,
        step: Option<u32>,
        payload: &Rendered,
    ) -> Result<()> {
        let at = self.now.millis();
        self.tx
            .append_rendered(self.run_id, kind, at, step, payload)
    }

    pub(super) fn append(
        &mut self,
        kind: EventKind,
        step: Option<u32>,
        payload: &Value,
    ) -> Result<()> {
        let at = self.now.millis();
        self.tx.append_event(self.run_id, kind, at, step, payload)
    }

    /// Moves a RUNNING run to a finished state and writes `run.finished`.
    pub(super) fn finish_run(
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
        self.append(EventKind::RunFinished, None, &payload)?;
        self.wake_parent(state, output, error)
    }

    /// Moves the run to WAITING_FOR_APPROVAL, releasing `grant`'s lease.
    pub(super) fn pause(&mut self, grant: &Grant) -> Result<()> {
        let to = RunState::WaitingForApproval;
        self.move_run(RunMove {
            guard: Some(grant),
            ..RunMove::new(&[RunState::Running], to, "it cannot pause")
        })?;
        Ok(())
    }

    /// The step's side of a decision: start it, close it with the denial, or make it wait.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn apply_decision(
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
                        result_text: None,
                        waiting_for: Some(reason),
                    },
                )?;
                let payload =
                    json!({ "call_id": call.id, "tool": call.name, "reason": reason.as_str() });
                self.append(EventKind::RunWaiting, Some(step), &payload)
            }
        }
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
