//! Recovery from a dead owner: the takeover of a run whose lease expired or is absent, and the
//! one reconciliation of each step it found interrupted.

use std::time::Instant;

use serde_json::json;

use super::{
    Leased, Move,
    guard::{Cx, Need, model_failure},
    reads,
};
use crate::{
    error::{Error, Result},
    store::{
        backend::MoveKind,
        model::{Resolution, RunSnapshot, ToolDecision, from_millis},
    },
    types::{ApprovalReason, EventKind, RunId, RunState, StepState, ToolCall, ToolResult},
};

/// Takes over a RUNNING run whose lease expired or is absent: the lease is taken and every
/// step in flight marked interrupted, in one transaction with `run.resumed` (and
/// `lease.taken_over` when someone held it, or `run.handed_over` when a drain released it).
///
/// A live lease of another owner is refused with `RunLeased` before the clock is read or
/// anything is written. This supervisor's own live lease is not refused: the caller checked
/// that it executes no call of this run, so that lease is a leftover.
pub(crate) struct TakeOver {
    pub by: Leased,
}

/// What a takeover did.
#[derive(Debug)]
pub(crate) struct TakenOver {
    /// The steps it marked interrupted, in order.
    pub interrupted: Vec<u32>,
    /// The new lease's expiry.
    #[cfg_attr(not(test), allow(dead_code))]
    pub expires_at: i64,
    /// Whose lease it was: none for a run nobody held (one that waited for a slot, a fork, a
    /// run a drain released).
    pub previous_owner: Option<String>,
    /// A drain released it (`run.handed_over` was written).
    pub handed_over: bool,
    /// The run as the takeover leaves it, read in its transaction: an owner whose lease lapsed
    /// may have written an outcome since any earlier read, and that step must not run again.
    pub snapshot: RunSnapshot,
}

impl Move for TakeOver {
    type Output = TakenOver;

    fn kind(&self) -> MoveKind {
        MoveKind::TakeOver
    }

    fn run_id(&self) -> &RunId {
        &self.by.run_id
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<TakenOver> {
        let (grant, run_id) = (&self.by.grant, cx.run_id);
        let holder = &grant.holder;
        let what = "only a RUNNING run can be taken over";
        let row = cx
            .tx
            .lease_row(run_id)?
            .ok_or_else(|| Error::RunNotFound(run_id.clone()))?;
        if row.state != RunState::Running {
            return Err(cx.refused(None, what));
        }
        let wall = cx.tx.lease_wall()?;
        if let (Some(owner), Some(expires_at)) = (&row.owner, row.expires_at)
            && expires_at > wall
            && **owner != *holder.owner
        {
            return Err(Error::RunLeased {
                run_id: run_id.clone(),
                owner: owner.clone(),
                expires_at: from_millis(expires_at),
            });
        }
        // Read before the wall clock: the grant's deadline is then no later than the expiry.
        let sent = Instant::now();
        let expires_at = holder.expiry(cx.tx.lease_wall()?);
        let at = cx.now.millis();
        if !cx
            .tx
            .take_lease(run_id, at, &holder.owner, expires_at, &row)?
        {
            return Err(cx.refused(None, what));
        }
        grant.acquired(row.epoch + 1, sent);
        // A run nobody holds was released by a drain if that is the last thing its log says.
        let released = match row.owner {
            Some(_) => None,
            None => {
                (cx.tx.last_event(run_id)?).filter(|event| event.kind == EventKind::RunReleased)
            }
        };
        let payload = json!({ "from": RunState::Running.as_str(), "fencing_token": row.epoch + 1 });
        cx.append(EventKind::RunResumed, None, &payload)?;
        if let Some(previous) = &row.owner {
            let payload = json!({
                "previous_owner": previous,
                "previous_expires_at": row.expires_at,
                "new_owner": &*holder.owner,
                "new_expires_at": expires_at,
            });
            cx.append(EventKind::LeaseTakenOver, None, &payload)?;
        } else if let Some(released) = &released {
            // A drain released it at a step boundary: nothing is in flight, nothing waited.
            let payload = json!({
                "previous_owner": released.payload["owner"],
                "new_owner": &*holder.owner,
                "fencing_token": row.epoch + 1,
            });
            cx.append(EventKind::RunHandedOver, None, &payload)?;
        }
        let mut interrupted = cx.tx.interrupt_steps(run_id)?;
        interrupted.sort_unstable_by_key(|(step, ..)| *step);
        let mut steps = Vec::with_capacity(interrupted.len());
        for (step, kind, attempt) in interrupted {
            let payload = json!({ "kind": kind.as_str(), "attempt": attempt });
            cx.append(EventKind::StepInterrupted, Some(step), &payload)?;
            steps.push(step);
        }
        Ok(TakenOver {
            interrupted: steps,
            expires_at,
            previous_owner: row.owner,
            handed_over: released.is_some(),
            snapshot: reads::load(cx.tx, run_id)?,
        })
    }
}

/// Records the one reconciliation of interrupted step `step` together with what it leads to:
/// its call dispatched or run again, its output recorded, a person asked, or the run failed.
pub(crate) struct Reconcile {
    pub by: Leased,
    pub step: u32,
    pub attempt: u32,
    /// The step's tool call; `None` for a model step.
    pub call: Option<ToolCall>,
    pub resolution: Resolution,
}

impl Move for Reconcile {
    type Output = ();

