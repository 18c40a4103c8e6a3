//! The run's domain model as the moves and the loop see it, whatever the backend: steps and
//! their states, the snapshot a loop resumes from, the lease a loop executes under, and what
//! a decision or a reconciliation records.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime},
};

use serde_json::{Value, json};

pub(crate) use crate::clock::{from_millis, to_millis};
use crate::{
    clock::Clock,
    schedule::{Missed, Schedule},
    types::{
        ApprovalReason, Lease, ModelResponse, Run, RunId, RunState, StepKind, StepState, ToolCall,
        Wait, WaitKind,
    },
};

/// A step as stored.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StepRow {
    pub step: u32,
    pub kind: StepKind,
    pub state: StepState,
    pub attempt: u32,
    /// Tool steps: the call.
    pub call: Option<ToolCall>,
    /// Model steps: the response; tool steps: a `ToolResult`.
    pub result: Option<Value>,
    pub waiting_for: Option<ApprovalReason>,
    /// Tool steps: the last heartbeat kept of its call (`RecordProgress`), for its next
    /// attempt.
    pub progress: Option<Value>,
}

/// An operator's decision as the loop needs it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ApprovalRow {
    pub approved: bool,
    pub by: String,
    pub note: Option<String>,
}

/// What a loop needs to execute a run: the run, its steps, and the decision recorded for the
/// step that waits, if any.
#[derive(Debug, Clone)]
pub(crate) struct RunSnapshot {
    pub run: Run,
    pub steps: Vec<StepRow>,
    pub approval: Option<ApprovalRow>,
    /// The run's wait, when it waits for an answer, an event, a timer or a child.
    pub wait: Option<WaitRow>,
}

/// A run's wait as stored: what its waiting tool step waits for.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct WaitRow {
    pub step: u32,
    /// The waiting call's id.
    pub call_id: String,
    pub kind: WaitKind,
    pub key: String,
    pub detail: Value,
    /// Milliseconds by `Config::clock`, as the three below.
    pub since: i64,
    pub due_at: Option<i64>,
    /// From when the run can go on: a timer's due time, or when what it waited for came.
    pub ready_at: Option<i64>,
    /// The `ToolResult` (as JSON) the run resumes with; `None` for a timer.
    pub result: Option<Value>,
}

impl WaitRow {
    /// Whether the run can go on at `now`.
    pub(crate) fn ready(&self, now: i64) -> bool {
        self.result.is_some() || self.ready_at.is_some_and(|at| at <= now)
    }

    /// As the public type shows it.
    pub(crate) fn public(&self, run_id: &RunId) -> Wait {
        Wait {
            run_id: run_id.clone(),
            step: self.step,
            call_id: self.call_id.clone(),
            kind: self.kind,
            key: self.key.clone(),
            detail: self.detail.clone(),
            since: from_millis(self.since),
            due_at: self.due_at.map(from_millis),
            woken_at: self.result.as_ref().and(self.ready_at).map(from_millis),
        }
    }
}

/// A schedule as stored.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ScheduleRow {
    pub name: String,
    pub agent: String,
    pub input: Value,
    pub cron: String,
    pub missed: Missed,
    pub paused: bool,
    /// Milliseconds by the clock of whoever put or advanced it, as the two below.
    pub next_at: i64,
    pub created_at: i64,
    pub updated_at: i64,
}

impl ScheduleRow {
    /// As the public type shows it.
    pub(crate) fn public(&self) -> Schedule {
        let mut schedule = Schedule::new(&self.name, &self.cron, &self.agent, self.input.clone())
            .missed(self.missed)
            .paused(self.paused);
        schedule.next_at = Some(from_millis(self.next_at));
        schedule
    }
}

/// The idempotency key of a tool call: stable across attempts, unique across calls.
pub(crate) fn idempotency_key(run_id: &RunId, step: u32) -> String {
    format!("{run_id}/{step}")
}

/// Who takes leases: a supervisor's owner name, how long a stamp or renewal lasts, and how
/// much of it must be left for a side effect to start.
#[derive(Debug, Clone)]
pub(crate) struct Holder {
    pub owner: Arc<str>,
    pub ttl: Duration,
    pub margin: Duration,
}

impl Holder {
    /// The expiry of a lease stamped at wall-clock time `wall`.
    pub(crate) fn expiry(&self, wall: i64) -> i64 {
        wall + self.ttl.as_millis() as i64
    }

    /// How long, in milliseconds, a lease must outlast the clock for a side effect to start.
    pub(crate) fn margin_millis(&self) -> i64 {
        self.margin.as_millis() as i64
    }
}

