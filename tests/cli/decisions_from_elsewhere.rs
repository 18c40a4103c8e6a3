//! Decisions and cancels recorded by another process (here the `agentrt` binary) reach a
//! supervisor built with `Config::watch`: an approval or a denial resumes the waiting run, a
//! cancel fires the running tool's cancellation signal; of two watching supervisors one
//! resumes the run; a decision recorded while no supervisor ran is picked up at start; a
//! supervisor without the watch, or without the run's agent, leaves the run waiting; a resume
//! that fails is tried again.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use agentrt::{
    Agent, Approval, Config, EventKind, ModelResponse, Outcome, RequireApprovalFor, RunId,
    RunSettled, RunState, SpawnRun, Store, SubscribeRuns, Supervisor, Tool, ToolCall, ToolContext,
    ToolError, ToolResult, Watch, async_trait,
    testkit::{Behaviour, RecordingTool, ScriptedModel, TempStore, with_system},
};
use serde_json::{Value, json};

use settled::{heard, subscriber};

use crate::support::{
    idempotency_keys, last_tool_result, pay_then_answer, settled, spawn, supervise,
};

/// An agent whose `pay` call waits for a person.
fn approving(model: ScriptedModel, pay: impl Tool) -> Agent {
    Agent::new(model)
        .tool(pay)
        .policy(RequireApprovalFor::tools(["pay"]))
}

/// The watch on, with leases that a loaded machine renews on time.
fn watching() -> Config {
    Config::default()
        .lease_ttl(Duration::from_secs(2))
        .watch(Watch::default())
}

