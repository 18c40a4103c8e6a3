//! The store's behaviours, written once for every backend: each move and its guard, the
//! refusals (which change nothing), renewal, release, takeover, inspection, waits and
//! schedules (`conformance/waits.rs`, `conformance/schedules.rs`), and the refusal of a
//! schema this build does not know.
//!
//! A backend joins the suite with one line, `conformance_suite!(name, fixture)`, where the
//! fixture says how to make a fresh store (and, if the backend can hold one, a database of a
//! newer schema). Every case must pass unchanged on every backend.

use crate::{
    store::moves::{FIRST_TOKEN, Leased},
    types::StepState,
};
use std::{sync::Arc, time::Duration};

use serde_json::{Value, json};

use super::{
    Store,
    backend::{ChangeKind, Changes, Session},
    model::{Grant, Holder, ModelOutcome, Rendered, Resolution, ToolDecision, wall_millis},
    moves,
};
use crate::{
    Approval, Error, EventKind, LeaseLostReason, ModelResponse, RunId, RunState, ToolCall,
    ToolResult, clock::SystemClock, error::Result,
};

/// How a backend makes the stores the suite runs on.
pub(crate) trait Fixture {
    /// Whether the backend can be tested here (a server to test against, say): when not, every
    /// case passes without running, and the fixture has said why.
    fn available(&self) -> bool {
        true
    }
    /// A fresh, empty store.
    fn store(&self) -> Store;
    /// Moves the expiry of `run_id`'s lease into the past, as the passing of its TTL would.
    fn expire_lease(&self, store: &Store, run_id: &RunId);
    /// Opens a database whose schema is newer than this build's: `None` when the backend
    /// cannot hold one (a database in memory is always this build's).
    fn open_newer_schema(&self) -> Option<Result<Store>>;
}

/// Instantiates every case of the suite for a backend's fixture.
macro_rules! conformance_suite {
    ($name:ident, $fixture:expr) => {
        mod $name {
            use super::*;

            conformance_suite!(@cases $fixture;
                a_new_run_is_running_under_its_creators_lease,
                an_existing_run_id_is_refused_and_nothing_changes,
                a_run_id_that_names_no_run_is_refused_by_every_move_that_makes_one,
                a_model_call_starts_only_under_an_unexpired_lease_of_its_own,
                a_refused_move_writes_nothing,
                a_move_refused_after_writing_in_a_group_is_rolled_back_alone,
                groups_of_every_size_commit_each_runs_moves_in_order,
                a_pairs_insert_refused_by_a_key_is_refused_alone,
                a_loop_steps_group_refused_by_a_guard_keeps_nothing_of_the_refused_move,
                a_pair_whose_start_is_refused_keeps_its_first_move_and_the_others_pairs,
                a_step_inserted_and_started_in_one_pair_is_stored_started,
                the_models_answer_adds_pending_tool_steps_or_finishes_the_run,
                a_failed_model_call_fails_the_run_and_releases_the_lease,
                an_allowed_call_starts_with_its_idempotency_key,
                a_denied_call_is_closed_with_the_denial,
                a_call_that_needs_approval_pauses_the_run_and_releases_the_lease,
                an_approval_is_recorded_once_and_only_for_a_waiting_call,
                of_two_resumes_of_a_waiting_run_one_wins,
                a_tools_outcome_is_written_only_under_the_lease_or_late_after_a_cancel,
                a_live_foreign_lease_refuses_a_takeover_without_a_write,
                a_takeover_of_an_expired_lease_interrupts_the_steps_in_flight,
                a_takeover_of_a_released_run_names_no_previous_owner,
                a_handover_releases_the_lease_and_its_taker_interrupts_nothing,
                a_handover_is_refused_with_a_tool_in_flight_and_under_a_lost_lease,
                an_interrupted_step_is_reconciled_once,
                a_tools_progress_is_kept_only_while_its_attempt_is_in_flight_under_the_lease,
                a_timed_out_call_is_interrupted_with_its_last_progress_and_reconciled_once,
                a_cancel_needs_no_lease_and_a_finished_run_cannot_be_cancelled,
                a_renewal_extends_only_the_owners_unexpired_leases,
                a_release_is_a_compare_and_set_on_the_owner,
                inspection_reads_runs_events_and_leases,
                a_new_run_keeps_its_trace_context_in_its_run_started,
                runs_are_counted_by_state_every_state_named,
                unknown_ids_are_not_found,
                a_newer_schema_is_refused,
                every_acquisition_takes_a_higher_token_and_an_older_one_writes_nothing,
                a_start_short_of_the_margin_writes_nothing_whatever_the_wall_clock_says,
                a_fork_copies_the_steps_before_it_and_their_events_and_only_reads_the_origin,
                a_fork_is_refused_unchanged_where_it_cannot_start,
                a_fork_is_taken_over_with_the_first_token_and_asks_the_model_at_its_step,
                a_purge_deletes_every_row_of_the_finished_runs_and_none_of_a_live_one,
                a_purge_by_id_refuses_an_unknown_or_unfinished_run_and_deletes_nothing,
                runs_are_listed_a_page_at_a_time_each_once_and_filtered,
                a_watcher_reads_what_waits_decided_then_each_change_after_its_cursor,
                a_wait_releases_the_lease_and_is_refused_under_a_lost_lease,
                an_answer_wakes_its_wait_once_and_one_resume_goes_on_with_it,
                an_event_is_kept_until_its_wait_and_a_repeat_is_a_duplicate,
                a_timer_is_ready_at_its_time_through_the_index_of_ready_waits,
                a_child_is_inserted_with_its_parents_wait_and_its_end_wakes_the_parent,
                cancelling_a_parent_cancels_the_child_it_waits_for,
                a_schedule_is_put_paused_resumed_and_deleted_by_name,
                what_cannot_be_put_or_is_not_there_is_refused_unchanged,
                a_pass_reads_the_due_schedules_of_its_agents_not_paused,
                a_due_occurrence_starts_once_and_the_schedule_moves_past_it,
                an_occurrence_whose_run_exists_starts_nothing_and_moves_on,
                two_advances_of_one_occurrence_in_a_group_start_one_run,
            );
        }
    };
    (@cases $fixture:expr; $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                let fixture = $fixture;
                if crate::store::conformance::Fixture::available(&fixture) {
                    crate::store::conformance::$case(&fixture);
                }
            }
        )*
    };
}
pub(crate) use conformance_suite;

mod waits;
pub(crate) use waits::{
    a_child_is_inserted_with_its_parents_wait_and_its_end_wakes_the_parent,
    a_timer_is_ready_at_its_time_through_the_index_of_ready_waits,
    a_wait_releases_the_lease_and_is_refused_under_a_lost_lease,
    an_answer_wakes_its_wait_once_and_one_resume_goes_on_with_it,
    an_event_is_kept_until_its_wait_and_a_repeat_is_a_duplicate,
    cancelling_a_parent_cancels_the_child_it_waits_for,
};

mod schedules;
pub(crate) use schedules::{
    a_due_occurrence_starts_once_and_the_schedule_moves_past_it,
    a_pass_reads_the_due_schedules_of_its_agents_not_paused,
    a_schedule_is_put_paused_resumed_and_deleted_by_name,
    an_occurrence_whose_run_exists_starts_nothing_and_moves_on,
    two_advances_of_one_occurrence_in_a_group_start_one_run,
    what_cannot_be_put_or_is_not_there_is_refused_unchanged,
};

const OWNER: &str = "me/000000000001";
const OTHER: &str = "them/000000000002";

/// A lease of `owner`'s as its loop holds it after a start: the first token, the TTL left,
/// and no start margin beyond an unexpired lease (the margin has cases of its own).
fn holder(owner: &str, ttl: Duration) -> Grant {
    let holder = Holder {
        owner: owner.into(),
        ttl,
        margin: Duration::ZERO,
    };
    Grant::held(holder, FIRST_TOKEN)
}

pub(crate) fn me() -> Grant {
    holder(OWNER, Duration::from_secs(30))
}

pub(crate) fn run(n: &str) -> RunId {
    RunId::from(n)
}

pub(crate) fn call(id: &str) -> ToolCall {
    ToolCall::new(id, "send", json!({"to": "a@example.com"}))
}

/// Applies what `f` makes of `run_id` through [`Moves`]: each move in a transaction of its
/// own (a case that chains two moves gets two commits).
pub(crate) fn on<R: Send>(
    store: &Store,
    run_id: &RunId,
    f: impl FnOnce(&mut Moves<'_>) -> Result<R>,
) -> Result<R> {
    f(&mut Moves { store, run_id })
}

/// The moves of one run, each applied in a transaction of its own as the suite's cases name
/// them: by what they do and with the values they carry.
pub(crate) struct Moves<'a> {
    store: &'a Store,
    run_id: &'a RunId,
}

