//! Tool timeouts and heartbeats: a call that hangs past its timeout, or whose heartbeats stop,
//! is cut off after the grace and reconciled as an interrupted call (its hook, then
//! `idempotent`, then a person); one that keeps beating goes on; one that answers its signal
//! within the grace has its outcome recorded; and the heartbeats are kept at most once per
//! period.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use agentrt::{
    Agent, ApprovalReason, Config, Event, EventKind, MoveInfo, MoveKind, MoveObserver, Outcome,
    Reconciliation, RunId, StartRun, Tool, ToolContext, ToolError, ToolResult, async_trait,
    testkit::TempStore,
};
use serde_json::{Value, json};

use crate::support::{ask, call_then_answer, outcome_of, results_seen};

/// The timeout of the calls that hang, and their grace: short, so that the tests are quick.
const LIMIT: Duration = Duration::from_millis(200);
const GRACE: Duration = Duration::from_millis(50);

/// What attempt 1 of a [`Fetch`] does; later attempts return at once, saying whether their
/// signal had fired.
#[derive(Clone, Copy)]
enum First {
    /// Never returns, whatever its signal says.
    Hangs,
    /// Returns an error as soon as its signal fires.
    Stops,
    /// Beats three times, 20 ms apart, then never returns.
    BeatsThenHangs,
    /// Beats every `every` until `for_` has passed, then returns.
    BeatsFor { every: Duration, for_: Duration },
}

/// A tool whose first attempt does as [`First`] says; it records each attempt it is called for.
#[derive(Clone)]
struct Fetch {
    first: First,
    timeout: Option<Duration>,
    heartbeat_timeout: Option<Duration>,
    idempotent: bool,
    hook: Option<Reconciliation>,
    attempts: Arc<Mutex<Vec<u32>>>,
    /// How long attempt 1 took, from its start to its return.
    took: Arc<Mutex<Option<Duration>>>,
}

impl Fetch {
    fn new(first: First) -> Self {
        Fetch {
            first,
            timeout: Some(LIMIT),
            heartbeat_timeout: None,
            idempotent: false,
            hook: None,
            attempts: Arc::default(),
            took: Arc::default(),
        }
    }

    fn attempts(&self) -> Vec<u32> {
        self.attempts.lock().unwrap().clone()
    }
}

#[async_trait(?Send)]
impl Tool for Fetch {
    fn name(&self) -> &str {
        "fetch"
    }

    fn idempotent(&self) -> bool {
        self.idempotent
    }

    fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    fn heartbeat_timeout(&self) -> Option<Duration> {
        self.heartbeat_timeout
    }

    async fn call(&self, ctx: &ToolContext, _: &Value) -> Result<Value, ToolError> {
        self.attempts.lock().unwrap().push(ctx.attempt);
        if ctx.attempt > 1 {
            // Whether the signal fired already: the timeout of the attempt before fired its
            // own, not the run's.
            let signalled = ctx.cancellation.is_cancelled();
            return Ok(json!({"attempt": ctx.attempt, "signalled": signalled}));
        }
        let started = Instant::now();
        match self.first {
            First::Hangs => std::future::pending().await,
            First::Stops => {
                ctx.cancellation.cancelled().await;
                Err(ToolError::new("stopped at the signal"))
            }
            First::BeatsThenHangs => {
                for done in 1..=3 {
                    ctx.heartbeat(json!({ "done": done }));
                    actix_rt::time::sleep(Duration::from_millis(20)).await;
                }
                std::future::pending().await
            }
            First::BeatsFor { every, for_ } => {
                let mut done = 0;
                while started.elapsed() < for_ {
                    done += 1;
                    ctx.heartbeat(json!({ "done": done }));
                    actix_rt::time::sleep(every).await;
                }
                *self.took.lock().unwrap() = Some(started.elapsed());
                Ok(json!({"beats": done}))
            }
        }
    }

    async fn reconcile(&self, _: &ToolContext, _: &Value) -> Option<Reconciliation> {
        self.hook.clone()
    }
}

fn agent(tool: &Fetch) -> Agent {
    Agent::new(call_then_answer("c1", "fetch", json!({}), "done"))
        .tool(tool.clone())
        .tool_grace(GRACE)
}

fn events(db: &TempStore) -> Vec<Event> {
    db.open().events(&RunId::from("run-1")).unwrap()
}

fn of_kind(events: &[Event], kind: EventKind) -> Vec<&Event> {
    events.iter().filter(|e| e.kind == kind).collect()
}

