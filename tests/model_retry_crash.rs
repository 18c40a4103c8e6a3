//! A supervisor crashes (its actix system goes away, with no further write) in the middle of a
//! model call's retries; a fresh supervisor resumes the run: every attempt is in the log as it
//! happened, the model is asked again, and no tool runs twice.

use std::time::Duration;

use agentrt::{
    Agent, Config, EventKind, ModelError, ModelPolicy, ModelResponse, Outcome, RunId, StartRun,
    Supervisor, ToolCall,
    testkit::{RecordingTool, ScriptedModel, TempStore, resume_when_free, with_system},
};
use serde_json::json;

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
        ModelPolicy::default().backoff(Duration::from_millis(5), Duration::from_millis(20)),
    )
}

/// A short TTL: the crashed supervisor's run is free again quickly.
fn fast_lease() -> Config {
    Config::default().lease_ttl(Duration::from_millis(300))
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
    let (store, agent_a, watched) = (db.open(), agent(&flaky, &charge), flaky.clone());
    with_system(|| async move {
        let supervisor = Supervisor::builder(store)
            .config(fast_lease())
            .agent("billing", agent_a)
            .start()
            .unwrap();
        actix_rt::spawn(supervisor.send(StartRun::new("billing", json!({})).with_id("run-1")));
        watched.wait_calls(3).await;
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
    let (store_b, agent_b, id) = (db.open(), agent(&steady, &charge), run_id.clone());
    let reply = with_system(|| async move {
        let supervisor = Supervisor::builder(store_b)
            .config(fast_lease())
            .agent("billing", agent_b)
            .start()
            .unwrap();
        resume_when_free(&supervisor, &id, Duration::from_secs(10)).await
    })
    .unwrap();

    assert_eq!(
        reply.outcome,
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
