//! The operator console in a real browser: Debian's Chromium driven by playwright-core from
//! the scripts in `tests/browser/`, against the web API served on 127.0.0.1 under a prefix,
//! with a supervisor executing the runs. Each test sets the runs up here, runs one script,
//! and checks the store afterwards; the script checks the page.
//!
//! Needs Node.js, `/usr/bin/chromium` and `npm ci --prefix tests/browser`; without them each
//! test prints a skip line, or fails when `CI` is set. Screenshots go to
//! `$CARGO_TARGET_TMPDIR/browser/<test>/`.

use std::{
    io::{BufRead, BufReader, Read},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::mpsc,
    thread::JoinHandle,
    time::Duration,
};

use actix::Addr;
use actix_web::{App, HttpServer};
use agentrt::{
    Agent, Config, Decision, EventKind, ModelResponse, Outcome, RunId, RunState, SpawnRun,
    StartRun, Store, Supervisor, ToolCall,
    testkit::{Behaviour, RecordingTool, ScriptedModel, TempStore, with_system},
    web::Api,
};
use serde_json::json;

use crate::support::supervise;

const OPERATOR: &str = "alice";
const TOKEN: &str = "console-test-token";
const PREFIX: &str = "/ops";
const POLICY_REASON: &str = "transfers need a second pair of eyes";

/// Whether the browser tests can run here; when they cannot, says what is missing, and fails
/// under `CI`.
fn browser_available() -> bool {
    let node = Command::new("node")
        .arg("--version")
        .output()
        .is_ok_and(|out| out.status.success());
    let mut missing = Vec::new();
    if !node {
        missing.push("Node.js 20 or later on the PATH (Debian: apt-get install nodejs npm)");
    }
    if !Path::new("/usr/bin/chromium").exists() {
        missing.push("Chromium at /usr/bin/chromium (Debian: apt-get install chromium)");
    }
    if !browser_dir().join("node_modules/playwright-core").exists() {
        missing.push("playwright-core (npm ci --prefix tests/browser)");
    }
    if missing.is_empty() {
        return true;
    }
    let message = format!("the console's browser tests need {}", missing.join("; "));
    assert!(std::env::var_os("CI").is_none(), "{message}");
    println!("skipped: {message}");
    false
}

fn browser_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser")
}

/// The API and its console, served on 127.0.0.1 by a supervisor's actix system on a thread of
/// its own; stopped when dropped.
struct Served {
    /// The console's address, `http://127.0.0.1:PORT/ops/ui/`.
    url: String,
    /// The runs the setup started.
    runs: Vec<RunId>,
    system: actix::System,
    thread: Option<JoinHandle<()>>,
}