impl Moves<'_> {
    fn by(&self, grant: &Grant) -> Leased {
        Leased::new(self.run_id, grant)
    }

    fn apply<M: moves::Move>(&self, mv: M) -> Result<M::Output> {
        self.store.apply(&SystemClock, mv)
    }

    pub(crate) fn create_run(&mut self, agent: &str, input: &Value, grant: &Grant) -> Result<i64> {
        self.apply(moves::CreateRun {
            by: self.by(grant),
            agent: agent.into(),
            input: input.clone(),
            trace: None,
        })
    }

    pub(crate) fn begin_model_step(&mut self, grant: &Grant, step: u32) -> Result<()> {
        self.apply(moves::BeginModelStep {
            by: self.by(grant),
            step,
        })
    }

    pub(crate) fn fail_run(&mut self, grant: &Grant, error: &str) -> Result<()> {
        self.apply(moves::FailRun {
            by: self.by(grant),
            error: error.into(),
        })
    }

    pub(crate) fn finish_model_step(
        &mut self,
        grant: &Grant,
        step: u32,
        attempt: u32,
        outcome: &ModelOutcome,
    ) -> Result<()> {
        self.apply(moves::FinishModelStep {
            by: self.by(grant),
            step,
            attempt,
            outcome: outcome.clone(),
        })
    }

    pub(crate) fn decide_tool(
        &mut self,
        grant: &Grant,
        step: u32,
        call: &ToolCall,
        decision: &ToolDecision,
    ) -> Result<()> {
        self.apply(decide_tool(self.run_id, grant, step, call, decision))
    }

    pub(crate) fn finish_tool(
        &mut self,
        grant: &Grant,
        step: u32,
        attempt: u32,
        call_id: &str,
        result: &ToolResult,
    ) -> Result<bool> {
        let by = self.by(grant);
        self.apply(moves::FinishTool::new(by, step, attempt, call_id, result))
    }

    pub(crate) fn reconcile(
        &mut self,
        grant: &Grant,
        step: u32,
        attempt: u32,
        call: Option<&ToolCall>,
        resolution: &Resolution,
    ) -> Result<()> {
        self.apply(moves::Reconcile {
            by: self.by(grant),
            step,
            attempt,
            call: call.cloned(),
            resolution: resolution.clone(),
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn resume_waiting(
        &mut self,
        grant: &Grant,
        step: u32,
        attempt: u32,
        call: &ToolCall,
        reason: crate::ApprovalReason,
        decision: &ToolDecision,
        source: &'static str,
    ) -> Result<i64> {
        self.apply(moves::ResumeWaiting {
            by: self.by(grant),
            step,
            attempt,
            call: call.clone(),
            reason,
            decision: decision.clone(),
            source,
        })
    }

    pub(crate) fn record_progress(
        &mut self,
        grant: &Grant,
        step: u32,
        attempt: u32,
        progress: &Value,
    ) -> Result<()> {
        self.apply(moves::RecordProgress {
            by: self.by(grant),
            step,
            attempt,
            progress: progress.clone(),
        })
    }

    pub(crate) fn time_out_tool(
        &mut self,
        grant: &Grant,
        step: u32,
        attempt: u32,
        progress: Option<&Value>,
    ) -> Result<()> {
        self.apply(moves::TimeOutTool {
            by: self.by(grant),
            step,
            attempt,
            call_id: "c1".into(),
            why: moves::TimedOut::Timeout,
            limit: Duration::from_millis(200),
            progress: progress.cloned(),
        })
    }

    /// A drain's release; what model attempt it abandoned.
    pub(crate) fn hand_over(
        &mut self,
        grant: &Grant,
        backing_off: bool,
    ) -> Result<Option<(u32, u32)>> {
        self.apply(moves::HandOver {
            by: self.by(grant),
            backing_off,
        })
        .map(|released| released.abandoned)
    }

    pub(crate) fn begin_model_attempt(
        &mut self,
        grant: &Grant,
        step: u32,
        attempt: u32,
    ) -> Result<()> {
        self.apply(moves::BeginModelAttempt {
            by: self.by(grant),
            step,
            attempt,
        })
    }

    /// The steps it marked interrupted, the new expiry, and whether someone held the lease.
    pub(crate) fn take_over(&mut self, grant: &Grant) -> Result<(Vec<u32>, i64, bool)> {
        let taken = self.apply(moves::TakeOver { by: self.by(grant) })?;
        let held = taken.previous_owner.is_some();
        Ok((taken.interrupted, taken.expires_at, held))
    }
}

/// The policy's decision on step `step`'s `call`, as a run's loop makes it under `grant`.
pub(crate) fn decide_tool(
    run_id: &RunId,
    grant: &Grant,
    step: u32,
    call: &ToolCall,
    decision: &ToolDecision,
) -> moves::DecideTool {
    moves::DecideTool {
        by: Leased::new(run_id, grant),
        step,
        call: call.clone(),
        decision: decision.clone(),
    }
}

pub(crate) fn create(store: &Store, run_id: &RunId, holder: &Grant) {
    on(store, run_id, |m| {
        m.create_run("agent", &json!({"n": 1}), holder)
    })
    .unwrap();
}

/// A run whose lease, stamped by `owner`, has expired.
fn create_expired(f: &dyn Fixture, store: &Store, run_id: &RunId, owner: &str) {
    create(store, run_id, &holder(owner, Duration::from_secs(30)));
    f.expire_lease(store, run_id);
}

fn kinds(store: &Store, run_id: &RunId) -> Vec<EventKind> {
    store
        .events(run_id)
        .unwrap()
        .into_iter()
        .map(|event| event.kind)
        .collect()
}

fn last_payload(store: &Store, run_id: &RunId) -> Value {
    store.events(run_id).unwrap().pop().unwrap().payload
}

/// Model step 1 reserved and answered with `calls` (tool steps 2, 3, ...), under our lease.
fn model_answered(store: &Store, run_id: &RunId, calls: Vec<ToolCall>) {
    model_answered_by(store, run_id, &me(), calls);
}

/// Model step 1 reserved and answered with `calls` under `holder`'s lease.
pub(crate) fn model_answered_by(
    store: &Store,
    run_id: &RunId,
    holder: &Grant,
    calls: Vec<ToolCall>,
) {
    on(store, run_id, |m| m.begin_model_step(holder, 1)).unwrap();
    let response = ModelResponse::calls(calls);
    let outcome = ModelOutcome::Answered {
        recorded: Rendered::new(serde_json::to_value(&response).unwrap()),
        response,
    };
    on(store, run_id, |m| {
        m.finish_model_step(holder, 1, 1, &outcome)
    })
    .unwrap();
}

/// Model step 1 answered with `calls` under `holder`'s lease, and the first of them (step 2)
/// started.
pub(crate) fn tool_in_flight(store: &Store, run_id: &RunId, holder: &Grant, calls: Vec<ToolCall>) {
    let first = calls[0].clone();
    model_answered_by(store, run_id, holder, calls);
    on(store, run_id, |m| {
        m.decide_tool(holder, 2, &first, &allow())
    })
    .unwrap();
}

fn decide(store: &Store, run_id: &RunId, step: u32, c: &ToolCall, d: &ToolDecision) -> Result<()> {
    let me = me();
    on(store, run_id, |m| m.decide_tool(&me, step, c, d))
}

pub(crate) fn allow() -> ToolDecision {
    ToolDecision::Allow {
        reason: None,
        by: None,
        note: None,
    }
}

fn require() -> ToolDecision {
    ToolDecision::RequireApproval {
        reason: "sends email".into(),
    }
}

/// A run waiting for an approval of call `c1` at step 2.
fn waiting(store: &Store, run_id: &RunId) {
    create(store, run_id, &me());
    model_answered(store, run_id, vec![call("c1")]);
    decide(store, run_id, 2, &call("c1"), &require()).unwrap();
}

fn session(store: &Store) -> Session {
    store.session(Arc::new(SystemClock), None).unwrap()
}

/// Renews `owner`'s leases on `held`, each under the first token.
fn renew(store: &Store, owner: &str, held: &[RunId]) -> super::model::Renewal {
    let held: Vec<(RunId, u64)> = held.iter().map(|id| (id.clone(), FIRST_TOKEN)).collect();
    renew_tokens(store, owner, &held)
}

/// Renews `owner`'s leases on `held`, each run under its token.
fn renew_tokens(store: &Store, owner: &str, held: &[(RunId, u64)]) -> super::model::Renewal {
    let mut session = session(store);
    let ttl = Duration::from_secs(30);
    match &mut session.renewer {
        Some(renewer) => renewer.renew(owner, held, ttl, Duration::from_secs(1)),
        None => session.writer.renew(owner, held, ttl),
    }
    .unwrap()
}

// ---------------------------------------------------------------------------------------------
// The cases

pub(crate) fn a_new_run_is_running_under_its_creators_lease(f: &dyn Fixture) {
    let store = f.store();
    let before = wall_millis();
    create(&store, &run("r"), &me());
    let stored = store.run(&run("r")).unwrap();
    assert_eq!(stored.state, RunState::Running);
    assert_eq!(stored.agent, "agent");
    assert_eq!(stored.input, json!({"n": 1}));
    let lease = store.lease(&run("r")).unwrap().expect("leased");
    assert_eq!(lease.owner, OWNER);
    let expires = crate::clock::to_millis(lease.expires_at);
    assert!(expires >= before + 30_000, "stamped with the TTL");
    assert_eq!(kinds(&store, &run("r")), [EventKind::RunStarted]);
    assert_eq!(
        last_payload(&store, &run("r")),
        json!({"agent": "agent", "input": {"n": 1}, "fencing_token": 1})
    );
}

pub(crate) fn an_existing_run_id_is_refused_and_nothing_changes(f: &dyn Fixture) {
    let store = f.store();
    create(&store, &run("r"), &me());
    let them = holder(OTHER, Duration::from_secs(30));
    let err = on(&store, &run("r"), |m| {
        m.create_run("other", &json!({}), &them)
    })
    .unwrap_err();
    assert!(matches!(err, Error::RunExists(_)), "{err}");
    assert!(err.is_run_state());
    assert_eq!(store.run(&run("r")).unwrap().agent, "agent");
    assert_eq!(store.lease(&run("r")).unwrap().unwrap().owner, OWNER);
    assert_eq!(kinds(&store, &run("r")), [EventKind::RunStarted]);
}

pub(crate) fn a_run_id_that_names_no_run_is_refused_by_every_move_that_makes_one(f: &dyn Fixture) {
    let store = f.store();
    succeeded(&store, &run("r"));
    let before = everything(&store, &run("r"));
    let long = "x".repeat(RunId::MAX_LEN + 1);
    for id in [
        "",
        ".",
        "..",
        "a\nb",
        "a\u{202E}b",
        "\u{2066}",
        long.as_str(),
    ] {
        let id = RunId::from(id);
        let invalid = |err: &Error| matches!(err, Error::InvalidInput(m) if m.contains("a run id"));
        let err = on(&store, &id, |m| m.create_run("agent", &json!({}), &me())).unwrap_err();
        assert!(invalid(&err), "CreateRun {id:?}: {err}");
        let queue = moves::QueueRun {
            run_id: id.clone(),
            agent: "agent".into(),
            input: json!({}),
            trace: None,
        };
        let err = store.apply(&SystemClock, queue).unwrap_err();
        assert!(invalid(&err), "QueueRun {id:?}: {err}");
        let err = store.fork(&run("r"), 1, Some(id.clone())).unwrap_err();
        assert!(invalid(&err), "ForkRun {id:?}: {err}");
        assert!(matches!(store.run(&id), Err(Error::RunNotFound(_))));
    }
    assert_eq!(store.runs(None).unwrap().len(), 1);
    assert_eq!(everything(&store, &run("r")), before);
}

pub(crate) fn a_model_call_starts_only_under_an_unexpired_lease_of_its_own(f: &dyn Fixture) {
    let store = f.store();
    // Expired: refused as lost by expiry.
    create_expired(f, &store, &run("expired"), OWNER);
    let mine = me();
    let err = on(&store, &run("expired"), |m| m.begin_model_step(&mine, 1)).unwrap_err();
    assert!(
        matches!(
            &err,
            Error::LeaseLost {
                reason: LeaseLostReason::Expired,
                ..
            }
        ),
        "{err}"
    );
    // A move that starts nothing needs the lease held only: nobody took it over.
    on(&store, &run("expired"), |m| m.fail_run(&mine, "stop")).unwrap();
    assert_eq!(
        store.lease(&run("expired")).unwrap(),
        None,
        "finishing released it"
    );

    // Another owner's live lease: refused, naming it.
    create(
        &store,
        &run("theirs"),
        &holder(OTHER, Duration::from_secs(30)),
    );
    let err = on(&store, &run("theirs"), |m| m.begin_model_step(&mine, 1)).unwrap_err();
    assert!(
        matches!(&err, Error::RunLeased { owner, .. } if owner == OTHER),
        "{err}"
    );

    // Released (its call returned with an error): refused as released.
    create(&store, &run("released"), &mine);
    let mut session = session(&store);
    assert!(
        session
            .writer
            .release(&run("released"), OWNER, FIRST_TOKEN)
            .unwrap()
    );
    let err = on(&store, &run("released"), |m| m.begin_model_step(&mine, 1)).unwrap_err();
    assert!(
        matches!(
            &err,
            Error::LeaseLost {
                reason: LeaseLostReason::ReleasedOrCancelled,
                ..
            }
        ),
        "{err}"
    );
}

pub(crate) fn a_refused_move_writes_nothing(f: &dyn Fixture) {
    let store = f.store();
    create(&store, &run("r"), &holder(OTHER, Duration::from_secs(30)));
    let before = store.run(&run("r")).unwrap();
    let mine = me();
    for _ in 0..3 {
        on(&store, &run("r"), |m| m.begin_model_step(&mine, 1)).unwrap_err();
        on(&store, &run("r"), |m| m.fail_run(&mine, "x")).unwrap_err();
    }
    assert_eq!(store.run(&run("r")).unwrap(), before);
    assert_eq!(kinds(&store, &run("r")), [EventKind::RunStarted]);
    assert_eq!(store.lease(&run("r")).unwrap().unwrap().owner, OTHER);
}

/// A move queued for a group, and how to read whether it committed once the group is answered.
pub(crate) type Queued = (
    Box<dyn super::backend::Pending>,
    Box<dyn FnOnce() -> bool + Send>,
);

/// `mv`, queued for [`in_one_group`].
pub(crate) fn queued<M: moves::Move>(mv: M) -> Queued {
    let (pending, answer) = super::queue::pending(mv, super::backend::Durability::Durable);
    let committed = move || matches!(answer.blocking_recv(), Ok(Ok(_)));
    (pending, Box::new(committed))
}

/// Applies `moves` through a supervisor's writer as one group (one batch, as a store actor
/// hands the writer what queued during its last commit); returns whether each committed.
pub(crate) fn in_one_group(store: &Store, moves: Vec<Queued>) -> Vec<bool> {
    let session = store
        .session(Arc::new(SystemClock), None)
        .expect("a writer session");
    let mut writer = session.writer;
    let (batch, answers): (Vec<_>, Vec<_>) = moves.into_iter().unzip();
    writer.commit(batch, false);
    // A writer may answer from threads of its own: each answer is awaited.
    let committed = answers.into_iter().map(|committed| committed()).collect();
    writer.idle();
    committed
}

pub(crate) fn a_move_refused_after_writing_in_a_group_is_rolled_back_alone(f: &dyn Fixture) {
    let store = f.store();
    create(&store, &run("r"), &me());
    model_answered(&store, &run("r"), vec![call("c1")]);
    decide(&store, &run("r"), 2, &call("c1"), &allow()).unwrap();
    let before = store.events(&run("r")).unwrap();
    let creates = |n: &str| {
        queued(moves::CreateRun {
            by: Leased::new(&run(n), &me()),
            agent: "agent".into(),
            input: json!({}),
            trace: None,
        })
    };
    // Deciding the call again stamps the run and appends `policy.decided` before its step
    // guard refuses it: those writes must go with it, and nothing else.
    let again = queued(decide_tool(&run("r"), &me(), 2, &call("c1"), &allow()));
    let committed = in_one_group(&store, vec![creates("r1"), again, creates("r3")]);
    assert_eq!(committed, [true, false, true]);
    assert_eq!(
        store.events(&run("r")).unwrap(),
        before,
        "the refused move left nothing"
    );
    assert_eq!(store.run(&run("r1")).unwrap().state, RunState::Running);
    assert_eq!(store.run(&run("r3")).unwrap().state, RunState::Running);
}

/// A pair whose second move inserts a step that exists (the steps' key refuses it) is refused
/// alone, with its error: its first move, and another run's pair in the group, commit. (A key
/// taken may also be a race with another writer, which a PostgreSQL lane first tries again.)
pub(crate) fn a_pairs_insert_refused_by_a_key_is_refused_alone(f: &dyn Fixture) {
    let store = f.store();
    let grant = me();
    let done = ToolResult::Ok(json!({"sent": true}));
    let finish = |n: &str| moves::FinishTool::new(Leased::new(&run(n), &grant), 2, 1, "c1", &done);
    let begin = |n: &str, step| moves::BeginModelStep {
        by: Leased::new(&run(n), &grant),
        step,
    };
    for n in ["r", "s"] {
        create(&store, &run(n), &grant);
        tool_in_flight(&store, &run(n), &grant, vec![call("c1")]);
    }
    // Step 2 of `r` exists: a reservation numbered 2 is refused.
    let (r_pair, r_then) = queued_pair(finish("r"), begin("r", 2));
    let (s_pair, s_then) = queued_pair(finish("s"), begin("s", 3));
    assert_eq!(in_one_group(&store, vec![r_pair, s_pair]), [true, true]);
    // The refusal is the move's own error (the key's), not a failed commit.
    let refused = r_then.recv().unwrap();
    assert!(
        matches!(refused, Some(Err(Error::Database(_)))),
        "{refused:?}"
    );
    assert!(matches!(s_then.recv().unwrap(), Some(Ok(()))));
    let last = |n: &str| store.events(&run(n)).unwrap().pop().map(|event| event.kind);
    assert_eq!(last("r"), Some(EventKind::ToolFinished));
    assert_eq!(last("s"), Some(EventKind::ModelStarted));
}

/// Groups of a few moves, of a few dozen and of a hundred (a writer may plan them apart) each
/// commit every run's moves, each run's events numbered in order.
pub(crate) fn groups_of_every_size_commit_each_runs_moves_in_order(f: &dyn Fixture) {
    let store = f.store();
    let mine = me();
    for size in [5, 40, 100] {
        let ids: Vec<RunId> = (0..size).map(|n| run(&format!("g{size}-{n}"))).collect();
        let creates = ids
            .iter()
            .map(|id| {
                queued(moves::CreateRun {
                    by: Leased::new(id, &mine),
                    agent: "agent".into(),
                    input: json!({"n": size}),
                    trace: None,
                })
            })
            .collect();
        assert!(in_one_group(&store, creates).into_iter().all(|c| c));
        let begins = ids
            .iter()
            .map(|id| {
                queued(moves::BeginModelStep {
                    by: Leased::new(id, &mine),
                    step: 1,
                })
            })
            .collect();
        assert!(in_one_group(&store, begins).into_iter().all(|c| c));
        let answers = ids
            .iter()
            .map(|id| {
                let response = ModelResponse::calls(vec![call("c1")]);
                queued(moves::FinishModelStep {
                    by: Leased::new(id, &mine),
                    step: 1,
                    attempt: 1,
                    outcome: ModelOutcome::Answered {
                        recorded: Rendered::new(serde_json::to_value(&response).unwrap()),
                        response,
                    },
                })
            })
            .collect();
        assert!(in_one_group(&store, answers).into_iter().all(|c| c));
        for id in &ids {
            let events = store.events(id).unwrap();
            let seqs: Vec<u64> = events.iter().map(|event| event.seq).collect();
            assert_eq!(seqs, (1..=events.len() as u64).collect::<Vec<_>>(), "{id}");
            assert_eq!(events[0].kind, EventKind::RunStarted, "{id}");
            assert!(
                events
                    .iter()
                    .any(|event| event.kind == EventKind::ModelFinished),
                "{id}: {events:?}"
            );
            let steps = store.read(|reads| reads.steps(id)).unwrap();
            assert_eq!(steps.len(), 2, "{id}: the model's step and its call's");
            assert_eq!(steps[1].state, StepState::Pending, "{id}");
        }
    }
}

/// A group of loop steps (which a writer may commit without waiting for its writes' answers)
/// refused by a guard keeps nothing of the refused move, which is answered with its own
/// refusal, and commits the others.
pub(crate) fn a_loop_steps_group_refused_by_a_guard_keeps_nothing_of_the_refused_move(
    f: &dyn Fixture,
) {
    let store = f.store();
    let them = holder(OTHER, Duration::from_secs(30));
    create(&store, &run("r"), &them);
    model_answered_by(&store, &run("r"), &them, vec![call("c1"), call("c2")]);
    let mine = me();
    let alone = |mv: moves::DecideTool| {
        let session = store
            .session(Arc::new(SystemClock), None)
            .expect("a writer session");
        let mut writer = session.writer;
        let (pending, answer) = super::queue::pending(mv, super::backend::Durability::Durable);
        writer.commit(vec![pending], false);
        let answer = answer.blocking_recv().expect("an answer");
        writer.idle();
        answer
    };

    // A step guard: the call was decided already, so its step is no longer pending.
    on(&store, &run("r"), |m| {
        m.decide_tool(&them, 2, &call("c1"), &allow())
    })
    .unwrap();
    let before = store.events(&run("r")).unwrap();
    let err = alone(decide_tool(&run("r"), &them, 2, &call("c1"), &allow())).unwrap_err();
    assert!(err.is_run_state(), "{err}");
    assert_eq!(
        store.events(&run("r")).unwrap(),
        before,
        "nothing was written"
    );

    // The lease's guard: the run was taken over meanwhile.
    f.expire_lease(&store, &run("r"));
    on(&store, &run("r"), |m| m.take_over(&mine)).unwrap();
    let before = (
        store.events(&run("r")).unwrap(),
        store.run(&run("r")).unwrap(),
    );
    let err = alone(decide_tool(&run("r"), &them, 3, &call("c2"), &allow())).unwrap_err();
    assert!(
        matches!(&err, Error::RunLeased { owner, .. } if owner == OWNER),
        "{err}"
    );
    let after = (
        store.events(&run("r")).unwrap(),
        store.run(&run("r")).unwrap(),
    );
    assert_eq!(after, before, "nothing was written");

    // With another run's step in the same group: that one commits.
    create(&store, &run("s"), &mine);
    model_answered_by(&store, &run("s"), &mine, vec![call("c3")]);
    let committed = in_one_group(
        &store,
        vec![
            queued(decide_tool(&run("s"), &mine, 2, &call("c3"), &allow())),
            queued(decide_tool(&run("r"), &them, 3, &call("c2"), &allow())),
        ],
    );
    assert_eq!(committed, [true, false]);
    let after = (
        store.events(&run("r")).unwrap(),
        store.run(&run("r")).unwrap(),
    );
    assert_eq!(after, before, "nothing of the refused move was written");
    assert_eq!(
        kinds(&store, &run("s")).last(),
        Some(&EventKind::ToolStarted)
    );
}

/// What a pair's second move was answered: `None` when it was not attempted.
pub(crate) type Then = std::sync::mpsc::Receiver<Option<Result<()>>>;

/// `first` then `then` as the loop pairs them, in one move of a group: whether `first`
/// committed, and what `then` was answered.
pub(crate) fn queued_pair<A: moves::Move, B: moves::Move>(first: A, then: B) -> (Queued, Then) {
    let (pending, answer) =
        super::queue::pending_pair(first, then, |_| true, super::backend::Durability::Durable);
    let (second, seconds) = std::sync::mpsc::channel();
    let committed = move || {
        let answer = actix_rt::Runtime::new()
            .expect("a runtime")
            .block_on(answer);
        let (committed, then) = match answer {
            Ok((_, then)) => (true, then.map(|then| then.map(drop))),
            Err(_) => (false, None),
        };
        let _ = second.send(then);
        committed
    };
    ((pending, Box::new(committed)), seconds)
}

/// In one group, a pair whose second move (a start) is refused keeps its first (an outcome),
/// and another run's pair, both of whose moves write its rows, commits whole.
pub(crate) fn a_pair_whose_start_is_refused_keeps_its_first_move_and_the_others_pairs(
    f: &dyn Fixture,
) {
    let store = f.store();
    let grant = me();
    let done = ToolResult::Ok(json!({"sent": true}));
    let finish =
        |run_id: &RunId| moves::FinishTool::new(Leased::new(run_id, &grant), 2, 1, "c1", &done);
    let begin = |run_id: &RunId| moves::BeginModelStep {
        by: Leased::new(run_id, &grant),
        step: 3,
    };
    for n in ["r", "s"] {
        create(&store, &run(n), &grant);
        tool_in_flight(&store, &run(n), &grant, vec![call("c1")]);
    }
    // The stored lease of `r` has expired: an outcome is still recorded (the lease is not
    // another's), a start is not.
    f.expire_lease(&store, &run("r"));
    let (r_pair, r_then) = queued_pair(finish(&run("r")), begin(&run("r")));
    let (s_pair, s_then) = queued_pair(finish(&run("s")), begin(&run("s")));
    let committed = in_one_group(&store, vec![r_pair, s_pair]);
    assert_eq!(committed, [true, true], "both outcomes");
    assert!(
        matches!(
            r_then.recv().unwrap(),
            Some(Err(Error::LeaseLost {
                reason: crate::LeaseLostReason::Expired,
                ..
            }))
        ),
        "the start's own refusal"
    );
    assert!(matches!(s_then.recv().unwrap(), Some(Ok(()))));
    assert_eq!(
        kinds(&store, &run("r")).last(),
        Some(&EventKind::ToolFinished),
        "no start"
    );
    assert_eq!(
        kinds(&store, &run("s")).last(),
        Some(&EventKind::ModelStarted)
    );
    let steps = |n: &str| {
        let snapshot = store.read(|reads| moves::load(reads, &run(n))).unwrap();
        snapshot
            .steps
            .iter()
            .map(|s| (s.step, s.state, s.attempt))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        steps("r"),
        [(1, StepState::Finished, 1), (2, StepState::Finished, 1)]
    );
    assert_eq!(
        steps("s"),
        [
            (1, StepState::Finished, 1),
            (2, StepState::Finished, 1),
            (3, StepState::InFlight, 1)
        ]
    );
}

/// A model's answer and the decision on its first call, paired in one group: the call's step
/// is inserted and started in one transaction, and stored started; the next call's stays
/// pending.
pub(crate) fn a_step_inserted_and_started_in_one_pair_is_stored_started(f: &dyn Fixture) {
    let store = f.store();
    let grant = me();
    create(&store, &run("r"), &grant);
    on(&store, &run("r"), |m| m.begin_model_step(&grant, 1)).unwrap();
    let response = ModelResponse::calls(vec![call("c1"), call("c2")]);
    let answered = moves::FinishModelStep {
        by: Leased::new(&run("r"), &grant),
        step: 1,
        attempt: 1,
        outcome: ModelOutcome::Answered {
            recorded: Rendered::new(serde_json::to_value(&response).unwrap()),
            response,
        },
    };
    let decided = decide_tool(&run("r"), &grant, 2, &call("c1"), &allow());
    let (pair, then) = queued_pair(answered, decided);
    assert_eq!(in_one_group(&store, vec![pair]), [true]);
    assert!(matches!(then.recv().unwrap(), Some(Ok(()))));
    let snapshot = store.read(|reads| moves::load(reads, &run("r"))).unwrap();
    let steps: Vec<_> = snapshot
        .steps
        .iter()
        .map(|s| (s.step, s.state, s.attempt, s.call.clone()))
        .collect();
    assert_eq!(
        steps,
        [
            (1, StepState::Finished, 1, None),
            (2, StepState::InFlight, 1, Some(call("c1"))),
            (3, StepState::Pending, 0, Some(call("c2")))
        ]
    );
    let kinds = kinds(&store, &run("r"));
    assert_eq!(
        kinds[kinds.len() - 4..],
        [
            EventKind::ModelStarted,
            EventKind::ModelFinished,
            EventKind::PolicyDecided,
            EventKind::ToolStarted
        ]
    );
}

pub(crate) fn the_models_answer_adds_pending_tool_steps_or_finishes_the_run(f: &dyn Fixture) {
    let store = f.store();
    create(&store, &run("r"), &me());
    model_answered(&store, &run("r"), vec![call("c1"), call("c2")]);
    let snapshot = store.read(|reads| moves::load(reads, &run("r"))).unwrap();
    let states: Vec<(u32, StepState)> = snapshot.steps.iter().map(|s| (s.step, s.state)).collect();
    assert_eq!(
        states,
        [
            (1, StepState::Finished),
            (2, StepState::Pending),
            (3, StepState::Pending)
        ]
    );
    assert_eq!(snapshot.steps[1].call, Some(call("c1")));
    assert_eq!(
        kinds(&store, &run("r")),
        [
            EventKind::RunStarted,
            EventKind::ModelStarted,
            EventKind::ModelFinished
        ]
    );

    create(&store, &run("answered"), &me());
    let mine = me();
    on(&store, &run("answered"), |m| m.begin_model_step(&mine, 1)).unwrap();
    let response = ModelResponse::answer("done");
    let outcome = ModelOutcome::Answered {
        recorded: Rendered::new(serde_json::to_value(&response).unwrap()),
        response,
    };
    on(&store, &run("answered"), |m| {
        m.finish_model_step(&mine, 1, 1, &outcome)
    })
    .unwrap();
    let finished = store.run(&run("answered")).unwrap();
    assert_eq!(finished.state, RunState::Succeeded);
    assert_eq!(finished.output.as_deref(), Some("done"));
    assert_eq!(store.lease(&run("answered")).unwrap(), None);
    assert_eq!(
        last_payload(&store, &run("answered")),
        json!({"state": "SUCCEEDED", "output": "done"})
    );
}

pub(crate) fn a_failed_model_call_fails_the_run_and_releases_the_lease(f: &dyn Fixture) {
    let store = f.store();
    create(&store, &run("r"), &me());
    let mine = me();
    on(&store, &run("r"), |m| m.begin_model_step(&mine, 1)).unwrap();
    let outcome = ModelOutcome::Failed {
        error: "503".into(),
        attempts: 1,
    };
    on(&store, &run("r"), |m| {
        m.finish_model_step(&mine, 1, 1, &outcome)
    })
    .unwrap();
    let failed = store.run(&run("r")).unwrap();
    assert_eq!(failed.state, RunState::Failed);
    assert_eq!(failed.error.as_deref(), Some("the model failed: 503"));
    assert_eq!(store.lease(&run("r")).unwrap(), None);
    // A second answer to the same step is refused: the step is no longer in flight.
    on(&store, &run("r"), |m| {
        m.finish_model_step(&mine, 1, 1, &outcome)
    })
    .unwrap_err();
}

pub(crate) fn an_allowed_call_starts_with_its_idempotency_key(f: &dyn Fixture) {
    let store = f.store();
    create(&store, &run("r"), &me());
    model_answered(&store, &run("r"), vec![call("c1")]);
    decide(&store, &run("r"), 2, &call("c1"), &allow()).unwrap();
    let events = store.events(&run("r")).unwrap();
    let started = events.last().unwrap();
    assert_eq!(started.kind, EventKind::ToolStarted);
    assert_eq!(started.step, Some(2));
    assert_eq!(
        started.payload,
        json!({
            "call_id": "c1",
            "tool": "send",
            "args": {"to": "a@example.com"},
            "attempt": 1,
            "idempotency_key": "r/2",
            "fencing_token": 1,
        })
    );
    assert_eq!(events[events.len() - 2].kind, EventKind::PolicyDecided);
    // The same pending call cannot be decided twice.
    let err = decide(&store, &run("r"), 2, &call("c1"), &allow()).unwrap_err();
    assert!(err.is_run_state(), "{err}");
}

pub(crate) fn a_denied_call_is_closed_with_the_denial(f: &dyn Fixture) {
    let store = f.store();
    create(&store, &run("r"), &me());
    model_answered(&store, &run("r"), vec![call("c1")]);
    let deny = ToolDecision::Deny {
        reason: "not eligible".into(),
        by: Some("carol".into()),
        note: None,
    };
    decide(&store, &run("r"), 2, &call("c1"), &deny).unwrap();
    let snapshot = store.read(|reads| moves::load(reads, &run("r"))).unwrap();
    let step = &snapshot.steps[1];
    assert_eq!(step.state, StepState::Finished);
    let result: ToolResult = serde_json::from_value(step.result.clone().unwrap()).unwrap();
    assert_eq!(
        result,
        ToolResult::Error("the call was denied: not eligible".into())
    );
    let decided = last_payload(&store, &run("r"));
    assert_eq!(decided["decision"], "deny");
    assert_eq!(decided["decided_by"], "carol");
}

pub(crate) fn a_call_that_needs_approval_pauses_the_run_and_releases_the_lease(f: &dyn Fixture) {
    let store = f.store();
    waiting(&store, &run("r"));
    assert_eq!(
        store.run(&run("r")).unwrap().state,
        RunState::WaitingForApproval
    );
    assert_eq!(store.lease(&run("r")).unwrap(), None);
    let pending = store.pending_calls(&run("r")).unwrap();
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].call_id, "c1");
    assert_eq!(pending[0].step, 2);
    assert_eq!(
        kinds(&store, &run("r")).last(),
        Some(&EventKind::RunWaiting)
    );
    // The loop's lease is gone with the pause: it can start nothing more.
    let mine = me();
    let err = on(&store, &run("r"), |m| m.begin_model_step(&mine, 3)).unwrap_err();
    assert!(matches!(err, Error::LeaseLost { .. }), "{err}");
}

