//! An operator's cancel: no executor needed; a tool running at that moment still has its
//! outcome recorded, late, after `run.finished`.

use actix::Addr;
use agentrt::{
    Agent, CancelRun, Config, Error, EventKind, ModelResponse, Outcome, RequireApprovalFor, RunId,
    RunReply, RunState, StartRun, Store, Supervisor, ToolCall,
    testkit::{Behaviour, CountingClock, RecordingTool, ScriptedModel, TempStore, with_system},
};
use serde_json::json;

use crate::support::supervise;

fn deploy_then_answer() -> ScriptedModel {
    ScriptedModel::new(vec![
        ModelResponse::calls(vec![
            ToolCall::new("deploy-1", "deploy", json!({"service": "api"})),
            ToolCall::new("deploy-2", "deploy", json!({"service": "web"})),
        ]),
        ModelResponse::answer("deployed"),
    ])
}

/// Starts run `run-1` of `agent` on a new supervisor and returns once `tool` is executing,
/// with the pending call.
async fn start_until_the_tool_runs(
    store: Store,
    config: Config,
    agent: Agent,
    tool: &RecordingTool,
) -> (
    Addr<Supervisor>,
    tokio::task::JoinHandle<Result<agentrt::Result<RunReply>, actix::MailboxError>>,
) {
    let supervisor = supervise(store, config, "ops", agent);
    let call = actix_rt::spawn(supervisor.send(StartRun::new("ops", json!({})).with_id("run-1")));
    tool.wait_executions(1).await;
    (supervisor, call)
}

#[test]
fn cancel_while_a_tool_runs_records_its_outcome_late_and_runs_nothing_more() {
    let db = TempStore::new();
    let model = deploy_then_answer();
    let deploy = RecordingTool::new("deploy").behaviour(Behaviour::Block);
    let (store, agent, running) = (
        db.open(),
        Agent::new(model.clone()).tool(deploy.clone()),
        deploy.clone(),
    );
    let clock = CountingClock::default();
    let config = Config::default().clock(clock.clone());
    let reply = with_system(|| async move {
        let (supervisor, call) = start_until_the_tool_runs(store, config, agent, &running).await;
        supervisor
            .send(CancelRun::new("run-1", "change freeze"))
            .await
            .unwrap()
            .unwrap();
        call.await.unwrap().unwrap()
    })
    .unwrap();

    assert_eq!(
        reply.outcome,
        Outcome::Cancelled {
            reason: "change freeze".into()
        }
    );
    assert_eq!(
        deploy.executions().len(),
        1,
        "the second deploy never started"
    );
    let store = db.open();
    let run = store.run(&RunId::from("run-1")).unwrap();
    assert_eq!(run.state, RunState::Cancelled);
    assert_eq!(run.error.as_deref(), Some("change freeze"));
    let events = store.events(&run.id).unwrap();
    let tail: Vec<EventKind> = events.iter().rev().take(2).rev().map(|e| e.kind).collect();
    assert_eq!(tail, [EventKind::RunFinished, EventKind::ToolFinished]);
    let late = events.last().unwrap();
    assert_eq!(late.payload["late"], json!(true));
    assert_eq!(late.payload["call_id"], json!("deploy-1"));
    assert!(
        late.payload["error"]
            .as_str()
            .unwrap()
            .contains("cancellation signal"),
        "the tool honoured the signal"
    );
    assert_eq!(
        events[events.len() - 2].payload["state"],
        json!("CANCELLED")
    );
    assert_eq!(model.calls(), 1);
    // One reading per committed move: the insert, the reservation, the answer, the decision
    // with its start, the cancel, the late outcome. Nothing is attempted after the late one.
    assert_eq!(clock.reads(), 6);
}

/// Starts run `run-1` of `agent`, cancels it as the CLI does while `tool` executes (through
/// another connection: the supervisor's loop is not told, its next write finds out), lets the
/// tool return, and returns the call's reply.
fn cancel_from_another_process(
    db: &TempStore,
    config: Config,
    agent: Agent,
    tool: &RecordingTool,
) -> RunReply {
    let (store, operator_store, running) = (db.open(), db.open(), tool.clone());
    with_system(|| async move {
        let (_supervisor, call) = start_until_the_tool_runs(store, config, agent, &running).await;
        operator_store
            .cancel(&RunId::from("run-1"), "change freeze")
            .unwrap();
        running.release();
        call.await.unwrap().unwrap()
    })
    .unwrap()
}