/// One loop's hold on its run's lease: the holder, the fencing token its acquisition wrote,
/// and the deadline the loop judges the lease by.
///
/// The deadline is on the monotonic clock: the time its last successful write (the
/// acquisition, then each renewal) was sent, plus the TTL. The stored expiry was read from the
/// wall clock after that time, so the deadline comes no later than it by the elapsed time; a
/// wall clock stepped back cannot make the loop believe it has time it has not. A wall clock
/// stepped forward, or a host suspended (the monotonic clock stands still while the wall
/// clock does not), makes the stored lease end first: the writes that start a side effect
/// check the stored expiry too, and the fencing token covers the rest.
#[derive(Debug, Clone)]
pub(crate) struct Grant {
    pub holder: Holder,
    shared: Arc<Granted>,
}

#[derive(Debug)]
struct Granted {
    base: Instant,
    token: AtomicU64,
    /// Nanoseconds after `base`; 0 before the acquisition.
    deadline: AtomicU64,
    /// Acquisitions and renewals so far: a waiter that read it before its check misses none.
    renewals: AtomicU64,
    renewed: tokio::sync::Notify,
}

impl Grant {
    /// A grant not acquired yet: no token, and no time left.
    pub(crate) fn new(holder: Holder) -> Self {
        Grant {
            holder,
            shared: Arc::new(Granted {
                base: Instant::now(),
                token: AtomicU64::new(0),
                deadline: AtomicU64::new(0),
                renewals: AtomicU64::new(0),
                renewed: tokio::sync::Notify::new(),
            }),
        }
    }

    fn nanos(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.shared.base).as_nanos() as u64
    }

    /// The acquisition sent at `sent` wrote `token`.
    pub(crate) fn acquired(&self, token: u64, sent: Instant) {
        self.shared.token.store(token, Ordering::SeqCst);
        let deadline = self.nanos(sent + self.holder.ttl).max(1);
        self.shared.deadline.store(deadline, Ordering::SeqCst);
        self.shared.renewals.fetch_add(1, Ordering::SeqCst);
        self.shared.renewed.notify_waiters();
    }

    /// A renewal sent at `sent` succeeded.
    pub(crate) fn renewed(&self, sent: Instant) {
        let deadline = self.nanos(sent + self.holder.ttl);
        self.shared.deadline.fetch_max(deadline, Ordering::SeqCst);
        self.shared.renewals.fetch_add(1, Ordering::SeqCst);
        self.shared.renewed.notify_waiters();
    }

    /// How many acquisitions and renewals the grant has seen: read before a check, it tells
    /// [`renewed_since`](Self::renewed_since) whether one came after.
    pub(crate) fn renewals(&self) -> u64 {
        self.shared.renewals.load(Ordering::SeqCst)
    }

    /// Whether a renewal (or the acquisition) came since `renewals` was read.
    pub(crate) fn renewed_since(&self, renewals: u64) -> bool {
        self.renewals() != renewals
    }

    /// The fencing token of the acquisition (0 before it).
    pub(crate) fn token(&self) -> u64 {
        self.shared.token.load(Ordering::SeqCst)
    }

    /// The time left before the deadline.
    pub(crate) fn remaining(&self) -> Duration {
        let deadline = Duration::from_nanos(self.shared.deadline.load(Ordering::SeqCst));
        (self.shared.base + deadline).saturating_duration_since(Instant::now())
    }

    /// Whether a side effect may start now: more than the margin is left (so an expired
    /// lease never has it, whatever the margin).
    pub(crate) fn has_margin(&self) -> bool {
        self.remaining() > self.holder.margin
    }

    /// Completes at the next acquisition or renewal after the call.
    pub(crate) fn renewal(&self) -> tokio::sync::futures::Notified<'_> {
        self.shared.renewed.notified()
    }

    /// A grant that acquired `token` just now; for tests of the moves.
    #[cfg(test)]
    pub(crate) fn held(holder: Holder, token: u64) -> Self {
        let grant = Grant::new(holder);
        grant.acquired(token, Instant::now());
        grant
    }

    /// Moves the deadline to `left` from now, as if the last renewal had been sent then; for
    /// tests of what a loop does with little time left.
    #[cfg(test)]
    pub(crate) fn set_remaining(&self, left: Duration) {
        let deadline = self.nanos(Instant::now() + left).max(1);
        self.shared.deadline.store(deadline, Ordering::SeqCst);
    }
}

/// A run's state and lease as stored.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LeaseRow {
    pub state: RunState,
    pub owner: Option<String>,
    pub expires_at: Option<i64>,
    /// The fencing token of the lease's last acquisition.
    pub epoch: u64,
}

impl LeaseRow {
    /// The lease it holds, if anybody holds one.
    pub(crate) fn lease(&self) -> Option<Lease> {
        match (&self.owner, self.expires_at) {
            (Some(owner), Some(expires_at)) => Some(Lease {
                owner: owner.clone(),
                expires_at: from_millis(expires_at),
                fencing_token: crate::types::FencingToken::new(self.epoch),
            }),
            _ => None,
        }
    }
}

/// A JSON value with its text, made once where the value is built (a run's thread): a backend
/// that stores JSON as text then serializes nothing on its writer's thread, however many rows
/// the value goes to.
#[derive(Debug, Clone)]
pub(crate) struct Rendered {
    value: Value,
    text: String,
}

