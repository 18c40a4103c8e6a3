//! The chaos run's classes of executions and its count of waits, on hand-made logs: `examples/chaos.rs` itself is
//! not run by `cargo test`.

#[allow(dead_code)]
use std::time::{Duration, UNIX_EPOCH};

use crate::support::chaos_classes::{Class, Execution, Fence, Waits, classify, late_starts, waits};
use agentrt::{Event, EventKind, RunId};
use serde_json::{Value, json};

/// A run's log, built event by event.
#[derive(Default)]
struct Log(Vec<Event>);

impl Log {
    fn push(
        &mut self,
        at_ms: u64,
        kind: EventKind,
        step: Option<u32>,
        payload: Value,
    ) -> &mut Self {
        let seq = self.0.len() as u64 + 1;
        self.0.push(Event {
            run_id: RunId::from("r"),
            seq,
            kind,
            at: UNIX_EPOCH + Duration::from_millis(at_ms),
            step,
            payload,
        });
        self
    }

    fn started(&mut self, at_ms: u64) -> &mut Self {
        self.push(
            at_ms,
            EventKind::RunStarted,
            None,
            json!({"fencing_token": 1}),
        )
    }

    fn tool_started(&mut self, at_ms: u64, attempt: u32, token: u64) -> &mut Self {
        let payload = json!({
            "call_id": "c", "tool": "t", "args": {}, "attempt": attempt,
            "idempotency_key": "r/2", "fencing_token": token,
        });
        self.push(at_ms, EventKind::ToolStarted, Some(2), payload)
    }

    /// A takeover under `token` that interrupts attempt `attempt` and reconciles it so.
    fn taken_over(
        &mut self,
        at_ms: u64,
        token: u64,
        attempt: u32,
        outcome: &str,
        action: &str,
    ) -> &mut Self {
        let resumed = json!({"from": "RUNNING", "fencing_token": token});
        self.push(at_ms, EventKind::RunResumed, None, resumed).push(
            at_ms,
            EventKind::StepInterrupted,
            Some(2),
            json!({"kind": "tool", "attempt": attempt}),
        );
        let reconciled = json!({"attempt": attempt, "outcome": outcome, "action": action});
        self.push(at_ms + 1, EventKind::StepReconciled, Some(2), reconciled)
    }

    fn approved_and_resumed(&mut self, at_ms: u64, token: u64) -> &mut Self {
        let approval = json!({"call_id": "c", "approved": true, "decided_by": "p"});
        self.push(at_ms, EventKind::ApprovalRecorded, Some(2), approval);
        let resumed = json!({"from": "WAITING_FOR_APPROVAL", "fencing_token": token});
        self.push(at_ms + 1, EventKind::RunResumed, None, resumed)
    }
}

fn execution(attempt: u32, token: u64, at_us: Option<u64>) -> Execution {
    Execution {
        key: "r/2".into(),
        run: "r".into(),
        step: 2,
        call: "c".into(),
        tool: "t".into(),
        attempt,
        token,
        pid: 7,
        at_us,
        fence: None,
    }
}

fn classes(log: &Log, executions: &[Execution], idempotent: bool) -> Vec<Class> {
    classify(&log.0, executions, |_| idempotent)
}

#[test]
fn a_retry_after_not_applied_and_the_zombie_that_woke_after_it() {
    let mut log = Log::default();
    log.started(1000)
        .tool_started(1000, 1, 1)
        .taken_over(2000, 2, 1, "not_applied", "run_again")
        .tool_started(2001, 2, 2);
    // The retry acts first; the stopped owner of token 1 wakes and acts after it.
    let found = [
        execution(2, 2, Some(2_003_000)),
        execution(1, 1, Some(2_500_000)),
    ];
    assert_eq!(classes(&log, &found, false), [Class::First, Class::Zombie]);
    // Had the first owner acted before the takeover, the retry is the second.
    let found = [
        execution(1, 1, Some(1_500_000)),
        execution(2, 2, Some(2_003_000)),
    ];
    let classes = classes(&log, &found, false);
    assert!(matches!(classes[1], Class::Unexplained(_)), "{classes:?}");
}