/// The call was timed out once, for `why` after `limit`, and then reconciled once, saying
/// `outcome` and `action`: `step.tool_timed_out` comes right before `step.reconciled`.
fn assert_timed_out_then_reconciled(
    events: &[Event],
    why: &str,
    limit: Duration,
    outcome: &str,
    action: &str,
) {
    let timed_out = of_kind(events, EventKind::ToolTimedOut);
    assert_eq!(timed_out.len(), 1, "{events:#?}");
    assert_eq!(timed_out[0].step, Some(2));
    assert_eq!(
        timed_out[0].payload,
        json!({
            "call_id": "c1",
            "attempt": 1,
            "why": why,
            "limit_ms": limit.as_millis() as u64,
        })
    );
    let at = events
        .iter()
        .position(|e| e.kind == EventKind::ToolTimedOut)
        .unwrap();
    let reconciled = &events[at + 1];
    assert_eq!(reconciled.kind, EventKind::StepReconciled);
    assert_eq!(
        reconciled.payload,
        json!({"attempt": 1, "outcome": outcome, "action": action})
    );
    assert!(
        of_kind(events, EventKind::StepInterrupted).is_empty(),
        "no takeover: the loop marked its own step"
    );
}

#[test]
fn a_hung_call_the_hook_says_was_applied_is_recorded_not_run_again() {
    let db = TempStore::new();
    let mut fetch = Fetch::new(First::Hangs);
    fetch.hook = Some(Reconciliation::Applied(json!({"fetched": 1})));
    let outcome = outcome_of(&db, agent(&fetch), json!({}));

    assert_eq!(
        outcome,
        Outcome::Succeeded {
            output: "done".into()
        }
    );
    assert_eq!(fetch.attempts(), [1], "not run again");
    let events = events(&db);
    assert_timed_out_then_reconciled(&events, "timeout", LIMIT, "applied", "record_output");
    let finished = of_kind(&events, EventKind::ToolFinished);
    assert_eq!(finished.len(), 1);
    assert_eq!(finished[0].payload["reconciled"], json!(true));
}

#[test]
fn a_hung_call_the_hook_says_was_not_applied_runs_again() {
    let db = TempStore::new();
    let mut fetch = Fetch::new(First::Hangs);
    fetch.hook = Some(Reconciliation::NotApplied);
    let outcome = outcome_of(&db, agent(&fetch), json!({}));

    assert_eq!(
        outcome,
        Outcome::Succeeded {
            output: "done".into()
        }
    );
    assert_eq!(fetch.attempts(), [1, 2]);
    let events = events(&db);
    assert_timed_out_then_reconciled(&events, "timeout", LIMIT, "not_applied", "run_again");
    let finished = of_kind(&events, EventKind::ToolFinished);
    assert_eq!(
        finished[0].payload,
        json!({"call_id": "c1", "attempt": 2, "output": {"attempt": 2, "signalled": false}})
    );
}

#[test]
fn a_hung_idempotent_call_past_the_agents_timeout_runs_again() {
    let db = TempStore::new();
    let mut fetch = Fetch::new(First::Hangs);
    // The agent's timeout, not the tool's.
    fetch.timeout = None;
    fetch.idempotent = true;
    let agent = agent(&fetch).tool_timeout(LIMIT);
    let outcome = outcome_of(&db, agent, json!({}));

    assert_eq!(
        outcome,
        Outcome::Succeeded {
            output: "done".into()
        }
    );
    assert_eq!(fetch.attempts(), [1, 2]);
    assert_timed_out_then_reconciled(&events(&db), "timeout", LIMIT, "no_hook", "run_again");
}

#[test]
fn a_hung_call_without_a_hook_that_is_not_idempotent_waits_for_a_person() {
    let db = TempStore::new();
    let fetch = Fetch::new(First::Hangs);
    let outcome = outcome_of(&db, agent(&fetch), json!({}));

    let Outcome::WaitingForApproval { pending } = outcome else {
        panic!("{outcome:?}")
    };
    assert_eq!(pending.reason, ApprovalReason::Reconcile);
    assert_eq!(pending.call_id, "c1");
    assert_eq!(
        fetch.attempts(),
        [1],
        "nothing ran again before a person decided"
    );
    let events = events(&db);
    assert_timed_out_then_reconciled(&events, "timeout", LIMIT, "no_hook", "await_approval");
    assert_eq!(events.last().unwrap().kind, EventKind::RunWaiting);
}

