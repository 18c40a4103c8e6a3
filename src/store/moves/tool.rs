//! A tool call: the policy's decision on it and what that leads to (its start, its denial, or
//! a pause for an approval), its rejection when it cannot run at all, and its outcome.

use serde_json::{Value, json};

use super::{
    Leased, Move,
    guard::{Cx, Need},
};
use crate::{
    error::{Error, Result},
    store::{backend::MoveKind, model::ToolDecision},
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
    pub call_id: String,
    pub result: ToolResult,
    /// `result` as the step keeps it.
    pub result_json: Value,
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
        cx.close_step(step, StepState::InFlight, attempt, Some(&self.result_json))?;
        let mut payload = json!({ "call_id": self.call_id, "attempt": attempt });
        match &self.result {
            ToolResult::Ok(output) => payload["output"] = output.clone(),
            ToolResult::Error(error) => payload["error"] = json!(error),
        }
        if late {
            payload["late"] = json!(true);
        }
        cx.append(EventKind::ToolFinished, Some(step), &payload)?;
        Ok(late)
    }
}
