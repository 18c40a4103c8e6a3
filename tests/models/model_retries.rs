//! A model call under its agent's model policy: retryable errors and timeouts are tried again
//! after a backoff, each attempt written to the log as it happens; fatal errors, and a policy
//! that gives up, fail the run with the last error and the number of attempts.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use agentrt::{
    Agent, CancelRun, Config, Event, EventKind, Model, ModelError, ModelPolicy, ModelRequest,
    ModelResponse, Outcome, RunId, StartRun, Store, Usage, async_trait,
    testkit::{ScriptedModel, TempStore, with_system},
};
use serde_json::json;

use crate::support::{outcome_of, supervise};

/// Retries that wait milliseconds, not seconds.
fn quick_policy() -> ModelPolicy {
    ModelPolicy::default().backoff(Duration::from_millis(5), Duration::from_millis(20))
}

fn answer_with_usage() -> ModelResponse {
    ModelResponse {
        usage: Some(Usage::new(120, 7)),
        model: Some("scripted-1".into()),
        ..ModelResponse::answer("done")
    }
}

/// Starts run `run-1` of `agent` and returns how the call ended.
fn run(db: &TempStore, agent: Agent) -> Outcome {
    outcome_of(db, agent, json!("hello"))
}

fn model_events(store: &Store) -> Vec<Event> {
    store
        .events(&RunId::from("run-1"))
        .unwrap()
        .into_iter()
        .filter(|e| e.kind.as_str().starts_with("step.model"))
        .collect()
}

fn summary(events: &[Event]) -> Vec<(EventKind, u64)> {
    events
        .iter()
        .map(|e| (e.kind, e.payload["attempt"].as_u64().unwrap_or(0)))
        .collect()
}

fn finished(store: &Store) -> Event {
    let events = store.events(&RunId::from("run-1")).unwrap();
    let last = events.last().unwrap().clone();
    assert_eq!(last.kind, EventKind::RunFinished);
    last
}

#[test]
fn a_retryable_error_is_tried_again_and_every_attempt_is_in_the_log() {
    let db = TempStore::new();
    let model = ScriptedModel::new(vec![answer_with_usage()]).failing_at_turn(
        0,
        vec![
            ModelError::retryable("HTTP 503: overloaded"),
            ModelError::retryable("HTTP 429: slow down").retry_after(Duration::from_millis(30)),
        ],
    );
    let agent = Agent::new(model.clone()).model_policy(quick_policy());

    let outcome = run(&db, agent);

    assert_eq!(
        outcome,
        Outcome::Succeeded {
            output: "done".into()
        }
    );
    let store = db.open();
    let events = model_events(&store);
    assert_eq!(
        summary(&events),
        [
            (EventKind::ModelStarted, 1),
            (EventKind::ModelAttemptFailed, 1),
            (EventKind::ModelStarted, 2),
            (EventKind::ModelAttemptFailed, 2),
            (EventKind::ModelStarted, 3),
            (EventKind::ModelFinished, 0),
        ]
    );
    assert_eq!(events[1].payload["error"], json!("HTTP 503: overloaded"));
    assert_eq!(events[3].payload["error"], json!("HTTP 429: slow down"));
    // The server's Retry-After is what the second backoff waited, though longer than the
    // policy's own largest backoff.
    assert_eq!(events[3].payload["retry_in_ms"], json!(30));
    let attempts: Vec<u32> = model.requests().iter().map(|r| r.attempt).collect();
    assert_eq!(
        attempts,
        [1, 2, 3],
        "the model is told each attempt's number"
    );
    // Only the answer reported usage; the log has all three attempts.
    let usage = store.usage(&RunId::from("run-1")).unwrap();
    assert_eq!(usage.tokens, Usage::new(120, 7));
    assert_eq!((usage.answers, usage.attempts), (1, 3));
    assert_eq!(usage.models, ["scripted-1"]);
    assert_eq!(events[5].payload["usage"]["input_tokens"], json!(120));
    assert_eq!(events[5].payload["model"], json!("scripted-1"));
}

#[test]
fn a_fatal_error_fails_the_run_at_once() {
    let db = TempStore::new();
    let model = ScriptedModel::new(vec![ModelResponse::answer("never")])
        .failing_at_turn(0, vec![ModelError::fatal("HTTP 401: invalid API key")]);
    let agent = Agent::new(model.clone()).model_policy(quick_policy());

    let outcome = run(&db, agent);

    assert_eq!(
        outcome,
        Outcome::Failed {
            error: "the model failed: HTTP 401: invalid API key".into()
        }
    );
    assert_eq!(model.calls(), 1);
    let store = db.open();
    assert_eq!(
        summary(&model_events(&store)),
        [(EventKind::ModelStarted, 1), (EventKind::ModelFinished, 1)]
    );
    let finished = finished(&store);
    assert_eq!(finished.payload["model_attempts"], json!(1));
    assert_eq!(finished.payload["state"], json!("FAILED"));
}