/// Starts a supervisor over `db` with the agents `agents()` makes, runs `setup` with it (to
/// start runs), then serves the API under [`PREFIX`] with the operator's token.
fn serve<A, S, F>(db: &TempStore, agents: A, setup: S) -> Served
where
    A: FnOnce() -> Vec<(&'static str, Agent)> + Send + 'static,
    S: FnOnce(Addr<Supervisor>) -> F + Send + 'static,
    F: Future<Output = Vec<RunId>>,
{
    serve_with(db, Config::default(), agents, setup)
}

/// [`serve`], the supervisor configured by `config`.
fn serve_with<A, S, F>(db: &TempStore, config: Config, agents: A, setup: S) -> Served
where
    A: FnOnce() -> Vec<(&'static str, Agent)> + Send + 'static,
    S: FnOnce(Addr<Supervisor>) -> F + Send + 'static,
    F: Future<Output = Vec<RunId>>,
{
    let (store, api_store) = (db.open(), db.open());
    let (sender, receiver) = mpsc::channel();
    let thread = std::thread::spawn(move || {
        let system = actix::System::new();
        system.block_on(async move {
            let mut builder = Supervisor::builder(store).config(config);
            for (name, agent) in agents() {
                builder = builder.agent(name, agent);
            }
            let supervisor = builder.start().unwrap();
            let runs = setup(supervisor.clone()).await;
            let api = Api::new(api_store)
                .supervisor(supervisor)
                .token(OPERATOR, TOKEN)
                .unwrap();
            let server = HttpServer::new(move || App::new().service(api.scope(PREFIX)))
                .workers(1)
                .bind(("127.0.0.1", 0))
                .unwrap();
            let port = server.addrs()[0].port();
            actix::spawn(server.run());
            sender.send((port, runs, actix::System::current())).unwrap();
        });
        system.run().unwrap();
    });
    let (port, runs, system) = receiver
        .recv()
        .expect("the server's thread failed before serving");
    Served {
        url: format!("http://127.0.0.1:{port}{PREFIX}/ui/"),
        runs,
        system,
        thread: Some(thread),
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.system.stop();
        if let Some(thread) = self.thread.take() {
            let joined = thread.join();
            if !std::thread::panicking() {
                joined.unwrap();
            }
        }
    }
}

/// Runs `node tests/browser/SCRIPT` against `served`, with `env` beside the console's
/// address, the token and the first run's id; calls `on_reached` with each point the script
/// says it reached. Panics, with the script's output, unless it exits successfully.
fn run_script(
    script: &str,
    served: &Served,
    env: &[(&str, &str)],
    mut on_reached: impl FnMut(&str),
) {
    let test = std::thread::current()
        .name()
        .unwrap_or("console")
        .rsplit("::")
        .next()
        .unwrap()
        .to_owned();
    let shots = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("browser")
        .join(&test);
    let mut child = Command::new("node")
        .arg(script)
        .current_dir(browser_dir())
        .env("AGENTRT_CONSOLE_URL", &served.url)
        .env("AGENTRT_CONSOLE_TOKEN", TOKEN)
        .env("AGENTRT_RUN_ID", served.runs[0].as_str())
        .env("AGENTRT_SCREENSHOTS", &shots)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("node starts");
    let mut stderr = child.stderr.take().unwrap();
    let errors = std::thread::spawn(move || {
        let mut text = String::new();
        stderr.read_to_string(&mut text).ok();
        text
    });
    let mut output = String::new();
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        if let Some(point) = line.strip_prefix("@@") {
            on_reached(point);
        }
        output.push_str(&line);
        output.push('\n');
    }
    let status = child.wait().unwrap();
    let errors = errors.join().unwrap();
    println!("--- node {script}: {status}\n{output}{errors}");
    assert!(
        status.success(),
        "node tests/browser/{script} failed ({status}); screenshots in {}\n--- stdout\n{output}--- stderr\n{errors}",
        shots.display()
    );
}

/// A model that asks for a transfer, then answers "finished".
fn transfer_then_answer() -> ScriptedModel {
    ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new(
            "pay-1",
            "transfer",
            json!({"amount": 100}),
        )]),
        ModelResponse::answer("finished"),
    ])
}

/// An agent whose transfers wait for an operator.
fn gated_transfers(transfer: RecordingTool) -> Agent {
    Agent::new(transfer_then_answer())
        .tool(transfer)
        .policy(|_: &RunId, call: &ToolCall| {
            if call.name == "transfer" {
                Decision::RequireApproval(POLICY_REASON.into())
            } else {
                Decision::Allow
            }
        })
}

/// Serves a supervisor with one run waiting for the approval of its transfer.
fn serve_a_waiting_transfer(db: &TempStore, transfer: &RecordingTool) -> Served {
    let transfer = transfer.clone();
    serve(
        db,
        move || vec![("payments", gated_transfers(transfer))],
        |supervisor| async move {
            let reply = supervisor
                .send(StartRun::new("payments", json!({"invoice": 7})))
                .await
                .unwrap()
                .unwrap();
            assert!(
                matches!(reply.outcome, Outcome::WaitingForApproval { .. }),
                "{:?}",
                reply.outcome
            );
            vec![reply.run_id]
        },
    )
}

fn approvals_recorded(store: &Store, run_id: &RunId) -> Vec<serde_json::Value> {
    store
        .events(run_id)
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == EventKind::ApprovalRecorded)
        .map(|e| e.payload)
        .collect()
}