    fn kind(&self) -> MoveKind {
        MoveKind::Reconcile
    }

    fn run_id(&self) -> &RunId {
        &self.by.run_id
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<()> {
        let (grant, step, attempt) = (&self.by.grant, self.step, self.attempt);
        let resolution = &self.resolution;
        let what = "an interrupted step cannot be reconciled";
        match resolution {
            Resolution::AwaitApproval { .. } => cx.pause(grant)?,
            // Running again starts a side effect: the lease must be unexpired.
            Resolution::Redispatch { .. } | Resolution::Retry { .. } => {
                cx.touch_held(grant, Need::Margin, what)?
            }
            Resolution::Applied(_) => cx.touch_held(grant, Need::Held, what)?,
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
        cx.append(EventKind::StepReconciled, Some(step), &payload)?;
        match (resolution, &self.call) {
            (Resolution::Redispatch { .. }, _) => {
                cx.start_attempt(step, from, attempt)?;
                let payload = json!({ "attempt": attempt + 1 });
                cx.append(EventKind::ModelStarted, Some(step), &payload)
            }
            (Resolution::GiveUp { error, .. }, _) => {
                cx.close_step(step, from, attempt, None)?;
                let payload = json!({ "error": error, "attempt": attempt, "attempts": attempt });
                cx.append(EventKind::ModelFinished, Some(step), &payload)?;
                let error = model_failure(error, attempt);
                cx.finish_run(grant, RunState::Failed, None, Some(&error), Some(attempt))
            }
            (Resolution::Applied(output), Some(call)) => {
                let result = serde_json::to_value(ToolResult::Ok(output.clone())).unwrap();
                cx.close_step(step, from, attempt, Some(&result))?;
                let payload = json!({
                    "call_id": call.id,
                    "attempt": attempt,
                    "output": output,
                    "reconciled": true,
                });
                cx.append(EventKind::ToolFinished, Some(step), &payload)
            }
            (Resolution::Retry { .. }, Some(call)) => {
                cx.start_tool_attempt(grant, step, from, attempt, call)
            }
            (Resolution::AwaitApproval { .. }, Some(call)) => {
                let decision = ToolDecision::RequireApproval {
                    reason: String::new(),
                };
                let reason = ApprovalReason::Reconcile;
                cx.apply_decision(grant, step, from, attempt, call, &decision, reason)
            }
            (_, None) => Err(Error::Corrupt(format!(
                "tool step {step} of run {} has no call",
                cx.run_id
            ))),
        }
    }
}
