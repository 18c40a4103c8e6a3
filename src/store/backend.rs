//! The storage boundary: what the actors and the moves ask of a backend.
//!
//! A backend implements three things, each small:
//! - [`Reads`] and [`Tx`]: the guarded primitives the moves (in `moves/`, written once for
//!   every backend) are made of. Each guarded write returns whether its guard matched, and
//!   changes nothing when it did not.
//! - [`Backend`]: the store as a whole; inspection, operator moves, and a [`Session`] for a
//!   supervisor.
//! - [`Writer`] and [`Renewer`]: a supervisor's write side. The store's move queue holds the
//!   moves, and the store actor hands them to the writer in batches (or a [`Router`] takes
//!   each straight to the connection that commits it); the writer commits them with the
//!   durability each asked for and answers each caller. The lease keeper renews through the renewer, or through
//!   the writer where the backend has no second connection.
//! - [`Watcher`]: a supervisor's view of the decisions and cancels that any writer commits
//!   (another process, the CLI, its own writer), read from a change feed.

use std::{any::Any, sync::Arc, time::Duration};

use serde_json::Value;

use super::{
    health::Space,
    listing::ListQuery,
    model::{ApprovalRow, LeaseRow, Now, Rendered, Renewal, ScheduleRow, StepRow, WaitRow},
};
use crate::{
    clock::Clock,
    error::{Error, Result},
    types::{
        Approval, ApprovalReason, Delivery, Event, EventKind, Run, RunId, RunState, StepKind,
        StepState, ToolCall, WaitKind,
    },
};

/// Reads of a run's rows, inside a transaction or outside.
pub(crate) trait Reads {
    /// The wall-clock time leases are stamped and judged by, in milliseconds: this host's
    /// clock on a backend that lives on one host (SQLite), the database server's on one that
    /// several hosts share (PostgreSQL), so that no two hosts' clocks need to agree. Read anew
    /// at each call.
    fn lease_wall(&mut self) -> Result<i64> {
        Ok(super::model::wall_millis())
    }
    /// A run's state and lease; `None` for an unknown run.
    fn lease_row(&mut self, run_id: &RunId) -> Result<Option<LeaseRow>>;
    /// A run; `None` for an unknown run.
    fn run(&mut self, run_id: &RunId) -> Result<Option<Run>>;
    /// The runs, oldest first (ties by id); only those in `state` when given.
    fn runs(&mut self, state: Option<RunState>) -> Result<Vec<Run>>;
    /// How many runs are in each state, for the states that have any.
    fn count_by_state(&mut self) -> Result<Vec<(RunState, u64)>>;
    /// A run's events after sequence number `after`, in order (none for an unknown run).
    fn events_after(&mut self, run_id: &RunId, after: u64) -> Result<Vec<Event>>;
    /// A run's last event (`None` for an unknown run): a takeover reads it to tell a run a
    /// drain released from one whose owner died.
    fn last_event(&mut self, run_id: &RunId) -> Result<Option<Event>>;
    /// A run's first event, its `run.started` (`None` for an unknown run): where the run's
    /// trace context is kept.
    #[cfg(feature = "otel")]
    fn first_event(&mut self, run_id: &RunId) -> Result<Option<Event>>;
    /// A run's steps, in order.
    fn steps(&mut self, run_id: &RunId) -> Result<Vec<StepRow>>;
    /// The decision recorded for attempt `attempt` of step `step`.
    fn approval(&mut self, run_id: &RunId, step: u32, attempt: u32) -> Result<Option<ApprovalRow>>;
    /// The RUNNING runs whose lease expired by wall-clock time `wall` or that nobody holds,
    /// by id.
    fn unleased_runs(&mut self, wall: i64) -> Result<Vec<(RunId, LeaseRow)>>;
    /// What recovery takes over: the first `limit` RUNNING runs of `agents` whose lease expired
    /// by wall-clock time `wall` or that nobody holds, oldest first (ties by id); those some
    /// process executed (fencing token above 0) when `executed`, else those never executed.
    fn recoverable_runs(
        &mut self,
        wall: i64,
        agents: &[&str],
        executed: bool,
        limit: usize,
    ) -> Result<Vec<(RunId, LeaseRow)>>;
    /// At most `query.limit` runs matching its filters, after its place, by (created_at, id).
    fn list_runs(&mut self, query: &ListQuery<'_>) -> Result<Vec<Run>>;
    /// At most `limit` finished runs whose last move came before `before`, after `after`, by
    /// (updated_at, id): each with its updated_at.
    fn finished_runs(
        &mut self,
        before: i64,
        after: Option<(i64, &RunId)>,
        limit: usize,
    ) -> Result<Vec<(RunId, i64)>>;
    /// What purging `ids` would delete: those of them that have finished, in the order given,
    /// and their rows.
    fn purge_counts(&mut self, ids: &[RunId]) -> Result<Purged>;
    /// The run's wait (answer, event, timer, child), with its call's id; `None` when it has
    /// none.
    fn wait(&mut self, run_id: &RunId) -> Result<Option<WaitRow>>;
    /// At most `limit` runs of `agents` whose wait is ready by `until` (a due timer, or a wait
    /// woken), by when they became ready and then by id, after `after` (that time and the id
    /// of the last run of the previous page): each with that time. Read through the index of
    /// ready waits, whatever the number of runs that wait for later.
    fn ready_waits(
        &mut self,
        until: i64,
        agents: &[&str],
        after: Option<(i64, &RunId)>,
        limit: usize,
    ) -> Result<Vec<(RunId, i64)>>;
    /// The earliest time after `after` at which a wait of `agents` becomes ready (a timer).
    fn next_ready_at(&mut self, after: i64, agents: &[&str]) -> Result<Option<i64>>;
    /// At most `limit` waits (of `kind` when given) after (`since`, run id), by (since, run
    /// id): what the inbox and `agentrt waits` list.
    fn list_waits(
        &mut self,
        kind: Option<WaitKind>,
        after: Option<(i64, &RunId)>,
        limit: usize,
    ) -> Result<Vec<(RunId, WaitRow)>>;
    /// The schedule `name`; `None` when there is none. In a move's transaction, its row is the
    /// move's until the commit (a backend whose writers run side by side locks it).
    fn schedule(&mut self, name: &str) -> Result<Option<ScheduleRow>>;
    /// Every schedule, by name.
    fn schedules(&mut self) -> Result<Vec<ScheduleRow>>;
    /// The first `limit` schedules of `agents` that are not paused and whose next occurrence
    /// is at or before `until`, by that occurrence: read through the index of due schedules,
    /// per agent, whatever the number of schedules not due or of other agents.
    fn due_schedules(
        &mut self,
        until: i64,
        agents: &[&str],
        limit: usize,
    ) -> Result<Vec<ScheduleRow>>;
    /// The earliest next occurrence after `after` of the schedules of `agents` that are not
    /// paused.
    fn next_scheduled_at(&mut self, after: i64, agents: &[&str]) -> Result<Option<i64>>;
}

/// The rows a purge deleted (or would delete).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Purged {
    /// The runs, in the order they were asked for.
    pub ids: Vec<RunId>,
    pub runs: u64,
    pub steps: u64,
    pub events: u64,
    pub approvals: u64,
}