pub(crate) fn an_approval_is_recorded_once_and_only_for_a_waiting_call(f: &dyn Fixture) {
    let store = f.store();
    waiting(&store, &run("r"));
    let approval = Approval::approve(run("r"), "c1", "carol").note("ok");
    store.record_approval(&approval).unwrap();
    assert_eq!(
        last_payload(&store, &run("r")),
        json!({"call_id": "c1", "approved": true, "decided_by": "carol", "note": "ok"})
    );
    assert!(store.pending_calls(&run("r")).unwrap().is_empty());
    let again = store
        .record_approval(&Approval::deny(run("r"), "c1", "dave"))
        .unwrap_err();
    assert!(again.is_run_state(), "{again}");
    let unknown = store
        .record_approval(&Approval::approve(run("r"), "c9", "carol"))
        .unwrap_err();
    assert!(matches!(unknown, Error::CallNotFound { .. }), "{unknown}");
    let no_run = store
        .record_approval(&Approval::approve(run("x"), "c1", "carol"))
        .unwrap_err();
    assert!(matches!(no_run, Error::RunNotFound(_)), "{no_run}");
    // A call of a running run does not wait.
    create(&store, &run("running"), &me());
    model_answered(&store, &run("running"), vec![call("c1")]);
    let err = store
        .record_approval(&Approval::approve(run("running"), "c1", "carol"))
        .unwrap_err();
    assert!(err.is_run_state(), "{err}");
    assert_eq!(
        kinds(&store, &run("running")).last(),
        Some(&EventKind::ModelFinished)
    );
}

