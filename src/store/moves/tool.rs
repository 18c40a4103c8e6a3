//! A tool call: the policy's decision on it and what that leads to (its start, its denial, or
//! a pause for an approval), its rejection when it cannot run at all, its progress, its
//! timeout, and its outcome.

use std::time::Duration;

use serde_json::{Value, json};

use super::{
    Leased, Move,
    guard::{Cx, Need},
};
use crate::{
    error::{Error, Result},
    store::{
        backend::{MoveKind, StepUpdate},
        model::{Rendered, ToolDecision},
    },
    types::{ApprovalReason, EventKind, RunId, RunState, StepState, ToolCall, ToolResult},
};

/// Records the policy's decision on pending tool step `step` and acts on it in the same
/// transaction: starts the tool, records the denial, or pauses the run.
pub(crate) struct DecideTool {
    pub by: Leased,
    pub step: u32,
    pub call: ToolCall,
    pub decision: ToolDecision,
}

impl Move for DecideTool {
    type Output = ();

    fn kind(&self) -> MoveKind {
        MoveKind::DecideTool
    }

    fn run_id(&self) -> &RunId {
        &self.by.run_id
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<()> {
        let (grant, step, call, decision) = (&self.by.grant, self.step, &self.call, &self.decision);
        let what = "a tool call cannot be decided";
        match decision {
            ToolDecision::RequireApproval { .. } => cx.pause(grant)?,
            ToolDecision::Allow { .. } => cx.touch_held(grant, Need::Margin, what)?,
            ToolDecision::Deny { .. } => cx.touch_held(grant, Need::Held, what)?,
        }
        let payload = decision.payload(call, "policy");
        cx.append(EventKind::PolicyDecided, Some(step), &payload)?;
        let (from, reason) = (StepState::Pending, ApprovalReason::Policy);
        cx.apply_decision(grant, step, from, 0, call, decision, reason)
    }
}

/// Closes a pending call the loop cannot execute (an unknown tool, arguments that are not an
/// object): the model is told why; nothing ran.
pub(crate) struct RejectTool {
    pub by: Leased,
    pub step: u32,
    pub call: ToolCall,
    pub error: String,
}

impl Move for RejectTool {
    type Output = ();

    fn kind(&self) -> MoveKind {
        MoveKind::RejectTool
    }

    fn run_id(&self) -> &RunId {
        &self.by.run_id
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<()> {
        let what = "a tool call cannot be rejected";
        cx.touch_held(&self.by.grant, Need::Held, what)?;
        let result = serde_json::to_value(ToolResult::Error(self.error.clone())).unwrap();
        cx.close_step(self.step, StepState::Pending, 0, Some(&result))?;
        let payload = json!({
            "call_id": self.call.id,
            "attempt": 0,
            "error": self.error,
            "rejected": true,
        });
        cx.append(EventKind::ToolFinished, Some(self.step), &payload)
    }
}

/// Records a tool's outcome. On a RUNNING run it is an ordinary step; on a run an operator
/// cancelled meanwhile it is recorded as late (the run stays cancelled). Returns whether late.
pub(crate) struct FinishTool {
    pub by: Leased,
    pub step: u32,
    pub attempt: u32,
    /// The outcome as the step keeps it.
    pub result: Rendered,
    /// `step.tool_finished`'s payload for an outcome on time.
    pub finished: Rendered,
}

impl FinishTool {
    /// The outcome `result` of attempt `attempt` of tool step `step` (call `call_id`), its
    /// JSON made here, on the caller's thread.
    pub(crate) fn new(
        by: Leased,
        step: u32,
        attempt: u32,
        call_id: &str,
        result: &ToolResult,
    ) -> Self {
        let mut finished = json!({ "call_id": call_id, "attempt": attempt });
        match result {
            ToolResult::Ok(output) => finished["output"] = output.clone(),
            ToolResult::Error(error) => finished["error"] = json!(error),
        }
        FinishTool {
            by,
            step,
            attempt,
            result: Rendered::new(serde_json::to_value(result).expect("a tool result serializes")),
            finished: Rendered::new(finished),
        }
    }
}

impl Move for FinishTool {
    type Output = bool;

    fn kind(&self) -> MoveKind {
        MoveKind::FinishTool
    }