/// A new RUNNING run. With a lease (a start), its owner and expiry are stamped in the insert
/// with the first fencing token ([`FIRST_TOKEN`](super::moves::FIRST_TOKEN)); without one (a
/// fork), nobody holds it and its token is 0, so that the resume that takes it over takes
/// the first.
pub(crate) struct NewRun<'a> {
    pub run_id: &'a RunId,
    pub agent: &'a str,
    pub input: &'a Value,
    pub at: i64,
    /// The owner and the expiry of its lease; `None` for a run nobody holds.
    pub lease: Option<(&'a str, i64)>,
}

/// A run's move between states, guarded by its state (and its lease, for a loop's move). The
/// lease is set as given: an owner and an expiry entering RUNNING, with the next fencing token
/// (the stored one plus one); none leaving it.
pub(crate) struct RunUpdate<'a> {
    /// The states the run may be in (one or two).
    pub from: &'a [RunState],
    pub to: RunState,
    pub output: Option<&'a str>,
    pub error: Option<&'a str>,
    pub at: i64,
    pub owner: Option<&'a str>,
    pub expires_at: Option<i64>,
    /// The owner and fencing token of the lease the run must be under; `None` for an
    /// operator's move.
    pub guard: Option<(&'a str, u64)>,
}

/// A step's move out of the state and attempt its executor saw.
pub(crate) struct StepUpdate<'a> {
    pub from: StepState,
    pub attempt: u32,
    pub to: StepState,
    /// Adds an attempt.
    pub starts: bool,
    /// Replaces the stored result when given.
    pub result: Option<&'a Value>,
    /// `result`'s JSON text, when it was made already (for a backend that stores the text).
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub result_text: Option<&'a str>,
    pub waiting_for: Option<ApprovalReason>,
}