pub(crate) fn of_two_resumes_of_a_waiting_run_one_wins(f: &dyn Fixture) {
    let store = f.store();
    waiting(&store, &run("r"));
    let resume = |owner: &str| {
        let resumer = holder(owner, Duration::from_secs(30));
        on(&store, &run("r"), |m| {
            m.resume_waiting(
                &resumer,
                2,
                0,
                &call("c1"),
                crate::ApprovalReason::Policy,
                &allow(),
                "approval",
            )
        })
    };
    resume(OWNER).unwrap();
    let err = resume(OTHER).unwrap_err();
    assert!(err.is_run_state(), "{err}");
    assert_eq!(store.lease(&run("r")).unwrap().unwrap().owner, OWNER);
    let kinds = kinds(&store, &run("r"));
    assert_eq!(
        kinds[kinds.len() - 3..],
        [
            EventKind::RunResumed,
            EventKind::PolicyDecided,
            EventKind::ToolStarted
        ]
    );
}

pub(crate) fn a_tools_outcome_is_written_only_under_the_lease_or_late_after_a_cancel(
    f: &dyn Fixture,
) {
    let store = f.store();
    let finish = |run_id: &RunId, holder: &Grant| {
        let result = ToolResult::Ok(json!({"sent": true}));
        on(&store, run_id, |m| {
            m.finish_tool(holder, 2, 1, "c1", &result)
        })
    };
    // Held: recorded.
    create(&store, &run("held"), &me());
    model_answered(&store, &run("held"), vec![call("c1")]);
    decide(&store, &run("held"), 2, &call("c1"), &allow()).unwrap();
    assert!(!finish(&run("held"), &me()).unwrap());

    // Cancelled meanwhile: recorded late, the run stays cancelled.
    create(&store, &run("cancelled"), &me());
    model_answered(&store, &run("cancelled"), vec![call("c1")]);
    decide(&store, &run("cancelled"), 2, &call("c1"), &allow()).unwrap();
    store.cancel(&run("cancelled"), "operator").unwrap();
    assert!(finish(&run("cancelled"), &me()).unwrap());
    assert_eq!(last_payload(&store, &run("cancelled"))["late"], true);
    assert_eq!(
        store.run(&run("cancelled")).unwrap().state,
        RunState::Cancelled
    );

    // Taken over meanwhile: refused, the step stays in flight for the new owner.
    let them = holder(OTHER, Duration::from_secs(30));
    create(&store, &run("taken"), &them);
    tool_in_flight(&store, &run("taken"), &them, vec![call("c1")]);
    f.expire_lease(&store, &run("taken"));
    on(&store, &run("taken"), |m| m.take_over(&me())).unwrap();
    let err = finish(&run("taken"), &them).unwrap_err();
    assert!(
        matches!(&err, Error::RunLeased { owner, .. } if owner == OWNER),
        "{err}"
    );
}

pub(crate) fn a_live_foreign_lease_refuses_a_takeover_without_a_write(f: &dyn Fixture) {
    let store = f.store();
    create(&store, &run("r"), &holder(OTHER, Duration::from_secs(30)));
    let before = store.run(&run("r")).unwrap();
    let err = on(&store, &run("r"), |m| m.take_over(&me())).unwrap_err();
    assert!(
        matches!(&err, Error::RunLeased { owner, .. } if owner == OTHER),
        "{err}"
    );
    assert!(err.is_run_state());
    assert_eq!(store.run(&run("r")).unwrap(), before);
    assert_eq!(kinds(&store, &run("r")), [EventKind::RunStarted]);
}

