//! An ordinary run: its exact event sequence and its clock readings are a contract.

use agentrt::{
    Agent, Config, EventKind, ModelResponse, MoveInfo, MoveObserver, Outcome, RunState, StartRun,
    ToolCall,
    testkit::{CountingClock, RecordingTool, ScriptedModel, TempStore},
};
use serde_json::json;
use std::sync::{Arc, Mutex};

use crate::support::ask;

/// The event log of the run below: (seq, kind, step).
pub const GOLDEN: &[(u64, &str, Option<u32>)] = &[
    (1, "run.started", None),
    (2, "step.model_started", Some(1)),
    (3, "step.model_finished", Some(1)),
    (4, "policy.decided", Some(2)),
    (5, "step.tool_started", Some(2)),
    (6, "step.tool_finished", Some(2)),
    (7, "step.model_started", Some(3)),
    (8, "step.model_finished", Some(3)),
    (9, "policy.decided", Some(4)),
    (10, "step.tool_started", Some(4)),
    (11, "step.tool_finished", Some(4)),
    (12, "policy.decided", Some(5)),
    (13, "step.tool_started", Some(5)),
    (14, "step.tool_finished", Some(5)),
    (15, "step.model_started", Some(6)),
    (16, "step.model_finished", Some(6)),
    (17, "run.finished", None),
];

/// One clock reading per committed move: the insert, then per model step a reservation and an
/// answer, per tool call a decision (with its start) and an outcome.
const CLOCK_READINGS: u64 = 13;

/// The 13 moves take 7 durable commits: a move that no side effect separates from the next
/// commits with it. The insert with the first model reservation; each model answer with the
/// decision (and start) of its first call; each tool outcome with the next call's decision or
/// the next model reservation; the final answer alone.
const COMMITS: usize = 7;

/// Counts the transactions the store actor commits, and the moves in them.
#[derive(Clone, Default)]
struct Commits(Arc<Mutex<Vec<Vec<&'static str>>>>);

impl MoveObserver for Commits {
    fn committed(&self, moves: &[&MoveInfo]) {
        self.0
            .lock()
            .unwrap()
            .push(moves.iter().map(|m| m.kind.as_str()).collect());
    }
}

#[test]
fn scripted_run_succeeds_with_the_golden_event_sequence() {
    let db = TempStore::new();
    let clock = CountingClock::default();
    let lookup = RecordingTool::new("lookup");
    let notify = RecordingTool::new("notify");
    let model = ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new("c1", "lookup", json!({"id": 7}))]),
        ModelResponse::calls(vec![
            ToolCall::new("c2", "lookup", json!({"id": 8})),
            ToolCall::new("c3", "notify", json!({"to": "ops"})),
        ]),
        ModelResponse::answer("done"),
    ]);
    let agent = Agent::new(model.clone())
        .tool(lookup.clone())
        .tool(notify.clone());
    let store = db.open();
    let commits = Commits::default();
    let config = Config::default()
        .clock(clock.clone())
        .observer(commits.clone());
    let reply = ask(
        store,
        config,
        "golden",
        agent,
        StartRun::new("golden", json!({"q": 1})).with_id("run-1"),
    )
    .unwrap();

    assert_eq!(
        reply.outcome,
        Outcome::Succeeded {
            output: "done".into()
        }
    );
    let store = db.open();
    let events = store.events(&reply.run_id).unwrap();
    let got: Vec<(u64, &str, Option<u32>)> = events
        .iter()
        .map(|e| (e.seq, e.kind.as_str(), e.step))
        .collect();
    assert_eq!(got, GOLDEN);
    assert_eq!(clock.reads(), CLOCK_READINGS);
    let commits = commits.0.lock().unwrap().clone();
    assert_eq!(
        commits,
        [
            vec!["create_run", "begin_model_step"],
            vec!["finish_model_step", "decide_tool"],
            vec!["finish_tool", "begin_model_step"],
            vec!["finish_model_step", "decide_tool"],
            vec!["finish_tool", "decide_tool"],
            vec!["finish_tool", "begin_model_step"],
            vec!["finish_model_step"],
        ][..]
    );
    assert_eq!(commits.len(), COMMITS);

    // Times come from the clock, one reading per move, never going back.
    assert!(events.windows(2).all(|w| w[0].at <= w[1].at));
    let started = events
        .iter()
        .find(|e| e.kind == EventKind::ToolStarted)
        .unwrap();
    assert_eq!(started.payload["idempotency_key"], json!("run-1/2"));
    assert_eq!(started.payload["attempt"], json!(1));
    let run = store.run(&reply.run_id).unwrap();
    assert_eq!(run.state, RunState::Succeeded);
    assert_eq!(run.output.as_deref(), Some("done"));
    assert_eq!(run.input, json!({"q": 1}));

    // Each tool ran once, and the model saw every result in order.
    assert_eq!(lookup.executions().len(), 2);
    assert_eq!(notify.executions().len(), 1);
    let last_conversation = model.seen().pop().unwrap();
    assert_eq!(
        last_conversation.len(),
        6,
        "the input, two responses and three tool results"
    );
    assert_eq!(
        last_conversation[0],
        agentrt::ChatMessage::User {
            text: r#"{"q":1}"#.into()
        }
    );
}
