//! Resuming a decision: a run that waits for an approval goes on with the decision recorded
//! for it (or the policy's, asked again).

use std::panic::AssertUnwindSafe;

use super::run_loop::{Next, RunLoop};
use crate::{
    agent::Decision,
    error::{Error, Result},
    store::{
        model::{RunSnapshot, ToolDecision},
        moves::ResumeWaiting,
    },
    types::{ApprovalReason, Outcome, PendingCall, StepState},
};

impl RunLoop {
    /// Resumes a run that waits for an approval: the resume-time decision and what it leads to
    /// are one move. `Some` when the run still waits (and nothing was changed).
    pub(super) async fn resume_waiting(
        &mut self,
        snapshot: &RunSnapshot,
    ) -> Result<Option<Outcome>> {
        let waiting = snapshot
            .steps
            .iter()
            .find(|s| s.state == StepState::Waiting)
            .cloned()
            .ok_or_else(|| {
                Error::Corrupt(format!(
                    "run {} waits for approval with no waiting step",
                    self.run_id()
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
                let policy = self.agent().policy.clone();
                Some(
                    std::panic::catch_unwind(AssertUnwindSafe(|| {
                        policy.decide(self.run_id(), &call)
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
        self.commit(ResumeWaiting {
            by: self.leased(),
            step: number,
            attempt,
            call: call.clone(),
            reason,
            decision: decision.clone(),
            source,
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
            run_id = %self.run_id(),
            step = number,
            call_id = %call.id,
            tool = %call.name,
            approved,
            decided_by = %by.unwrap_or(source),
            owner = %self.grant().holder.owner,
            fencing_token = self.grant().token(),
            "run resumed"
        );
        match self.after_decision(number, attempt, call, decision, reason)? {
            Next::Continue => Ok(None),
            Next::Return(outcome) => Ok(Some(outcome)),
        }
    }
}
