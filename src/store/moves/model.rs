//! A model call: its reservation, written before the request is dispatched; the attempts a
//! model policy tries again; and the answer, with the tool calls it asks for.

use std::time::Duration;

use serde_json::json;

use super::{
    Leased, Move,
    guard::{Cx, Need, model_failure},
};
use crate::{
    error::Result,
    store::{
        backend::MoveKind,
        model::{ModelOutcome, wall_millis},
    },
    types::{EventKind, RunId, RunState, StepKind, StepState},
};

/// Reserves model step `step` before its request is dispatched.
pub(crate) struct BeginModelStep {
    pub by: Leased,
    pub step: u32,
}

impl Move for BeginModelStep {
    type Output = ();

    fn kind(&self) -> MoveKind {
        MoveKind::BeginModelStep
    }

    fn run_id(&self) -> &RunId {
        &self.by.run_id
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<()> {
        cx.touch_held(&self.by.grant, Need::Margin, "a model call cannot start")?;
        let (kind, state) = (StepKind::Model, StepState::InFlight);
        cx.tx
            .insert_step(cx.run_id, self.step, kind, state, 1, None)?;
        let payload = json!({ "attempt": 1 });
        cx.append(EventKind::ModelStarted, Some(self.step), &payload)
    }
}

/// Records attempt `attempt` of model step `step`, failed with an error the agent's model
/// policy tries again after `retry_in`. The step stays in flight: a crash before the next
/// attempt leaves it for a takeover to dispatch again.
pub(crate) struct FailModelAttempt {
    pub by: Leased,
    pub step: u32,
    pub attempt: u32,
    pub error: String,
    pub retry_in: Duration,
}

impl Move for FailModelAttempt {
    type Output = ();

    fn kind(&self) -> MoveKind {
        MoveKind::FailModelAttempt
    }

    fn run_id(&self) -> &RunId {
        &self.by.run_id
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<()> {
        let what = "a model attempt's failure cannot be recorded";
        cx.touch_held(&self.by.grant, Need::Held, what)?;
        let retry_in_ms = i64::try_from(self.retry_in.as_millis()).unwrap_or(i64::MAX);
        // By the wall clock leases are read from: a process that takes the run over during
        // the backoff waits out what is left of it.
        let payload = json!({
            "attempt": self.attempt,
            "error": self.error,
            "retry_in_ms": retry_in_ms,
            "retry_at": wall_millis().saturating_add(retry_in_ms),
        });
        cx.append(EventKind::ModelAttemptFailed, Some(self.step), &payload)
    }
}

/// Starts the next attempt of model step `step`, whose attempt `attempt` failed (or was
/// abandoned by a drain), before its request is dispatched.
pub(crate) struct BeginModelAttempt {
    pub by: Leased,
    pub step: u32,
    pub attempt: u32,
}

impl Move for BeginModelAttempt {
    type Output = ();

    fn kind(&self) -> MoveKind {
        MoveKind::BeginModelAttempt
    }

    fn run_id(&self) -> &RunId {
        &self.by.run_id
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<()> {
        cx.touch_held(&self.by.grant, Need::Margin, "a model call cannot start")?;
        // In flight after a failed attempt; pending after a drain handed the run over (rarely).
        match cx.start_attempt(self.step, StepState::InFlight, self.attempt) {
            Err(err) if err.is_run_state() => {
                cx.start_attempt(self.step, StepState::Pending, self.attempt)?
            }
            started => started?,
        }
        let payload = json!({ "attempt": self.attempt + 1 });
        cx.append(EventKind::ModelStarted, Some(self.step), &payload)
    }
}

/// Records the model's answer to attempt `attempt` of step `step`. Tool calls (their ids
/// already unique within the run) become pending steps numbered after this one; a final answer
/// finishes the run; a model error fails it.
pub(crate) struct FinishModelStep {
    pub by: Leased,
    pub step: u32,
    pub attempt: u32,
    pub outcome: ModelOutcome,
}

impl Move for FinishModelStep {
    type Output = ();

    fn kind(&self) -> MoveKind {
        MoveKind::FinishModelStep
    }

    fn run_id(&self) -> &RunId {
        &self.by.run_id
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<()> {
        let (grant, step, attempt) = (&self.by.grant, self.step, self.attempt);
        cx.touch_held(grant, Need::Held, "the model's answer cannot be recorded")?;
        let (response, recorded) = match &self.outcome {
            ModelOutcome::Failed { error, attempts } => {
                cx.close_step(step, StepState::InFlight, attempt, None)?;
                let payload = json!({ "error": error, "attempt": attempt, "attempts": attempts });
                cx.append(EventKind::ModelFinished, Some(step), &payload)?;
                let error = model_failure(error, *attempts);
                let state = RunState::Failed;
                return cx.finish_run(grant, state, None, Some(&error), Some(*attempts));
            }
            ModelOutcome::Answered { response, recorded } => (response, recorded),
        };
        // The loop made the call ids unique within the run, from every id it read back on
        // resume; the database checks only those of waiting calls.
        for (call, tool_step) in response.tool_calls.iter().zip(step + 1..) {
            let (kind, state) = (StepKind::Tool, StepState::Pending);
            cx.tx
                .insert_step(cx.run_id, tool_step, kind, state, 0, Some(call))?;
        }
        cx.close_step_rendered(step, StepState::InFlight, attempt, recorded)?;
        cx.append_rendered(EventKind::ModelFinished, Some(step), recorded)?;
        if response.tool_calls.is_empty() {
            let output = response.text.clone().unwrap_or_default();
            cx.finish_run(grant, RunState::Succeeded, Some(&output), None, None)?;
        }
        Ok(())
    }
}