pub(crate) fn a_takeover_of_an_expired_lease_interrupts_the_steps_in_flight(f: &dyn Fixture) {
    let store = f.store();
    let long = holder(OTHER, Duration::from_secs(30));
    create(&store, &run("r"), &long);
    // Its model step was in flight when it died.
    on(&store, &run("r"), |m| m.begin_model_step(&long, 1)).unwrap();
    f.expire_lease(&store, &run("r"));
    let events_before = store.events(&run("r")).unwrap().len();

    let (interrupted, expires_at, held) = on(&store, &run("r"), |m| m.take_over(&me())).unwrap();
    assert_eq!(interrupted, [1]);
    assert!(held, "the expired lease was someone's");
    assert!(expires_at > wall_millis());
    assert_eq!(store.lease(&run("r")).unwrap().unwrap().owner, OWNER);
    let events = store.events(&run("r")).unwrap();
    let new: Vec<EventKind> = events[events_before..].iter().map(|e| e.kind).collect();
    assert_eq!(
        new,
        [
            EventKind::RunResumed,
            EventKind::LeaseTakenOver,
            EventKind::StepInterrupted
        ]
    );
    let taken = &events[events_before + 1].payload;
    assert_eq!(taken["previous_owner"], OTHER);
    assert_eq!(taken["new_owner"], OWNER);
    assert_eq!(
        events.last().unwrap().payload,
        json!({"kind": "model", "attempt": 1})
    );
    // Seq is gapless.
    let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=events.len() as u64).collect::<Vec<_>>());
    // The old owner can start nothing more.
    let err = on(&store, &run("r"), |m| m.begin_model_step(&long, 2)).unwrap_err();
    assert!(matches!(err, Error::RunLeased { .. }), "{err}");
}

pub(crate) fn a_handover_releases_the_lease_and_its_taker_interrupts_nothing(f: &dyn Fixture) {
    let store = f.store();
    let old = holder(OTHER, Duration::from_secs(30));
    create(&store, &run("r"), &old);
    // A model call in flight when the drain came: abandoned, its attempt not counted.
    on(&store, &run("r"), |m| m.begin_model_step(&old, 1)).unwrap();
    let mut watcher = store.watcher().unwrap();
    watcher.poll().unwrap();
    let abandoned = on(&store, &run("r"), |m| m.hand_over(&old, false)).unwrap();
    assert_eq!(abandoned, Some((1, 1)));
    // The change feed tells a replica with the run's agent, which takes it up at once.
    let polled = watcher.poll().unwrap().expect("the release is a change");
    assert_eq!(changed(&polled), [(run("r"), ChangeKind::Released)]);
    assert!(store.lease(&run("r")).unwrap().is_none(), "released");
    let steps = store.read(|reads| reads.steps(&run("r"))).unwrap();
    assert_eq!((steps[0].state, steps[0].attempt), (StepState::Pending, 0));
    // The old owner writes nothing more.
    let err = on(&store, &run("r"), |m| m.begin_model_attempt(&old, 1, 0)).unwrap_err();
    assert!(matches!(err, Error::LeaseLost { .. }), "{err}");

    let mine = me();
    let (interrupted, _, held) = on(&store, &run("r"), |m| m.take_over(&mine)).unwrap();
    assert!(interrupted.is_empty());
    assert!(!held);
    let events = store.events(&run("r")).unwrap();
    let released = &events[events.len() - 3];
    assert_eq!(released.kind, EventKind::RunReleased);
    assert_eq!(released.payload["owner"], OTHER);
    assert_eq!(
        released.payload["abandoned"],
        json!({"step": 1, "attempt": 1})
    );
    let handed = events.last().unwrap();
    assert_eq!(handed.kind, EventKind::RunHandedOver);
    assert_eq!(handed.payload["previous_owner"], OTHER);
    assert_eq!(handed.payload["new_owner"], OWNER);
    assert_eq!(handed.payload["fencing_token"], FIRST_TOKEN + 1);
    // The next owner makes the abandoned attempt again, from the pending step.
    on(&store, &run("r"), |m| m.begin_model_attempt(&mine, 1, 0)).unwrap();
    let last = store.events(&run("r")).unwrap().pop().unwrap();
    assert_eq!(last.kind, EventKind::ModelStarted);
    assert_eq!(last.payload["attempt"], 1);
    let steps = store.read(|reads| reads.steps(&run("r"))).unwrap();
    assert_eq!((steps[0].state, steps[0].attempt), (StepState::InFlight, 1));

    // A run released with nothing in flight, and one whose failed attempt stays counted.
    create(&store, &run("s"), &old);
    on(&store, &run("s"), |m| m.begin_model_step(&old, 1)).unwrap();
    assert_eq!(
        on(&store, &run("s"), |m| m.hand_over(&old, true)).unwrap(),
        None
    );
    let steps = store.read(|reads| reads.steps(&run("s"))).unwrap();
    assert_eq!((steps[0].state, steps[0].attempt), (StepState::Pending, 1));
    // A takeover whose run's last event is not a release writes no handover.
    create(&store, &run("t"), &old);
    assert!(
        session(&store)
            .writer
            .release(&run("t"), OTHER, FIRST_TOKEN)
            .unwrap()
    );
    on(&store, &run("t"), |m| m.take_over(&mine)).unwrap();
    assert!(!kinds(&store, &run("t")).contains(&EventKind::RunHandedOver));
}

pub(crate) fn a_handover_is_refused_with_a_tool_in_flight_and_under_a_lost_lease(f: &dyn Fixture) {
    let store = f.store();
    let old = holder(OTHER, Duration::from_secs(30));
    create(&store, &run("r"), &old);
    on(&store, &run("r"), |m| m.begin_model_step(&old, 1)).unwrap();
    let answer = ModelOutcome::Answered {
        response: ModelResponse::calls(vec![call("c1")]),
        recorded: Rendered::new(
            serde_json::to_value(ModelResponse::calls(vec![call("c1")])).unwrap(),
        ),
    };
    on(&store, &run("r"), |m| {
        m.finish_model_step(&old, 1, 1, &answer)
    })
    .unwrap();
    on(&store, &run("r"), |m| {
        m.decide_tool(&old, 2, &call("c1"), &allow())
    })
    .unwrap();
    let before = store.events(&run("r")).unwrap();
    let err = on(&store, &run("r"), |m| m.hand_over(&old, false)).unwrap_err();
    assert!(matches!(err, Error::Corrupt(_)), "{err}");
    assert_eq!(store.events(&run("r")).unwrap(), before, "nothing written");
    assert!(store.lease(&run("r")).unwrap().is_some(), "still held");

    // Under a lease taken over since, the old owner releases nothing.
    f.expire_lease(&store, &run("r"));
    let mine = me();
    on(&store, &run("r"), |m| m.take_over(&mine)).unwrap();
    let err = on(&store, &run("r"), |m| m.hand_over(&old, false)).unwrap_err();
    assert!(matches!(err, Error::RunLeased { .. }), "{err}");
    assert_eq!(store.lease(&run("r")).unwrap().unwrap().owner, OWNER);
}

pub(crate) fn a_takeover_of_a_released_run_names_no_previous_owner(f: &dyn Fixture) {
    let store = f.store();
    create(&store, &run("r"), &holder(OTHER, Duration::from_secs(30)));
    assert!(
        session(&store)
            .writer
            .release(&run("r"), OTHER, FIRST_TOKEN)
            .unwrap()
    );
    let mine = me();
    let (_, _, held) = on(&store, &run("r"), |m| m.take_over(&mine)).unwrap();
    assert!(!held, "nobody held the released run");
    assert_eq!(
        kinds(&store, &run("r")),
        [EventKind::RunStarted, EventKind::RunResumed]
    );
    // A finished run cannot be taken over.
    on(&store, &run("r"), |m| m.fail_run(&mine, "x")).unwrap();
    let err = on(&store, &run("r"), |m| m.take_over(&me())).unwrap_err();
    assert!(
        matches!(
            &err,
            Error::RunState {
                state: RunState::Failed,
                ..
            }
        ),
        "{err}"
    );
}

pub(crate) fn an_interrupted_step_is_reconciled_once(f: &dyn Fixture) {
    let store = f.store();
    let gone = holder(OTHER, Duration::from_secs(30));
    create(&store, &run("r"), &gone);
    // The dead owner's tool step in flight.
    tool_in_flight(&store, &run("r"), &gone, vec![call("c1"), call("c2")]);
    assert!(
        session(&store)
            .writer
            .release(&run("r"), OTHER, FIRST_TOKEN)
            .unwrap()
    );
    let mine = me();
    let (interrupted, ..) = on(&store, &run("r"), |m| m.take_over(&mine)).unwrap();
    assert_eq!(interrupted, [2]);
    let applied = Resolution::Applied(json!({"sent": true}));
    let reconcile = |resolution: &Resolution| {
        on(&store, &run("r"), |m| {
            m.reconcile(&mine, 2, 1, Some(&call("c1")), resolution)
        })
    };
    reconcile(&applied).unwrap();
    assert_eq!(
        last_payload(&store, &run("r")),
        json!({"call_id": "c1", "attempt": 1, "output": {"sent": true}, "reconciled": true})
    );
    // Once: the step is no longer interrupted.
    let err = reconcile(&Resolution::Retry {
        outcome: "not_applied",
    })
    .unwrap_err();
    assert!(err.is_run_state(), "{err}");
    let reconciled: Vec<Value> = store
        .events(&run("r"))
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == EventKind::StepReconciled)
        .map(|e| e.payload)
        .collect();
    assert_eq!(
        reconciled,
        [json!({"attempt": 1, "outcome": "applied", "action": "record_output"})]
    );
}

/// Step `step` of `run_id`: its state, attempt and progress.
fn step_progress(store: &Store, run_id: &RunId, step: u32) -> (StepState, u32, Option<Value>) {
    let steps = store.read(|reads| reads.steps(run_id)).unwrap();
    let row = &steps[step as usize - 1];
    (row.state, row.attempt, row.progress.clone())
}

pub(crate) fn a_tools_progress_is_kept_only_while_its_attempt_is_in_flight_under_the_lease(
    f: &dyn Fixture,
) {
    let store = f.store();
    let gone = holder(OTHER, Duration::from_secs(30));
    create(&store, &run("r"), &gone);
    tool_in_flight(&store, &run("r"), &gone, vec![call("c1"), call("c2")]);
    let events = kinds(&store, &run("r"));
    let keep = |grant: &Grant, step: u32, attempt: u32, done: u32| {
        on(&store, &run("r"), |m| {
            m.record_progress(grant, step, attempt, &json!({ "done": done }))
        })
    };
    keep(&gone, 2, 1, 1).unwrap();
    keep(&gone, 2, 1, 2).unwrap();
    let kept = Some(json!({"done": 2}));
    assert_eq!(
        step_progress(&store, &run("r"), 2),
        (StepState::InFlight, 1, kept.clone())
    );
    assert_eq!(kinds(&store, &run("r")), events, "no event");

    // Another attempt, a step not in flight: refused, nothing changes.
    for (step, attempt) in [(2, 2), (3, 0)] {
        let err = keep(&gone, step, attempt, 9).unwrap_err();
        assert!(err.is_run_state(), "{err}");
    }
    assert_eq!(step_progress(&store, &run("r"), 2).2, kept);
    assert_eq!(step_progress(&store, &run("r"), 3).2, None);
    // In a supervisor's group: the refused one is rolled back alone.
    let progress = |attempt: u32, done: u32| {
        queued(moves::RecordProgress {
            by: Leased::new(&run("r"), &gone),
            step: 2,
            attempt,
            progress: json!({ "done": done }),
        })
    };
    let committed = in_one_group(&store, vec![progress(1, 5), progress(2, 6)]);
    assert_eq!(committed, [true, false]);
    let kept = Some(json!({"done": 5}));
    assert_eq!(step_progress(&store, &run("r"), 2).2, kept);

    // Taken over: the old owner keeps nothing more; the new one finds the progress kept.
    f.expire_lease(&store, &run("r"));
    let mine = me();
    on(&store, &run("r"), |m| m.take_over(&mine)).unwrap();
    let err = keep(&gone, 2, 1, 3).unwrap_err();
    assert!(matches!(err, Error::RunLeased { .. }), "{err}");
    assert_eq!(
        step_progress(&store, &run("r"), 2),
        (StepState::Interrupted, 1, kept.clone())
    );
    // Run again, the next attempt starts with it.
    let again = Resolution::Retry {
        outcome: "not_applied",
    };
    on(&store, &run("r"), |m| {
        m.reconcile(&mine, 2, 1, Some(&call("c1")), &again)
    })
    .unwrap();
    assert_eq!(
        step_progress(&store, &run("r"), 2),
        (StepState::InFlight, 2, kept)
    );
    keep(&mine, 2, 2, 4).unwrap();
    assert_eq!(
        step_progress(&store, &run("r"), 2).2,
        Some(json!({"done": 4}))
    );
}