/// A transaction of one backend: the guarded primitives every move is written with.
///
/// A move reads rows and then writes on what it read (`CreateRun` looks for the id before
/// it inserts, `append_event` numbers after the run's last event), so a backend must run each
/// transaction as if no other writer ran between its reads and its writes: SQLite's
/// `BEGIN IMMEDIATE` serializes writers; a backend with concurrent writers locks the run's row
/// first, or runs its transactions serializable and applies a move again after a conflict
/// (which is why a move may be applied more than once, with the same clock reading).
pub(crate) trait Tx: LeaseWrites {
    /// Waits for, and takes until the commit, the right to write the run's row: what a move
    /// does before it reads the clock a guard compares with, so that a wait for another
    /// writer comes before the reading, not between it and the guard. Nothing to do where a
    /// transaction already holds every row (SQLite's write lock).
    fn lock_run(&mut self, run_id: &RunId) -> Result<()> {
        let _ = run_id;
        Ok(())
    }
    /// Inserts a run that does not exist (the move checked).
    fn insert_run(&mut self, run: &NewRun<'_>) -> Result<()>;
    /// Stamps a RUNNING run under `owner`'s lease of fencing token `token` as moved at `at`;
    /// with `unexpired_at`, only if the lease expires after it. False when the guard did not
    /// match. A backend may put the guard off to the end of the move (or pair), answering true,
    /// and then fail the whole transaction if it does not match: a move must give the same
    /// result when applied again, and its answer is that of the last application.
    fn touch_run(
        &mut self,
        run_id: &RunId,
        at: i64,
        owner: &str,
        token: u64,
        unexpired_at: Option<i64>,
    ) -> Result<bool>;
    /// Stamps a RUNNING run as [`Tx::touch_run`] does, only if its lease outlasts the clock by
    /// `margin` milliseconds, the clock as read once the run's row is this transaction's. A
    /// backend whose server reads its own clock as the guard is written needs no reading here.
    fn touch_run_with_margin(
        &mut self,
        run_id: &RunId,
        at: i64,
        owner: &str,
        token: u64,
        margin: i64,
    ) -> Result<bool> {
        self.lock_run(run_id)?;
        let unexpired_at = self.lease_wall()? + margin;
        self.touch_run(run_id, at, owner, token, Some(unexpired_at))
    }
    /// Moves a run between states; the run's fencing token after the move, or `None` when the
    /// guard did not match.
    fn update_run(&mut self, run_id: &RunId, update: &RunUpdate<'_>) -> Result<Option<u64>>;
    /// Gives a RUNNING run's lease to `owner` until `expires_at`, with the next fencing token
    /// (`seen.epoch + 1`), if its lease is still the one `seen` (compare-and-set on owner,
    /// expiry and token); false otherwise.
    fn take_lease(
        &mut self,
        run_id: &RunId,
        at: i64,
        owner: &str,
        expires_at: i64,
        seen: &LeaseRow,
    ) -> Result<bool>;
    /// Stamps a run WAITING_FOR_APPROVAL as moved at `at`; false when it does not wait.
    fn touch_waiting(&mut self, run_id: &RunId, at: i64) -> Result<bool>;
    /// Inserts a step.
    fn insert_step(
        &mut self,
        run_id: &RunId,
        step: u32,
        kind: StepKind,
        state: StepState,
        attempt: u32,
        call: Option<&ToolCall>,
    ) -> Result<()>;
    /// Inserts a step as given, with its state, attempts, call, result and reason to wait: a
    /// fork's copy of a step of its origin.
    fn insert_step_row(&mut self, run_id: &RunId, step: &StepRow) -> Result<()>;
    /// Moves a step; false when it is no longer where its executor saw it.
    fn update_step(&mut self, run_id: &RunId, step: u32, update: &StepUpdate<'_>) -> Result<bool>;
    /// Puts a model step in flight at attempt `attempt` back to pending at attempt `pending_at`
    /// (a drain's handover); false when it is not in flight at that attempt.
    fn reset_step(
        &mut self,
        run_id: &RunId,
        step: u32,
        attempt: u32,
        pending_at: u32,
    ) -> Result<bool>;
    /// Keeps `progress` as the step's, if it is in flight at attempt `attempt`; false
    /// otherwise.
    fn set_progress(
        &mut self,
        run_id: &RunId,
        step: u32,
        attempt: u32,
        progress: &Value,
    ) -> Result<bool>;
    /// Marks every step in flight interrupted; returns each (step, kind, attempt).
    fn interrupt_steps(&mut self, run_id: &RunId) -> Result<Vec<(u32, StepKind, u32)>>;
    /// The step and attempt count of the run's call `call_id` that waits for a decision.
    fn waiting_call(&mut self, run_id: &RunId, call_id: &str) -> Result<Option<(u32, u32)>>;
    /// Whether the run has a call `call_id`, in any state.
    fn call_exists(&mut self, run_id: &RunId, call_id: &str) -> Result<bool>;
    /// Records a decision for attempt `attempt` of `step`; false when one is recorded already.
    fn insert_approval(
        &mut self,
        step: u32,
        attempt: u32,
        approval: &Approval,
        at: i64,
    ) -> Result<bool>;
    /// Appends an event numbered after the run's last one, so that the log has no gaps.
    fn append_event(
        &mut self,
        run_id: &RunId,
        kind: EventKind,
        at: i64,
        step: Option<u32>,
        payload: &Value,
    ) -> Result<()>;
    /// Appends an event as [`Tx::append_event`] does, its payload's text made already.
    fn append_rendered(
        &mut self,
        run_id: &RunId,
        kind: EventKind,
        at: i64,
        step: Option<u32>,
        payload: &Rendered,
    ) -> Result<()> {
        self.append_event(run_id, kind, at, step, payload.value())
    }
    /// Inserts the wait of the run's waiting step `wait.step` (the run's agent is read from
    /// its row).
    fn insert_wait(&mut self, run_id: &RunId, wait: &WaitRow) -> Result<()>;
    /// Records what the run's wait at `step` waited for (`result`, a `ToolResult`), ready at
    /// `at`; false when it is not there or already woken.
    fn wake_wait(&mut self, run_id: &RunId, step: u32, result: &Value, at: i64) -> Result<bool>;
    /// Deletes the run's wait at `step`; whether there was one.
    fn delete_wait(&mut self, run_id: &RunId, step: u32) -> Result<bool>;
    /// The run and step that wait, not yet woken, for child run `child` to finish.
    fn parent_wait(&mut self, child: &RunId) -> Result<Option<(RunId, u32)>>;
    /// Keeps an event delivered to a run; false when one of the same id was kept before.
    fn insert_inbox(&mut self, delivery: &Delivery, at: i64) -> Result<bool>;
    /// Gives the run's oldest kept event named `name` to its wait at `step`: its id and
    /// payload; `None` when none is kept.
    fn take_inbox(
        &mut self,
        run_id: &RunId,
        name: &str,
        step: u32,
    ) -> Result<Option<(String, Value)>>;
    /// Marks the run's event `event_id` taken by its wait at `step`.
    fn mark_inbox(&mut self, run_id: &RunId, event_id: &str, step: u32) -> Result<()>;
    /// Inserts schedule `row.name`, or replaces every column of the one of that name but its
    /// `created_at`.
    fn put_schedule(&mut self, row: &ScheduleRow) -> Result<()>;
    /// Sets whether schedule `name` is paused, and its next occurrence when given, stamped at
    /// `at`; false when there is none.
    fn set_schedule_paused(
        &mut self,
        name: &str,
        paused: bool,
        next_at: Option<i64>,
        at: i64,
    ) -> Result<bool>;
    /// Moves the next occurrence of schedule `name` from `from` to `to`, stamped at `at`, if
    /// it is still `from` and the schedule is not paused (compare-and-set); false otherwise.
    fn advance_schedule(&mut self, name: &str, from: i64, to: i64, at: i64) -> Result<bool>;
    /// Deletes schedule `name`; whether there was one.
    fn delete_schedule(&mut self, name: &str) -> Result<bool>;
    /// Deletes those of `ids` that have finished, with their steps, events and approvals; the
    /// state is checked in each delete's statement. What it deleted.
    fn delete_finished_runs(&mut self, ids: &[RunId]) -> Result<Purged>;
    /// Opens a savepoint named `name`, nested in the transaction (or in an open savepoint).
    fn savepoint(&mut self, name: &str) -> Result<()>;
    /// Undoes what was done since savepoint `name` opened; it stays open.
    fn rollback_to(&mut self, name: &str) -> Result<()>;
    /// Closes savepoint `name`, keeping what it holds.
    fn release_savepoint(&mut self, name: &str) -> Result<()>;
}

/// A connection outside any transaction: the lease's single-statement writes.
pub(crate) trait LeaseWrites: Reads {
    /// Extends to `expires_at` the leases of `held` (each run with its fencing token) that
    /// `owner` holds unexpired at wall-clock time `wall`, in one statement; returns the runs
    /// renewed.
    fn renew_leases(
        &mut self,
        owner: &str,
        held: &[(RunId, u64)],
        wall: i64,
        expires_at: i64,
    ) -> Result<Vec<RunId>>;
    /// Clears `owner`'s lease of fencing token `token` on a run (compare-and-set on both);
    /// whether it held it.
    fn release_lease(&mut self, run_id: &RunId, owner: &str, token: u64) -> Result<bool>;
}

/// What a move does: its name in [`MoveInfo`]. JSON: its name, [`MoveKind::as_str`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum MoveKind {
    /// A new run, with its lease (`run.started`).
    CreateRun,
    /// A new run that waits for a free slot of its supervisor, with no lease (`run.started`).
    QueueRun,
    /// A model call's reservation (`step.model_started`).
    BeginModelStep,
    /// A model's answer or failure (`step.model_finished`), with the tool calls it asked for.
    FinishModelStep,
    /// A model attempt that failed and is tried again (`step.model_attempt_failed`).
    FailModelAttempt,
    /// The next attempt of a model call, after a failed one (`step.model_started`).
    BeginModelAttempt,
    /// The policy's decision on a tool call, and its start, denial or pause.
    DecideTool,
    /// A tool call the loop cannot execute (unknown tool, arguments not an object).
    RejectTool,
    /// A tool's outcome (`step.tool_finished`).
    FinishTool,
    /// A waiting run resumed with the decision recorded for it.
    ResumeWaiting,
    /// A RUNNING run whose lease expired or is absent, taken over.
    TakeOver,
    /// The one reconciliation of an interrupted step.
    Reconcile,
    /// A run failed by its loop (its step limit, say).
    FailRun,
    /// An operator's approval or denial.
    RecordApproval,
    /// An operator's cancel.
    CancelRun,
    /// A new run from an existing one's history before a step (`run.started`, `run.forked`,
    /// and the copies).
    ForkRun,
    /// A draining supervisor's release of a run for another replica (`run.released`).
    HandOver,
    /// A tool call's latest heartbeat, kept for its next attempt (no event).
    RecordProgress,
    /// A tool call that did not return within the grace after its timeout, marked interrupted
    /// (`step.tool_timed_out`).
    TimeOutTool,
    /// A waiting call's wait begins: for an answer, an event, a timer or a child run, which
    /// it inserts (`run.waiting`).
    BeginWait,
    /// A waiting run resumed with what its wait brought (`run.resumed`).
    ResumeWait,
    /// A person's answer to a run's question (`wait.woken`).
    AnswerQuestion,
    /// An event delivered to a run (`event.received`).
    DeliverEvent,
    /// A schedule made or replaced (no event).
    PutSchedule,
    /// A schedule paused (no event).
    PauseSchedule,
    /// A paused schedule resumed (no event).
    ResumeSchedule,
    /// A schedule deleted; its runs are kept (no event).
    DeleteSchedule,
    /// An occurrence of a schedule started: its run inserted with no lease, as a run that
    /// waits for a slot is (`run.started`), and the schedule advanced past now.
    StartScheduled,
    /// A schedule's missed occurrences skipped: the schedule advanced past now (no event).
    SkipScheduled,
}

impl MoveKind {
    /// The move's name in snake case (`"create_run"`), as logs and metrics print it.
    pub fn as_str(self) -> &'static str {
        match self {
            MoveKind::CreateRun => "create_run",
            MoveKind::QueueRun => "queue_run",
            MoveKind::BeginModelStep => "begin_model_step",
            MoveKind::FinishModelStep => "finish_model_step",
            MoveKind::FailModelAttempt => "fail_model_attempt",
            MoveKind::BeginModelAttempt => "begin_model_attempt",
            MoveKind::DecideTool => "decide_tool",
            MoveKind::RejectTool => "reject_tool",
            MoveKind::FinishTool => "finish_tool",
            MoveKind::ResumeWaiting => "resume_waiting",
            MoveKind::TakeOver => "take_over",
            MoveKind::Reconcile => "reconcile",
            MoveKind::FailRun => "fail_run",
            MoveKind::RecordApproval => "record_approval",
            MoveKind::CancelRun => "cancel_run",
            MoveKind::ForkRun => "fork_run",
            MoveKind::HandOver => "hand_over",
            MoveKind::RecordProgress => "record_progress",
            MoveKind::TimeOutTool => "time_out_tool",
            MoveKind::BeginWait => "begin_wait",
            MoveKind::ResumeWait => "resume_wait",
            MoveKind::AnswerQuestion => "answer_question",
            MoveKind::DeliverEvent => "deliver_event",
            MoveKind::PutSchedule => "put_schedule",
            MoveKind::PauseSchedule => "pause_schedule",
            MoveKind::ResumeSchedule => "resume_schedule",
            MoveKind::DeleteSchedule => "delete_schedule",
            MoveKind::StartScheduled => "start_scheduled",
            MoveKind::SkipScheduled => "skip_scheduled",
        }
    }
}

impl std::fmt::Display for MoveKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A move a supervisor is about to commit, or has committed. JSON:
/// `{"kind": "decide_tool", "run_id": "r1"}`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MoveInfo {
    /// What the move does.
    pub kind: MoveKind,
    /// The run it moves. A schedule's occurrence names the run of that occurrence
    /// (`nightly@2026-12-03T02:00:00Z`), started or skipped; a move of a schedule as a whole
    /// (put, pause, resume, delete) names it by the prefix its runs' ids share (`nightly@`).
    pub run_id: RunId,
}

