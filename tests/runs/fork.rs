//! Forking a run: a new run from another's history before a step, whose model is asked again
//! there. Completed tool calls are copied, never run again; the origin is only read.

use agentrt::{
    Agent, ChatMessage, Config, Error, Event, EventKind, ForkRun, ModelError, ModelResponse,
    Outcome, ResumeRun, RunId, RunState, StartRun, Supervisor, ToolCall,
    testkit::{
        Behaviour, ReconcileHook, RecordingTool, ScriptedModel, TempStore, assert_no_run_leased,
        with_system,
    },
};
use serde_json::{Value, json};

use crate::support::{PATIENCE, ask, crash_in_tool, fast_lease, kinds, resume_when_free_on};

fn lookup(id: &str, n: u32) -> ToolCall {
    ToolCall::new(id, "lookup", json!({ "n": n }))
}

/// Sends `msg` to a new supervisor over `db` executing agent `ops`, and returns its answer.
fn call<M>(db: &TempStore, agent: Agent, msg: M) -> agentrt::Result<agentrt::RunReply>
where
    M: actix::Message<Result = agentrt::Result<agentrt::RunReply>> + Send + 'static,
    Supervisor: actix::Handler<M>,
{
    ask(db.open(), Config::default(), "ops", agent, msg)
}

/// The copies of a fork's log: each event saying where it came from.
fn copied_from(event: &Event) -> Option<(String, u64)> {
    let from = event.payload.get("copied_from")?;
    Some((
        from["run_id"].as_str().unwrap().to_owned(),
        from["seq"].as_u64().unwrap(),
    ))
}

/// Every row the database holds of `run_id`, as its backend stores it.
fn rows(db: &TempStore, run_id: &str) -> Vec<String> {
    db.rows_of(run_id)
        .into_iter()
        .flat_map(|(table, rows)| rows.into_iter().map(move |row| format!("{table}: {row}")))
        .collect()
}

/// Run `origin`: the model asks for `lookup` (step 2), then fails for good at step 3.
fn failed_at_step_3(db: &TempStore, tool: &RecordingTool) -> RunId {
    let model = ScriptedModel::with_results(vec![
        Ok(ModelResponse::calls(vec![lookup("c1", 1)])),
        Err(ModelError::fatal("the model is down")),
    ]);
    let reply = call(
        db,
        Agent::new(model).tool(tool.clone()),
        StartRun::new("ops", json!({"ticket": 7})).with_id("origin"),
    )
    .unwrap();
    assert!(matches!(reply.outcome, Outcome::Failed { .. }), "{reply:?}");
    RunId::from("origin")
}

#[test]
fn a_failed_run_forked_at_its_failed_step_succeeds_and_its_tool_does_not_run_again() {
    let db = TempStore::new();
    let tool = RecordingTool::new("lookup");
    let origin = failed_at_step_3(&db, &tool);
    assert_eq!(tool.executions().len(), 1);
    let store = db.open();
    let origin_events = store.events(&origin).unwrap();

    let forked = store.fork(&origin, 3, Some(RunId::from("retry"))).unwrap();
    assert_eq!(forked, RunId::from("retry"));
    assert_eq!(store.run(&forked).unwrap().state, RunState::Running);
    assert_eq!(store.lease(&forked).unwrap(), None, "written, not executed");

    // The same script, but the model now answers at step 3.
    let model = ScriptedModel::new(vec![
        ModelResponse::calls(vec![lookup("c1", 1)]),
        ModelResponse::answer("found it"),
    ]);
    let agent = Agent::new(model.clone()).tool(tool.clone());
    let reply = call(&db, agent, ResumeRun::new("retry")).unwrap();
    assert_eq!(
        reply.outcome,
        Outcome::Succeeded {
            output: "found it".into()
        }
    );
    assert_eq!(tool.executions().len(), 1, "the lookup of step 2 ran once");
    let asked = model.requests();
    assert_eq!(asked.len(), 1, "asked once, at step 3");
    assert_eq!((asked[0].step, asked[0].attempt), (3, 1));

    let events = store.events(&forked).unwrap();
    assert_eq!(
        kinds(&events),
        [
            EventKind::RunStarted,
            EventKind::RunForked,
            EventKind::ModelStarted,
            EventKind::ModelFinished,
            EventKind::PolicyDecided,
            EventKind::ToolStarted,
            EventKind::ToolFinished,
            EventKind::RunResumed,
            EventKind::ModelStarted,
            EventKind::ModelFinished,
            EventKind::RunFinished,
        ]
    );
    assert_eq!(
        events[0].payload["forked_from"],
        json!({"run_id": "origin", "at": 3})
    );
    assert_eq!(
        events[1].payload,
        json!({"origin": "origin", "at": 3, "steps_copied": 2})
    );
    // Copies of the origin's seq 2 to 6, in order; the failed step 3 and the run's end are
    // not copied; nothing after them is a copy.
    let copies: Vec<_> = events.iter().filter_map(copied_from).collect();
    let expected: Vec<_> = (2..=6).map(|seq| ("origin".to_owned(), seq)).collect();
    assert_eq!(copies, expected);
    for event in &events[2..7] {
        let (_, seq) = copied_from(event).unwrap();
        let original = &origin_events[seq as usize - 1];
        assert_eq!((event.kind, event.step), (original.kind, original.step));
    }
    assert!(events[7..].iter().all(|e| copied_from(e).is_none()));
    assert_eq!(events[7].payload["fencing_token"], json!(1));
    // What the fork used is its own model call only.
    assert_eq!(store.usage(&forked).unwrap().attempts, 1);
    assert_no_run_leased(&store);
}