#[test]
fn a_call_that_answers_its_signal_within_the_grace_has_its_outcome_recorded() {
    let db = TempStore::new();
    let fetch = Fetch::new(First::Stops);
    let model = call_then_answer("c1", "fetch", json!({}), "done");
    // A grace long enough for the call to return in, whatever the machine.
    let agent = Agent::new(model.clone())
        .tool(fetch.clone())
        .tool_grace(Duration::from_secs(30));
    let outcome = outcome_of(&db, agent, json!({}));

    assert_eq!(
        outcome,
        Outcome::Succeeded {
            output: "done".into()
        }
    );
    let events = events(&db);
    assert!(of_kind(&events, EventKind::ToolTimedOut).is_empty());
    assert!(of_kind(&events, EventKind::StepReconciled).is_empty());
    assert_eq!(
        results_seen(&model),
        [ToolResult::Error("stopped at the signal".into())]
    );
    // Only the call's signal fired: the run was not cancelled.
    assert_eq!(
        db.open().run(&RunId::from("run-1")).unwrap().state,
        agentrt::RunState::Succeeded
    );
}

#[test]
fn a_call_whose_heartbeats_stop_times_out() {
    let db = TempStore::new();
    let mut fetch = Fetch::new(First::BeatsThenHangs);
    fetch.timeout = None;
    fetch.heartbeat_timeout = Some(LIMIT);
    fetch.hook = Some(Reconciliation::Applied(json!({"fetched": 1})));
    let outcome = outcome_of(&db, agent(&fetch), json!({}));

    assert_eq!(
        outcome,
        Outcome::Succeeded {
            output: "done".into()
        }
    );
    assert_timed_out_then_reconciled(&events(&db), "heartbeat", LIMIT, "applied", "record_output");
}

#[test]
fn a_call_that_keeps_beating_past_its_heartbeat_timeout_is_not_timed_out() {
    let db = TempStore::new();
    let mut fetch = Fetch::new(First::BeatsFor {
        every: Duration::from_millis(10),
        for_: LIMIT * 3,
    });
    fetch.timeout = Some(Duration::from_secs(60));
    fetch.heartbeat_timeout = Some(LIMIT);
    let outcome = outcome_of(&db, agent(&fetch), json!({}));

    assert_eq!(
        outcome,
        Outcome::Succeeded {
            output: "done".into()
        }
    );
    assert_eq!(fetch.attempts(), [1]);
    let events = events(&db);
    assert!(
        of_kind(&events, EventKind::ToolTimedOut).is_empty(),
        "{events:#?}"
    );
    let finished = of_kind(&events, EventKind::ToolFinished);
    assert!(finished[0].payload["output"]["beats"].as_u64().unwrap() > 1);
}

/// Counts the progress writes committed.
#[derive(Clone, Default)]
struct ProgressWrites(Arc<AtomicUsize>);

impl MoveObserver for ProgressWrites {
    fn after_commit(&self, info: &MoveInfo) {
        if info.kind == MoveKind::RecordProgress {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
}

#[test]
fn heartbeats_are_written_at_most_once_per_period() {
    let db = TempStore::new();
    let period = Duration::from_millis(50);
    let mut fetch = Fetch::new(First::BeatsFor {
        every: Duration::from_millis(1),
        for_: Duration::from_millis(300),
    });
    fetch.timeout = None;
    let agent = agent(&fetch).progress_every(period);
    let writes = ProgressWrites::default();
    let config = Config::default().observer(writes.clone());
    let start = StartRun::new("a", json!({})).with_id("run-1");
    let outcome = ask(db.open(), config, "a", agent, start).unwrap().outcome;

    assert_eq!(
        outcome,
        Outcome::Succeeded {
            output: "done".into()
        }
    );
    let beats = of_kind(&events(&db), EventKind::ToolFinished)[0].payload["output"]["beats"]
        .as_u64()
        .unwrap();
    // Every write begins within the call, a period after the one before.
    let took = fetch.took.lock().unwrap().unwrap();
    let bound = took.as_nanos().div_ceil(period.as_nanos()) as usize + 1;
    let written = writes.0.load(Ordering::SeqCst);
    assert!(written >= 1, "the heartbeats were kept");
    assert!(
        written <= bound,
        "{written} writes of {beats} beats in {took:?}: at most {bound}"
    );
}