#[test]
fn an_approved_rerun_and_an_idempotent_retry() {
    let mut log = Log::default();
    log.started(1000)
        .tool_started(1000, 1, 1)
        .taken_over(2000, 2, 1, "no_hook", "await_approval")
        .approved_and_resumed(2500, 3)
        .tool_started(2501, 2, 3);
    // The first owner acted and was killed before its outcome: the outcome was unknown.
    let found = [
        execution(1, 1, Some(1_004_000)),
        execution(2, 3, Some(2_505_000)),
    ];
    assert_eq!(
        classes(&log, &found, false),
        [Class::First, Class::ApprovedRerun]
    );

    let mut log = Log::default();
    log.started(1000)
        .tool_started(1000, 1, 1)
        .taken_over(2000, 2, 1, "no_hook", "run_again")
        .tool_started(2001, 2, 2);
    let found = [
        execution(1, 1, Some(1_004_000)),
        execution(2, 2, Some(2_005_000)),
    ];
    assert_eq!(
        classes(&log, &found, true),
        [Class::First, Class::IdempotentRetry]
    );
    // A tool that is not idempotent is never run again on an unknown outcome.
    let classes = classes(&log, &found, false);
    assert!(matches!(classes[1], Class::Unexplained(_)), "{classes:?}");
}

#[test]
fn an_act_in_the_millisecond_of_a_takeover_is_a_zombie_and_one_before_it_is_not() {
    let mut log = Log::default();
    log.started(1000)
        .tool_started(1000, 1, 1)
        .taken_over(2000, 2, 1, "applied", "record_output");
    assert_eq!(
        classes(&log, &[execution(1, 1, Some(2_000_400))], false),
        [Class::Zombie]
    );
    assert_eq!(
        classes(&log, &[execution(1, 1, Some(1_999_900))], false),
        [Class::First]
    );
}

#[test]
fn a_refused_write_is_a_zombie_and_an_attempt_that_acted_twice_is_unexplained() {
    let mut log = Log::default();
    log.started(1000)
        .tool_started(1000, 1, 1)
        .taken_over(2000, 2, 1, "not_applied", "run_again")
        .tool_started(2001, 2, 2);
    let refused = Execution {
        fence: Some(Fence::Refused),
        ..execution(1, 1, None)
    };
    let found = [execution(2, 2, Some(2_003_000)), refused];
    assert_eq!(classes(&log, &found, false), [Class::First, Class::Zombie]);

    let found = [
        execution(1, 1, Some(1_001_000)),
        execution(1, 1, Some(1_002_000)),
    ];
    let classes = classes(&log, &found, false);
    assert_eq!(classes[0], Class::First);
    assert!(matches!(classes[1], Class::Unexplained(_)), "{classes:?}");
}

#[test]
fn an_execution_no_attempt_started_is_unexplained() {
    let mut log = Log::default();
    log.started(1000).tool_started(1000, 1, 1);
    let classes = classes(&log, &[execution(1, 2, Some(1_001_000))], false);
    assert!(matches!(classes[0], Class::Unexplained(_)), "{classes:?}");
}

#[test]
fn a_start_after_the_expiry_its_takeover_recorded_is_late() {
    let takeover = |log: &mut Log, at_ms: u64, expired_ms: u64| {
        log.push(
            at_ms,
            EventKind::RunResumed,
            None,
            json!({"fencing_token": 2}),
        );
        let payload = json!({"previous_owner": "a", "previous_expires_at": expired_ms});
        log.push(at_ms, EventKind::LeaseTakenOver, None, payload);
    };
    let mut log = Log::default();
    log.started(1000).tool_started(1400, 1, 1);
    takeover(&mut log, 2000, 1500);
    assert!(late_starts(&log.0).is_empty());

    let mut log = Log::default();
    log.started(1000).tool_started(1600, 1, 1);
    takeover(&mut log, 2000, 1500);
    let late = late_starts(&log.0);
    assert_eq!(late.len(), 1);
    assert_eq!((late[0].0.seq, late[0].1), (2, 1500));
}

