//! Write-ahead: each step's start is in the database before its side effect begins, and each
//! outcome before the next step starts. Checked from inside the model and tool calls, through
//! another connection, as a process that read the database at that moment would see it.

use std::sync::{Arc, Mutex};

use agentrt::{
    Agent, Config, Event, EventKind, Model, ModelError, ModelRequest, ModelResponse, Outcome,
    RunId, StartRun, Store, Tool, ToolCall, ToolContext, ToolError, async_trait,
    testkit::{ScriptedModel, TempStore},
};
use serde_json::{Value, json};

use crate::support::ask;

/// What each call found in the database when it began: (what called, step, events seen).
type Seen = Arc<Mutex<Vec<(&'static str, u32, Vec<Event>)>>>;

/// The events of `run_id` read through a handle of its own on the store at `db`, on a thread
/// of its own, as another process would read them.
fn events(db: &str, run_id: &RunId) -> Vec<Event> {
    let (db, run_id) = (db.to_owned(), run_id.clone());
    std::thread::spawn(move || Store::connect(&db).unwrap().events(&run_id).unwrap())
        .join()
        .unwrap()
}

struct ReadingModel {
    scripted: ScriptedModel,
    db: String,
    seen: Seen,
}

#[async_trait(?Send)]
impl Model for ReadingModel {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        let found = events(&self.db, request.run_id);
        self.seen
            .lock()
            .unwrap()
            .push(("model", request.step, found));
        self.scripted.complete(request).await
    }
}

struct ReadingTool {
    db: String,
    seen: Seen,
}

#[async_trait(?Send)]
impl Tool for ReadingTool {
    fn name(&self) -> &str {
        "lookup"
    }

    async fn call(&self, ctx: &ToolContext, _: &Value) -> Result<Value, ToolError> {
        let found = events(&self.db, &ctx.run_id);
        self.seen.lock().unwrap().push(("tool", ctx.step, found));
        Ok(json!("ok"))
    }
}

#[test]
fn each_start_is_written_before_its_side_effect_and_each_outcome_before_the_next_step() {
    let db = TempStore::new();
    let seen = Seen::default();
    let scripted = ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new("c1", "lookup", json!({}))]),
        ModelResponse::calls(vec![
            ToolCall::new("c2", "lookup", json!({})),
            ToolCall::new("c3", "lookup", json!({})),
        ]),
        ModelResponse::answer("done"),
    ]);
    let model = ReadingModel {
        scripted,
        db: db.location(),
        seen: seen.clone(),
    };
    let tool = ReadingTool {
        db: db.location(),
        seen: seen.clone(),
    };
    let store = db.open();
    let reply = ask(
        store,
        Config::default(),
        "a",
        Agent::new(model).tool(tool),
        StartRun::new("a", json!({})).with_id("r1"),
    )
    .unwrap();
    assert_eq!(
        reply.outcome,
        Outcome::Succeeded {
            output: "done".into()
        }
    );

    let seen = seen.lock().unwrap();
    let calls: Vec<(&str, u32)> = seen.iter().map(|(what, step, _)| (*what, *step)).collect();
    assert_eq!(
        calls,
        [
            ("model", 1),
            ("tool", 2),
            ("model", 3),
            ("tool", 4),
            ("tool", 5),
            ("model", 6)
        ]
    );
    for (what, step, found) in seen.iter() {
        let last = found.last().expect("the run is in the database");
        // The call's own start is the newest event: written, and nothing after it yet.
        let start = match *what {
            "model" => EventKind::ModelStarted,
            _ => EventKind::ToolStarted,
        };
        assert_eq!(
            (last.kind, last.step),
            (start, Some(*step)),
            "{what} call of step {step} began after {:?}",
            found.iter().map(|e| (e.kind, e.step)).collect::<Vec<_>>()
        );
        // Every step before it is finished: its outcome was written before this one started.
        for earlier in 1..*step {
            let finished = found.iter().any(|e| {
                e.step == Some(earlier)
                    && matches!(e.kind, EventKind::ModelFinished | EventKind::ToolFinished)
            });
            assert!(finished, "step {earlier} unfinished when step {step} began");
        }
    }
}