#[test]
fn approving_a_waiting_call_in_the_inbox_finishes_the_run() {
    if !browser_available() {
        return;
    }
    let db = TempStore::new();
    let transfer = RecordingTool::new("transfer");
    let served = serve_a_waiting_transfer(&db, &transfer);

    run_script(
        "approve_in_inbox.mjs",
        &served,
        &[("AGENTRT_POLICY_REASON", POLICY_REASON)],
        |_| {},
    );

    let store = db.open();
    let run_id = &served.runs[0];
    assert_eq!(store.run(run_id).unwrap().state, RunState::Succeeded);
    assert_eq!(transfer.executions().len(), 1);
    let approvals = approvals_recorded(&store, run_id);
    assert_eq!(approvals.len(), 1, "{approvals:?}");
    // The approver is the token's operator: the page only ever sent a note.
    assert_eq!(approvals[0]["decided_by"], json!(OPERATOR));
    assert_eq!(approvals[0]["approved"], json!(true));
    assert_eq!(approvals[0]["note"], json!("within budget"));
}

/// The question the child run of [`answering_a_question_in_the_inbox_finishes_the_child_and_its_parent`]
/// asks, and its answer's schema.
const QUESTION: &str = "Which account pays for the trip?";

#[test]
fn answering_a_question_in_the_inbox_finishes_the_child_and_its_parent() {
    if !browser_available() {
        return;
    }
    let db = TempStore::new();
    let schema = json!({
        "type": "object",
        "properties": {"account": {"type": "string"}},
        "required": ["account"]
    });
    let planner = ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new(
            "book-1",
            "book",
            json!({"task": "book the train"}),
        )]),
        ModelResponse::answer("trip planned"),
    ]);
    let booker = ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new(
            "ask-1",
            "ask_person",
            json!({"question": QUESTION, "schema": schema}),
        )]),
        ModelResponse::answer("booked"),
    ]);
    // The parent is woken by its child's end through the change feed, which the watch reads.
    let config =
        Config::default().watch(agentrt::Watch::default().every(Duration::from_millis(20)));
    let (store, parent_model) = (db.open(), planner.clone());
    let served = serve_with(
        &db,
        config,
        move || {
            vec![
                (
                    "planner",
                    Agent::new(planner).delegate(
                        "book",
                        "booker",
                        "Hand the booking to the booker.",
                    ),
                ),
                ("booker", Agent::new(booker).ask_person()),
            ]
        },
        |supervisor| async move {
            let reply = supervisor
                .send(StartRun::new("planner", json!({"trip": 7})).with_id("trip-7"))
                .await
                .unwrap()
                .unwrap();
            assert!(
                matches!(reply.outcome, Outcome::Waiting { .. }),
                "{:?}",
                reply.outcome
            );
            // The child is started at once; the page opens once it asks.
            let child = RunId::from("trip-7/2");
            crate::support::until_state(&store, &child, RunState::WaitingForAnswer).await;
            vec![reply.run_id, child]
        },
    );

    run_script(
        "answer_in_inbox.mjs",
        &served,
        &[
            ("AGENTRT_CHILD_ID", served.runs[1].as_str()),
            ("AGENTRT_QUESTION", QUESTION),
        ],
        |_| {},
    );

    let store = db.open();
    let (parent, child) = (&served.runs[0], &served.runs[1]);
    assert_eq!(store.run(child).unwrap().state, RunState::Succeeded);
    assert_eq!(store.run(parent).unwrap().state, RunState::Succeeded);
    let woken: Vec<_> = store
        .events(child)
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == EventKind::WaitWoken)
        .map(|e| e.payload)
        .collect();
    assert_eq!(
        woken.len(),
        1,
        "one answer, the refused ones wrote nothing: {woken:?}"
    );
    // The answerer is the token's operator: the page only ever sent the answer.
    assert_eq!(woken[0]["answered_by"], json!(OPERATOR));
    assert_eq!(woken[0]["answer"], json!({"account": "savings"}));
    assert_eq!(
        crate::support::last_tool_result(&parent_model),
        agentrt::ToolResult::Ok(json!("booked"))
    );
}