/// Runs the operator binary on the store at `location` (a file's path or a PostgreSQL URL),
/// off the actix thread (the supervisor keeps running meanwhile), and checks that it succeeded.
async fn cli(location: &str, args: &[&str]) {
    let (location, args): (String, Vec<String>) = (
        location.to_owned(),
        args.iter().map(|a| a.to_string()).collect(),
    );
    let output = actix_rt::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_agentrt"))
            .arg("--db")
            .arg(&location)
            .args(&args)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        output.status.success(),
        "agentrt failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// What a subscriber has heard.
type Inbox = tokio::sync::watch::Receiver<Vec<RunSettled>>;

/// Starts a supervisor of `agent`, registered as `name`, subscribed to a new inbox.
async fn subscribed(
    store: Store,
    config: Config,
    name: &str,
    agent: Agent,
) -> (actix::Addr<Supervisor>, Inbox) {
    let supervisor = supervise(store, config, name, agent);
    let (inbox, rx) = subscriber();
    supervisor
        .send(SubscribeRuns(inbox.recipient()))
        .await
        .unwrap();
    (supervisor, rx)
}

/// Starts a watching supervisor of `agent` (as `billing`) subscribed to a new inbox, spawns
/// run `run_id` and waits until it waits for its approval.
async fn waiting_run(
    store: Store,
    config: Config,
    agent: Agent,
    run_id: &str,
) -> (actix::Addr<Supervisor>, Inbox) {
    let (supervisor, mut rx) = subscribed(store, config, "billing", agent).await;
    spawn(&supervisor, "billing", run_id).await;
    let paused = heard(&mut rx, 1).await;
    assert!(
        matches!(paused[0].result, Ok(Outcome::WaitingForApproval { .. })),
        "{paused:?}"
    );
    (supervisor, rx)
}

fn kinds(store: &Store, run_id: &RunId) -> Vec<EventKind> {
    store
        .events(run_id)
        .unwrap()
        .iter()
        .map(|e| e.kind)
        .collect()
}

#[test]
fn an_approval_by_the_cli_resumes_the_waiting_run_and_the_tool_runs_once() {
    let db = TempStore::new();
    let pay = RecordingTool::new("pay");
    let (store, location, agent) = (
        db.open(),
        db.location(),
        approving(pay_then_answer(), pay.clone()),
    );

    let (settled, took) = with_system(|| async move {
        let (_supervisor, mut rx) = waiting_run(store, watching(), agent, "r1").await;
        let asked = Instant::now();
        cli(&location, &["approve", "r1", "pay-1", "--by", "alice"]).await;
        let settled = heard(&mut rx, 2).await;
        (settled, asked.elapsed())
    });

    println!("from the CLI's start to the run settling: {took:?}");
    assert_eq!(settled.len(), 2, "{settled:?}");
    assert_eq!(
        settled[1].result,
        Ok(Outcome::Succeeded {
            output: "paid".into()
        })
    );
    assert_eq!(pay.executions().len(), 1);
    let store = db.open();
    let run_id = RunId::from("r1");
    assert_eq!(store.run(&run_id).unwrap().state, RunState::Succeeded);
    let events = store.events(&run_id).unwrap();
    let recorded = events
        .iter()
        .find(|e| e.kind == EventKind::ApprovalRecorded)
        .unwrap();
    assert_eq!(recorded.payload["decided_by"], json!("alice"));
    let resumes = events
        .iter()
        .filter(|e| e.kind == EventKind::RunResumed)
        .count();
    assert_eq!(resumes, 1);
}

#[test]
fn a_denial_by_the_cli_resumes_the_run_and_the_model_is_told() {
    let db = TempStore::new();
    let (pay, model) = (RecordingTool::new("pay"), pay_then_answer());
    let (store, location, agent) = (
        db.open(),
        db.location(),
        approving(model.clone(), pay.clone()),
    );

    let settled = with_system(|| async move {
        let (_supervisor, mut rx) = waiting_run(store, watching(), agent, "r1").await;
        cli(
            &location,
            &[
                "deny",
                "r1",
                "pay-1",
                "--by",
                "bob",
                "--note",
                "over budget",
            ],
        )
        .await;
        heard(&mut rx, 2).await
    });

    assert_eq!(
        settled[1].result,
        Ok(Outcome::Succeeded {
            output: "paid".into()
        })
    );
    assert!(pay.executions().is_empty(), "a denied call never runs");
    let told = last_tool_result(&model);
    match told {
        ToolResult::Error(error) => assert!(error.contains("over budget"), "{error}"),
        other => panic!("the model was not told of the denial: {other:?}"),
    }
}

#[test]
fn a_cancel_by_the_cli_fires_the_running_tools_cancellation_signal() {
    let db = TempStore::new();
    // Waits until its cancellation signal fires, then fails saying so.
    let pay = RecordingTool::new("pay").behaviour(Behaviour::Block);
    let (store, location, probe) = (db.open(), db.location(), pay.clone());
    let agent = Agent::new(pay_then_answer()).tool(pay.clone());
    // A lease renewed every 100 s: the renewal, which also finds a run cancelled, cannot be
    // what tells the tool within the minute `heard` waits.
    let config = Config::default()
        .lease_ttl(Duration::from_secs(300))
        .watch(Watch::default());

    let settled = with_system(|| async move {
        let (supervisor, mut rx) = subscribed(store, config, "billing", agent).await;
        spawn(&supervisor, "billing", "r1").await;
        probe.wait_executions(1).await;
        cli(&location, &["cancel", "r1", "--reason", "change freeze"]).await;
        heard(&mut rx, 1).await
    });

    assert_eq!(
        settled[0].result,
        Ok(Outcome::Cancelled {
            reason: "change freeze".into()
        })
    );
    let store = db.open();
    let run_id = RunId::from("r1");
    assert_eq!(store.run(&run_id).unwrap().state, RunState::Cancelled);
    let events = store.events(&run_id).unwrap();
    let tail: Vec<EventKind> = events.iter().rev().take(2).rev().map(|e| e.kind).collect();
    assert_eq!(tail, [EventKind::RunFinished, EventKind::ToolFinished]);
    let late = events.last().unwrap();
    assert_eq!(late.payload["late"], json!(true));
    assert!(
        late.payload["error"]
            .as_str()
            .unwrap()
            .contains("cancellation signal"),
        "the tool was told: {late:?}"
    );
    assert_eq!(pay.executions().len(), 1);
}

#[test]
fn of_two_watching_supervisors_one_resumes_each_decided_run() {
    let db = TempStore::new();
    let pay = RecordingTool::new("pay");
    let (location, stores) = (db.location(), [db.open(), db.open()]);
    let agents = [
        approving(pay_then_answer(), pay.clone()),
        approving(pay_then_answer(), pay.clone()),
    ];
    let ids: Vec<String> = (1..=4).map(|n| format!("r{n}")).collect();
    let runs = ids.clone();

    let settled = with_system(|| async move {
        let (inbox, mut rx) = subscriber();
        let mut supervisors = Vec::new();
        for (store, agent) in stores.into_iter().zip(agents) {
            let supervisor = supervise(store, watching(), "billing", agent);
            supervisor
                .send(SubscribeRuns(inbox.clone().recipient()))
                .await
                .unwrap();
            supervisors.push(supervisor);
        }
        for id in &runs {
            supervisors[0]
                .send(SpawnRun::new("billing", json!({})).with_id(id.as_str()))
                .await
                .unwrap()
                .unwrap();
        }
        heard(&mut rx, runs.len()).await;
        for id in &runs {
            cli(&location, &["approve", id, "pay-1", "--by", "alice"]).await;
        }
        heard(&mut rx, 2 * runs.len()).await
    });

    let ends: Vec<&RunSettled> = settled
        .iter()
        .filter(|s| !matches!(s.result, Ok(Outcome::WaitingForApproval { .. })))
        .collect();
    assert_eq!(ends.len(), ids.len(), "{settled:?}");
    for end in &ends {
        assert_eq!(
            end.result,
            Ok(Outcome::Succeeded {
                output: "paid".into()
            })
        );
    }
    let mut keys = idempotency_keys(&pay);
    keys.sort();
    keys.dedup();
    assert_eq!(pay.executions().len(), ids.len(), "each call ran once");
    assert_eq!(keys.len(), ids.len());
    let store = db.open();
    for id in &ids {
        let id = RunId::from(id.as_str());
        let resumes = kinds(&store, &id)
            .into_iter()
            .filter(|k| *k == EventKind::RunResumed)
            .count();
        assert_eq!(resumes, 1, "run {id} was resumed once");
    }
}

#[test]
fn a_decision_recorded_while_no_supervisor_ran_is_picked_up_at_start() {
    let db = TempStore::new();
    let pay = RecordingTool::new("pay");
    let store = db.open();
    let agent = approving(pay_then_answer(), pay.clone());
    // Paused by a supervisor without the watch, which then stops.
    with_system(|| async move {
        waiting_run(store, Config::default(), agent, "r1").await;
    });
    // Through a handle of its own, as another process would (the CLI's read-only checks may
    // meet the files of the supervisor above still closing on its threads).
    db.open()
        .record_approval(&Approval::approve(RunId::from("r1"), "pay-1", "alice"))
        .unwrap();

    let (store, agent) = (db.open(), approving(pay_then_answer(), pay.clone()));
    let settled = with_system(|| async move {
        let (_supervisor, mut rx) = subscribed(store, watching(), "billing", agent).await;
        heard(&mut rx, 1).await
    });

    assert_eq!(
        settled[0].result,
        Ok(Outcome::Succeeded {
            output: "paid".into()
        })
    );
    assert_eq!(pay.executions().len(), 1);
}

#[test]
fn a_supervisor_without_the_watch_or_the_agent_leaves_the_decided_run_waiting() {
    let db = TempStore::new();
    let pay = RecordingTool::new("pay");
    let location = db.location();
    let (plain, watcher) = (db.open(), db.open());
    let (billing, shipping) = (
        approving(pay_then_answer(), pay.clone()),
        approving(pay_then_answer(), pay.clone()),
    );

    let settled = with_system(|| async move {
        // Executes billing runs, without the watch.
        let (_plain, _) = waiting_run(plain, Config::default(), billing, "billing-1").await;
        // Watches, and has only the shipping agent.
        let (supervisor, mut rx) = subscribed(watcher, watching(), "shipping", shipping).await;
        spawn(&supervisor, "shipping", "shipping-1").await;
        heard(&mut rx, 1).await;
        cli(
            &location,
            &["approve", "billing-1", "pay-1", "--by", "alice"],
        )
        .await;
        cli(
            &location,
            &["approve", "shipping-1", "pay-1", "--by", "alice"],
        )
        .await;
        // The watch has read past the billing decision once it resumed the shipping run.
        heard(&mut rx, 2).await
    });

    assert_eq!(settled[1].run_id, RunId::from("shipping-1"));
    assert_eq!(
        settled[1].result,
        Ok(Outcome::Succeeded {
            output: "paid".into()
        })
    );
    let store = db.open();
    let billing = RunId::from("billing-1");
    assert_eq!(
        store.run(&billing).unwrap().state,
        RunState::WaitingForApproval
    );
    assert!(!kinds(&store, &billing).contains(&EventKind::RunResumed));
    assert_eq!(pay.executions().len(), 1, "only the shipping call ran");
}

/// A tool that notes the wall-clock time each call starts at.
#[derive(Clone, Default)]
struct Stamped(Arc<Mutex<Vec<(String, SystemTime)>>>);

#[async_trait(?Send)]
impl Tool for Stamped {
    fn name(&self) -> &str {
        "pay"
    }

    async fn call(&self, ctx: &ToolContext, _: &Value) -> Result<Value, ToolError> {
        let now = SystemTime::now();
        self.0.lock().unwrap().push((ctx.run_id.to_string(), now));
        Ok(json!({"paid": true}))
    }
}

/// The latency of a decision from elsewhere, with the default watch: from the commit of the
/// CLI's approval (its `approval.recorded` time, milliseconds of the system clock) to the
/// tool's start, over 20 decisions, one after the other. Prints the figures; asserts none.
///
/// `cargo test --all-features --release --test cli decisions_from_elsewhere:: -- --ignored --nocapture`
#[test]
#[ignore = "a measurement: run it by name with --ignored --nocapture"]
fn latency_from_a_cli_approval_to_the_tool_starting() {
    const RUNS: usize = 20;
    let db = TempStore::new();
    let stamped = Stamped::default();
    let (store, location, agent) = (
        db.open(),
        db.location(),
        approving(
            ScriptedModel::new(
                (0..RUNS)
                    .flat_map(|_| {
                        [
                            ModelResponse::calls(vec![ToolCall::new(
                                "pay-1",
                                "pay",
                                json!({"cents": 100}),
                            )]),
                            ModelResponse::answer("paid"),
                        ]
                    })
                    .collect(),
            ),
            stamped.clone(),
        ),
    );
    let ids: Vec<String> = (1..=RUNS).map(|n| format!("r{n:02}")).collect();
    let runs = ids.clone();
    with_system(|| async move {
        let (supervisor, mut rx) = subscribed(
            store,
            Config::default().watch(Watch::default()),
            "billing",
            agent,
        )
        .await;
        for (n, id) in runs.iter().enumerate() {
            spawn(&supervisor, "billing", id.as_str()).await;
            // One run at a time: the scripted model answers in turn.
            heard(&mut rx, 2 * n + 1).await;
            // A pause spread over a poll period (the golden ratio's steps): decisions that
            // follow each other at the loop's own pace would fall at one point of every period.
            let spread = (n as f64 * 0.618_033_988_75).fract();
            actix_rt::time::sleep(Duration::from_millis(50).mul_f64(spread)).await;
            cli(&location, &["approve", id, "pay-1", "--by", "alice"]).await;
            heard(&mut rx, 2 * n + 2).await;
        }
    });

    let store = db.open();
    let started = stamped.0.lock().unwrap().clone();
    let mut millis: Vec<i64> = ids
        .iter()
        .map(|id| {
            let recorded = store
                .events(&RunId::from(id.as_str()))
                .unwrap()
                .into_iter()
                .find(|e| e.kind == EventKind::ApprovalRecorded)
                .unwrap()
                .at;
            let (_, start) = started.iter().find(|(run, _)| run == id).unwrap();
            let took = start.duration_since(recorded).unwrap_or_default();
            took.as_millis() as i64
        })
        .collect();
    millis.sort();
    let at = |q: f64| millis[((millis.len() - 1) as f64 * q).round() as usize];
    println!(
        "decision to tool start over {RUNS} CLI approvals (poll every 50 ms): p50 {} ms, p99 {} ms, min {} ms, max {} ms",
        at(0.5),
        at(0.99),
        millis[0],
        millis[millis.len() - 1]
    );
}

#[test]
fn a_resume_that_fails_is_tried_again_and_the_decided_run_finishes() {
    let db = TempStore::new();
    let pay = RecordingTool::new("pay");
    // Asks for a person at first; panics when asked again at the first resume; then leaves
    // the call to the recorded approval.
    let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = asked.clone();
    let policy = move |_: &RunId, _: &ToolCall| match counter
        .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
    {
        1 => panic!("the policy service is down"),
        _ => agentrt::Decision::RequireApproval("a person decides".into()),
    };
    let agent = Agent::new(pay_then_answer())
        .tool(pay.clone())
        .policy(policy);
    let (store, location) = (db.open(), db.location());
    let settled = with_system(|| async move {
        let (_supervisor, mut rx) = waiting_run(store, watching(), agent, "r1").await;
        cli(&location, &["approve", "r1", "pay-1", "--by", "alice"]).await;
        let finished = actix_rt::time::timeout(
            Duration::from_secs(60),
            rx.wait_for(|seen| {
                seen.iter()
                    .any(|s| matches!(s.result, Ok(Outcome::Succeeded { .. })))
            }),
        );
        finished.await.expect("the run finishes").unwrap().clone()
    });
    assert!(
        settled
            .iter()
            .any(|s| s.result.as_ref().is_err_and(|e| e.contains("panic"))),
        "the first resume failed: {settled:?}"
    );
    assert_eq!(pay.executions().len(), 1, "the approved call ran once");
    assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 3);
    assert_eq!(
        db.open().run(&RunId::from("r1")).unwrap().state,
        RunState::Succeeded
    );
}
