//! A supervisor crashes (its actix system goes away, with no further write) in the middle of a
//! model call's retries; a fresh supervisor resumes the run: every attempt is in the log as it
//! happened, the model is asked again, and no tool runs twice.

use std::time::Duration;

use agentrt::{
    Agent, Config, EventKind, ModelError, ModelPolicy, ModelResponse, Outcome, RunId, StartRun,
    ToolCall,
    testkit::{RecordingTool, ScriptedModel, TempStore, resume_when_free, with_system},
};
use serde_json::json;

use crate::support::supervise;

fn script() -> Vec<ModelResponse> {
    vec![
        ModelResponse::calls(vec![ToolCall::new(
            "charge-1",
            "charge",
            json!({"cents": 500}),
        )]),
        ModelResponse::answer("charged"),
    ]
}

fn agent(model: &ScriptedModel, charge: &RecordingTool) -> Agent {
    Agent::new(model.clone()).tool(charge.clone()).model_policy(
        ModelPolicy::default()
            .max_attempts(4)
            .backoff(Duration::from_millis(5), Duration::from_millis(20)),
    )
}

/// The crashed supervisor's run is free again after this; long enough that a slow machine
/// renews the lease on time before the crash.
fn lease() -> Config {
    Config::default().lease_ttl(Duration::from_secs(2))
}

/// Starts `run-1` with `model`, and crashes its supervisor once `crash_when` says so of the
/// run's events.
fn crash_when(
    db: &TempStore,
    agent: Agent,
    crash_when: impl Fn(&[agentrt::Event]) -> bool + 'static,
) {
    let (store, watcher) = (db.open(), db.open());
    with_system(|| async move {
        let supervisor = supervise(store, lease(), "billing", agent);
        actix_rt::spawn(supervisor.send(StartRun::new("billing", json!({})).with_id("run-1")));
        // Before the run's insert commits it is not found: no events yet.
        while !crash_when(&watcher.events(&RunId::from("run-1")).unwrap_or_default()) {
            actix_rt::time::sleep(Duration::from_millis(5)).await;
        }
    });
}

fn resume(db: &TempStore, agent: Agent) -> Outcome {
    let store = db.open();
    with_system(|| async move {
        let supervisor = supervise(store, lease(), "billing", agent);
        resume_when_free(&supervisor, &RunId::from("run-1"), Duration::from_secs(20)).await
    })
    .unwrap()
    .outcome
}

#[test]
fn a_crash_during_retries_keeps_every_attempt_and_the_resume_asks_the_model_again() {
    let db = TempStore::new();
    let charge = RecordingTool::new("charge");
    let run_id = RunId::from("run-1");

    // Two attempts fail, the third hangs: the system goes away under it.
    let flaky = ScriptedModel::new(script())
        .failing_at_turn(
            0,
            vec![
                ModelError::retryable("HTTP 502: bad gateway"),
                ModelError::retryable("connection reset"),
            ],
        )
        .block_at_turn(0);
    crash_when(&db, agent(&flaky, &charge), |events| {
        events
            .iter()
            .filter(|e| e.kind == EventKind::ModelStarted)
            .count()
            == 3
    });
    let store = db.open();
    let attempts = |kinds: &[EventKind]| -> Vec<(EventKind, u64)> {
        store
            .events(&run_id)
            .unwrap()
            .into_iter()
            .filter(|e| kinds.contains(&e.kind))
            .map(|e| (e.kind, e.payload["attempt"].as_u64().unwrap_or(0)))
            .collect()
    };
    let model_kinds = [
        EventKind::ModelStarted,
        EventKind::ModelAttemptFailed,
        EventKind::ModelFinished,
        EventKind::StepInterrupted,
    ];
    assert_eq!(
        attempts(&model_kinds),
        [
            (EventKind::ModelStarted, 1),
            (EventKind::ModelAttemptFailed, 1),
            (EventKind::ModelStarted, 2),
            (EventKind::ModelAttemptFailed, 2),
            (EventKind::ModelStarted, 3),
        ],
        "every attempt up to the crash is in the log, and nothing after it"
    );
    assert_eq!(
        store.events(&run_id).unwrap().last().unwrap().kind,
        EventKind::ModelStarted
    );

    // A new process: the same agent, its model answering at once.
    let steady = ScriptedModel::new(script());
    let outcome = resume(&db, agent(&steady, &charge));

    assert_eq!(
        outcome,
        Outcome::Succeeded {
            output: "charged".into()
        }
    );
    assert_eq!(charge.executions().len(), 1, "the tool ran once");
    let requests = steady.requests();
    assert_eq!(
        (requests[0].step, requests[0].attempt),
        (1, 4),
        "the interrupted call is dispatched again as its fourth attempt"
    );
    assert_eq!(
        attempts(&model_kinds),
        [
            (EventKind::ModelStarted, 1),
            (EventKind::ModelAttemptFailed, 1),
            (EventKind::ModelStarted, 2),
            (EventKind::ModelAttemptFailed, 2),
            (EventKind::ModelStarted, 3),
            (EventKind::StepInterrupted, 3),
            (EventKind::ModelStarted, 4),
            (EventKind::ModelFinished, 0),
            (EventKind::ModelStarted, 1),
            (EventKind::ModelFinished, 0),
        ]
    );
    let usage = store.usage(&run_id).unwrap();
    assert_eq!(
        (usage.answers, usage.attempts),
        (2, 5),
        "five attempts dispatched, two answered: the one cut off by the crash may be paid for too"
    );
    agentrt::testkit::assert_no_run_leased(&store);
}