/// Watches the moves a supervisor commits ([`Config::observer`]): for metrics,
/// tracing, or telling listeners that a run has new events.
///
/// `before_apply` runs on the thread that owns the write connection, with no transaction open.
/// `after_commit` and `committed` run once the moves are durable: on that thread too, or, for
/// a group whose sync was left to a thread of the backend's own (see `docs/persistence.md`),
/// on that thread, while `before_apply` may run for the next group. They come in commit
/// order, one group at a time. A slow observer delays every move of the supervisor.
///
/// [`Config::observer`]: crate::Config::observer
pub trait MoveObserver: Send + Sync + 'static {
    /// The move is about to be applied: nothing of it is written yet.
    fn before_apply(&self, info: &MoveInfo) {
        let _ = info;
    }

    /// The move committed (and, at `synchronous=FULL`, is on disk). Its caller has not been
    /// answered yet, unless it asked to be answered once the move was written: a run's model
    /// reservation (see `docs/runs.md`), whose loop may already be calling the model.
    fn after_commit(&self, info: &MoveInfo) {
        let _ = info;
    }

    /// One transaction committed, making `moves` durable together (in the order they were
    /// applied): a group commit holds moves of many runs, and a run's loop commits a move
    /// together with the one that follows it when no side effect lies between them. Called
    /// after [`after_commit`](Self::after_commit) of each of them.
    fn committed(&self, moves: &[&MoveInfo]) {
        let _ = moves;
    }
}