pub(crate) fn a_timed_out_call_is_interrupted_with_its_last_progress_and_reconciled_once(
    f: &dyn Fixture,
) {
    let store = f.store();
    let mine = me();
    create(&store, &run("r"), &mine);
    tool_in_flight(&store, &run("r"), &mine, vec![call("c1")]);
    let last = json!({"done": 7});
    let time_out = |grant: &Grant, progress: Option<&Value>| {
        on(&store, &run("r"), |m| {
            m.time_out_tool(grant, 2, 1, progress)
        })
    };
    time_out(&mine, Some(&last)).unwrap();
    assert_eq!(
        step_progress(&store, &run("r"), 2),
        (StepState::Interrupted, 1, Some(last.clone()))
    );
    let events = store.events(&run("r")).unwrap();
    let timed_out = events.last().unwrap();
    assert_eq!(
        (timed_out.kind, timed_out.step),
        (EventKind::ToolTimedOut, Some(2))
    );
    assert_eq!(
        timed_out.payload,
        json!({"call_id": "c1", "attempt": 1, "why": "timeout", "limit_ms": 200})
    );
    // Once: the step is no longer in flight.
    let err = time_out(&mine, None).unwrap_err();
    assert!(err.is_run_state(), "{err}");
    assert_eq!(store.events(&run("r")).unwrap().len(), events.len());
    // Reconciled as a takeover's interrupted step is.
    let again = Resolution::Retry { outcome: "no_hook" };
    on(&store, &run("r"), |m| {
        m.reconcile(&mine, 2, 1, Some(&call("c1")), &again)
    })
    .unwrap();
    assert_eq!(
        kinds(&store, &run("r"))[events.len()..],
        [EventKind::StepReconciled, EventKind::ToolStarted]
    );

    // Under a lease taken over meanwhile: refused, nothing written.
    let them = holder(OTHER, Duration::from_secs(30));
    create(&store, &run("t"), &them);
    tool_in_flight(&store, &run("t"), &them, vec![call("c1")]);
    f.expire_lease(&store, &run("t"));
    on(&store, &run("t"), |m| m.take_over(&me())).unwrap();
    let before = everything(&store, &run("t"));
    let err = on(&store, &run("t"), |m| {
        m.time_out_tool(&them, 2, 1, Some(&last))
    })
    .unwrap_err();
    assert!(matches!(err, Error::RunLeased { .. }), "{err}");
    let after = everything(&store, &run("t"));
    assert_eq!((after.2, after.3), (before.2, before.3));
}

pub(crate) fn a_cancel_needs_no_lease_and_a_finished_run_cannot_be_cancelled(f: &dyn Fixture) {
    let store = f.store();
    create(
        &store,
        &run("running"),
        &holder(OTHER, Duration::from_secs(30)),
    );
    store.cancel(&run("running"), "operator").unwrap();
    let cancelled = store.run(&run("running")).unwrap();
    assert_eq!(cancelled.state, RunState::Cancelled);
    assert_eq!(cancelled.error.as_deref(), Some("operator"));
    assert_eq!(store.lease(&run("running")).unwrap(), None);
    assert_eq!(
        last_payload(&store, &run("running")),
        json!({"state": "CANCELLED", "reason": "operator"})
    );
    waiting(&store, &run("waiting"));
    store.cancel(&run("waiting"), "operator").unwrap();
    assert!(store.pending_calls(&run("waiting")).unwrap().is_empty());
    let err = store.cancel(&run("running"), "again").unwrap_err();
    assert!(
        matches!(
            &err,
            Error::RunState {
                state: RunState::Cancelled,
                ..
            }
        ),
        "{err}"
    );
    // The owner's loop learns it at its next move.
    let them = holder(OTHER, Duration::from_secs(30));
    let err = on(&store, &run("running"), |m| m.begin_model_step(&them, 1)).unwrap_err();
    assert!(
        matches!(
            &err,
            Error::RunState {
                state: RunState::Cancelled,
                ..
            }
        ),
        "{err}"
    );
}

pub(crate) fn a_renewal_extends_only_the_owners_unexpired_leases(f: &dyn Fixture) {
    let store = f.store();
    create(&store, &run("r0"), &me());
    create_expired(f, &store, &run("r1"), OWNER);
    create(&store, &run("r2"), &holder(OTHER, Duration::from_secs(30)));
    let held = [run("r0"), run("r1"), run("r2"), run("gone")];
    let before = store.lease(&run("r0")).unwrap().unwrap().expires_at;
    let renewal = renew(&store, OWNER, &held);
    assert_eq!(renewal.renewed, [run("r0")]);
    let missing: Vec<&str> = renewal.missing.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(missing, ["r1", "r2", "gone"]);
    assert_eq!(
        renewal.missing[1].1.as_ref().unwrap().owner.as_deref(),
        Some(OTHER)
    );
    assert!(renewal.missing[2].1.is_none());
    let renewed = store.lease(&run("r0")).unwrap().unwrap().expires_at;
    assert_eq!(
        crate::clock::to_millis(renewed),
        renewal.expires_at,
        "stamped with the renewal"
    );
    assert!(renewed >= before);
    // An expired lease stays expired; a foreign one stays its owner's.
    assert!(store.lease(&run("r1")).unwrap().unwrap().expires_at <= std::time::SystemTime::now());
    assert_eq!(store.lease(&run("r2")).unwrap().unwrap().owner, OTHER);
    // No event for a renewal.
    assert_eq!(kinds(&store, &run("r0")), [EventKind::RunStarted]);
}

pub(crate) fn a_release_is_a_compare_and_set_on_the_owner(f: &dyn Fixture) {
    let store = f.store();
    create(&store, &run("r"), &holder(OTHER, Duration::from_secs(30)));
    let mut session = session(&store);
    assert!(
        !session
            .writer
            .release(&run("r"), OWNER, FIRST_TOKEN)
            .unwrap(),
        "not ours"
    );
    assert_eq!(store.lease(&run("r")).unwrap().unwrap().owner, OTHER);
    assert!(
        session
            .writer
            .release(&run("r"), OTHER, FIRST_TOKEN)
            .unwrap()
    );
    assert_eq!(store.lease(&run("r")).unwrap(), None);
    assert_eq!(store.run(&run("r")).unwrap().state, RunState::Running);
    assert!(
        !session
            .writer
            .release(&run("r"), OTHER, FIRST_TOKEN)
            .unwrap(),
        "released once"
    );
    assert_eq!(kinds(&store, &run("r")), [EventKind::RunStarted]);
}

pub(crate) fn a_new_run_keeps_its_trace_context_in_its_run_started(f: &dyn Fixture) {
    let store = f.store();
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let traced = run("traced");
    store
        .apply(
            &SystemClock,
            moves::CreateRun {
                by: Leased::new(&traced, &me()),
                agent: "agent".into(),
                input: json!({}),
                trace: Some(traceparent.into()),
            },
        )
        .unwrap();
    on(&store, &traced, |m| m.begin_model_step(&me(), 1)).unwrap();
    create(&store, &run("plain"), &me());
    let started = |id: &RunId| store.events(id).unwrap().remove(0);
    assert_eq!(
        started(&traced).payload["trace"],
        json!({ "traceparent": traceparent })
    );
    assert!(started(&run("plain")).payload.get("trace").is_none());
    #[cfg(feature = "otel")]
    {
        let first = store.read(|reads| reads.first_event(&traced)).unwrap();
        assert_eq!(first, Some(started(&traced)));
        let unknown = store.read(|reads| reads.first_event(&run("unknown")));
        assert_eq!(unknown.unwrap(), None);
    }
}

pub(crate) fn inspection_reads_runs_events_and_leases(f: &dyn Fixture) {
    let store = f.store();
    create(&store, &run("a"), &me());
    waiting(&store, &run("b"));
    store.cancel(&run("a"), "operator").unwrap();
    let all: Vec<String> = store
        .runs(None)
        .unwrap()
        .into_iter()
        .map(|r| r.id.to_string())
        .collect();
    assert_eq!(all, ["a", "b"], "oldest first");
    let waiting: Vec<RunId> = store
        .runs(Some(RunState::WaitingForApproval))
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(waiting, [run("b")]);
    let events = store.events(&run("b")).unwrap();
    let after = store.events_after(&run("b"), 2).unwrap();
    assert_eq!(after, events[2..]);
    assert!(
        store
            .events_after(&run("b"), events.len() as u64)
            .unwrap()
            .is_empty()
    );
    assert_eq!(store.schema_version().unwrap(), super::SCHEMA_VERSION);
    let health = store.health().unwrap();
    assert!(health.is_ok(), "{health:?}");
    assert!(health.stale_leases.is_empty());
}

pub(crate) fn runs_are_counted_by_state_every_state_named(f: &dyn Fixture) {
    let store = f.store();
    let zero: Vec<(RunState, u64)> = RunState::ALL.iter().map(|&s| (s, 0)).collect();
    assert_eq!(store.count_by_state().unwrap(), zero, "an empty store");
    create(&store, &run("a"), &me());
    create(&store, &run("b"), &me());
    create(&store, &run("c"), &me());
    waiting(&store, &run("d"));
    succeeded(&store, &run("e"));
    store.cancel(&run("a"), "operator").unwrap();
    assert_eq!(
        store.count_by_state().unwrap(),
        [
            (RunState::Running, 2),
            (RunState::WaitingForApproval, 1),
            (RunState::WaitingForAnswer, 0),
            (RunState::WaitingForEvent, 0),
            (RunState::WaitingForTimer, 0),
            (RunState::WaitingForChild, 0),
            (RunState::Succeeded, 1),
            (RunState::Failed, 0),
            (RunState::Cancelled, 1),
        ]
    );
}

pub(crate) fn unknown_ids_are_not_found(f: &dyn Fixture) {
    let store = f.store();
    let x = run("nope");
    assert!(store.run(&x).unwrap_err().is_not_found());
    assert!(store.events(&x).unwrap_err().is_not_found());
    assert!(store.events_after(&x, 3).unwrap_err().is_not_found());
    assert!(store.lease(&x).unwrap_err().is_not_found());
    assert!(store.pending_calls(&x).unwrap_err().is_not_found());
    assert!(store.cancel(&x, "r").unwrap_err().is_not_found());
    let mine = me();
    let err = on(&store, &x, |m| m.take_over(&mine)).unwrap_err();
    assert!(err.is_not_found(), "{err}");
    let err = on(&store, &x, |m| m.begin_model_step(&mine, 1)).unwrap_err();
    assert!(err.is_not_found(), "{err}");
    assert!(store.runs(None).unwrap().is_empty(), "nothing was created");
}

pub(crate) fn a_newer_schema_is_refused(f: &dyn Fixture) {
    let Some(opened) = f.open_newer_schema() else {
        return;
    };
    let err = opened.unwrap_err();
    assert!(
        matches!(&err, Error::SchemaTooNew { found, supported, .. } if found > supported),
        "{err}"
    );
}

/// The fencing token the run's lease was last acquired with, as stored.
fn stored_token(store: &Store, run_id: &RunId) -> u64 {
    store
        .read(|reads| Ok(reads.lease_row(run_id)?.unwrap().epoch))
        .unwrap()
}

