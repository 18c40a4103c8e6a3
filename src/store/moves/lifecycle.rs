//! A run's life outside its steps: its insert (started or queued), its failure by its loop, an
//! operator's cancel, and a fork.

use std::time::Instant;

use serde_json::{Value, json};

use super::{
    Leased, Move,
    guard::{Cx, FIRST_TOKEN, RunMove},
};
use crate::{
    error::{Error, Result},
    store::backend::{MoveKind, NewRun},
    types::{EventKind, RunId, RunState, StepKind, StepState},
};

/// Inserts a new RUNNING run and its `run.started`, with the lease stamped in the insert and
/// the first fencing token. An existing id, or one [`RunId::check`] refuses, is refused
/// unchanged. Returns the lease's expiry.
pub(crate) struct CreateRun {
    pub by: Leased,
    pub agent: String,
    pub input: Value,
    /// The W3C `traceparent` its `run.started` keeps, for its later executions to join the
    /// same trace.
    pub trace: Option<String>,
}

impl Move for CreateRun {
    type Output = i64;

    fn kind(&self) -> MoveKind {
        MoveKind::CreateRun
    }

    fn run_id(&self) -> &RunId {
        &self.by.run_id
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<i64> {
        cx.run_id.check()?;
        if cx.run_state()?.is_some() {
            return Err(Error::RunExists(cx.run_id.clone()));
        }
        let grant = &self.by.grant;
        let sent = Instant::now();
        let expires_at = grant.holder.expiry(cx.tx.lease_wall()?);
        cx.tx.insert_run(&NewRun {
            run_id: cx.run_id,
            agent: &self.agent,
            input: &self.input,
            at: cx.now.millis(),
            lease: Some((&grant.holder.owner, expires_at)),
        })?;
        grant.acquired(FIRST_TOKEN, sent);
        let payload =
            json!({ "agent": self.agent, "input": self.input, "fencing_token": FIRST_TOKEN });
        cx.append_started(payload, self.trace.as_deref())?;
        Ok(expires_at)
    }
}

/// Inserts a new RUNNING run that nobody holds yet, and its `run.started` (marked `queued`,
/// fencing token 0): a run that waits for a free slot of its supervisor. Whoever executes it
/// first takes it over, with the first fencing token; a crash leaves it to any recovering
/// supervisor. An existing id, or one [`RunId::check`] refuses, is refused unchanged.
pub(crate) struct QueueRun {
    pub run_id: RunId,
    pub agent: String,
    pub input: Value,
    /// As [`CreateRun::trace`].
    pub trace: Option<String>,
}

impl Move for QueueRun {
    type Output = ();

    fn kind(&self) -> MoveKind {
        MoveKind::QueueRun
    }

    fn run_id(&self) -> &RunId {
        &self.run_id
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<()> {
        cx.run_id.check()?;
        if cx.run_state()?.is_some() {
            return Err(Error::RunExists(cx.run_id.clone()));
        }
        cx.tx.insert_run(&NewRun {
            run_id: cx.run_id,
            agent: &self.agent,
            input: &self.input,
            at: cx.now.millis(),
            lease: None,
        })?;
        let payload = json!({
            "agent": self.agent,
            "input": self.input,
            "fencing_token": 0,
            "queued": true,
        });
        cx.append_started(payload, self.trace.as_deref())
    }
}

/// Fails a RUNNING run from its loop (it reached its step limit, say).
pub(crate) struct FailRun {
    pub by: Leased,
    pub error: String,
}

impl Move for FailRun {
    type Output = ();

    fn kind(&self) -> MoveKind {
        MoveKind::FailRun
    }

    fn run_id(&self) -> &RunId {
        &self.by.run_id
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<()> {
        let (state, error) = (RunState::Failed, Some(self.error.as_str()));
        cx.finish_run(&self.by.grant, state, None, error, None)
    }
}

/// An operator's cancel, whichever door it comes through (the store, a supervisor, the API,
/// the command line): no lease needed; the run moves to CANCELLED from RUNNING or any waiting
/// state, and its lease is released with the move. The child run it waits for, if any, is
/// cancelled with it.
pub(crate) struct CancelRun {
    pub run_id: RunId,
    pub reason: String,
}

impl Move for CancelRun {
    /// The child runs cancelled with it, down the tree.
    type Output = Vec<RunId>;

    fn kind(&self) -> MoveKind {
        MoveKind::CancelRun
    }