/// How the moves of a group commit are kept apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isolation {
    /// Straight into the group's transaction: a refusal rolls the whole group back.
    Shared,
    /// In a savepoint of its own: a refusal rolls back this move alone.
    Savepoint,
}

/// When a caller is answered: the durability it asks of its moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Durability {
    /// Once they are durable, as the store's settings say (at SQLite's `FULL`, synced).
    Durable,
    /// Once written, before the sync that makes them durable, which the next commit's does (a
    /// log keeps a prefix of its commits): a crash of the process loses nothing; a power loss
    /// undoes these moves, and no later move survives without them. For a run's model
    /// reservation, since a model call has no external side effect. Where a backend makes each
    /// commit durable by itself (SQLite without its log-sync thread: no group commit,
    /// `NORMAL`, `EXTRA`, `:memory:`, not Unix), and in a group with any move that asked for
    /// `Durable`, it is `Durable`.
    Written,
}

/// A submitted move (or pair of moves), type-erased for the queue and the writer.
pub(crate) trait Pending: Send {
    /// The moves it makes, in order.
    fn infos(&self) -> &[MoveInfo];
    /// The moves it made once applied.
    fn applied(&self) -> &[MoveInfo];
    /// Whether a move of it was refused.
    // Asked by SQLite's writer only.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    fn refused(&self) -> bool;
    /// When its caller is answered.
    fn durability(&self) -> Durability;
    /// Applies the move inside the group's transaction, keeping its result (replacing the one
    /// of an earlier attempt); false when it was refused, or when only part of it stands and
    /// the group must be applied again with savepoints.
    fn apply(&mut self, tx: &mut dyn Tx, clock: &dyn Clock, isolation: Isolation) -> bool;
    /// Answers the caller: its own result, unless the group failed to commit or to sync.
    fn answer(self: Box<Self>, failed: Option<&GroupFailure>);
}

