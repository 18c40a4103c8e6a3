//! Bad input gets a clear error and loses nothing.

use agentrt::{
    Agent, Config, Error, EventKind, ModelError, ModelResponse, Outcome, ResumeRun, RunId,
    RunState, SCHEMA_VERSION, StartRun, Store, Supervisor, ToolCall, ToolResult,
    testkit::{Behaviour, RecordingTool, ScriptedModel, TempStore, with_system},
};
use serde_json::json;

use crate::support::{ask, call_then_answer, crash_when, results_seen};

fn lookup_then_answer() -> ScriptedModel {
    call_then_answer("c1", "lookup", json!({"id": 1}), "ok")
}

/// Starts `agent` registered as "a" with `msg`; returns the reply.
fn start(store: Store, agent: Agent, msg: StartRun) -> agentrt::Result<agentrt::RunReply> {
    ask(store, Config::default(), "a", agent, msg)
}

fn resume(store: Store, agent: Option<Agent>, run_id: &str) -> agentrt::Result<agentrt::RunReply> {
    let run_id = RunId::from(run_id);
    with_system(|| async move {
        let mut builder = Supervisor::builder(store);
        if let Some(agent) = agent {
            builder = builder.agent("a", agent);
        }
        builder
            .start()
            .unwrap()
            .send(ResumeRun::new(run_id))
            .await
            .unwrap()
    })
}

#[test]
fn unknown_run_ids_are_not_found() {
    let db = TempStore::new();
    let store = db.open();
    let missing = RunId::from("missing");
    assert!(matches!(store.run(&missing), Err(Error::RunNotFound(_))));
    assert!(matches!(store.events(&missing), Err(Error::RunNotFound(_))));
    assert!(matches!(
        store.pending_calls(&missing),
        Err(Error::RunNotFound(_))
    ));
    let err = resume(db.open(), Some(Agent::new(lookup_then_answer())), "missing").unwrap_err();
    assert!(err.is_not_found(), "{err}");
    assert!(
        err.to_string().contains("missing"),
        "the message names the id: {err}"
    );
    assert!(store.runs(None).unwrap().is_empty());
}

#[test]
fn starting_an_unknown_agent_is_refused_and_writes_nothing() {
    let db = TempStore::new();
    let err = with_system(|| {
        let store = db.open();
        async move {
            Supervisor::builder(store)
                .start()
                .unwrap()
                .send(StartRun::new("ghost", json!({})))
                .await
                .unwrap()
        }
    })
    .unwrap_err();
    assert!(
        matches!(&err, Error::UnknownAgent(name) if name == "ghost"),
        "{err}"
    );
    assert!(err.to_string().contains("ghost"));
    assert!(db.open().runs(None).unwrap().is_empty());
}

#[test]
fn resuming_a_run_whose_agent_is_not_registered_is_refused_and_leaves_it_untouched() {
    let db = TempStore::new();
    let tool = RecordingTool::new("lookup").behaviour(Behaviour::Block);
    let agent = Agent::new(lookup_then_answer()).tool(tool.clone());
    let start = StartRun::new("a", json!({})).with_id("r1");
    crash_when(
        db.open(),
        Config::default(),
        "a",
        agent,
        start,
        tool.wait_executions(1),
    );
    let before = db.open().events(&RunId::from("r1")).unwrap();

    let err = resume(db.open(), None, "r1").unwrap_err();

    assert!(
        matches!(&err, Error::UnknownAgent(name) if name == "a"),
        "{err}"
    );
    assert_eq!(db.open().events(&RunId::from("r1")).unwrap(), before);
    assert_eq!(
        db.open().run(&RunId::from("r1")).unwrap().state,
        RunState::Running
    );
}