/// A parent's log: it sleeps (step 2), is resumed by another worker under token 2, delegates
/// (step 4) and is resumed under token 3 once its child ended, then calls a tool (step 6)
/// that needs an approval first.
fn parent_log() -> Log {
    let mut log = Log::default();
    log.started(1000);
    let waiting = |kind: &str| json!({"call_id": "c", "tool": "t", "waits_for": kind, "key": "k", "detail": {}});
    let resumed = |from: &str, token: u64| json!({"from": from, "fencing_token": token});
    log.push(1001, EventKind::RunWaiting, Some(2), waiting("timer"))
        .push(
            1300,
            EventKind::RunResumed,
            None,
            resumed("WAITING_FOR_TIMER", 2),
        )
        .push(1301, EventKind::RunWaiting, Some(4), waiting("child"))
        .push(
            1800,
            EventKind::WaitWoken,
            Some(4),
            json!({"waits_for": "child", "child": "r/4", "state": "SUCCEEDED"}),
        )
        .push(
            1801,
            EventKind::RunResumed,
            None,
            resumed("WAITING_FOR_CHILD", 3),
        )
        .push(
            1802,
            EventKind::RunWaiting,
            Some(6),
            json!({"call_id": "c6", "tool": "t", "reason": "policy"}),
        )
        .push(
            1900,
            EventKind::RunResumed,
            None,
            resumed("WAITING_FOR_APPROVAL", 4),
        );
    let started = json!({
        "call_id": "c6", "tool": "t", "args": {}, "attempt": 1,
        "idempotency_key": "r/6", "fencing_token": 4,
    });
    log.push(1901, EventKind::ToolStarted, Some(6), started);
    log
}

#[test]
fn a_parents_waits_and_its_childs_start_are_counted_and_approvals_are_not() {
    let counted = waits(&parent_log().0);
    assert_eq!(
        counted,
        Waits {
            timers: 1,
            children: 1,
            woken: 1,
            resumed: 2,
            ..Waits::default()
        }
    );
    assert_eq!(counted.begun(), 2);

    let mut child = Log::default();
    let started = json!({
        "fencing_token": 0, "queued": true,
        "parent": {"run_id": "r", "step": 4, "call_id": "c4"},
    });
    child.push(1301, EventKind::RunStarted, None, started);
    let counted = waits(&child.0);
    assert!(counted.child_run);
    assert_eq!(counted.begun(), 0);
}

#[test]
fn answers_events_and_kept_events_are_counted_by_kind() {
    let mut log = Log::default();
    log.started(1000);
    let waiting = |kind: &str| json!({"call_id": "c", "tool": "t", "waits_for": kind, "key": "k", "detail": {}});
    let resumed = |from: &str, token: u64| json!({"from": from, "fencing_token": token});
    log.push(1001, EventKind::RunWaiting, Some(2), waiting("answer"))
        .push(
            1100,
            EventKind::EventReceived,
            None,
            json!({"name": "payment", "event_id": "e1"}),
        )
        .push(
            1200,
            EventKind::WaitWoken,
            Some(2),
            json!({"call_id": "c", "waits_for": "answer", "answer": "yes", "answered_by": "p"}),
        )
        .push(
            1201,
            EventKind::RunResumed,
            None,
            resumed("WAITING_FOR_ANSWER", 2),
        )
        .push(1300, EventKind::RunWaiting, Some(4), waiting("event"))
        .push(
            1400,
            EventKind::EventReceived,
            Some(4),
            json!({"name": "other", "event_id": "e2"}),
        )
        .push(
            1400,
            EventKind::WaitWoken,
            Some(4),
            json!({"call_id": "c", "waits_for": "event", "name": "other", "event_id": "e2"}),
        )
        .push(
            1401,
            EventKind::RunResumed,
            None,
            resumed("WAITING_FOR_EVENT", 3),
        );
    let counted = waits(&log.0);
    assert_eq!(
        counted,
        Waits {
            answers: 1,
            events: 1,
            woken: 2,
            answer_wakes: 1,
            event_wakes: 1,
            events_received: 2,
            events_kept: 1,
            resumed: 2,
            ..Waits::default()
        }
    );
    assert_eq!(counted.begun(), 2);
}

#[test]
fn an_act_after_a_wait_is_first_under_the_token_of_the_resume_that_started_it() {
    let log = parent_log();
    let after_wait = Execution {
        key: "r/6".into(),
        step: 6,
        call: "c6".into(),
        ..execution(1, 4, Some(1_902_000))
    };
    assert_eq!(
        classes(&log, std::slice::from_ref(&after_wait), false),
        [Class::First]
    );
    // The worker that slept under token 1 never started it: nothing explains its act.
    let stray = Execution {
        token: 1,
        ..after_wait
    };
    let classes = classes(&log, &[stray], false);
    assert!(matches!(classes[0], Class::Unexplained(_)), "{classes:?}");
}