impl Rendered {
    pub(crate) fn new(value: Value) -> Self {
        let text = value.to_string();
        Rendered { value, text }
    }

    pub(crate) fn value(&self) -> &Value {
        &self.value
    }

    /// The value's JSON text.
    pub(crate) fn text(&self) -> &str {
        &self.text
    }
}

/// How a model step ended.
#[derive(Clone)]
pub(crate) enum ModelOutcome {
    /// The answer, and its JSON as recorded (built by the loop, off the writer's thread).
    Answered {
        response: ModelResponse,
        recorded: Rendered,
    },
    /// No answer: the last attempt's error, after this many attempts.
    Failed { error: String, attempts: u32 },
}

/// A decision on a tool call, as it is recorded.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ToolDecision {
    /// Run it: the step starts (its next attempt).
    Allow {
        reason: Option<String>,
        by: Option<String>,
        note: Option<String>,
    },
    /// Do not run it; the model is told why.
    Deny {
        reason: String,
        by: Option<String>,
        note: Option<String>,
    },
    /// Wait for an approval.
    RequireApproval { reason: String },
}

impl ToolDecision {
    /// What the model is told of a denied call: the reason, and the decider's note.
    pub(crate) fn denial(reason: &str, note: Option<&str>) -> String {
        match note {
            Some(note) if !note.trim().is_empty() => {
                format!("the call was denied: {reason}: {note}")
            }
            _ => format!("the call was denied: {reason}"),
        }
    }

    /// The payload of its `policy.decided`.
    pub(crate) fn payload(&self, call: &ToolCall, source: &str) -> Value {
        let (decision, reason, by, note) = match self {
            ToolDecision::Allow { reason, by, note } => ("allow", reason.as_deref(), by, note),
            ToolDecision::Deny { reason, by, note } => ("deny", Some(reason.as_str()), by, note),
            ToolDecision::RequireApproval { reason } => {
                ("require_approval", Some(reason.as_str()), &None, &None)
            }
        };
        let mut payload = json!({
            "call_id": call.id,
            "tool": call.name,
            "decision": decision,
            "source": source,
        });
        if let Some(reason) = reason {
            payload["reason"] = json!(reason);
        }
        if let Some(by) = by {
            payload["decided_by"] = json!(by);
        }
        if let Some(note) = note {
            payload["note"] = json!(note);
        }
        payload
    }
}

/// What reconciling an interrupted step decided.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Resolution {
    /// A model step: dispatch it again. `outcome` says what its log showed: `model_call` (an
    /// attempt in flight) or `attempt_failed` (a failed attempt, in its backoff).
    Redispatch { outcome: &'static str },
    /// A model step whose attempts the model policy allows are spent: the run fails with
    /// `error`.
    GiveUp {
        outcome: &'static str,
        error: String,
    },
    /// A tool step that took effect: this is its output.
    Applied(Value),
    /// Run the tool again; `outcome` says what the hook answered ("not_applied", "unknown",
    /// "no_hook").
    Retry { outcome: &'static str },
    /// Ask a person; `outcome` as for `Retry`.
    AwaitApproval { outcome: &'static str },
}

/// What one renewal tick found.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Renewal {
    /// The new expiry of every run renewed.
    pub expires_at: i64,
    /// The runs renewed.
    pub renewed: Vec<RunId>,
    /// The runs asked for but not renewed, with their row as found (`None`: no such run).
    pub missing: Vec<(RunId, Option<LeaseRow>)>,
}

/// RUNNING runs whose lease expired, with that lease; and RUNNING runs nobody holds.
pub(crate) type LeaseReport = (Vec<(RunId, Lease)>, Vec<RunId>);

/// The time of one move, read from the clock on first use only.
pub(crate) struct Now<'a> {
    clock: &'a dyn Clock,
    read: Option<i64>,
}

impl<'a> Now<'a> {
    /// The time of a move not applied yet.
    // SQLite's writer makes it; PostgreSQL's lanes resume with their readings.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub(crate) fn new(clock: &'a dyn Clock) -> Self {
        Now { clock, read: None }
    }

    /// The time of a move applied again: the reading it took before, if any.
    pub(crate) fn resume(clock: &'a dyn Clock, read: Option<i64>) -> Self {
        Now { clock, read }
    }

    /// The reading taken, if any.
    pub(crate) fn reading(&self) -> Option<i64> {
        self.read
    }

    /// Milliseconds since the Unix epoch.
    pub(crate) fn millis(&mut self) -> i64 {
        *self.read.get_or_insert_with(|| to_millis(self.clock.now()))
    }
}

/// The wall clock in milliseconds: what lease times are read from, never `Config::clock`.
pub(crate) fn wall_millis() -> i64 {
    to_millis(SystemTime::now()) + crate::clock::wall_shift()
}