#[test]
fn the_timeline_grows_live() {
    if !browser_available() {
        return;
    }
    let db = TempStore::new();
    let lookup = RecordingTool::new("lookup").behaviour(Behaviour::Block);
    let model = ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new("find-1", "lookup", json!({"q": "ada"}))]),
        ModelResponse::answer("found"),
    ]);
    let served = {
        let lookup = lookup.clone();
        let tool = lookup.clone();
        serve(
            &db,
            move || vec![("research", Agent::new(model).tool(tool))],
            |supervisor| async move {
                let run_id = supervisor
                    .send(SpawnRun::new("research", json!({"q": "ada"})))
                    .await
                    .unwrap()
                    .unwrap();
                // The page opens while the run is blocked in the tool.
                lookup.wait_executions(1).await;
                vec![run_id]
            },
        )
    };
    let run_id = served.runs[0].clone();

    let mut released = false;
    run_script("timeline_grows_live.mjs", &served, &[], |point| {
        assert_eq!(point, "blocked-seen");
        assert_eq!(
            db.open().run(&run_id).unwrap().state,
            RunState::Running,
            "the run waited for the page"
        );
        lookup.release();
        released = true;
    });

    assert!(released, "the script never saw the blocked run");
    assert_eq!(db.open().run(&run_id).unwrap().state, RunState::Succeeded);
    assert_eq!(lookup.executions().len(), 1);
}

#[test]
fn a_lapsed_lease_is_shown_expired_and_the_run_resumed_from_its_page() {
    if !browser_available() {
        return;
    }
    let db = TempStore::new();
    // Idempotent: the attempt cut off by the crash is run again on the takeover.
    let lookup = RecordingTool::new("lookup")
        .behaviour(Behaviour::Block)
        .idempotent(true);
    let model = ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new("find-1", "lookup", json!({"q": "ada"}))]),
        ModelResponse::answer("found"),
    ]);
    let agent = || Agent::new(model.clone()).tool(lookup.clone());

    // A supervisor with a short lease is torn down while the run is in the tool: a crash that
    // leaves the run RUNNING under a lease nobody renews.
    let (store, crashed, blocked) = (db.open(), agent(), lookup.clone());
    let run_id = with_system(|| async move {
        let config = Config::default()
            .lease_owner("crashed-host")
            .lease_ttl(Duration::from_millis(200));
        let supervisor = supervise(store, config, "research", crashed);
        let run_id = supervisor
            .send(SpawnRun::new("research", json!({"q": "ada"})))
            .await
            .unwrap()
            .unwrap();
        blocked.wait_executions(1).await;
        run_id
    });

    let served = {
        let (agent, run_id) = (agent(), run_id.clone());
        serve(
            &db,
            move || vec![("research", agent)],
            |_| async move { vec![run_id] },
        )
    };
    let mut released = false;
    run_script("lapsed_lease.mjs", &served, &[], |point| {
        assert_eq!(point, "taken-over");
        lookup.release();
        released = true;
    });

    assert!(released, "the script never saw the takeover");
    let store = db.open();
    assert_eq!(store.run(&run_id).unwrap().state, RunState::Succeeded);
    assert_eq!(
        lookup.executions().len(),
        2,
        "the cut-off attempt and the new one"
    );
}

