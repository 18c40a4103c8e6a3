//! The chaos run's count of executions: a pure function of a run's events and the executions
//! its tools logged, shared by `examples/chaos.rs` and `tests/crashes/chaos_classes.rs`.
//!
//! Per idempotency key, the earliest execution by an owner whose lease was not taken over is
//! the first; every other execution is sorted into exactly one class, and one that no class
//! explains is a bug.

use std::{
    collections::HashMap,
    time::{SystemTime, UNIX_EPOCH},
};

use agentrt::{Event, EventKind};
use serde::{Deserialize, Serialize};

/// What a fenced resource did with an execution's write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fence {
    Applied,
    Refused,
}

/// One execution of a tool: the line it appended to the side-effect log when it acted.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Execution {
    /// The idempotency key, `RUN/STEP`.
    pub key: String,
    pub run: String,
    pub step: u32,
    pub call: String,
    pub tool: String,
    pub attempt: u32,
    /// The fencing token of the lease it ran under.
    pub token: u64,
    pub pid: u32,
    /// Wall-clock microseconds since the Unix epoch, read right before it acted; absent when
    /// the log has no line for it (a fenced write the resource recorded, refused, by a process
    /// killed before its line).
    pub at_us: Option<u64>,
    /// For a fenced tool, what the resource did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fence: Option<Fence>,
}

/// Why an execution happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Class {
    /// The first execution for its key.
    First,
    /// (a) A person approved running again a call whose outcome was unknown.
    ApprovedRerun,
    /// (b) An idempotent tool run again after an unknown outcome.
    IdempotentRetry,
    /// (c) Run again after the reconcile hook said the interrupted attempt did not apply.
    NotAppliedRetry,
    /// (d) An owner acted after a higher fencing token had been acquired for the run: its
    /// lease had been taken over.
    Zombie,
    /// (e) Nothing explains it.
    Unexplained(String),
}

fn millis(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The class of each of `executions` (all of one run), in their order. `idempotent` says which
/// tools are.
pub fn classify(
    events: &[Event],
    executions: &[Execution],
    idempotent: impl Fn(&str) -> bool,
) -> Vec<Class> {
    // Every acquisition of the run's lease and its token: the start, every resume (of a
    // waiting run, or a takeover).
    let acquisitions: Vec<(u64, u64)> = events
        .iter()
        .filter(|e| matches!(e.kind, EventKind::RunStarted | EventKind::RunResumed))
        .filter_map(|e| Some((millis(e.at), e.payload["fencing_token"].as_u64()?)))
        .collect();
    let step_event = |kind: EventKind, step: u32, attempt: u32| {
        events.iter().find(move |e| {
            e.kind == kind
                && e.step == Some(step)
                && e.payload["attempt"].as_u64() == Some(attempt.into())
        })
    };
    // Events are stamped in whole milliseconds, the log in microseconds. An act in the same
    // millisecond as a higher token's acquisition counts as after it: a takeover reads its
    // clock only once it has found the old lease expired by the same wall clock, so the act
    // was outside a live lease either way.
    let zombie = |x: &Execution| {
        x.fence == Some(Fence::Refused)
            || x.at_us.is_some_and(|at| {
                acquisitions
                    .iter()
                    .any(|&(acquired, token)| token > x.token && acquired <= at / 1000)
            })
    };

    let mut classes: Vec<Option<Class>> = executions
        .iter()
        .map(|x| {
            let started = step_event(EventKind::ToolStarted, x.step, x.attempt).filter(|e| {
                e.payload["fencing_token"].as_u64() == Some(x.token)
                    && e.payload["tool"].as_str() == Some(x.tool.as_str())
            });
            if started.is_none() {
                Some(Class::Unexplained(format!(
                    "no step.tool_started for attempt {} of {} under token {}",
                    x.attempt, x.tool, x.token
                )))
            } else if zombie(x) {
                Some(Class::Zombie)
            } else {
                None
            }
        })
        .collect();

    // The others, per key by attempt: attempt n + 1 starts after attempt n was taken over, so
    // an owner that kept its lease acted in attempt order.
    let mut order: Vec<usize> = (0..executions.len())
        .filter(|&i| classes[i].is_none())
        .collect();
    order.sort_by_key(|&i| {
        let x = &executions[i];
        (x.key.clone(), x.attempt, x.at_us)
    });
    let mut before: HashMap<&str, Vec<&Execution>> = HashMap::new();
    for i in order {
        let x = &executions[i];
        let earlier = before.entry(x.key.as_str()).or_default();
        let class = if earlier.is_empty() {
            Class::First
        } else if earlier.iter().any(|e| e.attempt == x.attempt) {
            Class::Unexplained(format!("attempt {} of {} acted twice", x.attempt, x.tool))
        } else {
            rerun(x, earlier, &step_event, &idempotent, events)
        };
        classes[i] = Some(class);
        earlier.push(x);
    }
    classes
        .into_iter()
        .map(|c| c.expect("classified"))
        .collect()
}

/// Why attempt `x.attempt`, not the first to act for its key, ran: the reconciliation of the
/// attempt before it.
fn rerun<'e>(
    x: &Execution,
    earlier: &[&Execution],
    step_event: &impl Fn(EventKind, u32, u32) -> Option<&'e Event>,
    idempotent: &impl Fn(&str) -> bool,
    events: &[Event],
) -> Class {
    let previous = x.attempt - 1;
    let Some(reconciled) = step_event(EventKind::StepReconciled, x.step, previous) else {
        return Class::Unexplained(format!(
            "attempt {} of {} ran with no reconciliation of attempt {previous}",
            x.attempt, x.tool
        ));
    };
    let outcome = reconciled.payload["outcome"].as_str().unwrap_or_default();
    let action = reconciled.payload["action"].as_str().unwrap_or_default();
    match (outcome, action) {
        ("not_applied", "run_again") => {
            // Not applied, yet an effect acted (and was logged) before the takeover that
            // interrupted the attempt, which comes before the hook: the answer was wrong.
            let taken_over = step_event(EventKind::StepInterrupted, x.step, previous)
                .map_or(u64::MAX, |e| millis(e.at));
            let missed = earlier.iter().find(|e| {
                e.fence != Some(Fence::Refused) && e.at_us.is_some_and(|at| at / 1000 < taken_over)
            });
            match missed {
                Some(e) => Class::Unexplained(format!(
                    "attempt {} of {} ran on not_applied, though attempt {} acted before the takeover",
                    x.attempt, x.tool, e.attempt
                )),
                None => Class::NotAppliedRetry,
            }
        }
        ("unknown" | "no_hook", "run_again") if idempotent(&x.tool) => Class::IdempotentRetry,
        ("unknown" | "no_hook", "await_approval") => {
            let approved = events.iter().any(|e| {
                e.kind == EventKind::ApprovalRecorded
                    && e.seq > reconciled.seq
                    && e.payload["call_id"].as_str() == Some(x.call.as_str())
                    && e.payload["approved"].as_bool() == Some(true)
            });
            if approved {
                Class::ApprovedRerun
            } else {
                Class::Unexplained(format!(
                    "attempt {} of {} ran after await_approval with no approval",
                    x.attempt, x.tool
                ))
            }
        }
        _ => Class::Unexplained(format!(
            "attempt {} of {} ran after a reconciliation {outcome}/{action}",
            x.attempt, x.tool
        )),
    }
}

