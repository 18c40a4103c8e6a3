//! The reads the moves and the store's inspection share: a run, its log, its lease, its
//! snapshot, its usage, and the calls that wait for a decision.

use serde_json::Value;

use crate::{
    error::{Error, Result},
    store::{
        backend::Reads,
        model::{LeaseReport, RunSnapshot},
    },
    types::{
        ApprovalReason, Event, EventKind, Lease, PendingCall, Run, RunId, RunState, RunUsage,
        StepState, Usage,
    },
};

/// What a run's model calls used, from its log; an unknown run is not found.
pub(crate) fn usage(reads: &mut dyn Reads, run_id: &RunId) -> Result<RunUsage> {
    run(reads, run_id)?;
    let mut usage = RunUsage::default();
    // A fork's copies were its origin's calls, counted there.
    let events = reads.events_after(run_id, 0)?;
    for event in events
        .iter()
        .filter(|e| e.payload.get("copied_from").is_none())
    {
        match event.kind {
            EventKind::ModelStarted => usage.attempts += 1,
            EventKind::ModelFinished if event.payload.get("error").is_none() => {
                usage.answers += 1;
                if let Some(tokens) = event
                    .payload
                    .get("usage")
                    .and_then(|u| serde_json::from_value::<Usage>(u.clone()).ok())
                {
                    usage.tokens += tokens;
                }
                if let Some(model) = event.payload.get("model").and_then(Value::as_str)
                    && !usage.models.iter().any(|m| m == model)
                {
                    usage.models.push(model.to_owned());
                }
            }
            _ => {}
        }
    }
    Ok(usage)
}

/// A run; an unknown one is not found.
pub(crate) fn run(reads: &mut dyn Reads, run_id: &RunId) -> Result<Run> {
    reads
        .run(run_id)?
        .ok_or_else(|| Error::RunNotFound(run_id.clone()))
}

/// The largest seq an event can have: both backends keep it as a signed 64-bit integer.
pub(crate) const MAX_SEQ: u64 = i64::MAX as u64;

/// A run's events after `after`; an unknown run is not found (every run has `run.started`). An
/// `after` past [`MAX_SEQ`] is refused: no event can follow it, and it is most likely a cursor
/// gone wrong.
pub(crate) fn events_after(
    reads: &mut dyn Reads,
    run_id: &RunId,
    after: u64,
) -> Result<Vec<Event>> {
    if after > MAX_SEQ {
        return Err(Error::InvalidInput(format!(
            "seq {after} is past the largest an event can have, {MAX_SEQ} (2^63 - 1): ask for \
             the events after a seq a previous read gave, or after 0 for all of them"
        )));
    }
    let events = reads.events_after(run_id, after)?;
    if events.is_empty() {
        run(reads, run_id)?;
    }
    Ok(events)
}

/// The stored lease of a run, read without taking or changing it.
pub(crate) fn lease(reads: &mut dyn Reads, run_id: &RunId) -> Result<Option<Lease>> {
    let row = reads
        .lease_row(run_id)?
        .ok_or_else(|| Error::RunNotFound(run_id.clone()))?;
    Ok(row.lease())
}

/// The run, its steps, and the decision recorded for its waiting step.
pub(crate) fn load(reads: &mut dyn Reads, run_id: &RunId) -> Result<RunSnapshot> {
    let run = run(reads, run_id)?;
    let steps = reads.steps(run_id)?;
    let approval = match steps.iter().find(|s| s.state == StepState::Waiting) {
        Some(waiting) => reads.approval(run_id, waiting.step, waiting.attempt + 1)?,
        None => None,
    };
    let wait = if run.state.waits_for().is_some() {
        reads.wait(run_id)?
    } else {
        None
    };
    Ok(RunSnapshot {
        run,
        steps,
        approval,
        wait,
    })
}

/// RUNNING runs whose lease expired by wall-clock time `wall`, with that lease; and RUNNING
/// runs nobody holds.
pub(crate) fn lease_report(reads: &mut dyn Reads) -> Result<LeaseReport> {
    let wall = reads.lease_wall()?;
    let (mut stale, mut unleased) = (Vec::new(), Vec::new());
    for (run_id, row) in reads.unleased_runs(wall)? {
        match row.lease() {
            Some(lease) => stale.push((run_id, lease)),
            None => unleased.push(run_id),
        }
    }
    Ok((stale, unleased))
}

/// The calls of a run that wait for a decision not recorded yet.
pub(crate) fn pending_calls(reads: &mut dyn Reads, run_id: &RunId) -> Result<Vec<PendingCall>> {
    let snapshot = load(reads, run_id)?;
    if snapshot.run.state != RunState::WaitingForApproval {
        // A cancelled run keeps its waiting step as it was, but nothing waits any more.
        return Ok(Vec::new());
    }
    Ok(snapshot
        .steps
        .iter()
        .filter(|step| step.state == StepState::Waiting && snapshot.approval.is_none())
        .filter_map(|step| {
            let call = step.call.clone()?;
            Some(PendingCall {
                step: step.step,
                call_id: call.id,
                tool: call.name,
                args: call.args,
                reason: step.waiting_for.unwrap_or(ApprovalReason::Policy),
            })
        })
        .collect())
}