#[test]
fn a_second_start_with_an_existing_id_is_a_state_error_and_writes_nothing() {
    let db = TempStore::new();
    let first = start(
        db.open(),
        Agent::new(lookup_then_answer()).tool(RecordingTool::new("lookup")),
        StartRun::new("a", json!({"n": 1})).with_id("r1"),
    );
    assert!(matches!(first.unwrap().outcome, Outcome::Succeeded { .. }));
    let before = db.open().events(&RunId::from("r1")).unwrap();

    let tool = RecordingTool::new("lookup");
    let err = start(
        db.open(),
        Agent::new(lookup_then_answer()).tool(tool.clone()),
        StartRun::new("a", json!({"n": 2})).with_id("r1"),
    )
    .unwrap_err();

    assert!(matches!(err, Error::RunExists(_)), "{err}");
    assert!(err.is_run_state());
    assert!(tool.executions().is_empty());
    assert_eq!(db.open().events(&RunId::from("r1")).unwrap(), before);
    assert_eq!(
        db.open().run(&RunId::from("r1")).unwrap().input,
        json!({"n": 1})
    );
}

#[test]
fn resuming_a_finished_run_is_a_state_error() {
    let db = TempStore::new();
    let agent = || Agent::new(lookup_then_answer()).tool(RecordingTool::new("lookup"));
    start(
        db.open(),
        agent(),
        StartRun::new("a", json!({})).with_id("r1"),
    )
    .unwrap();
    let err = resume(db.open(), Some(agent()), "r1").unwrap_err();
    assert!(
        matches!(
            &err,
            Error::RunState {
                state: RunState::Succeeded,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn a_model_asking_for_a_tool_the_agent_lacks_gets_a_failed_result() {
    let db = TempStore::new();
    let model = ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new("c1", "rm_rf", json!({"path": "/"}))]),
        ModelResponse::answer("ok"),
    ]);
    let reply = start(
        db.open(),
        Agent::new(model.clone()),
        StartRun::new("a", json!({})),
    )
    .unwrap();
    assert_eq!(
        reply.outcome,
        Outcome::Succeeded {
            output: "ok".into()
        }
    );
    let results = results_seen(&model);
    let [ToolResult::Error(error)] = results.as_slice() else {
        panic!("{results:?}")
    };
    assert!(error.contains("no tool named \"rm_rf\""), "{error}");
    let events = db.open().events(&reply.run_id).unwrap();
    let finished = events
        .iter()
        .find(|e| e.kind == EventKind::ToolFinished)
        .unwrap();
    assert_eq!(finished.payload["rejected"], json!(true));
    assert!(!events.iter().any(|e| e.kind == EventKind::ToolStarted));
}

#[test]
fn tool_arguments_that_are_not_a_json_object_are_rejected() {
    let db = TempStore::new();
    let tool = RecordingTool::new("lookup");
    let model = ScriptedModel::new(vec![
        ModelResponse::calls(vec![
            ToolCall::new("c1", "lookup", json!("id=1")),
            ToolCall::new("c2", "lookup", json!([1, 2])),
        ]),
        ModelResponse::answer("ok"),
    ]);
    let reply = start(
        db.open(),
        Agent::new(model.clone()).tool(tool.clone()),
        StartRun::new("a", json!({})),
    )
    .unwrap();
    assert_eq!(
        reply.outcome,
        Outcome::Succeeded {
            output: "ok".into()
        }
    );
    assert!(tool.executions().is_empty());
    let results = results_seen(&model);
    assert_eq!(results.len(), 2);
    assert!(
        results
            .iter()
            .all(|r| matches!(r, ToolResult::Error(e) if e.contains("must be a JSON object")))
    );
}

#[test]
fn a_tool_error_is_a_result_the_model_sees() {
    let db = TempStore::new();
    let model = lookup_then_answer();
    let tool = RecordingTool::new("lookup").behaviour(Behaviour::Fail("upstream 503".into()));
    let reply = start(
        db.open(),
        Agent::new(model.clone()).tool(tool),
        StartRun::new("a", json!({})),
    )
    .unwrap();
    assert_eq!(
        reply.outcome,
        Outcome::Succeeded {
            output: "ok".into()
        }
    );
    assert_eq!(
        results_seen(&model),
        [ToolResult::Error("upstream 503".into())]
    );
}

