//! How a call ends: stopped by a lost lease or a cancel, or by a panic, and what is logged.

use std::any::Any;

use super::{
    panic_message,
    run_loop::{Next, RunLoop},
    send,
};
use crate::{
    actors::store::ReadState,
    error::{Error, Result},
    store::moves,
    types::{LeaseLostReason, Outcome, RunState},
};

impl RunLoop {
    /// Logs where this execution left the run, for an operator: waiting for an approval,
    /// finished, failed, cancelled, or stopped by an error. A lost lease and a handover are
    /// logged where they are found.
    pub(super) fn ended(&self, result: &Result<Outcome>) {
        let (run_id, steps) = (self.run_id(), self.step_count());
        match result {
            Ok(Outcome::WaitingForApproval { pending }) => tracing::info!(
                %run_id,
                step = pending.step,
                call_id = %pending.call_id,
                tool = %pending.tool,
                reason = %pending.reason.as_str(),
                "run waiting for approval"
            ),
            Ok(Outcome::Waiting { wait }) => tracing::info!(
                %run_id,
                step = wait.step,
                call_id = %wait.call_id,
                waits_for = %wait.kind,
                key = %wait.key,
                "run waiting"
            ),
            Ok(Outcome::Succeeded { .. }) => {
                tracing::info!(%run_id, state = %RunState::Succeeded, steps, "run finished")
            }
            Ok(Outcome::Failed { error }) => {
                tracing::info!(%run_id, state = %RunState::Failed, steps, %error, "run failed")
            }
            Ok(Outcome::Cancelled { reason }) => {
                tracing::info!(%run_id, state = %RunState::Cancelled, steps, %reason, "run finished")
            }
            // Logged where it is found.
            Err(Error::LeaseLost { .. } | Error::HandedOver { .. }) => {}
            // It stays RUNNING, for a resume or another process's recovery.
            Err(err) => tracing::warn!(%run_id, steps, error = %err, "run stopped"),
        }
    }

    /// The loop learnt its lease was lost: the call ends cancelled if an operator cancelled
    /// the run, with `LeaseLost` otherwise.
    pub(super) async fn stopped(&self) -> Result<Outcome> {
        let run = self.read_run().await?;
        if run.state == RunState::Cancelled {
            return Ok(Outcome::Cancelled {
                reason: run.error.unwrap_or_default(),
            });
        }
        let reason = self.lease_lost().unwrap_or(LeaseLostReason::Expired);
        Err(Error::LeaseLost {
            run_id: self.run_id().clone(),
            reason,
        })
    }

    pub(super) async fn read_run(&self) -> Result<crate::types::Run> {
        let id = self.run_id().clone();
        send(
            self.store().addr(),
            ReadState::new(move |reads| moves::run(reads, &id)),
        )
        .await
    }

    /// The cancellation signal fired during a model call (which is dropped, not awaited: it has
    /// no side effect): an operator's cancel, or a lost lease.
    pub(super) async fn interrupted_by_signal(&self) -> Result<Next> {
        if self.lease_lost().is_some() {
            return self.stopped().await.map(Next::Return);
        }
        self.cancelled().await.map(Next::Return)
    }

    /// The outcome of a run an operator cancelled.
    pub(super) async fn cancelled(&self) -> Result<Outcome> {
        let run = self.read_run().await?;
        Ok(Outcome::Cancelled {
            reason: run.error.unwrap_or_default(),
        })
    }

    /// A panic in the model, a tool or the policy: the step stays as it is for a resume.
    pub(super) fn panicked(&self, step: u32, what: String, panic: Box<dyn Any + Send>) -> Error {
        let message = panic_message(panic);
        tracing::error!(step, what, message, "panic in a run");
        Error::Panicked {
            run_id: self.run_id().clone(),
            step,
            what,
            message,
        }
    }
}