/// Why a group's callers get an error instead of their results.
#[derive(Debug, Clone)]
pub(crate) enum GroupFailure {
    /// Nothing of the group was committed.
    Commit(String),
    /// The commit met an I/O error: the group may or may not have been written.
    Unknown(String),
    /// The group may have been committed, and may not be durable.
    Sync(String),
    /// The store refused to write after an earlier I/O error: nothing was committed.
    Refused(String),
}

impl GroupFailure {
    pub(crate) fn of(err: &Error) -> Self {
        match err {
            Error::CommitUnknown(message) => GroupFailure::Unknown(message.clone()),
            Error::SyncFailed(message) => GroupFailure::Sync(message.clone()),
            Error::DiskStateUnknown(why) => GroupFailure::Refused(why.clone()),
            Error::CommitFailed(message) => GroupFailure::Commit(message.clone()),
            err => GroupFailure::Commit(err.to_string()),
        }
    }

    /// The failure of a group that committed, from the sync that was to make it durable: a
    /// store that refuses to sync (it stopped at an I/O error meanwhile) leaves the group
    /// committed, readable, and maybe not durable, as a failed sync does.
    // SQLite's writer syncs its log after a group; PostgreSQL's commit is durable by itself.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub(crate) fn of_sync(synced: Result<()>) -> Option<Self> {
        match synced {
            Err(Error::DiskStateUnknown(why)) => Some(GroupFailure::Sync(format!(
                "the store stopped at an I/O error before this group's sync ({why})"
            ))),
            synced => GroupFailure::of_result(synced),
        }
    }

    /// The failure, if any, of a commit or a sync.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub(crate) fn of_result(result: Result<()>) -> Option<Self> {
        result.err().map(|err| GroupFailure::of(&err))
    }

    pub(crate) fn error(&self) -> Error {
        match self {
            GroupFailure::Commit(message) => Error::CommitFailed(message.clone()),
            GroupFailure::Unknown(message) => Error::CommitUnknown(message.clone()),
            GroupFailure::Sync(message) => Error::SyncFailed(message.clone()),
            GroupFailure::Refused(why) => Error::DiskStateUnknown(why.clone()),
        }
    }
}