#[test]
fn a_model_error_fails_the_run_with_the_error_recorded() {
    let db = TempStore::new();
    let model = ScriptedModel::with_results(vec![Err(ModelError::new("rate limited"))]);
    let reply = start(db.open(), Agent::new(model), StartRun::new("a", json!({}))).unwrap();
    let Outcome::Failed { error } = &reply.outcome else {
        panic!("{:?}", reply.outcome)
    };
    assert!(error.contains("rate limited"));
    let store = db.open();
    assert_eq!(store.run(&reply.run_id).unwrap().state, RunState::Failed);
    let last = store.events(&reply.run_id).unwrap().pop().unwrap();
    assert_eq!(last.kind, EventKind::RunFinished);
    assert!(
        last.payload["error"]
            .as_str()
            .unwrap()
            .contains("rate limited")
    );
}

#[test]
fn a_run_that_reaches_its_step_limit_fails() {
    let db = TempStore::new();
    let call = || ModelResponse::calls(vec![ToolCall::new("", "lookup", json!({}))]);
    let model = ScriptedModel::new(vec![call(), call(), call(), call()]);
    let tool = RecordingTool::new("lookup");
    let agent = Agent::new(model).tool(tool.clone()).max_steps(4);
    let reply = start(db.open(), agent, StartRun::new("a", json!({}))).unwrap();
    let Outcome::Failed { error } = &reply.outcome else {
        panic!("{:?}", reply.outcome)
    };
    assert!(error.contains("limit of 4 steps"), "{error}");
    assert_eq!(tool.executions().len(), 2);
    // Empty call ids were made unique.
    let ids: Vec<String> = tool.executions().into_iter().map(|e| e.call_id).collect();
    assert_eq!(ids, ["call-2", "call-4"]);
}