/// The starts of a side effect (`step.tool_started`, `step.model_started`) stamped after the
/// expiry of the lease they were made under, as the takeover that ended that lease recorded it
/// (`lease.taken_over`'s `previous_expires_at`, renewals included). A move that starts a side
/// effect needs the start margin left by the stored expiry, so none should be: one is a start
/// the lease did not cover. Meaningful where event times and lease times are read from one
/// clock: one host, or the server's clock and hosts whose stamps are true.
pub fn late_starts(events: &[Event]) -> Vec<(&Event, u64)> {
    let (mut current, mut previous) = (Vec::new(), Vec::new());
    let mut late = Vec::new();
    for e in events {
        match e.kind {
            EventKind::RunStarted | EventKind::RunResumed => {
                previous = std::mem::take(&mut current);
            }
            EventKind::LeaseTakenOver => {
                if let Some(expired) = e.payload["previous_expires_at"].as_u64() {
                    late.extend(
                        previous
                            .iter()
                            .filter(|s: &&&Event| millis(s.at) > expired)
                            .map(|s| (*s, expired)),
                    );
                }
                previous.clear();
            }
            EventKind::ToolStarted | EventKind::ModelStarted => current.push(e),
            _ => {}
        }
    }
    late
}

/// What a run's log says of its waits other than for an approval: those begun (by kind),
/// woken (by kind), and resumed, the events it received, and whether the run is a child run.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Waits {
    /// `run.waiting` for a time.
    pub timers: usize,
    /// `run.waiting` for a child run.
    pub children: usize,
    /// `run.waiting` for a person's answer.
    pub answers: usize,
    /// `run.waiting` for an event.
    pub events: usize,
    /// `wait.woken`: what a wait waited for came (an answer, an event, a child's end).
    pub woken: usize,
    /// `wait.woken` by an answer.
    pub answer_wakes: usize,
    /// `wait.woken` by an event.
    pub event_wakes: usize,
    /// `event.received`: the events delivered to the run and recorded (a duplicate is not).
    pub events_received: usize,
    /// `event.received` with no step: an event kept for a wait the run had not begun yet.
    pub events_kept: usize,
    /// `run.resumed` from a wait's state: the run went on.
    pub resumed: usize,
    /// The run was started by a parent's delegating call (its `run.started` names it).
    pub child_run: bool,
}

impl Waits {
    /// Every wait begun, whatever it waited for.
    pub fn begun(&self) -> usize {
        self.timers + self.children + self.answers + self.events
    }

    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: &Waits) {
        self.timers += other.timers;
        self.children += other.children;
        self.answers += other.answers;
        self.events += other.events;
        self.woken += other.woken;
        self.answer_wakes += other.answer_wakes;
        self.event_wakes += other.event_wakes;
        self.events_received += other.events_received;
        self.events_kept += other.events_kept;
        self.resumed += other.resumed;
    }
}

/// The waits of one run's log.
pub fn waits(events: &[Event]) -> Waits {
    let mut waits = Waits::default();
    for e in events {
        match e.kind {
            EventKind::RunStarted => waits.child_run = e.payload["parent"].is_object(),
            // An approval's `run.waiting` says no `waits_for`.
            EventKind::RunWaiting => match e.payload["waits_for"].as_str() {
                Some("timer") => waits.timers += 1,
                Some("child") => waits.children += 1,
                Some("answer") => waits.answers += 1,
                Some(_) => waits.events += 1,
                None => {}
            },
            EventKind::WaitWoken => {
                waits.woken += 1;
                match e.payload["waits_for"].as_str() {
                    Some("answer") => waits.answer_wakes += 1,
                    Some("event") => waits.event_wakes += 1,
                    _ => {}
                }
            }
            EventKind::EventReceived => {
                waits.events_received += 1;
                waits.events_kept += usize::from(e.step.is_none());
            }
            EventKind::RunResumed
                if e.payload["from"].as_str().is_some_and(|from| {
                    from.starts_with("WAITING_FOR_") && from != "WAITING_FOR_APPROVAL"
                }) =>
            {
                waits.resumed += 1
            }
            _ => {}
        }
    }
    waits
}