pub(crate) fn every_acquisition_takes_a_higher_token_and_an_older_one_writes_nothing(
    f: &dyn Fixture,
) {
    let store = f.store();
    // A start takes the first token.
    let first = me();
    create(&store, &run("r"), &first);
    assert_eq!(stored_token(&store, &run("r")), FIRST_TOKEN);
    assert_eq!(first.token(), FIRST_TOKEN);
    tool_in_flight(&store, &run("r"), &first, vec![call("c1")]);
    assert_eq!(last_payload(&store, &run("r"))["fencing_token"], 1);

    // The same owner name takes it over (a restart with a fixed name, say): a new token, and
    // the grant of the old one can no longer write, renew or release.
    f.expire_lease(&store, &run("r"));
    let second = me();
    on(&store, &run("r"), |m| m.take_over(&second)).unwrap();
    assert_eq!((second.token(), stored_token(&store, &run("r"))), (2, 2));
    assert_eq!(last_payload(&store, &run("r"))["kind"], "tool");
    let resumed = store
        .events(&run("r"))
        .unwrap()
        .into_iter()
        .rfind(|e| e.kind == EventKind::RunResumed)
        .unwrap();
    assert_eq!(resumed.payload["fencing_token"], 2);
    let events = store.events(&run("r")).unwrap().len();
    let applied = Resolution::Applied(json!({"sent": true}));
    let err = on(&store, &run("r"), |m| {
        m.reconcile(&first, 2, 1, Some(&call("c1")), &applied)
    })
    .unwrap_err();
    assert!(matches!(err, Error::RunLeased { .. }), "{err}");
    let outcome = ToolResult::Ok(json!({}));
    let err = on(&store, &run("r"), |m| {
        m.finish_tool(&first, 2, 1, "c1", &outcome)
    })
    .unwrap_err();
    assert!(matches!(err, Error::RunLeased { .. }), "{err}");
    let renewal = renew_tokens(&store, OWNER, &[(run("r"), FIRST_TOKEN)]);
    assert!(renewal.renewed.is_empty());
    let mut session = session(&store);
    assert!(
        !session
            .writer
            .release(&run("r"), OWNER, FIRST_TOKEN)
            .unwrap()
    );
    assert_eq!(store.events(&run("r")).unwrap().len(), events);

    // The new token's retry starts under it, and pausing then resuming takes the next one.
    let retry = Resolution::Retry {
        outcome: "not_applied",
    };
    on(&store, &run("r"), |m| {
        m.reconcile(&second, 2, 1, Some(&call("c1")), &retry)
    })
    .unwrap();
    assert_eq!(last_payload(&store, &run("r"))["fencing_token"], 2);
    on(&store, &run("r"), |m| {
        m.finish_tool(&second, 2, 2, "c1", &outcome)
    })
    .unwrap();
    let response = ModelResponse::calls(vec![call("c2")]);
    let answered = ModelOutcome::Answered {
        recorded: Rendered::new(serde_json::to_value(&response).unwrap()),
        response,
    };
    on(&store, &run("r"), |m| m.begin_model_step(&second, 3)).unwrap();
    on(&store, &run("r"), |m| {
        m.finish_model_step(&second, 3, 1, &answered)
    })
    .unwrap();
    on(&store, &run("r"), |m| {
        m.decide_tool(&second, 4, &call("c2"), &require())
    })
    .unwrap();
    let third = me();
    on(&store, &run("r"), |m| {
        m.resume_waiting(
            &third,
            4,
            0,
            &call("c2"),
            crate::ApprovalReason::Policy,
            &allow(),
            "approval",
        )
    })
    .unwrap();
    assert_eq!((third.token(), stored_token(&store, &run("r"))), (3, 3));
    assert_eq!(last_payload(&store, &run("r"))["fencing_token"], 3);
}

pub(crate) fn a_start_short_of_the_margin_writes_nothing_whatever_the_wall_clock_says(
    f: &dyn Fixture,
) {
    let store = f.store();
    let grant = Grant::held(
        Holder {
            owner: OWNER.into(),
            ttl: Duration::from_secs(30),
            margin: Duration::from_secs(10),
        },
        FIRST_TOKEN,
    );
    create(&store, &run("r"), &grant);
    model_answered_by(&store, &run("r"), &grant, vec![call("c1"), call("c2")]);
    let events = store.events(&run("r")).unwrap().len();
    let short = |err: &Error| {
        matches!(
            err,
            Error::LeaseLost {
                reason: crate::LeaseLostReason::Expired,
                ..
            }
        )
    };
    // Moved back, the wall clock says the stored lease has most of its 30 s left; moved
    // forward by less than that, it still says more than the margin. The loop's own deadline
    // has 5 s left: short of the 10 s margin, nothing starts, and the deadline is judged
    // before the wall clock is read at all.
    for shift in [-60_000, 0, 10_000] {
        crate::clock::THREAD_WALL_SHIFT.set(shift);
        grant.set_remaining(Duration::from_secs(5));
        let err = on(&store, &run("r"), |m| {
            m.decide_tool(&grant, 2, &call("c1"), &allow())
        })
        .unwrap_err();
        assert!(short(&err), "{err}");
        let retry = Resolution::Retry {
            outcome: "not_applied",
        };
        let err = on(&store, &run("r"), |m| {
            m.reconcile(&grant, 2, 0, Some(&call("c1")), &retry)
        })
        .unwrap_err();
        assert!(short(&err), "{err}");
        assert_eq!(store.events(&run("r")).unwrap().len(), events, "{shift}");
    }
    // A move that starts nothing needs no margin.
    let deny = ToolDecision::Deny {
        reason: "no".into(),
        by: None,
        note: None,
    };
    on(&store, &run("r"), |m| {
        m.decide_tool(&grant, 2, &call("c1"), &deny)
    })
    .unwrap();
    // With the margin back (a renewal), the start goes, unless the wall clock has moved so far
    // forward that the stored lease is short of the margin by it: both must have it.
    grant.set_remaining(Duration::from_secs(29));
    crate::clock::THREAD_WALL_SHIFT.set(25_000);
    let err = on(&store, &run("r"), |m| {
        m.decide_tool(&grant, 3, &call("c2"), &allow())
    })
    .unwrap_err();
    assert!(short(&err), "{err}");
    crate::clock::THREAD_WALL_SHIFT.set(0);
    on(&store, &run("r"), |m| {
        m.decide_tool(&grant, 3, &call("c2"), &allow())
    })
    .unwrap();
    assert_eq!(
        kinds(&store, &run("r")).last(),
        Some(&EventKind::ToolStarted)
    );
}

/// A run that succeeded: model step 1 asked for `c1`, tool step 2 ran it, model step 3
/// answered.
fn succeeded(store: &Store, run_id: &RunId) {
    let grant = me();
    create(store, run_id, &grant);
    tool_in_flight(store, run_id, &grant, vec![call("c1")]);
    let outcome = ToolResult::Ok(json!({"sent": true}));
    on(store, run_id, |m| {
        m.finish_tool(&grant, 2, 1, "c1", &outcome)
    })
    .unwrap();
    on(store, run_id, |m| m.begin_model_step(&grant, 3)).unwrap();
    let response = ModelResponse::answer("done");
    let answered = ModelOutcome::Answered {
        recorded: Rendered::new(serde_json::to_value(&response).unwrap()),
        response,
    };
    on(store, run_id, |m| {
        m.finish_model_step(&grant, 3, 1, &answered)
    })
    .unwrap();
}

/// Everything stored of a run: its row, lease, steps and events.
type Stored = (
    crate::Run,
    Option<super::model::LeaseRow>,
    Vec<super::model::StepRow>,
    Vec<crate::Event>,
);

fn everything(store: &Store, run_id: &RunId) -> Stored {
    let run = store.run(run_id).unwrap();
    let lease = store.read(|reads| reads.lease_row(run_id)).unwrap();
    let steps = store.read(|reads| reads.steps(run_id)).unwrap();
    (run, lease, steps, store.events(run_id).unwrap())
}

pub(crate) fn a_fork_copies_the_steps_before_it_and_their_events_and_only_reads_the_origin(
    f: &dyn Fixture,
) {
    let store = f.store();
    succeeded(&store, &run("r"));
    let before = everything(&store, &run("r"));
    let origin_steps = store.read(|reads| reads.steps(&run("r"))).unwrap();
    let origin_events = store.events(&run("r")).unwrap();

    assert_eq!(store.fork(&run("r"), 3, Some(run("f"))).unwrap(), run("f"));
    let forked = store.run(&run("f")).unwrap();
    assert_eq!(forked.state, RunState::Running);
    assert_eq!(
        (forked.agent.as_str(), &forked.input),
        ("agent", &json!({"n": 1}))
    );
    assert_eq!(store.lease(&run("f")).unwrap(), None, "nobody holds it");
    assert_eq!(stored_token(&store, &run("f")), 0);
    let steps = store.read(|reads| reads.steps(&run("f"))).unwrap();
    assert_eq!(steps, origin_steps[..2], "copied as recorded");
    let events = store.events(&run("f")).unwrap();
    assert_eq!(
        events.iter().map(|e| e.kind).collect::<Vec<_>>(),
        [
            EventKind::RunStarted,
            EventKind::RunForked,
            EventKind::ModelStarted,
            EventKind::ModelFinished,
            EventKind::PolicyDecided,
            EventKind::ToolStarted,
            EventKind::ToolFinished,
        ]
    );
    assert_eq!(
        events[0].payload,
        json!({"agent": "agent", "input": {"n": 1}, "fencing_token": 0,
               "forked_from": {"run_id": "r", "at": 3}})
    );
    assert_eq!(
        events[1].payload,
        json!({"origin": "r", "at": 3, "steps_copied": 2})
    );
    for (copy, original) in events[2..].iter().zip(&origin_events[1..6]) {
        let mut payload = copy.payload.clone();
        let from = payload
            .as_object_mut()
            .unwrap()
            .remove("copied_from")
            .unwrap();
        assert_eq!(from, json!({"run_id": "r", "seq": original.seq}));
        assert_eq!(
            (copy.kind, copy.step, payload),
            (original.kind, original.step, original.payload.clone())
        );
    }
    // One move: one clock reading for all of it.
    assert!(events.iter().all(|e| e.at == events[0].at));
    // The copies were the origin's model calls: the fork has used nothing yet.
    assert_eq!(store.usage(&run("f")).unwrap(), crate::RunUsage::default());

    // One past the last step drops nothing (but the origin's end); step 1 copies nothing.
    store.fork(&run("r"), 4, Some(run("all"))).unwrap();
    let all = store.read(|reads| reads.steps(&run("all"))).unwrap();
    assert_eq!(all, origin_steps);
    assert_eq!(store.events(&run("all")).unwrap().len(), 2 + 7);
    store.fork(&run("r"), 1, Some(run("none"))).unwrap();
    assert_eq!(
        kinds(&store, &run("none")),
        [EventKind::RunStarted, EventKind::RunForked]
    );
    assert!(
        store
            .read(|reads| reads.steps(&run("none")))
            .unwrap()
            .is_empty()
    );
    // A fork of a fork copies its copies, each saying which event of its own origin it is.
    store.fork(&run("f"), 3, Some(run("ff"))).unwrap();
    let again = store.events(&run("ff")).unwrap();
    assert_eq!(
        again[2].payload["copied_from"],
        json!({"run_id": "f", "seq": 3})
    );

    assert_eq!(
        everything(&store, &run("r")),
        before,
        "the origin is unchanged"
    );
}