#[test]
fn repeated_and_empty_call_ids_are_made_unique_within_the_run() {
    let db = TempStore::new();
    let model = ScriptedModel::new(vec![
        // Step 2 keeps its id; step 3 repeats it; step 4 has none, and `call-4` is taken.
        ModelResponse::calls(vec![
            ToolCall::new("call-4", "lookup", json!({})),
            ToolCall::new("call-4", "lookup", json!({})),
            ToolCall::new("", "lookup", json!({})),
        ]),
        // Step 6 repeats an id of an earlier step.
        ModelResponse::calls(vec![ToolCall::new("call-3", "lookup", json!({}))]),
        ModelResponse::answer("done"),
    ]);
    let tool = RecordingTool::new("lookup");
    let agent = Agent::new(model).tool(tool.clone());
    let reply = start(db.open(), agent, StartRun::new("a", json!({}))).unwrap();
    assert!(matches!(reply.outcome, Outcome::Succeeded { .. }));
    let ids: Vec<String> = tool.executions().into_iter().map(|e| e.call_id).collect();
    assert_eq!(ids, ["call-4", "call-3", "call-4-2", "call-6"]);
    // The stored answer carries the ids as made unique.
    let store = db.open();
    let answer = store
        .events(&reply.run_id)
        .unwrap()
        .into_iter()
        .find(|e| e.kind == EventKind::ModelFinished)
        .unwrap();
    let stored: Vec<&str> = answer.payload["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|call| call["id"].as_str().unwrap())
        .collect();
    assert_eq!(stored, ["call-4", "call-3", "call-4-2"]);
}

#[test]
fn a_panicking_tool_ends_the_call_with_an_error_and_the_step_stays_in_flight() {
    let db = TempStore::new();
    let tool = RecordingTool::new("lookup").behaviour(Behaviour::Panic);
    let err = start(
        db.open(),
        Agent::new(lookup_then_answer()).tool(tool.clone()),
        StartRun::new("a", json!({})).with_id("r1"),
    )
    .unwrap_err();
    assert!(matches!(&err, Error::Panicked { step: 2, .. }), "{err}");
    let store = db.open();
    assert_eq!(
        store.run(&RunId::from("r1")).unwrap().state,
        RunState::Running
    );
    assert_eq!(
        store
            .events(&RunId::from("r1"))
            .unwrap()
            .pop()
            .unwrap()
            .kind,
        EventKind::ToolStarted
    );

    // A resume reconciles it like any interrupted call.
    tool.set_behaviour(Behaviour::Succeed);
    let reply = resume(
        db.open(),
        Some(Agent::new(lookup_then_answer()).tool(tool.clone())),
        "r1",
    )
    .unwrap();
    assert!(
        matches!(reply.outcome, Outcome::WaitingForApproval { .. }),
        "not idempotent, no hook"
    );
}

#[test]
fn a_file_that_is_not_a_database_is_refused_and_left_unchanged() {
    let db = TempStore::new();
    let bytes: Vec<u8> = (0..8192u32).map(|i| (i * 31 % 251) as u8).collect();
    std::fs::write(db.path(), &bytes).unwrap();

    let err = Store::open(db.path()).unwrap_err();

    assert!(matches!(err, Error::NotADatabase { .. }), "{err}");
    assert!(err.to_string().contains("not an SQLite database"), "{err}");
    assert_eq!(std::fs::read(db.path()).unwrap(), bytes);
}

#[test]
fn a_database_from_a_newer_version_is_refused_and_left_unchanged() {
    let db = TempStore::new();
    {
        let conn = rusqlite::Connection::open(db.path()).unwrap();
        conn.execute_batch("CREATE TABLE from_the_future (x); PRAGMA user_version = 99;")
            .unwrap();
    }
    let bytes = std::fs::read(db.path()).unwrap();

    let err = Store::open(db.path()).unwrap_err();

    assert!(
        matches!(err, Error::SchemaTooNew { found: 99, supported, .. } if supported == SCHEMA_VERSION),
        "{err}"
    );
    assert!(err.to_string().contains("newer"), "{err}");
    assert_eq!(std::fs::read(db.path()).unwrap(), bytes);
    assert!(!db.dir().join("agentrt.db-wal").exists());
}

#[test]
fn a_database_reopened_by_the_same_version_keeps_its_runs() {
    let db = TempStore::new();
    let reply = start(
        db.open(),
        Agent::new(lookup_then_answer()).tool(RecordingTool::new("lookup")),
        StartRun::new("a", json!({})),
    )
    .unwrap();
    let store = db.open();
    assert_eq!(store.schema_version().unwrap(), SCHEMA_VERSION);
    assert_eq!(store.runs(Some(RunState::Succeeded)).unwrap().len(), 1);
    assert!(store.runs(Some(RunState::Running)).unwrap().is_empty());
    assert_eq!(store.run(&reply.run_id).unwrap().state, RunState::Succeeded);
}

#[test]
fn events_after_a_seq_past_the_largest_a_store_holds_are_refused_not_wrapped_round() {
    let db = TempStore::new();
    start(
        db.open(),
        Agent::new(lookup_then_answer()).tool(RecordingTool::new("lookup")),
        StartRun::new("a", json!({})).with_id("r1"),
    )
    .unwrap();
    let store = db.open();
    let r1 = RunId::from("r1");
    assert!(!store.events(&r1).unwrap().is_empty());
    assert!(store.events_after(&r1, i64::MAX as u64).unwrap().is_empty());
    for after in [i64::MAX as u64 + 1, u64::MAX] {
        let err = store.events_after(&r1, after).unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)), "{err:?}");
        assert!(err.to_string().contains("9223372036854775807"), "{err}");
    }
}
