//! A drain's handover: a draining supervisor releases a run's lease at a step boundary, with
//! nothing in flight, so that another replica continues the run at once.

use serde_json::json;

use super::{
    Leased, Move,
    guard::{Cx, Need},
};
use crate::{
    error::{Error, Result},
    store::backend::MoveKind,
    types::{EventKind, RunId, StepKind, StepState},
};

/// Releases the run's lease for another replica to take up, writing `run.released`.
///
/// Nothing may be in flight: a model call the drain abandoned (a model call has no side effect)
/// goes back to pending, for the next owner to dispatch again; a tool
/// call in flight refuses the move, since only a takeover may decide what became of it. The
/// next owner's takeover then finds nothing to interrupt, and writes `run.handed_over`.
pub(crate) struct HandOver {
    pub by: Leased,
    /// The loop waits out the backoff after a failed model attempt: that attempt stays
    /// counted. Otherwise a model call in flight (dispatched, or only reserved) is not: the
    /// next owner makes the same attempt again, so that a deploy spends none of the model
    /// policy's attempts.
    pub backing_off: bool,
}

/// What a handover released.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct HandedOver {
    /// The model step whose attempt in flight was abandoned, with that attempt.
    pub abandoned: Option<(u32, u32)>,
}

impl Move for HandOver {
    type Output = HandedOver;

    fn kind(&self) -> MoveKind {
        MoveKind::HandOver
    }

    fn run_id(&self) -> &RunId {
        &self.by.run_id
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<HandedOver> {
        let grant = &self.by.grant;
        cx.touch_held(grant, Need::Held, "the run cannot be handed over")?;
        let mut abandoned = None;
        for step in cx.tx.steps(cx.run_id)? {
            match (step.kind, step.state) {
                (StepKind::Model, StepState::InFlight) => {
                    // Pending at attempt N means attempt N + 1 comes next.
                    let next_from = if self.backing_off {
                        step.attempt
                    } else {
                        abandoned = Some((step.step, step.attempt));
                        step.attempt.saturating_sub(1)
                    };
                    if !cx
                        .tx
                        .reset_step(cx.run_id, step.step, step.attempt, next_from)?
                    {
                        return Err(cx.state_error(format!(
                            "step {} is no longer in flight at attempt {}",
                            step.step, step.attempt
                        )));
                    }
                }
                (StepKind::Tool, StepState::InFlight) => {
                    return Err(Error::Corrupt(format!(
                        "run {}: tool step {} is in flight; a run is handed over only between \
                         steps",
                        cx.run_id, step.step
                    )));
                }
                _ => {}
            }
        }
        let (owner, token) = (&grant.holder.owner, grant.token());
        if !cx.tx.release_lease(cx.run_id, owner, token)? {
            return Err(cx.refused(Some(grant), "the run cannot be handed over"));
        }
        let mut payload = json!({ "owner": &**owner, "fencing_token": token });
        if let Some((step, attempt)) = abandoned {
            payload["abandoned"] = json!({ "step": step, "attempt": attempt });
        }
        cx.append(EventKind::RunReleased, None, &payload)?;
        Ok(HandedOver { abandoned })
    }
}