/// Run `origin`: lookups at steps 2 and 4, asked for at steps 1 and 3, and an answer at 5.
fn two_lookups_then_an_answer() -> ScriptedModel {
    ScriptedModel::new(vec![
        ModelResponse::calls(vec![lookup("c1", 1)]),
        ModelResponse::calls(vec![lookup("c2", 2)]),
        ModelResponse::answer("first answer"),
    ])
}

#[test]
fn a_succeeded_run_forked_at_an_earlier_model_step_shows_the_model_the_copied_history() {
    let db = TempStore::new();
    let tool = RecordingTool::new("lookup");
    let first = two_lookups_then_an_answer();
    call(
        &db,
        Agent::new(first.clone()).tool(tool.clone()),
        StartRun::new("ops", json!({"ticket": 7})).with_id("origin"),
    )
    .unwrap();
    assert_eq!(tool.executions().len(), 2);

    // The model answers otherwise at step 3: at once, without the second lookup.
    let other = ScriptedModel::new(vec![
        ModelResponse::calls(vec![lookup("c1", 1)]),
        ModelResponse::answer("another answer"),
    ]);
    let reply = call(
        &db,
        Agent::new(other.clone()).tool(tool.clone()),
        ForkRun::new("origin", 3).with_id("what-if"),
    )
    .unwrap();
    assert_eq!(reply.run_id, RunId::from("what-if"));
    assert_eq!(
        reply.outcome,
        Outcome::Succeeded {
            output: "another answer".into()
        }
    );
    assert_eq!(tool.executions().len(), 2, "nothing ran again");
    // The model was given, at step 3, the conversation the origin's model was given there.
    assert_eq!(other.requests()[0].step, 3);
    assert_eq!(other.seen(), [first.seen()[1].clone()]);
    let history = &other.seen()[0];
    assert!(
        history.iter().any(|m| matches!(
            m,
            ChatMessage::Tool { call_id, .. } if call_id == "c1"
        )),
        "{history:?}"
    );
    let store = db.open();
    let run = store.run(&RunId::from("what-if")).unwrap();
    assert_eq!(
        (run.agent.as_str(), &run.input),
        ("ops", &json!({"ticket": 7}))
    );
    assert_eq!(
        store.run(&RunId::from("origin")).unwrap().output.as_deref(),
        Some("first answer")
    );
    assert_no_run_leased(&store);
}

#[test]
fn refused_forks_write_nothing() {
    let db = TempStore::new();
    let tool = RecordingTool::new("lookup");
    call(
        &db,
        Agent::new(two_lookups_then_an_answer()).tool(tool.clone()),
        StartRun::new("ops", json!({})).with_id("origin"),
    )
    .unwrap();
    // A run left mid-tool (step 2 in flight) by a supervisor that crashed.
    let blocked = RecordingTool::new("lookup").behaviour(Behaviour::Block);
    let agent = Agent::new(two_lookups_then_an_answer()).tool(blocked.clone());
    let start = StartRun::new("ops", json!({})).with_id("busy");
    crash_in_tool(&db, "ops", agent, start, &blocked);
    let store = db.open();
    let before = ["origin", "busy"].map(|id| rows(&db, id));
    let invalid = |err: &Error, what: &str| {
        matches!(err, Error::InvalidInput(_)) && err.to_string().contains(what)
    };

    let err = store.fork(&RunId::from("nope"), 1, None).unwrap_err();
    assert!(
        matches!(&err, Error::RunNotFound(id) if id.as_str() == "nope"),
        "{err}"
    );
    let err = store.fork(&RunId::from("origin"), 0, None).unwrap_err();
    assert!(invalid(&err, "numbered from 1"), "{err}");
    let err = store.fork(&RunId::from("origin"), 2, None).unwrap_err();
    assert!(
        invalid(&err, "step 2 of run origin is a tool call"),
        "{err}"
    );
    let err = store.fork(&RunId::from("origin"), 7, None).unwrap_err();
    assert!(invalid(&err, "run origin has 5 steps"), "{err}");
    let existing = Some(RunId::from("busy"));
    let err = store.fork(&RunId::from("origin"), 1, existing).unwrap_err();
    assert!(
        matches!(&err, Error::RunExists(id) if id.as_str() == "busy"),
        "{err}"
    );
    let err = store.fork(&RunId::from("busy"), 3, None).unwrap_err();
    assert!(err.is_run_state(), "{err}");
    assert!(err.to_string().contains("step 2 is in_flight"), "{err}");
    // Through a supervisor: the same refusals, and an agent it does not have.
    let err = call(
        &db,
        Agent::new(ScriptedModel::new(vec![])),
        ForkRun::new("origin", 2),
    )
    .unwrap_err();
    assert!(invalid(&err, "tool call"), "{err}");
    let stranger = Supervisor::builder(db.open());
    let unknown = with_system(|| async move {
        let supervisor = stranger
            .agent("other", Agent::new(ScriptedModel::new(vec![])))
            .start()
            .unwrap();
        supervisor
            .send(ForkRun::new("origin", 1).with_id("x"))
            .await
            .unwrap()
    })
    .unwrap_err();
    assert!(
        matches!(&unknown, Error::UnknownAgent(name) if name == "ops"),
        "{unknown}"
    );

    assert_eq!(store.runs(None).unwrap().len(), 2, "no run was added");
    assert_eq!(["origin", "busy"].map(|id| rows(&db, id)), before);
}

