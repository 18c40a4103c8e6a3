//! The reconciliation step: an interrupted step is reconciled exactly once, its decision and
//! what it leads to in one move.

use std::{panic::AssertUnwindSafe, time::Duration};

use futures_util::FutureExt;

use super::{
    run_loop::{Next, RunLoop},
    send,
};
use crate::{
    actors::store::ReadState,
    agent::{Heart, Reconciliation},
    error::Result,
    store::{
        model::{Resolution, StepRow, ToolDecision, wall_millis},
        moves::{self, Reconcile},
    },
    types::{ApprovalReason, EventKind, Outcome, StepState, ToolResult},
};

impl RunLoop {
    /// Reconciles an interrupted step, exactly once: the decision and what it leads to are one
    /// move.
    pub(super) async fn reconcile(&mut self, step: &StepRow) -> Result<Next> {
        let (number, attempt) = (step.step, step.attempt);
        let Some(call) = step.call.clone() else {
            return self.reconcile_model(number, attempt).await;
        };
        let tool = self.agent().tools.get(&call.name).map(|t| t.tool.clone());
        let answer = match &tool {
            Some(tool) => {
                // Given the progress the interrupted attempt kept; its heartbeats go nowhere.
                let (heart, _) = Heart::new();
                let ctx = self.tool_context(step, &call, self.cancellation().clone(), heart);
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
        // A drain that began while the hook was asked: the step stays interrupted, for the
        // next owner's one reconciliation, and no call starts here.
        if self.draining() {
            return self.hand_over().await;
        }
        let reconciled = self
            .commit(Reconcile {
                by: self.leased(),
                step: number,
                attempt,
                call: Some(call.clone()),
                resolution: resolution.clone(),
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
    pub(super) async fn reconcile_model(&mut self, number: u32, attempt: u32) -> Result<Next> {
        let id = self.run_id().clone();
        let last = send(
            self.store().addr(),
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
        let policy = &self.agent().model_policy;
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
        let reconciled = self
            .commit(Reconcile {
                by: self.leased(),
                step: number,
                attempt,
                call: None,
                resolution: resolution.clone(),
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
}