#[test]
fn a_cancel_from_another_process_is_learnt_at_the_outcome_and_nothing_follows_it() {
    let db = TempStore::new();
    let deploy = RecordingTool::new("deploy").behaviour(Behaviour::BlockIgnoringCancel);
    let agent = Agent::new(deploy_then_answer()).tool(deploy.clone());
    let clock = CountingClock::default();
    let config = Config::default().clock(clock.clone());
    let reply = cancel_from_another_process(&db, config, agent, &deploy);
    assert!(matches!(reply.outcome, Outcome::Cancelled { .. }));
    assert_eq!(deploy.executions().len(), 1);
    let events = db.open().events(&RunId::from("run-1")).unwrap();
    let last = events.last().unwrap();
    assert_eq!(
        (last.kind, last.payload["late"].clone()),
        (EventKind::ToolFinished, json!(true))
    );
    // The decision on deploy-2, planned to commit with the outcome, was not recorded. (A
    // writer that pipelines may have applied it in a transaction it then rolled back, so the
    // proof is what was written, not the clock readings of the moves attempted.)
    assert!(
        !events
            .iter()
            .any(|event| event.kind == EventKind::PolicyDecided
                && event.payload["call_id"] == json!("deploy-2")),
        "nothing was decided after the late outcome"
    );
    // The insert, the reservation, the answer, the decision with its start, the late outcome
    // (the CLI's cancel is stamped by the system clock), and the decision planned with the
    // outcome: the writer read the clock for it in the transaction it then rolled back, as the
    // outcome's guard is sent with the pair's writes, not before them.
    assert_eq!(clock.reads(), 6);
}

#[test]
fn cancel_of_a_waiting_run_needs_no_executor() {
    let db = TempStore::new();
    let deploy = RecordingTool::new("deploy");
    let agent = Agent::new(deploy_then_answer())
        .tool(deploy.clone())
        .policy(RequireApprovalFor::tools(["deploy"]));
    let (store, operator_store) = (db.open(), db.open());
    let (waiting, cancelled, again) = with_system(|| async move {
        let supervisor = supervise(store, Config::default(), "ops", agent);
        let waiting = supervisor
            .send(StartRun::new("ops", json!({})).with_id("run-1"))
            .await
            .unwrap()
            .unwrap();
        // Another supervisor, executing nothing, cancels it.
        let operator = Supervisor::builder(operator_store).start().unwrap();
        let cancelled = operator
            .send(CancelRun::new("run-1", "not needed"))
            .await
            .unwrap();
        let again = operator
            .send(CancelRun::new("run-1", "twice"))
            .await
            .unwrap();
        (waiting, cancelled, again)
    });
    assert!(matches!(
        waiting.outcome,
        Outcome::WaitingForApproval { .. }
    ));
    cancelled.unwrap();
    let again = again.unwrap_err();
    assert!(again.is_run_state(), "{again}");
    let store = db.open();
    assert_eq!(
        store.run(&waiting.run_id).unwrap().state,
        RunState::Cancelled
    );
    assert!(store.pending_calls(&waiting.run_id).unwrap().is_empty());
    assert!(deploy.executions().is_empty());
}

#[test]
fn cancel_of_an_unknown_run_is_not_found() {
    let db = TempStore::new();
    let store = db.open();
    let err = with_system(|| async move {
        let supervisor = Supervisor::builder(store).start().unwrap();
        supervisor
            .send(CancelRun::new("missing", "why not"))
            .await
            .unwrap()
    })
    .unwrap_err();
    assert!(matches!(err, Error::RunNotFound(_)), "{err}");
    assert!(err.is_not_found());
}

#[test]
fn a_cancel_found_as_the_last_calls_outcome_commits_calls_the_model_no_more() {
    let db = TempStore::new();
    let deploy = RecordingTool::new("deploy").behaviour(Behaviour::BlockIgnoringCancel);
    let model = ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new("deploy-1", "deploy", json!({}))]),
        ModelResponse::answer("deployed"),
    ]);
    let agent = Agent::new(model.clone()).tool(deploy.clone());
    let reply = cancel_from_another_process(&db, Config::default(), agent, &deploy);

    assert_eq!(
        reply.outcome,
        Outcome::Cancelled {
            reason: "change freeze".into()
        }
    );
    // The outcome's commit would have reserved the next model call, and the loop waits for
    // that commit to be written (not synced) before it calls: the outcome came late, so the
    // reservation was not attempted and the model not called again.
    assert_eq!(model.calls(), 1);
    let events = db.open().events(&RunId::from("run-1")).unwrap();
    let kinds: Vec<EventKind> = events.iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        [
            EventKind::RunStarted,
            EventKind::ModelStarted,
            EventKind::ModelFinished,
            EventKind::PolicyDecided,
            EventKind::ToolStarted,
            EventKind::RunFinished,
            EventKind::ToolFinished,
        ]
    );
    assert_eq!(events.last().unwrap().payload["late"], json!(true));
    let run = db.open().run(&RunId::from("run-1")).unwrap();
    assert_eq!(run.state, RunState::Cancelled);
}
