//! Waits: a call of a built-in waiting tool (or of a tool that asked to be called again later)
//! makes the run wait, holding no lease; a resume goes on with what the wait brought.

use serde_json::Value;

use super::run_loop::{Next, RunLoop};
use crate::{
    error::{Error, Result},
    store::{
        model::{RunSnapshot, StepRow},
        moves::{Began, BeginWait, ResumeWait, Resumed, WaitRequest},
    },
    types::{Outcome, StepState, ToolCall},
};

impl RunLoop {
    /// The started call of `step` waits for `request`: the run releases its lease in the
    /// same move, and this call returns [`Outcome::Waiting`]. A wait with nothing to wait for
    /// (an event kept, a time past) finishes the call at once, and the loop goes on.
    pub(super) async fn begin_wait(
        &mut self,
        step: &StepRow,
        call: &ToolCall,
        request: WaitRequest,
    ) -> Result<Next> {
        let (number, attempt) = (step.step, step.attempt);
        let began = self
            .commit(BeginWait {
                by: self.leased(),
                step: number,
                attempt,
                call: call.clone(),
                request,
            })
            .await?;
        match began {
            Began::Waiting(wait) => {
                tracing::info!(
                    run_id = %self.run_id(),
                    step = number,
                    call_id = %call.id,
                    waits_for = %wait.kind,
                    key = %wait.key,
                    "run waiting"
                );
                Ok(Next::Return(Outcome::Waiting { wait }))
            }
            Began::Finished(result) => {
                let json = serde_json::to_value(&result).expect("a result serializes");
                self.set_step(number, StepState::Finished, attempt, Some(json));
                Ok(Next::Continue)
            }
        }
    }

    /// Resumes a run that waits for an answer, an event, a time or a child: the wait's end
    /// and the call's result are one move. `Some` when the wait is not over (nothing was
    /// changed).
    pub(super) async fn resume_wait(&mut self, snapshot: &RunSnapshot) -> Result<Option<Outcome>> {
        let run_id = self.run_id().clone();
        let wait = snapshot.wait.clone().ok_or_else(|| {
            Error::Corrupt(format!(
                "run {run_id} is {} with no wait",
                snapshot.run.state
            ))
        })?;
        let waiting = || {
            Ok(Some(Outcome::Waiting {
                wait: wait.public(&run_id),
            }))
        };
        if !wait.ready(self.now_millis()) {
            return waiting();
        }
        let step = snapshot
            .steps
            .iter()
            .find(|s| s.step == wait.step)
            .ok_or_else(|| {
                Error::Corrupt(format!("run {run_id} waits on no step {}", wait.step))
            })?;
        let call = step.call.clone().expect("only tool steps wait");
        let resumed = self
            .commit(ResumeWait {
                by: self.leased(),
                step: wait.step,
                attempt: step.attempt,
                call,
            })
            .await;
        let resumed = match resumed {
            Ok((_, resumed)) => resumed,
            // Not over by the store's reading of the clock after all, or resumed by another.
            Err(Error::RunState { state, .. }) if state.is_waiting() => return waiting(),
            Err(err) => return Err(err),
        };
        // The resume took the lease: it is renewed from here on.
        self.hold();
        self.taken("resume");
        tracing::info!(
            %run_id,
            step = wait.step,
            waited_for = %wait.kind,
            owner = %self.grant().holder.owner,
            fencing_token = self.grant().token(),
            "run resumed"
        );
        match resumed {
            Resumed::Finished(result) => {
                let json: Value = serde_json::to_value(&result).expect("a result serializes");
                self.set_step(wait.step, StepState::Finished, step.attempt, Some(json));
            }
            Resumed::Again => {
                self.set_step(wait.step, StepState::InFlight, step.attempt + 1, None);
            }
        }
        Ok(None)
    }
}
