//! The metrics the runtime records, in one place: their names, and one small helper for each
//! place that records. They go through the `metrics` facade, to whatever recorder the process
//! installed (`agentrt::web` installs a Prometheus one); with none, each call is a no-op.
//!
//! Names and label values are static strings, so that recording one allocates nothing. The
//! runs by state are not recorded here: they are read from the store when scraped.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use ::metrics::{counter, gauge, histogram};

use crate::types::{LeaseLostReason, Outcome, StepKind, Usage};

/// Gauge, label `state`: the runs in the store in each state, read at scrape time.
#[cfg_attr(not(feature = "web"), allow(dead_code))]
pub(crate) const RUNS: &str = "agentrt_runs";
/// Histogram, label `kind` (`model`, `tool`): how long a model call or a tool call took, from
/// its dispatch to its answer or error.
pub(crate) const STEP_DURATION: &str = "agentrt_step_duration_seconds";
/// Counter, label `direction` (`input`, `output`): the tokens the models reported using.
pub(crate) const MODEL_TOKENS: &str = "agentrt_model_tokens_total";
/// Counter: tool calls that ended in an error: the tool's own, a panic, a timeout, or a tool
/// the agent no longer has.
pub(crate) const TOOL_ERRORS: &str = "agentrt_tool_errors_total";
/// Counter: leases extended by a renewal, one per run per renewal.
pub(crate) const LEASE_RENEWALS: &str = "agentrt_lease_renewals_total";
/// Counter: runs taken over from an owner whose lease had expired.
pub(crate) const TAKEOVERS: &str = "agentrt_takeovers_total";
/// Counter, label `side` (`released`, `taken`): runs a draining supervisor of this process
/// handed over, and runs this process took up from a draining one.
pub(crate) const HANDOVERS: &str = "agentrt_handovers_total";
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

/// The buckets of the step histogram, in seconds: a tool's call of a millisecond up to a
/// model's answer of minutes.
#[cfg_attr(not(feature = "web"), allow(dead_code))]
pub(crate) const STEP_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
/// The buckets of the commit histogram, in seconds: from a commit in memory to a slow disk's
/// sync.
#[cfg_attr(not(feature = "web"), allow(dead_code))]
pub(crate) const COMMIT_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];
/// The buckets of the moves per commit: powers of two up to the largest groups seen.
#[cfg_attr(not(feature = "web"), allow(dead_code))]
pub(crate) const MOVES_BUCKETS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
];

/// The runs waiting for a slot across the process's supervisors. Kept here as well as in the
/// gauge, so that the gauge is right even when the recorder was installed after runs queued.
static QUEUED: AtomicU64 = AtomicU64::new(0);

/// A run handed over by a drain (`released`), or taken up after one (`taken`).
pub(crate) fn handed_over(side: &'static str) {
    counter!(HANDOVERS, "side" => side).increment(1);
}

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

/// A tool call ended in an error, a panic or a timeout.
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

/// Sets the queue's gauge from the count: what a recorder installed late needs before its
/// first scrape.
#[cfg_attr(not(feature = "web"), allow(dead_code))]
pub(crate) fn refresh_queued() {
    gauge!(QUEUED_RUNS).set(QUEUED.load(Ordering::Relaxed) as f64);
}

/// A call executing a run returned with `outcome`: counted when the run finished.
pub(crate) fn run_returned(outcome: &Outcome) {
    match outcome {
        Outcome::Succeeded { .. } => counter!(RUNS_FINISHED, "state" => "SUCCEEDED"),
        Outcome::Failed { .. } => counter!(RUNS_FINISHED, "state" => "FAILED"),
        Outcome::Cancelled { .. } => counter!(RUNS_FINISHED, "state" => "CANCELLED"),
        Outcome::WaitingForApproval { .. } | Outcome::Waiting { .. } => return,
    }
    .increment(1);
}

/// Describes every recorded metric to the installed recorder, for its `# HELP` lines.
#[cfg(feature = "web")]
pub(crate) fn describe() {
    use ::metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_histogram!(
        STEP_DURATION,
        Unit::Seconds,
        "How long model calls and tool calls took, from dispatch to answer."
    );
    describe_counter!(
        MODEL_TOKENS,
        Unit::Count,
        "Tokens the models reported using."
    );
    describe_counter!(
        TOOL_ERRORS,
        Unit::Count,
        "Tool calls that ended in an error, a panic or a timeout."
    );
    describe_counter!(
        LEASE_RENEWALS,
        Unit::Count,
        "Leases extended by a renewal, one per run per renewal."
    );
    describe_counter!(
        TAKEOVERS,
        Unit::Count,
        "Runs taken over from an owner whose lease had expired."
    );
    describe_counter!(
        HANDOVERS,
        Unit::Count,
        "Runs handed over by a drain (released), or taken up after one (taken)."
    );
    describe_counter!(
        LEASES_LOST,
        Unit::Count,
        "Leases a supervisor lost while executing their run."
    );
    describe_histogram!(
        COMMIT_DURATION,
        Unit::Seconds,
        "How long group commits took, until their callers were answered."
    );
    describe_histogram!(
        COMMIT_MOVES,
        Unit::Count,
        "Moves committed together by each transaction."
    );
    describe_gauge!(
        QUEUED_RUNS,
        Unit::Count,
        "Runs waiting for a free slot of their supervisor."
    );
    describe_counter!(
        RUNS_FINISHED,
        Unit::Count,
        "Runs this process executed to a finished state."
    );
    // Every counter's series from the start, at 0: a series that first appears at 1 adds
    // nothing to `increase()`, and an alert on the first takeover after a restart would miss it.
    use ::metrics::counter;
    for direction in ["input", "output"] {
        counter!(MODEL_TOKENS, "direction" => direction).increment(0);
    }
    counter!(TOOL_ERRORS).increment(0);
    counter!(LEASE_RENEWALS).increment(0);
    counter!(TAKEOVERS).increment(0);
    for side in ["released", "taken"] {
        counter!(HANDOVERS, "side" => side).increment(0);
    }
    for reason in ["taken_over", "released_or_cancelled", "expired"] {
        counter!(LEASES_LOST, "reason" => reason).increment(0);
    }
    for state in ["SUCCEEDED", "FAILED", "CANCELLED"] {
        counter!(RUNS_FINISHED, "state" => state).increment(0);
    }
}