#[test]
fn forking_a_run_from_its_page_opens_the_fork() {
    if !browser_available() {
        return;
    }
    let db = TempStore::new();
    let served = serve(
        &db,
        || {
            let model = ScriptedModel::new(vec![ModelResponse::answer("summed up")]);
            vec![("summaries", Agent::new(model))]
        },
        |supervisor| async move {
            let reply = supervisor
                .send(StartRun::new("summaries", json!({"ticket": 12})))
                .await
                .unwrap()
                .unwrap();
            vec![reply.run_id]
        },
    );

    run_script("fork_from_page.mjs", &served, &[], |_| {});

    let store = db.open();
    let fork = RunId::from("fork-of-summary");
    assert_eq!(store.run(&fork).unwrap().state, RunState::Succeeded);
    let forked = store
        .events(&fork)
        .unwrap()
        .into_iter()
        .find(|e| e.kind == EventKind::RunForked)
        .expect("the fork's log says where it came from");
    assert_eq!(forked.payload["origin"], json!(served.runs[0].as_str()));
    assert_eq!(forked.payload["at"], json!(1));
}

#[test]
fn a_write_without_a_token_is_refused() {
    if !browser_available() {
        return;
    }
    let db = TempStore::new();
    let transfer = RecordingTool::new("transfer");
    let served = serve_a_waiting_transfer(&db, &transfer);

    run_script("write_without_token.mjs", &served, &[], |_| {});

    let store = db.open();
    let run_id = &served.runs[0];
    assert_eq!(
        approvals_recorded(&store, run_id),
        Vec::<serde_json::Value>::new()
    );
    assert_eq!(
        store.run(run_id).unwrap().state,
        RunState::WaitingForApproval
    );
    assert_eq!(store.pending_calls(run_id).unwrap().len(), 1);
    assert!(transfer.executions().is_empty());
}

/// Renders `docs/console.png`: the runs list with a few runs, one of them waiting for an
/// approval and one for an answer. Run it with `cargo test --features web --test web console_browser:: -- --ignored`.
#[test]
#[ignore = "writes docs/console.png; run it when the console's look changes"]
fn render_the_docs_screenshot() {
    assert!(browser_available(), "the screenshot needs the browser");
    let db = TempStore::new();
    let (transfer, lookup) = (
        RecordingTool::new("transfer"),
        RecordingTool::new("lookup").behaviour(Behaviour::Block),
    );
    let served = {
        let (transfer, lookup) = (transfer.clone(), lookup.clone());
        let blocked = lookup.clone();
        serve(
            &db,
            move || {
                let research = ScriptedModel::new(vec![
                    ModelResponse::calls(vec![ToolCall::new("find-1", "lookup", json!({}))]),
                    ModelResponse::answer("found"),
                ]);
                let summary = ScriptedModel::new(vec![ModelResponse::answer("summed up")]);
                vec![
                    ("payments", gated_transfers(transfer)),
                    ("research", Agent::new(research).tool(lookup)),
                    ("summaries", Agent::new(summary)),
                    // A script that runs out on its first turn: a failed run.
                    ("triage", Agent::new(ScriptedModel::new(vec![]))),
                    (
                        "onboarding",
                        Agent::new(ScriptedModel::new(vec![ModelResponse::calls(vec![
                            ToolCall::new(
                                "ask-1",
                                "ask_person",
                                json!({"question": "Which team does the new hire join?"}),
                            ),
                        ])]))
                        .ask_person(),
                    ),
                ]
            },
            |supervisor| async move {
                let mut runs = Vec::new();
                for (id, agent) in [
                    ("summary-0412", "summaries"),
                    ("triage-0413", "triage"),
                    ("invoice-0415", "payments"),
                    ("summary-0416", "summaries"),
                    ("onboarding-0417", "onboarding"),
                ] {
                    let reply = supervisor
                        .send(StartRun::new(agent, json!({"ticket": id})).with_id(id))
                        .await
                        .unwrap()
                        .unwrap();
                    runs.push(reply.run_id);
                }
                let id = supervisor
                    .send(
                        SpawnRun::new("research", json!({"ticket": "research-0418"}))
                            .with_id("research-0418"),
                    )
                    .await
                    .unwrap()
                    .unwrap();
                blocked.wait_executions(1).await;
                runs.push(id);
                runs
            },
        )
    };
    let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/console.png");
    run_script(
        "docs_screenshot.mjs",
        &served,
        &[("AGENTRT_DOCS_SCREENSHOT", target.to_str().unwrap())],
        |_| {},
    );
    lookup.release();
}
