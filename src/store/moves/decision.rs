//! Decisions taken outside the loop: an operator's approval or denial of a waiting call, and
//! the resume that acts on the decision recorded for it.

use serde_json::json;

use super::{
    Leased, Move,
    guard::{Cx, RunMove},
};
use crate::{
    error::{Error, Result},
    store::{backend::MoveKind, model::ToolDecision},
    types::{Approval, ApprovalReason, EventKind, RunId, RunState, StepState, ToolCall},
};

/// Records an operator's decision on a call that waits for one, whichever door it comes
/// through (the store, a supervisor, the API, the command line). A call that does not wait,
/// or whose decision is already recorded, is refused unchanged.
pub(crate) struct RecordApproval {
    pub approval: Approval,
}

impl Move for RecordApproval {
    type Output = ();

    fn kind(&self) -> MoveKind {
        MoveKind::RecordApproval
    }

    fn run_id(&self) -> &RunId {
        &self.approval.run_id
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<()> {
        let (approval, run_id) = (&self.approval, cx.run_id);
        let call_id = approval.call_id.as_str();
        let Some((step, attempt)) = cx.tx.waiting_call(run_id, call_id)? else {
            // Which error: a scan of the run's steps, on this path only.
            let known = cx.tx.call_exists(run_id, call_id)?;
            return Err(match cx.run_state()? {
                None => Error::RunNotFound(run_id.clone()),
                Some(_) if known => {
                    cx.state_error(format!("call {call_id:?} is not waiting for an approval"))
                }
                Some(_) => Error::CallNotFound {
                    run_id: run_id.clone(),
                    call_id: call_id.to_owned(),
                },
            });
        };
        let at = cx.now.millis();
        if !cx.tx.touch_waiting(run_id, at)? {
            let reason = format!("call {call_id:?} cannot be decided: the run is not waiting");
            return Err(cx.state_error(reason));
        }
        if !cx.tx.insert_approval(step, attempt + 1, approval, at)? {
            return Err(cx.state_error(format!("call {call_id:?} is already decided")));
        }
        let mut payload = json!({
            "call_id": call_id,
            "approved": approval.approved,
            "decided_by": approval.by,
        });
        if let Some(note) = &approval.note {
            payload["note"] = json!(note);
        }
        cx.append(EventKind::ApprovalRecorded, Some(step), &payload)
    }
}

/// Resumes a waiting run: back to RUNNING, the resume-time decision recorded and acted on, in
/// one compare-and-set on the run's state, so of two resumers one wins. Returns the expiry of
/// the lease it took.
pub(crate) struct ResumeWaiting {
    pub by: Leased,
    pub step: u32,
    pub attempt: u32,
    pub call: ToolCall,
    pub reason: ApprovalReason,
    pub decision: ToolDecision,
    /// Who decided: `policy` or `approval`.
    pub source: &'static str,
}

impl Move for ResumeWaiting {
    type Output = i64;

    fn kind(&self) -> MoveKind {
        MoveKind::ResumeWaiting
    }

    fn run_id(&self) -> &RunId {
        &self.by.run_id
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<i64> {
        let grant = &self.by.grant;
        let what = "only a run waiting for approval can be resumed this way";
        let from = [RunState::WaitingForApproval];
        let expires_at = cx
            .move_run(RunMove {
                take: Some(grant),
                ..RunMove::new(&from, RunState::Running, what)
            })?
            .expect("entering RUNNING takes the lease");
        let payload = json!({
            "from": RunState::WaitingForApproval.as_str(),
            "fencing_token": grant.token(),
        });
        cx.append(EventKind::RunResumed, None, &payload)?;
        let payload = self.decision.payload(&self.call, self.source);
        cx.append(EventKind::PolicyDecided, Some(self.step), &payload)?;
        let (step, attempt, from) = (self.step, self.attempt, StepState::Waiting);
        cx.apply_decision(
            grant,
            step,
            from,
            attempt,
            &self.call,
            &self.decision,
            self.reason,
        )?;
        Ok(expires_at)
    }
}