    fn run_id(&self) -> &RunId {
        &self.by.run_id
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<bool> {
        // Written only while the loop holds the lease (or, late, once an operator cancelled):
        // otherwise the step stays in flight for the owner that took the run over.
        let what = "the tool's outcome cannot be recorded";
        let late = match cx.touch_held(&self.by.grant, Need::Held, what) {
            Ok(()) => false,
            Err(Error::RunState {
                state: RunState::Cancelled,
                ..
            }) => true,
            Err(err) => return Err(err),
        };
        let (step, attempt) = (self.step, self.attempt);
        cx.close_step_rendered(step, StepState::InFlight, attempt, &self.result)?;
        if late {
            let mut payload = self.finished.value().clone();
            payload["late"] = json!(true);
            cx.append(EventKind::ToolFinished, Some(step), &payload)?;
        } else {
            cx.append_rendered(EventKind::ToolFinished, Some(step), &self.finished)?;
        }
        Ok(late)
    }
}

/// Keeps a tool call's latest heartbeat as its step's progress, for the call's next attempt:
/// only while the loop holds the lease and the step is in flight at this attempt. Writes no
/// event: progress is a hint for the next attempt, not a fact of the run's history.
pub(crate) struct RecordProgress {
    pub by: Leased,
    pub step: u32,
    pub attempt: u32,
    pub progress: Value,
}

impl Move for RecordProgress {
    type Output = ();

    fn kind(&self) -> MoveKind {
        MoveKind::RecordProgress
    }

    fn run_id(&self) -> &RunId {
        &self.by.run_id
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<()> {
        let what = "a tool's progress cannot be kept";
        cx.touch_held(&self.by.grant, Need::Held, what)?;
        keep_progress(cx, self.step, self.attempt, &self.progress)
    }
}

/// Why a tool call timed out, as `step.tool_timed_out` says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TimedOut {
    /// It ran past its timeout.
    Timeout,
    /// Its heartbeats stopped for longer than its heartbeat timeout.
    Heartbeat,
}

impl TimedOut {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            TimedOut::Timeout => "timeout",
            TimedOut::Heartbeat => "heartbeat",
        }
    }
}

/// Records that attempt `attempt` of tool step `step` did not return within the grace after
/// its timeout: the step is marked interrupted (`step.tool_timed_out`), as a takeover marks a
/// dead owner's, for the loop to reconcile it. The latest heartbeat not kept yet, if any, is
/// kept with it.
pub(crate) struct TimeOutTool {
    pub by: Leased,
    pub step: u32,
    pub attempt: u32,
    pub call_id: String,
    pub why: TimedOut,
    /// The limit that passed: the timeout, or the heartbeat timeout.
    pub limit: Duration,
    pub progress: Option<Value>,
}

impl Move for TimeOutTool {
    type Output = ();

    fn kind(&self) -> MoveKind {
        MoveKind::TimeOutTool
    }

    fn run_id(&self) -> &RunId {
        &self.by.run_id
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<()> {
        let (step, attempt) = (self.step, self.attempt);
        let what = "a tool call cannot be timed out";
        cx.touch_held(&self.by.grant, Need::Held, what)?;
        if let Some(progress) = &self.progress {
            keep_progress(cx, step, attempt, progress)?;
        }
        let update = StepUpdate {
            from: StepState::InFlight,
            attempt,
            to: StepState::Interrupted,
            starts: false,
            result: None,
            result_text: None,
            waiting_for: None,
        };
        cx.move_step(step, update)?;
        let payload = json!({
            "call_id": self.call_id,
            "attempt": attempt,
            "why": self.why.as_str(),
            "limit_ms": u64::try_from(self.limit.as_millis()).unwrap_or(u64::MAX),
        });
        cx.append(EventKind::ToolTimedOut, Some(step), &payload)
    }
}

/// Keeps `progress` as the progress of step `step`, in flight at attempt `attempt`; a step
/// found elsewhere refuses the move.
fn keep_progress(cx: &mut Cx<'_, '_>, step: u32, attempt: u32, progress: &Value) -> Result<()> {
    if cx.tx.set_progress(cx.run_id, step, attempt, progress)? {
        return Ok(());
    }
    Err(cx.state_error(format!(
        "step {step} is no longer in flight at attempt {attempt}"
    )))
}
