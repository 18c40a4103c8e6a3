//! Research desk: a run that waits for a child run, a person and a timer, on an embedded SQLite
//! file.
//!
//! A desk agent hands a research task to a child run of a research agent and waits for its
//! answer; then asks an editor whether to publish the summary (an answer with a JSON Schema);
//! then sleeps for a second before it publishes. The example plays the editor: when it sees the
//! run waiting for an answer, it answers through the store, as an operator's tool would. While
//! the run waits it holds no lease, no slot and no memory: the supervisor wakes it when the
//! child ends, when the answer is recorded and when the time comes. The example prints each
//! run's events and where the database is.
//!
//! ```text
//! cargo run --example research_desk
//! ```

use std::time::{Duration, Instant};

use agentrt::{
    Agent, Answer, ChatMessage, Config, Model, ModelError, ModelRequest, ModelResponse, Outcome,
    Recovery, RunId, RunState, StartRun, Store, Supervisor, Tool, ToolCall, ToolContext, ToolError,
    ToolResult, WaitKind, Watch, async_trait,
};
use serde_json::{Value, json};

/// Plays the desk's model from a fixed script: delegate, ask the editor, sleep, answer.
struct DeskModel;

#[async_trait(?Send)]
impl Model for DeskModel {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        let turn = request
            .messages
            .iter()
            .filter(|m| matches!(m, ChatMessage::Assistant(_)))
            .count();
        Ok(match turn {
            0 => ModelResponse::calls(vec![ToolCall::new(
                "research-1",
                "research",
                json!({ "task": request.input["topic"] }),
            )]),
            1 => ModelResponse::calls(vec![ToolCall::new(
                "ask-1",
                "ask_person",
                json!({
                    "question": format!("Publish this summary? \"{}\"", last_result(&request)),
                    "schema": {
                        "type": "object",
                        "properties": {
                            "publish": { "type": "boolean" },
                            "note": { "type": "string" }
                        },
                        "required": ["publish"]
                    }
                }),
            )]),
            2 => ModelResponse::calls(vec![ToolCall::new(
                "sleep-1",
                "sleep_until",
                json!({ "seconds": 1, "reason": "let the editor's changes land" }),
            )]),
            _ => ModelResponse::answer("Summary published to the team's page."),
        })
    }
}

/// Plays the research agent's model: search the notes, then summarize what came back.
struct ResearchModel;

#[async_trait(?Send)]
impl Model for ResearchModel {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        Ok(match request.messages.last() {
            Some(ChatMessage::Tool {
                result: ToolResult::Ok(found),
                ..
            }) => ModelResponse::answer(format!(
                "{} notes agree: {}",
                found["notes"].as_array().map_or(0, Vec::len),
                found["notes"][0].as_str().unwrap_or_default()
            )),
            Some(ChatMessage::Tool { .. }) => ModelResponse::answer("Nothing found."),
            _ => ModelResponse::calls(vec![ToolCall::new(
                "search-1",
                "search_notes",
                json!({ "query": request.input }),
            )]),
        })
    }
}

/// The text of the conversation's last tool result.
fn last_result(request: &ModelRequest<'_>) -> String {
    match request.messages.last() {
        Some(ChatMessage::Tool {
            result: ToolResult::Ok(value),
            ..
        }) => value
            .as_str()
            .map_or_else(|| value.to_string(), str::to_owned),
        Some(ChatMessage::Tool {
            result: ToolResult::Error(error),
            ..
        }) => format!("(failed: {error})"),
        _ => String::new(),
    }
}

/// A read-only search of the team's notes.
struct SearchNotes;

#[async_trait(?Send)]
impl Tool for SearchNotes {
    fn name(&self) -> &str {
        "search_notes"
    }

    fn idempotent(&self) -> bool {
        true
    }

    async fn call(&self, _: &ToolContext, args: &Value) -> Result<Value, ToolError> {
        Ok(json!({
            "query": args["query"],
            "notes": [
                "a waiting run holds no lease, no slot and no memory",
                "a wait survives a restart of the process",
                "whoever answers need not be the process that runs it"
            ]
        }))
    }
}

#[actix::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // RUST_LOG=agentrt=info shows each wait and resume.
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let path = std::env::current_dir()?.join("agentrt-research-desk.db");
    let store = Store::open(&path)?;
    let desk = Agent::new(DeskModel)
        .delegate(
            "research",
            "researcher",
            "Hand a research task to the research agent; its summary is the result.",
        )
        .ask_person()
        .sleep_until();
    // A supervisor wakes waiting runs when it watches the change feed: it hears of the child's
    // end and of the answer there, and sets a timer for the sleep. Recovery takes up the runs
    // of a process that stopped (this example's, stopped midway and started again).
    let config = Config::default()
        .watch(Watch::default().every(Duration::from_millis(20)))
        .recovery(Recovery::default().every(Duration::from_secs(1)));
    let supervisor = Supervisor::builder(store.clone())
        .config(config)
        .agent("desk", desk)
        .agent("researcher", Agent::new(ResearchModel).tool(SearchNotes))
        .start()?;

    let reply = supervisor
        .send(StartRun::new(
            "desk",
            json!({ "topic": "what durable agent runtimes keep while a run waits" }),
        ))
        .await??;
    let run_id = reply.run_id;
    // It waits for its child at once: the child's id is the wait's key.
    let child = match reply.outcome {
        Outcome::Waiting { wait } if wait.kind == WaitKind::Child => RunId::from(wait.key),
        other => return Err(format!("expected a wait for the child, got {other:?}").into()),
    };
    println!("run {run_id} started, waiting for its child run {child}");

    // The editor: watches the run and answers its question when it asks one. The store's
    // reads block: they stay off the arbiter that hosts the runs.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen = None;
    let state = loop {
        let (id, reader) = (run_id.clone(), store.clone());
        let (state, wait) = actix_rt::task::spawn_blocking(move || {
            Ok::<_, agentrt::Error>((reader.run(&id)?.state, reader.wait(&id)?))
        })
        .await??;
        if seen != Some(state) {
            println!("run {run_id} is {state}");
            seen = Some(state);
        }
        match (state, wait) {
            (RunState::WaitingForAnswer, Some(wait)) if wait.kind == WaitKind::Answer => {
                println!("  question: {}", wait.detail["question"]);
                let answer = Answer {
                    run_id: run_id.clone(),
                    call_id: wait.call_id,
                    answer: json!({ "publish": true, "note": "fine as it is" }),
                    by: "editor@example.com".into(),
                };
                let writer = store.clone();
                actix_rt::task::spawn_blocking(move || writer.answer(&answer)).await??;
                println!("  answered by editor@example.com");
            }
            (state, _) if state.is_finished() => break state,
            _ => {}
        }
        if Instant::now() > deadline {
            return Err(format!("run {run_id} did not finish within a minute ({state})").into());
        }
        actix_rt::time::sleep(Duration::from_millis(20)).await;
    };

    for id in [run_id.clone(), child] {
        let reader = store.clone();
        let read = id.clone();
        let events = actix_rt::task::spawn_blocking(move || reader.events(&read)).await??;
        println!("\nevents of {id}:");
        for event in events {
            println!(
                "  {:>2} {:<20} step={:<4} {}",
                event.seq,
                event.kind,
                event.step.map(|s| s.to_string()).unwrap_or_default(),
                event.payload
            );
        }
    }
    println!("\ndatabase: {}", path.display());
    match state {
        RunState::Succeeded => Ok(()),
        other => Err(format!("the run did not succeed: it is {other}").into()),
    }
}