#[test]
fn a_crash_during_the_last_attempt_fails_the_run_without_another() {
    let db = TempStore::new();
    let charge = RecordingTool::new("charge");
    let failures = (0..3).map(|_| ModelError::retryable("HTTP 503")).collect();
    let flaky = ScriptedModel::new(script())
        .failing_at_turn(0, failures)
        .block_at_turn(0);
    crash_when(&db, agent(&flaky, &charge), |events| {
        events
            .iter()
            .any(|e| e.kind == EventKind::ModelStarted && e.payload["attempt"] == json!(4))
    });

    let steady = ScriptedModel::new(script());
    let outcome = resume(&db, agent(&steady, &charge));

    let error = "the model failed after 4 attempts: attempt 4, the last the model policy allows, \
                 was cut off before it answered";
    assert_eq!(
        outcome,
        Outcome::Failed {
            error: error.into()
        }
    );
    assert_eq!(steady.calls(), 0, "no fifth attempt");
    let store = db.open();
    let events = store.events(&RunId::from("run-1")).unwrap();
    let reconciled = events
        .iter()
        .find(|e| e.kind == EventKind::StepReconciled)
        .unwrap();
    assert_eq!(
        reconciled.payload,
        json!({"attempt": 4, "outcome": "model_call", "action": "fail_run"})
    );
    let finished = events.last().unwrap();
    assert_eq!(finished.kind, EventKind::RunFinished);
    assert_eq!(finished.payload["model_attempts"], json!(4));
    agentrt::testkit::assert_no_run_leased(&store);
}

#[test]
fn a_takeover_during_the_backoff_waits_out_the_servers_retry_after() {
    let db = TempStore::new();
    let charge = RecordingTool::new("charge");
    // Longer than the lease: the next owner takes the run over before the wait is over.
    let retry_after = Duration::from_secs(3);
    let flaky = ScriptedModel::new(script()).failing_at_turn(
        0,
        vec![ModelError::retryable("HTTP 429: slow down").retry_after(retry_after)],
    );
    let policy =
        ModelPolicy::default().backoff(Duration::from_millis(5), Duration::from_millis(20));
    let agent_a = Agent::new(flaky.clone())
        .tool(charge.clone())
        .model_policy(policy.clone());
    crash_when(&db, agent_a, |events| {
        events
            .iter()
            .any(|e| e.kind == EventKind::ModelAttemptFailed)
    });
    let store = db.open();
    let failed = store
        .events(&RunId::from("run-1"))
        .unwrap()
        .into_iter()
        .find(|e| e.kind == EventKind::ModelAttemptFailed)
        .unwrap();
    let retry_at = failed.payload["retry_at"].as_i64().unwrap();

    /// Notes the wall-clock time of each call.
    #[derive(Clone)]
    struct Timed(ScriptedModel, std::sync::Arc<std::sync::Mutex<Vec<i64>>>);
    #[agentrt::async_trait(?Send)]
    impl agentrt::Model for Timed {
        async fn complete(
            &self,
            request: agentrt::ModelRequest<'_>,
        ) -> Result<ModelResponse, ModelError> {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_millis() as i64;
            self.1.lock().unwrap().push(now);
            self.0.complete(request).await
        }
    }
    let times = std::sync::Arc::default();
    let timed = Timed(ScriptedModel::new(script()), std::sync::Arc::clone(&times));
    let outcome = resume(
        &db,
        Agent::new(timed).tool(charge.clone()).model_policy(policy),
    );

    assert_eq!(
        outcome,
        Outcome::Succeeded {
            output: "charged".into()
        }
    );
    let first = times.lock().unwrap()[0];
    assert!(
        first >= retry_at,
        "the next attempt was sent {} ms before the server's Retry-After ran out",
        retry_at - first
    );
    let events = store.events(&RunId::from("run-1")).unwrap();
    let reconciled = events
        .iter()
        .find(|e| e.kind == EventKind::StepReconciled)
        .unwrap();
    assert_eq!(
        reconciled.payload,
        json!({"attempt": 1, "outcome": "attempt_failed", "action": "dispatch_again"})
    );
    assert_eq!(charge.executions().len(), 1);
}