/// A supervisor's write side of a backend, driven by its store actor on a thread that may
/// block (its moves, when the session has no [`Router`]).
pub(crate) trait Writer: Send {
    /// Commits `batch`, the moves taken from a queue in the order they were submitted, and
    /// answers each caller: once its moves are durable, or once written if it asked for that.
    /// `more_queued`: other moves wait behind it. The answers may come from another thread,
    /// after this returns.
    fn commit(&mut self, batch: Vec<Box<dyn Pending>>, more_queued: bool);
    /// The most entries of the queue (a move, or a pair of one run's moves) one batch holds:
    /// the store actor leaves the rest queued for the next. Unbounded by default.
    fn max_batch(&self) -> usize {
        usize::MAX
    }
    /// How long the store actor watches for the next move after a commit before it parks.
    fn watch(&self) -> Duration;
    /// The queue is empty: make durable what was answered once written.
    fn idle(&mut self);
    /// A read that sees every committed move, answered once what it could have seen is
    /// durable.
    fn read(&mut self, read: &mut dyn FnMut(&mut dyn Reads) -> Result<()>) -> Result<()>;
    /// A renewal tick, for a backend without a renewal connection of its own.
    fn renew(&mut self, owner: &str, held: &[(RunId, u64)], ttl: Duration) -> Result<Renewal>;
    /// Releases `owner`'s lease of fencing token `token` on a run that stays RUNNING; whether
    /// it held it.
    fn release(&mut self, run_id: &RunId, owner: &str, token: u64) -> Result<bool>;
}

/// Renews a supervisor's leases on a connection of its own.
pub(crate) trait Renewer: Send {
    /// One renewal tick, given up after `patience` (a busy database, say).
    fn renew(
        &mut self,
        owner: &str,
        held: &[(RunId, u64)],
        ttl: Duration,
        patience: Duration,
    ) -> Result<Renewal>;
}

/// Hands a move straight to the connection that commits it, from the caller's thread: for a
/// writer whose connections each commit their own share of the runs, each run's moves in order
/// (PostgreSQL's lanes), so that a move crosses one thread, not the store actor's and then the
/// connection's.
pub(crate) trait Router: Send + Sync {
    /// Queues `pending` on its run's connection, or answers it with the failure that stops it.
    fn route(&self, pending: Box<dyn Pending>);
}