pub(crate) fn a_fork_is_refused_unchanged_where_it_cannot_start(f: &dyn Fixture) {
    let store = f.store();
    succeeded(&store, &run("r"));
    create(&store, &run("busy"), &me());
    tool_in_flight(&store, &run("busy"), &me(), vec![call("c1")]);
    let before = (
        everything(&store, &run("r")),
        everything(&store, &run("busy")),
    );
    let invalid = |err: &Error| matches!(err, Error::InvalidInput(_));
    for (at, what) in [(0, "numbered from 1"), (2, "tool call"), (5, "has 3 steps")] {
        let err = store.fork(&run("r"), at, Some(run("x"))).unwrap_err();
        assert!(
            invalid(&err) && err.to_string().contains(what),
            "{at}: {err}"
        );
    }
    let err = store.fork(&run("nope"), 1, Some(run("x"))).unwrap_err();
    assert!(
        matches!(&err, Error::RunNotFound(id) if *id == run("nope")),
        "{err}"
    );
    let err = store.fork(&run("r"), 1, Some(run("busy"))).unwrap_err();
    assert!(
        matches!(&err, Error::RunExists(id) if *id == run("busy")),
        "{err}"
    );
    // Step 2 of `busy` is in flight: a fork after it is refused, naming it; one before it is
    // not.
    let err = store.fork(&run("busy"), 3, Some(run("x"))).unwrap_err();
    assert!(
        matches!(&err, Error::RunState { run_id, state: RunState::Running, .. } if *run_id == run("busy")),
        "{err}"
    );
    assert!(err.to_string().contains("step 2 is in_flight"), "{err}");
    let err = store.fork(&run("nope"), 0, Some(run("x"))).unwrap_err();
    assert!(invalid(&err), "{err}");
    assert!(matches!(store.run(&run("x")), Err(Error::RunNotFound(_))));
    assert_eq!(store.runs(None).unwrap().len(), 2);
    assert_eq!(
        (
            everything(&store, &run("r")),
            everything(&store, &run("busy"))
        ),
        before
    );
    store.fork(&run("busy"), 1, Some(run("x"))).unwrap();
}

pub(crate) fn a_fork_is_taken_over_with_the_first_token_and_asks_the_model_at_its_step(
    f: &dyn Fixture,
) {
    let store = f.store();
    succeeded(&store, &run("r"));
    let id = store.fork(&run("r"), 3, None).unwrap();
    assert_ne!(id, run("r"));
    let grant = me();
    let (interrupted, _, held) = on(&store, &id, |m| m.take_over(&grant)).unwrap();
    assert!(interrupted.is_empty());
    assert!(!held, "nobody held the fork");
    assert_eq!(
        (grant.token(), stored_token(&store, &id)),
        (FIRST_TOKEN, FIRST_TOKEN)
    );
    let kinds = kinds(&store, &id);
    assert_eq!(kinds.last(), Some(&EventKind::RunResumed), "nobody held it");
    assert_eq!(
        last_payload(&store, &id),
        json!({"from": "RUNNING", "fencing_token": FIRST_TOKEN})
    );
    on(&store, &id, |m| m.begin_model_step(&grant, 3)).unwrap();
    assert_eq!(last_payload(&store, &id), json!({"attempt": 1}));
}

/// The rows of every table of a run, counted through the boundary: (steps, events, approvals).
fn row_counts(store: &Store, run_id: &RunId) -> (u64, u64, u64) {
    let purged = store
        .read(|reads| reads.purge_counts(std::slice::from_ref(run_id)))
        .unwrap();
    (purged.steps, purged.events, purged.approvals)
}

/// A run cancelled while it waited for an approval, which an operator had recorded.
fn cancelled_with_an_approval(store: &Store, run_id: &RunId) {
    waiting(store, run_id);
    store
        .record_approval(&Approval::approve(run_id.clone(), "c1", "alice"))
        .unwrap();
    store.cancel(run_id, "no longer needed").unwrap();
}

pub(crate) fn a_purge_deletes_every_row_of_the_finished_runs_and_none_of_a_live_one(
    f: &dyn Fixture,
) {
    use crate::Purge;
    let store = f.store();
    succeeded(&store, &run("done"));
    cancelled_with_an_approval(&store, &run("cancelled"));
    waiting(&store, &run("waits"));
    create(&store, &run("live"), &me());
    let live: Vec<Stored> = ["waits", "live"]
        .iter()
        .map(|id| everything(&store, &run(id)))
        .collect();
    let (done, cancelled) = (
        row_counts(&store, &run("done")),
        row_counts(&store, &run("cancelled")),
    );
    assert_eq!(cancelled.2, 1, "the cancelled run has its approval");
    let later = std::time::SystemTime::now() + Duration::from_secs(3600);

    let dry = store
        .purge(&Purge::finished_before(later).dry_run(true))
        .unwrap();
    assert!(dry.dry_run && dry.space.is_none());
    let mut finished: Vec<crate::Run> = ["done", "cancelled"]
        .iter()
        .map(|id| store.run(&run(id)).unwrap())
        .collect();
    finished.sort_by(|a, b| (a.updated_at, &a.id).cmp(&(b.updated_at, &b.id)));
    let oldest_first: Vec<RunId> = finished.into_iter().map(|r| r.id).collect();
    assert_eq!(dry.run_ids, oldest_first, "oldest finish first");
    assert_eq!(
        (dry.runs, dry.steps, dry.events, dry.approvals),
        (
            2,
            done.0 + cancelled.0,
            done.1 + cancelled.1,
            done.2 + cancelled.2
        )
    );
    assert_eq!(
        row_counts(&store, &run("done")),
        done,
        "a dry run deletes nothing"
    );

    let report = store
        .purge(&Purge::finished_before(later).batch(1))
        .unwrap();
    assert_eq!(
        (report.runs, report.steps, report.events, report.approvals),
        (dry.runs, dry.steps, dry.events, dry.approvals)
    );
    assert_eq!(report.run_ids, dry.run_ids);
    assert_eq!(report.batches, 2, "one transaction per run");
    assert!(report.space.is_some());
    for id in ["done", "cancelled"] {
        assert!(store.run(&run(id)).unwrap_err().is_not_found(), "{id}");
        assert_eq!(row_counts(&store, &run(id)), (0, 0, 0), "{id}");
    }
    let after: Vec<Stored> = ["waits", "live"]
        .iter()
        .map(|id| everything(&store, &run(id)))
        .collect();
    assert_eq!(after, live, "the runs that have not finished are untouched");

    let again = store.purge(&Purge::finished_before(later)).unwrap();
    assert_eq!((again.runs, again.batches), (0, 0), "nothing left to purge");
    let err = store
        .purge(&Purge::finished_before(later).batch(0))
        .unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err}");
}

pub(crate) fn a_purge_by_id_refuses_an_unknown_or_unfinished_run_and_deletes_nothing(
    f: &dyn Fixture,
) {
    use crate::Purge;
    let store = f.store();
    succeeded(&store, &run("done"));
    succeeded(&store, &run("also-done"));
    waiting(&store, &run("waits"));
    let before = everything(&store, &run("done"));
    for (ids, not_found) in [
        (["done", "waits", "also-done"], false),
        (["done", "nope", "also-done"], true),
    ] {
        for dry_run in [true, false] {
            // Batches of one: the refusal comes before the first batch deletes anything.
            let err = store
                .purge(&Purge::runs(ids).batch(1).dry_run(dry_run))
                .unwrap_err();
            assert_eq!(err.is_not_found(), not_found, "{err}");
            assert_eq!(err.is_run_state(), !not_found, "{err}");
            assert_eq!(everything(&store, &run("done")), before, "{err}");
        }
    }
    let report = store
        .purge(&Purge::runs(["also-done", "done", "done"]).batch(1))
        .unwrap();
    assert_eq!(
        report.run_ids,
        [run("also-done"), run("done")],
        "as given, once each"
    );
    assert_eq!((report.runs, report.batches), (2, 2));
    assert!(store.run(&run("done")).unwrap_err().is_not_found());
    assert_eq!(
        store.run(&run("waits")).unwrap().state,
        RunState::WaitingForApproval
    );
}

pub(crate) fn runs_are_listed_a_page_at_a_time_each_once_and_filtered(f: &dyn Fixture) {
    use crate::RunQuery;
    let store = f.store();
    for n in 0..7 {
        create(&store, &run(&format!("r{n}")), &me());
    }
    on(&store, &run("other"), |m| {
        m.create_run("other-agent", &json!({}), &me())
    })
    .unwrap();
    waiting(&store, &run("waits"));
    let all: Vec<RunId> = store
        .runs(None)
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(all.len(), 9);

    let mut seen = Vec::new();
    let mut query = RunQuery::new().limit(2);
    let mut pages = 0;
    loop {
        let page = store.list_runs(&query).unwrap();
        pages += 1;
        assert!(page.runs.len() <= 2);
        seen.extend(page.runs.into_iter().map(|r| r.id));
        if pages == 2 {
            // A run created between two pages comes on a later one, once; none is seen twice.
            // (Its id sorts last among runs created in the same millisecond.)
            create(&store, &run("zz-late"), &me());
        }
        match page.next {
            Some(next) => query = query.after(next),
            None => break,
        }
    }
    let mut expected = all.clone();
    expected.push(run("zz-late"));
    assert_eq!(seen, expected, "each run once, in (created_at, id) order");

    let ids = |query: RunQuery| -> Vec<RunId> {
        let page = store.list_runs(&query).unwrap();
        assert_eq!(page.next, None);
        page.runs.into_iter().map(|r| r.id).collect()
    };
    assert_eq!(ids(RunQuery::new().agent("other-agent")), [run("other")]);
    assert_eq!(
        ids(RunQuery::new()
            .agent("agent")
            .state(RunState::WaitingForApproval)),
        [run("waits")]
    );
    assert!(
        ids(RunQuery::new()
            .agent("other-agent")
            .state(RunState::WaitingForApproval))
        .is_empty()
    );
    let future = std::time::SystemTime::now() + Duration::from_secs(3600);
    assert!(ids(RunQuery::new().since(future)).is_empty());
    let past = std::time::SystemTime::now() - Duration::from_secs(3600);
    assert_eq!(ids(RunQuery::new().since(past).limit(1000)).len(), 10);

    for query in [
        RunQuery::new().after("not a cursor"),
        RunQuery::new().limit(0),
        RunQuery::new().limit(1001),
    ] {
        let err = store.list_runs(&query).unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)), "{err}");
    }
}

/// The runs and kinds of what a poll read, in order.
fn changed(changes: &Changes) -> Vec<(RunId, ChangeKind)> {
    changes
        .changes
        .iter()
        .map(|change| (change.run_id.clone(), change.kind))
        .collect()
}

pub(crate) fn a_watcher_reads_what_waits_decided_then_each_change_after_its_cursor(
    f: &dyn Fixture,
) {
    let store = f.store();
    // Decided before anyone watched: the first poll finds it among the waiting runs.
    waiting(&store, &run("early"));
    waiting(&store, &run("undecided"));
    create(&store, &run("running"), &me());
    store
        .record_approval(&Approval::approve(run("early"), "c1", "alice"))
        .unwrap();
    let mut watcher = store.watcher().unwrap();
    let first = watcher.poll().unwrap().expect("the first poll reads");
    assert!(first.resync, "the first poll may have missed cancels");
    assert_eq!(changed(&first), [(run("early"), ChangeKind::Decided)]);
    assert_eq!(first.changes[0].agent, "agent");
    assert_eq!(watcher.poll().unwrap(), None, "nothing committed since");

    // Committed afterwards: read from the feed once each, in commit order. The moves of an
    // ordinary run (a start, a model step, a pause) are no change.
    waiting(&store, &run("late"));
    store
        .record_approval(&Approval::deny(run("late"), "c1", "bob"))
        .unwrap();
    store.cancel(&run("running"), "operator").unwrap();
    store.cancel(&run("undecided"), "operator").unwrap();
    // Refused: no change.
    store.cancel(&run("running"), "again").unwrap_err();
    let next = watcher.poll().unwrap().expect("changes were committed");
    assert!(!next.resync);
    assert_eq!(
        changed(&next),
        [
            (run("late"), ChangeKind::Decided),
            (run("running"), ChangeKind::Cancelled),
            (run("undecided"), ChangeKind::Cancelled),
        ]
    );
    assert_eq!(watcher.poll().unwrap(), None);
    create(&store, &run("another"), &me());
    assert_eq!(
        watcher.poll().unwrap(),
        None,
        "a commit that changed nothing watched"
    );

    // A decision acted on before the poll (the run resumed already) is no news.
    waiting(&store, &run("resumed"));
    store
        .record_approval(&Approval::approve(run("resumed"), "c1", "alice"))
        .unwrap();
    on(&store, &run("resumed"), |m| {
        m.resume_waiting(
            &me(),
            2,
            0,
            &call("c1"),
            crate::ApprovalReason::Policy,
            &allow(),
            "approval",
        )
    })
    .unwrap();
    assert_eq!(watcher.poll().unwrap(), None);
}