#[test]
fn the_origin_is_byte_for_byte_unchanged_by_a_fork_and_its_execution() {
    let db = TempStore::new();
    let tool = RecordingTool::new("lookup");
    let origin = failed_at_step_3(&db, &tool);
    let before = rows(&db, origin.as_str());
    assert!(before.len() > 3);

    let model = ScriptedModel::new(vec![
        ModelResponse::calls(vec![lookup("c1", 1)]),
        ModelResponse::answer("done"),
    ]);
    let agent = Agent::new(model).tool(tool.clone());
    let reply = call(&db, agent, ForkRun::new(origin.as_str(), 3)).unwrap();
    assert_ne!(reply.run_id, origin);
    assert!(matches!(reply.outcome, Outcome::Succeeded { .. }));
    // Forking at the step after the last keeps every step, the failed one included.
    let kept = db.open().fork(&origin, 4, None).unwrap();
    assert_eq!(db.open().events(&kept).unwrap().len(), 2 + 7);

    assert_eq!(rows(&db, origin.as_str()), before);
}

#[test]
fn a_fork_crashed_mid_tool_is_reconciled_on_resume_as_any_run() {
    let db = TempStore::new();
    let tool = RecordingTool::new("lookup");
    call(
        &db,
        Agent::new(two_lookups_then_an_answer()).tool(tool.clone()),
        StartRun::new("ops", json!({})).with_id("origin"),
    )
    .unwrap();

    // The fork's model asks, at step 3, for another call, whose tool blocks: the process
    // crashes under it.
    let script = || {
        ScriptedModel::new(vec![
            ModelResponse::calls(vec![lookup("c1", 1)]),
            ModelResponse::calls(vec![ToolCall::new("c9", "charge", json!({"cents": 5}))]),
            ModelResponse::answer("charged"),
        ])
    };
    let charge = RecordingTool::new("charge")
        .behaviour(Behaviour::Block)
        .reconcile_hook(ReconcileHook::FromLog);
    let agent = Agent::new(script()).tool(tool.clone()).tool(charge.clone());
    let fork = ForkRun::new("origin", 3).with_id("fork");
    crash_in_tool(&db, "ops", agent, fork, &charge);
    let store = db.open();
    let fork = RunId::from("fork");
    assert_eq!(
        store.events(&fork).unwrap().last().unwrap().kind,
        EventKind::ToolStarted
    );

    charge.set_behaviour(Behaviour::Succeed);
    let agent = Agent::new(script()).tool(tool.clone()).tool(charge.clone());
    let reply =
        resume_when_free_on(db.open(), fast_lease(), "ops", agent, &fork, PATIENCE).unwrap();
    assert_eq!(
        reply.outcome,
        Outcome::Succeeded {
            output: "charged".into()
        }
    );
    assert_eq!(charge.executions().len(), 1, "the charge ran once");
    assert_eq!(charge.reconciles().len(), 1);
    assert_eq!(
        tool.executions().len(),
        2,
        "the copied lookup never ran again"
    );
    let events = store.events(&fork).unwrap();
    let count = |kind| events.iter().filter(|e| e.kind == kind).count();
    assert_eq!(count(EventKind::StepInterrupted), 1);
    assert_eq!(count(EventKind::LeaseTakenOver), 1);
    let reconciled: Vec<&Value> = events
        .iter()
        .filter(|e| e.kind == EventKind::StepReconciled)
        .map(|e| &e.payload)
        .collect();
    assert_eq!(
        reconciled,
        [&json!({"attempt": 1, "outcome": "applied", "action": "record_output"})]
    );
    // Two acquisitions: the fork's first resume took token 1, the takeover token 2.
    let tokens: Vec<&Value> = events
        .iter()
        .filter(|e| e.kind == EventKind::RunResumed)
        .map(|e| &e.payload["fencing_token"])
        .collect();
    assert_eq!(tokens, [&json!(1), &json!(2)]);
    assert!(
        events
            .iter()
            .enumerate()
            .all(|(i, e)| e.seq == i as u64 + 1),
        "gapless"
    );
    assert_no_run_leased(&store);
}