    fn run_id(&self) -> &RunId {
        &self.run_id
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<Vec<RunId>> {
        cancel(cx, &self.reason)
    }
}

/// Cancels the run of `cx` from any state but a finished one: its wait is dropped, the child
/// it waits for is cancelled with it, and the parent that waits for it is woken. Returns the
/// child runs cancelled with it, down the tree.
pub(super) fn cancel(cx: &mut Cx<'_, '_>, reason: &str) -> Result<Vec<RunId>> {
    let from = [
        RunState::Running,
        RunState::WaitingForApproval,
        RunState::WaitingForAnswer,
        RunState::WaitingForEvent,
        RunState::WaitingForTimer,
        RunState::WaitingForChild,
    ];
    let what = "a finished run cannot be cancelled";
    // The guard compares with at most two states: the one the run is in, read under the
    // transaction's lock, is the one it must still be in.
    let from = match cx.run_state()? {
        Some(state) if from.contains(&state) => vec![state],
        _ => from[..2].to_vec(),
    };
    cx.move_run(RunMove {
        error: Some(reason),
        ..RunMove::new(&from, RunState::Cancelled, what)
    })?;
    let payload = json!({ "state": "CANCELLED", "reason": reason });
    cx.append(EventKind::RunFinished, None, &payload)?;
    let below = cx.cancel_below(reason)?;
    cx.wake_parent(RunState::Cancelled, None, Some(reason))?;
    Ok(below)
}

/// Forks a new run (`run_id`) from `origin` at step `at`: a RUNNING run of the same agent and
/// input that nobody holds (fencing token 0: the resume that takes it over takes the first),
/// whose steps before `at` are copies of the origin's, so that its loop asks the model again at
/// step `at`. Writes `run.started` (with `forked_from`), `run.forked`, and a copy of each of
/// the origin's events about those steps, in order, each saying which event it copies. The
/// origin is only read. Returns the number of steps copied.
///
/// Refused unchanged: an id [`RunId::check`] refuses, `at` 0, past the step after the
/// origin's last, or at a tool step (`InvalidInput`); an unknown origin; an existing id
/// (`RunExists`); a step before `at` that has not finished (a state error of the origin,
/// naming the step).
pub(crate) struct ForkRun {
    pub run_id: RunId,
    pub origin: RunId,
    pub at: u32,
    /// As [`CreateRun::trace`].
    pub trace: Option<String>,
    /// The agents of the supervisor that executes the fork: the fork of a run of any other
    /// agent is refused (`UnknownAgent`), as it would be left for another to resume. `None`
    /// outside a supervisor.
    pub agents: Option<Vec<String>>,
}

impl Move for ForkRun {
    type Output = u32;

    fn kind(&self) -> MoveKind {
        MoveKind::ForkRun
    }

    fn run_id(&self) -> &RunId {
        &self.run_id
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<u32> {
        cx.run_id.check()?;
        let (origin, at) = (&self.origin, self.at);
        if let (Some(agents), Some(source)) = (&self.agents, cx.tx.run(origin)?)
            && !agents.contains(&source.agent)
        {
            return Err(Error::UnknownAgent(source.agent));
        }
        if at == 0 {
            return Err(Error::InvalidInput(
                "steps are numbered from 1: a fork starts at step 1 or later".into(),
            ));
        }
        let source = cx
            .tx
            .run(origin)?
            .ok_or_else(|| Error::RunNotFound(origin.clone()))?;
        if cx.run_state()?.is_some() {
            return Err(Error::RunExists(cx.run_id.clone()));
        }
        let steps = cx.tx.steps(origin)?;
        let last = steps.len() as u32;
        if at > last + 1 {
            return Err(Error::InvalidInput(format!(
                "run {origin} has {last} steps: a fork starts at one of its model steps, or at \
                 step {} to keep them all",
                last + 1
            )));
        }
        if let Some(step) = steps.get(at as usize - 1)
            && step.kind != StepKind::Model
        {
            return Err(Error::InvalidInput(format!(
                "step {at} of run {origin} is a tool call: a fork starts at a model step, where \
                 the model is asked again"
            )));
        }
        let copied = &steps[..at as usize - 1];
        if let Some(step) = copied.iter().find(|s| s.state != StepState::Finished) {
            return Err(Error::RunState {
                run_id: origin.clone(),
                state: source.state,
                reason: format!(
                    "its step {} is {}: a fork copies finished steps only; fork at a model \
                     step no later than {}, or once it has finished",
                    step.step,
                    step.state.as_str(),
                    step.step
                ),
            });
        }
        cx.tx.insert_run(&NewRun {
            run_id: cx.run_id,
            agent: &source.agent,
            input: &source.input,
            at: cx.now.millis(),
            lease: None,
        })?;
        for step in copied {
            cx.tx.insert_step_row(cx.run_id, step)?;
        }
        let payload = json!({
            "agent": source.agent,
            "input": source.input,
            "fencing_token": 0,
            "forked_from": { "run_id": origin, "at": at },
        });
        cx.append_started(payload, self.trace.as_deref())?;
        let payload = json!({ "origin": origin, "at": at, "steps_copied": at - 1 });
        cx.append(EventKind::RunForked, None, &payload)?;
        // The run-level events (resumes, takeovers, the end) were the origin's own: only what
        // its copied steps did is the fork's history.
        for event in cx.tx.events_after(origin, 0)? {
            if event.step.is_none_or(|step| step >= at) {
                continue;
            }
            let mut payload = event.payload;
            let Some(fields) = payload.as_object_mut() else {
                return Err(Error::Corrupt(format!(
                    "event {} of run {origin} has a payload that is not an object",
                    event.seq
                )));
            };
            fields.insert(
                "copied_from".into(),
                json!({ "run_id": origin, "seq": event.seq }),
            );
            cx.append(event.kind, event.step, &payload)?;
        }
        Ok(at - 1)
    }
}
