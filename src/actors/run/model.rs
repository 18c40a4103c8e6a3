//! The model call step: dispatch an attempt, record the answer (paired with the move that
//! follows it) or the failure, back off and try again as the model policy says.

use std::{
    panic::AssertUnwindSafe,
    time::{Duration, Instant},
};

use futures_util::FutureExt;
use tracing::Instrument;

use super::run_loop::{Next, RunLoop};
use crate::{
    agent::ModelError,
    error::Result,
    metrics,
    store::{
        model::{ModelOutcome, Rendered, StepRow},
        moves::{self, FailModelAttempt, FinishModelStep},
    },
    types::{Outcome, StepKind, StepState},
};

impl RunLoop {
    /// Dispatches attempt `attempt` of model step `step` (already reserved) and records what
    /// came of it: the answer, with the move that follows it; a failure the model policy
    /// tries again, then the next attempt's reservation; or the failure of the run.
    pub(super) async fn call_model(&mut self, step: u32, attempt: u32) -> Result<Next> {
        // Signed: an OpenTelemetry layer keeps unsigned integers as text.
        let span = tracing::info_span!(
            "model",
            step = i64::from(step),
            attempt = i64::from(attempt),
            otel.name = tracing::field::Empty,
        );
        #[cfg(feature = "otel")]
        span.record("otel.name", "chat");
        let request = self.request(step, attempt);
        let policy = &self.agent().model_policy;
        let answer = AssertUnwindSafe(self.agent().model.complete(request))
            .catch_unwind()
            .instrument(span);
        let timeout = async {
            match policy.attempt_timeout() {
                Some(limit) => actix_rt::time::sleep(limit).await,
                None => std::future::pending().await,
            }
        };
        let dispatched = Instant::now();
        // A model call has no side effect: on cancel or timeout it is dropped, not awaited.
        let answer = futures_util::select_biased! {
            answer = answer.fuse() => answer,
            _ = self.cancellation().cancelled().fuse() => return self.interrupted_by_signal().await,
            // Abandoned rather than awaited: quick, and safe for a call with no side effect.
            () = self.drained().fuse() => return self.hand_over().await,
            () = timeout.fuse() => Ok(Err(ModelError::retryable(format!(
                "no answer within {} s",
                policy.attempt_timeout().unwrap_or_default().as_secs_f64()
            )))),
        };
        metrics::step_took(StepKind::Model, dispatched.elapsed());
        let answer = answer.map_err(|panic| self.panicked(step, "the model".into(), panic))?;
        let mut response = match answer {
            Ok(response) => response,
            Err(error) => return self.model_failed(step, attempt, error).await,
        };
        metrics::model_used(response.usage);
        self.make_call_ids_unique(step, &mut response);
        let stored_json = serde_json::to_value(&response).expect("a response serializes");
        let created: Vec<StepRow> = response
            .tool_calls
            .iter()
            .zip(step + 1..)
            .map(|(call, number)| StepRow {
                step: number,
                kind: StepKind::Tool,
                state: StepState::Pending,
                attempt: 0,
                call: Some(call.clone()),
                result: None,
                waiting_for: None,
                progress: None,
            })
            .collect();
        let output = response.text.clone().unwrap_or_default();
        let outcome = ModelOutcome::Answered {
            response,
            recorded: Rendered::new(stored_json.clone()),
        };
        let first = FinishModelStep {
            by: self.leased(),
            step,
            attempt,
            outcome,
        };
        self.set_step(step, StepState::Finished, attempt, Some(stored_json));
        if created.is_empty() {
            self.commit(first).await?;
            return Ok(Next::Return(Outcome::Succeeded { output }));
        }
        for row in created {
            self.push_step(row);
        }
        // The first call's decision (and start) commits with the answer, unless a drain hands
        // the run over first.
        let next = if self.draining() {
            Ok(None)
        } else {
            self.plan()
        };
        let ((), next) = self.commit_with(first, next, |_| true).await?;
        next
    }

    /// Attempt `attempt` of model step `step` failed: records it and reserves the next
    /// attempt after the policy's backoff, or fails the run when the policy gives up.
    pub(super) async fn model_failed(
        &mut self,
        step: u32,
        attempt: u32,
        error: ModelError,
    ) -> Result<Next> {
        let message = error.message().to_owned();
        let next = if error.is_retryable() {
            let unit = rand::random::<f64>();
            self.agent()
                .model_policy
                .next_attempt(attempt, error.retry_after_hint(), unit)
        } else {
            Err(None)
        };
        let retry_in = match next {
            Ok(retry_in) => retry_in,
            Err(refused) => {
                let message = match refused {
                    Some(why) => format!("{message} ({why})"),
                    None => message,
                };
                tracing::warn!(step, attempt, error = %message, "the model failed");
                let outcome = ModelOutcome::Failed {
                    error: message.clone(),
                    attempts: attempt,
                };
                self.commit(FinishModelStep {
                    by: self.leased(),
                    step,
                    attempt,
                    outcome,
                })
                .await?;
                return Ok(Next::Return(Outcome::Failed {
                    error: moves::model_failure(&message, attempt),
                }));
            }
        };
        tracing::info!(step, attempt, error = %message, ?retry_in, "a model attempt failed; trying again");
        self.commit(FailModelAttempt {
            by: self.leased(),
            step,
            attempt,
            error: message,
            retry_in,
        })
        .await?;
        if let Some(stopped) = self.back_off(retry_in).await {
            return stopped;
        }
        // Planned as the next move: the loop reserves the next attempt with the start margin.
        // (Stored, the step stays in flight until then.)
        self.set_step(step, StepState::Pending, attempt, None);
        Ok(Next::Continue)
    }

    /// Waits `wait` before a model call's next attempt; `Some` when the cancellation signal
    /// (an operator's cancel, a lost lease) or a drain ended the wait, with where the loop goes
    /// then.
    pub(super) async fn back_off(&self, wait: Duration) -> Option<Result<Next>> {
        futures_util::select_biased! {
            _ = self.cancellation().cancelled().fuse() => Some(self.interrupted_by_signal().await),
            () = self.drained().fuse() => Some(self.hand_over_backing_off().await),
            () = actix_rt::time::sleep(wait).fuse() => None,
        }
    }
}