/// What a supervisor's store actor and lease keeper write through.
pub(crate) struct Session {
    pub writer: Box<dyn Writer>,
    /// `None`: renewals go through the writer.
    pub renewer: Option<Box<dyn Renewer>>,
    /// `Some`: moves go to their connection through it, not through the store actor's queue.
    pub router: Option<Arc<dyn Router>>,
}

/// What a committed change asks of a watching supervisor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChangeKind {
    /// A decision was recorded for the run's waiting call, and the run still waits with it
    /// (as the poll read it): a resume acts on it.
    Decided,
    /// The run was cancelled: the tool running for it, if any, is to be told.
    Cancelled,
    /// A draining supervisor released the run's lease with nothing in flight: a replica with
    /// recovery or a watch takes it over at once.
    Released,
    /// What the run's wait waited for came (an answer, an event, its child's end): a replica
    /// with recovery or a watch resumes it.
    Woken,
}

/// One change of the feed: a run of an agent, and what happened to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Change {
    pub run_id: RunId,
    pub agent: String,
    pub kind: ChangeKind,
}

/// What a watcher read at one poll.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Changes {
    /// In commit order; a run is decided once at most.
    pub changes: Vec<Change>,
    /// The feed could not say everything since the last poll (the first poll, or one that fell
    /// further behind than the feed keeps): the runs waiting for approval whose decision is
    /// recorded are among `changes`, read from the runs themselves, but cancels may be
    /// missing: the supervisor reads the state of the runs it executes.
    pub resync: bool,
}

/// Reads the changes committed by any writer of the store, on a thread of the caller's that
/// may block. Writes nothing.
pub(crate) trait Watcher: Send {
    /// The changes committed since the last poll that read some; `None` when nothing was
    /// committed since (a cheap check). The first poll finds where the feed stands and reads
    /// the runs waiting for approval whose decision is recorded (decided while nobody
    /// watched), with `resync` set. An error leaves the cursor where it was: the next poll
    /// reads the same changes again.
    fn poll(&mut self) -> Result<Option<Changes>>;

    /// Waits up to `period` before the next poll: less when the backend is told of a commit.
    fn wait(&mut self, period: Duration) {
        std::thread::sleep(period);
    }
}

/// A store's backend.
pub(crate) trait Backend: Send + Sync + 'static {
    /// For `Debug`: where the data lives.
    fn describe(&self) -> String;
    /// The schema version of the database.
    fn schema_version(&self) -> Result<u32>;
    /// An inspection read, answered once every move it could have seen is durable. `Send`,
    /// like `transact`'s move: a backend whose driver cannot block a thread that runs an async
    /// runtime (an actix arbiter's) runs it on a thread of its own.
    fn read(&self, read: &mut (dyn FnMut(&mut dyn Reads) -> Result<()> + Send)) -> Result<()>;
    /// One move, in a transaction of its own, outside any supervisor (an operator's).
    fn transact(
        &self,
        clock: &dyn Clock,
        apply: &mut (dyn FnMut(&mut dyn Tx, &mut Now<'_>) -> Result<()> + Send),
    ) -> Result<()>;
    /// The write side of a supervisor: `clock` stamps its moves, `observer` hears of them.
    /// `bell` is rung once a group has committed, by a backend that commits after
    /// `Writer::commit` returns or takes its moves through a router (the store actor rings it
    /// after each return).
    fn session(
        self: Arc<Self>,
        clock: Arc<dyn Clock>,
        observer: Option<Arc<dyn MoveObserver>>,
        bell: Arc<super::pulse::Bell>,
    ) -> Result<Session>;
    /// A watcher of the store's change feed, for a supervisor with `Config::watch`.
    fn watcher(self: Arc<Self>) -> Result<Box<dyn Watcher>>;
    /// A check for commits made by anyone, on a connection of its own (the web API's streams).
    #[cfg_attr(not(feature = "web"), allow(dead_code))]
    fn pulse(self: Arc<Self>) -> Result<Box<dyn super::pulse::Pulse>>;
    /// A health report.
    fn health(&self) -> Result<crate::store::Health>;
    /// Gives the free space of the database back to the disk, where the database allows it,
    /// in short steps that let other writers in between; its size and free space.
    fn reclaim(&self) -> Result<Space>;
    /// Rewrites the database compactly, switching it to giving space back after a purge.
    fn vacuum(&self) -> Result<Space>;
    /// The backend itself, for its own module's extensions (`agentrt::sqlite`).
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    fn as_any(&self) -> &dyn Any;
}
