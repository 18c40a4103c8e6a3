//! The metrics the runtime records, in one place: their names, and one small helper for each
//! place that records. They go through the `metrics` facade, to whatever recorder the process
//! installed (`agentrt::web` installs a Prometheus one); with none, each call is a no-op.
//!
//! Names and label values are static strings, so that recording one allocates nothing.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use ::metrics::{counter, gauge, histogram};

use crate::{
    store::model::StepKind,
    types::{LeaseLostReason, Outcome, Usage},
};

/// Histogram, label `kind` (`model`, `tool`): how long a model call or a tool call took, from
/// its dispatch to its answer or error.
pub(crate) const STEP_DURATION: &str = "agentrt_step_duration_seconds";
/// Counter, label `direction` (`input`, `output`): the tokens the models reported using.
pub(crate) const MODEL_TOKENS: &str = "agentrt_model_tokens_total";
/// Counter: tool calls that ended in an error (the tool's own, or a tool the agent lacks).
pub(crate) const TOOL_ERRORS: &str = "agentrt_tool_errors_total";
/// Counter: leases extended by a renewal, one per run per renewal.
pub(crate) const LEASE_RENEWALS: &str = "agentrt_lease_renewals_total";
/// Counter: runs taken over from an owner whose lease had expired.
pub(crate) const TAKEOVERS: &str = "agentrt_takeovers_total";
/// Counter, label `reason` (`taken_over`, `released_or_cancelled`, `expired`): leases a
/// supervisor lost while executing their run.
pub(crate) const LEASES_LOST: &str = "agentrt_leases_lost_total";
/// Histogram: how long a group commit took, from its transaction's start to its callers'
/// answer (its log sync included where the callers wait for it).
pub(crate) const COMMIT_DURATION: &str = "agentrt_commit_duration_seconds";
/// Histogram: the moves each committed transaction made durable together.
pub(crate) const COMMIT_MOVES: &str = "agentrt_commit_moves";
/// Gauge: runs waiting for a free slot of their supervisor (`Config::max_concurrent_runs`).
pub(crate) const QUEUED_RUNS: &str = "agentrt_queued_runs";
/// Counter, label `state`: runs this process's supervisors executed to a finished state.
pub(crate) const RUNS_FINISHED: &str = "agentrt_runs_finished_total";

/// The runs waiting for a slot across the process's supervisors. Kept here as well as in the
/// gauge, so that the gauge is right even when the recorder was installed after runs queued.
static QUEUED: AtomicU64 = AtomicU64::new(0);

/// A model call (`StepKind::Model`) or a tool call answered after `took`.
pub(crate) fn step_took(kind: StepKind, took: Duration) {
    match kind {
        StepKind::Model => histogram!(STEP_DURATION, "kind" => "model").record(took),
        StepKind::Tool => histogram!(STEP_DURATION, "kind" => "tool").record(took),
    }
}

/// A model's answer reported `usage`.
pub(crate) fn model_used(usage: Option<Usage>) {
    if let Some(usage) = usage {
        counter!(MODEL_TOKENS, "direction" => "input").increment(usage.input_tokens);
        counter!(MODEL_TOKENS, "direction" => "output").increment(usage.output_tokens);
    }
}

/// A tool call ended in an error.
pub(crate) fn tool_failed() {
    counter!(TOOL_ERRORS).increment(1);
}

/// A renewal extended `runs` leases.
pub(crate) fn leases_renewed(runs: usize) {
    if runs > 0 {
        counter!(LEASE_RENEWALS).increment(runs as u64);
    }
}

/// A run was taken over from an owner whose lease had expired.
pub(crate) fn taken_over() {
    counter!(TAKEOVERS).increment(1);
}

/// A supervisor lost a lease, for `reason`.
pub(crate) fn lease_lost(reason: &LeaseLostReason) {
    match reason {
        LeaseLostReason::TakenBy(_) => counter!(LEASES_LOST, "reason" => "taken_over"),
        LeaseLostReason::ReleasedOrCancelled => {
            counter!(LEASES_LOST, "reason" => "released_or_cancelled")
        }
        LeaseLostReason::Expired => counter!(LEASES_LOST, "reason" => "expired"),
    }
    .increment(1);
}

/// A transaction made `moves` moves durable, and its callers were answered `took` after it
/// began. A group whose every move was refused made nothing durable and is not counted.
pub(crate) fn group_committed(moves: usize, took: Duration) {
    if moves > 0 {
        histogram!(COMMIT_DURATION).record(took);
        histogram!(COMMIT_MOVES).record(moves as f64);
    }
}

/// A run joined a supervisor's line for a free slot.
pub(crate) fn run_queued() {
    let queued = QUEUED.fetch_add(1, Ordering::Relaxed) + 1;
    gauge!(QUEUED_RUNS).set(queued as f64);
}

/// `runs` runs left a supervisor's line: their turn came, or the supervisor stopped.
pub(crate) fn runs_dequeued(runs: usize) {
    if runs == 0 {
        return;
    }
    let runs = runs as u64;
    let before = QUEUED
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |queued| {
            Some(queued.saturating_sub(runs))
        })
        .unwrap_or_default();
    gauge!(QUEUED_RUNS).set(before.saturating_sub(runs) as f64);
}

/// A call executing a run returned with `outcome`: counted when the run finished.
pub(crate) fn run_returned(outcome: &Outcome) {
    match outcome {
        Outcome::Succeeded { .. } => counter!(RUNS_FINISHED, "state" => "SUCCEEDED"),
        Outcome::Failed { .. } => counter!(RUNS_FINISHED, "state" => "FAILED"),
        Outcome::Cancelled { .. } => counter!(RUNS_FINISHED, "state" => "CANCELLED"),
        Outcome::WaitingForApproval { .. } => return,
    }
    .increment(1);
}
