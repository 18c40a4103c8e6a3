//! The tool call step: run a started call and record its outcome, paired with the move that
//! follows it.

use std::{panic::AssertUnwindSafe, time::Instant};

use futures_util::FutureExt;
use tracing::Instrument;

use super::run_loop::{Next, RunLoop};
use crate::{
    agent::ToolContext,
    error::{Error, Result},
    metrics,
    store::{
        model::{StepRow, idempotency_key},
        moves::FinishTool,
    },
    types::{FencingToken, LeaseLostReason, StepKind, StepState, ToolCall, ToolResult},
};

impl RunLoop {
    /// Runs a started tool call and records its outcome, with the move that follows it.
    pub(super) async fn call_tool(&mut self, step: &StepRow) -> Result<Next> {
        let call = step.call.clone().expect("tool steps have a call");
        let (number, attempt) = (step.step, step.attempt);
        // The start was written under the lease, but its answer came back after the deadline
        // (the process stalled, or the network held the answer up): by now another process may
        // have taken the run over. The call is not made; the takeover reconciles the step.
        if self.grant().remaining().is_zero() {
            tracing::warn!(step = number, tool = %call.name, "the lease expired before the tool could start");
            return Err(Error::LeaseLost {
                run_id: self.run_id().clone(),
                reason: LeaseLostReason::Expired,
            });
        }
        let span = tracing::info_span!(
            "tool",
            step = i64::from(number),
            tool = %call.name,
            call_id = %call.id,
            attempt = i64::from(attempt),
            fencing_token = self.grant().token() as i64,
            otel.name = tracing::field::Empty,
        );
        #[cfg(feature = "otel")]
        span.record("otel.name", format!("execute_tool {}", call.name));
        let result = match self.agent().tools.get(&call.name).map(|t| t.tool.clone()) {
            // The agent was registered again without this tool since the call started.
            None => {
                metrics::tool_failed();
                ToolResult::Error(format!("the agent has no tool named {:?}", call.name))
            }
            Some(tool) => {
                let ctx = self.tool_context(number, &call, attempt);
                let started = Instant::now();
                // Cancellation is the tool's to honour: its outcome is awaited and recorded.
                let outcome = AssertUnwindSafe(tool.call(&ctx, &call.args))
                    .catch_unwind()
                    .instrument(span)
                    .await;
                metrics::step_took(StepKind::Tool, started.elapsed());
                if !matches!(outcome, Ok(Ok(_))) {
                    metrics::tool_failed();
                }
                match outcome
                    .map_err(|panic| self.panicked(number, format!("tool {}", call.name), panic))?
                {
                    Ok(output) => ToolResult::Ok(output),
                    Err(error) => ToolResult::Error(error.0),
                }
            }
        };
        let result_json = serde_json::to_value(&result).unwrap();
        let first = FinishTool {
            by: self.leased(),
            step: number,
            attempt,
            call_id: call.id,
            result,
            result_json: result_json.clone(),
        };
        self.set_step(number, StepState::Finished, attempt, Some(result_json));
        // A lost lease or an operator's cancel (both fire the signal) plans nothing more: the
        // outcome alone is offered. So does a drain, which then hands the run over.
        let next = if self.cancellation().is_cancelled() || self.draining() {
            Ok(None)
        } else {
            self.plan()
        };
        // A late outcome (an operator cancelled the run) is followed by nothing.
        let (late, next) = self.commit_with(first, next, |late| !late).await?;
        if late {
            return self.cancelled().await.map(Next::Return);
        }
        next
    }

    pub(super) fn tool_context(&self, step: u32, call: &ToolCall, attempt: u32) -> ToolContext {
        ToolContext {
            run_id: self.run_id().clone(),
            step,
            call_id: call.id.clone(),
            attempt,
            idempotency_key: idempotency_key(self.run_id(), step),
            fencing_token: FencingToken::new(self.grant().token()),
            cancellation: self.cancellation().clone(),
        }
    }
}