#[test]
fn the_policy_gives_up_after_its_attempts_with_the_last_error() {
    let db = TempStore::new();
    let errors = (1..=3)
        .map(|n| ModelError::retryable(format!("HTTP 500, number {n}")))
        .collect();
    let model = ScriptedModel::new(vec![ModelResponse::answer("never")]).failing_at_turn(0, errors);
    let agent = Agent::new(model.clone()).model_policy(quick_policy().max_attempts(3));

    let outcome = run(&db, agent);

    let error = "the model failed after 3 attempts: HTTP 500, number 3";
    assert_eq!(
        outcome,
        Outcome::Failed {
            error: error.into()
        }
    );
    assert_eq!(model.calls(), 3);
    let store = db.open();
    let events = model_events(&store);
    assert_eq!(
        summary(&events),
        [
            (EventKind::ModelStarted, 1),
            (EventKind::ModelAttemptFailed, 1),
            (EventKind::ModelStarted, 2),
            (EventKind::ModelAttemptFailed, 2),
            (EventKind::ModelStarted, 3),
            (EventKind::ModelFinished, 3),
        ]
    );
    assert_eq!(events[5].payload["attempts"], json!(3));
    let finished = finished(&store);
    assert_eq!(finished.payload["error"], json!(error));
    assert_eq!(finished.payload["model_attempts"], json!(3));
    assert_eq!(
        store.run(&RunId::from("run-1")).unwrap().error.unwrap(),
        error
    );
}

/// Its first call never answers; every later one answers at once.
#[derive(Clone, Default)]
struct HangsOnce {
    calls: Arc<AtomicUsize>,
}

#[async_trait(?Send)]
impl Model for HangsOnce {
    async fn complete(&self, _: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
            std::future::pending::<()>().await;
        }
        Ok(ModelResponse::answer("late but here"))
    }
}

#[test]
fn an_attempt_that_outlasts_its_timeout_is_dropped_and_tried_again() {
    let db = TempStore::new();
    let model = HangsOnce::default();
    let policy = quick_policy().timeout(Duration::from_millis(200));
    let agent = Agent::new(model.clone()).model_policy(policy);

    let outcome = run(&db, agent);

    assert_eq!(
        outcome,
        Outcome::Succeeded {
            output: "late but here".into()
        }
    );
    assert_eq!(model.calls.load(Ordering::SeqCst), 2);
    let store = db.open();
    let events = model_events(&store);
    assert_eq!(
        summary(&events),
        [
            (EventKind::ModelStarted, 1),
            (EventKind::ModelAttemptFailed, 1),
            (EventKind::ModelStarted, 2),
            (EventKind::ModelFinished, 0),
        ]
    );
    assert_eq!(events[1].payload["error"], json!("no answer within 0.2 s"));
}

#[test]
fn a_fatal_error_after_retryable_ones_fails_the_run_with_it() {
    let db = TempStore::new();
    let model = ScriptedModel::new(vec![ModelResponse::answer("never")]).failing_at_turn(
        0,
        vec![
            ModelError::retryable("HTTP 503"),
            ModelError::fatal("HTTP 400: the request is too long"),
        ],
    );
    let agent = Agent::new(model.clone()).model_policy(quick_policy().max_attempts(5));

    let outcome = run(&db, agent);

    assert_eq!(
        outcome,
        Outcome::Failed {
            error: "the model failed after 2 attempts: HTTP 400: the request is too long".into()
        }
    );
    assert_eq!(model.calls(), 2);
}

#[test]
fn a_cancel_during_the_backoff_stops_the_run_before_another_attempt() {
    let db = TempStore::new();
    let model = ScriptedModel::new(vec![ModelResponse::answer("never")])
        .failing_at_turn(0, vec![ModelError::retryable("HTTP 503")]);
    // A backoff far longer than the test: only the cancel can end it.
    let policy = ModelPolicy::default().backoff(Duration::from_secs(600), Duration::from_secs(600));
    let agent = Agent::new(model.clone()).model_policy(policy);
    let (store, watcher) = (db.open(), db.open());

    let outcome = with_system(|| async move {
        let supervisor = supervise(store, Config::default(), "a", agent);
        let call = supervisor.send(StartRun::new("a", json!("hello")).with_id("run-1"));
        let call = actix_rt::spawn(call);
        // Waits until the failed attempt is in the log: the loop is in its backoff.
        let failed = |events: Vec<Event>| {
            events
                .iter()
                .any(|e| e.kind == EventKind::ModelAttemptFailed)
        };
        // Before the run's insert commits it is not found: no events yet.
        while !failed(watcher.events(&RunId::from("run-1")).unwrap_or_default()) {
            actix_rt::time::sleep(Duration::from_millis(5)).await;
        }
        supervisor
            .send(CancelRun::new("run-1", "no longer needed"))
            .await
            .unwrap()
            .unwrap();
        // A cancel that did not end the backoff fails here, rather than wait it out.
        let reply = actix_rt::time::timeout(Duration::from_secs(60), call).await;
        reply
            .expect("the cancel ended the backoff")
            .unwrap()
            .unwrap()
            .unwrap()
            .outcome
    });

    assert_eq!(
        outcome,
        Outcome::Cancelled {
            reason: "no longer needed".into()
        }
    );
    assert_eq!(model.calls(), 1, "no attempt after the cancel");
    let store = db.open();
    assert_eq!(
        summary(&model_events(&store)),
        [
            (EventKind::ModelStarted, 1),
            (EventKind::ModelAttemptFailed, 1)
        ]
    );
}

#[test]
fn a_retry_after_longer_than_the_policy_allows_fails_the_run() {
    let db = TempStore::new();
    let model = ScriptedModel::new(vec![ModelResponse::answer("never")]).failing_at_turn(
        0,
        vec![ModelError::retryable("HTTP 429").retry_after(Duration::from_secs(3600))],
    );
    let agent = Agent::new(model.clone()).model_policy(quick_policy());

    let outcome = run(&db, agent);

    assert_eq!(
        outcome,
        Outcome::Failed {
            error: "the model failed: HTTP 429 (the server asked to wait 3600 s, longer than \
                    the policy's 60 s)"
                .into()
        }
    );
    assert_eq!(model.calls(), 1);
}
