//! A deploy, with real processes: a child supervisor gets SIGTERM while a tool runs. Within the
//! drain's deadline the tool finishes, its outcome is recorded and the run is handed over: a
//! supervisor in the parent continues it at once (its lease TTL is a minute, and the test
//! fails long before that), with nothing interrupted and nothing reconciled. Past the
//! deadline, a tool that ignores its cancellation is left behind as by a crash.

use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use agentrt::{
    Agent, Config, Drain, Event, EventKind, Outcome, Recovery, RunId, RunState, Store, Supervisor,
    Tool, ToolContext, ToolError, async_trait,
    testkit::{RecordingTool, TempStore, with_system},
};
use serde_json::{Value, json};

use crate::support::{
    call_then_answer, child, kinds,
    settled::{self, subscribed},
    spawn,
};

const DB_VAR: &str = "AGENTRT_TEST_DRAIN_CHILD_DB";
const GATE_VAR: &str = "AGENTRT_TEST_DRAIN_CHILD_GATE";
const MODE_VAR: &str = "AGENTRT_TEST_DRAIN_CHILD_MODE";

/// A lease the parent could never wait out within the test.
const LONG_TTL: Duration = Duration::from_secs(60);

/// A tool that reports it runs, then returns once the gate file exists: the parent opens the
/// gate after its SIGTERM, so the call is in flight when the drain begins. With `ignore`, it
/// never returns, whatever its cancellation signal says.
struct Gated {
    gate: PathBuf,
    ignore: bool,
}

#[async_trait(?Send)]
impl Tool for Gated {
    fn name(&self) -> &str {
        "provision"
    }

    async fn call(&self, _: &ToolContext, _: &Value) -> Result<Value, ToolError> {
        println!("TOOL_RUNNING");
        loop {
            if !self.ignore && self.gate.exists() {
                return Ok(json!({"provisioned": "xl"}));
            }
            actix_rt::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

fn agent(tool: impl Tool) -> Agent {
    Agent::new(call_then_answer(
        "c1",
        "provision",
        json!({"size": "xl"}),
        "done",
    ))
    .tool(tool)
}

/// The child's side: a supervisor wired to drain on SIGTERM, one run mid-tool. It prints the
/// drain's report and exits when the drain ends.
#[test]
#[ignore = "the child process of the drain tests below"]
fn child_drains_on_sigterm() {
    let store = Store::connect(&std::env::var(DB_VAR).unwrap()).unwrap();
    let gate = PathBuf::from(std::env::var(GATE_VAR).unwrap());
    let ignore = std::env::var(MODE_VAR).unwrap() == "ignore";
    let drain = if ignore {
        Drain::within(Duration::from_millis(200)).grace(Duration::from_millis(200))
    } else {
        Drain::within(Duration::from_secs(30))
    };
    let ttl = if ignore {
        Duration::from_millis(800)
    } else {
        LONG_TTL
    };
    let system = actix_rt::System::new();
    system.block_on(async move {
        let config = Config::default().lease_owner("child").lease_ttl(ttl);
        let sup = Supervisor::builder(store)
            .config(config)
            .agent("provision", agent(Gated { gate, ignore }))
            .start()
            .unwrap();
        let drained = agentrt::drain_on_signal(sup.clone(), drain);
        actix_rt::spawn(async move {
            let report = drained.await;
            println!(
                "DRAINED handed_over={} left_running={}",
                report.handed_over.len(),
                report.left_running.len()
            );
            actix_rt::System::current().stop();
        });
        spawn(&sup, "provision", "deploy-1").await;
    });
    // The system runs until the drain stops it; the process then exits, as a service does.
    system.run().unwrap();
}

/// The child process and the lines it prints, read on a thread of their own.
struct Child {
    process: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Child {
    /// What follows `word` on the next line that holds it; the test fails if none comes
    /// within a minute (the child is killed), rather than hang.
    fn report(&mut self, word: &str) -> String {
        loop {
            match self.lines.recv_timeout(Duration::from_secs(60)) {
                Ok(line) => {
                    if let Some((_, rest)) = line.split_once(word) {
                        return rest.trim().to_owned();
                    }
                }
                Err(err) => {
                    let _ = self.process.kill();
                    panic!("the child did not report {word:?}: {err}");
                }
            }
        }
    }
}

/// Starts the child on the store at `location` and waits for its tool to run.
fn child_mid_tool(location: &str, gate: &std::path::Path, mode: &str) -> Child {
    let mut process = child::test(module_path!(), "child_drains_on_sigterm")
        .env(DB_VAR, location)
        .env(GATE_VAR, gate)
        .env(MODE_VAR, mode)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = std::io::BufReader::new(process.stdout.take().unwrap());
    let (send, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in stdout.lines().map_while(Result::ok) {
            if send.send(line).is_err() {
                return;
            }
        }
    });
    let mut child = Child { process, lines };
    child.report("TOOL_RUNNING");
    child
}

fn sigterm(child: &Child) {
    // SAFETY: a plain kill(2) of our own child's pid.
    let sent = unsafe { libc::kill(child.process.id() as libc::pid_t, libc::SIGTERM) };
    assert_eq!(sent, 0, "SIGTERM could not be sent");
}

fn of_kind(events: &[Event], kind: EventKind) -> Vec<&Event> {
    events.iter().filter(|e| e.kind == kind).collect()
}

#[test]
fn sigterm_mid_tool_hands_the_run_over_with_no_ttl_wait_and_nothing_to_reconcile() {
    let db = TempStore::new();
    drop(db.open());
    let gate = tempfile::tempdir().unwrap();
    let gate = gate.path().join("open");

    // The parent's tool would record any call that reached it: none should.
    let parent_tool = RecordingTool::new("provision");
    let (store, parent_agent) = (db.open(), agent(parent_tool.clone()));
    let location = db.location();
    let gate_path = gate.clone();
    let (settled, handover) = with_system(|| async move {
        // Recovery with a period far beyond the test: only the feed can make it prompt.
        let config = Config::default()
            .lease_owner("parent")
            .lease_ttl(LONG_TTL)
            .recovery(Recovery::default().every(Duration::from_secs(3600)));
        let sup = Supervisor::builder(store)
            .config(config)
            .agent("provision", parent_agent)
            .start()
            .unwrap();
        let (_inbox, mut rx) = subscribed(&sup).await;
        let (mut child, signalled) = actix_rt::task::spawn_blocking(move || {
            let child = child_mid_tool(&location, &gate_path, "finish");
            sigterm(&child);
            let signalled = Instant::now();
            std::fs::write(&gate_path, b"").unwrap();
            (child, signalled)
        })
        .await
        .unwrap();
        let heard = actix_rt::time::timeout(Duration::from_secs(20), settled::heard(&mut rx, 1))
            .await
            .expect("the parent continued the run well within the lease TTL");
        let handover = signalled.elapsed();
        let exit = actix_rt::task::spawn_blocking(move || {
            let drained = child.report("DRAINED");
            (drained, child.process.wait().unwrap())
        })
        .await
        .unwrap();
        assert_eq!(exit.0, "handed_over=1 left_running=0");
        assert!(exit.1.success(), "the child exited cleanly: {:?}", exit.1);
        (heard, handover)
    });
    assert_eq!(settled.len(), 1);
    assert_eq!(settled[0].run_id, RunId::from("deploy-1"));
    assert!(
        matches!(&settled[0].result, Ok(Outcome::Succeeded { output }) if output == "done"),
        "{:?}",
        settled[0].result
    );
    println!("SIGTERM to the run's end in the other process: {handover:?}");

    let store = db.open();
    let run_id = RunId::from("deploy-1");
    assert_eq!(store.run(&run_id).unwrap().state, RunState::Succeeded);
    let events = store.events(&run_id).unwrap();
    let kinds = kinds(&events);
    for absent in [
        EventKind::StepInterrupted,
        EventKind::StepReconciled,
        EventKind::LeaseTakenOver,
    ] {
        assert!(!kinds.contains(&absent), "{absent} in {kinds:?}");
    }
    // The child's tool finished and its outcome is recorded; the parent ran no tool.
    let finished = of_kind(&events, EventKind::ToolFinished);
    assert_eq!(finished.len(), 1, "{kinds:?}");
    assert_eq!(finished[0].payload["output"], json!({"provisioned": "xl"}));
    assert!(parent_tool.executions().is_empty());
    // The handover is in the log: released by the child, taken up by the parent.
    let released = of_kind(&events, EventKind::RunReleased);
    assert_eq!(released.len(), 1, "{kinds:?}");
    assert_eq!(
        released[0].payload["owner"].as_str().map(owner_name),
        Some("child")
    );
    let handed = of_kind(&events, EventKind::RunHandedOver);
    assert_eq!(handed.len(), 1, "{kinds:?}");
    assert_eq!(
        handed[0].payload["previous_owner"],
        released[0].payload["owner"]
    );
    assert_eq!(
        handed[0].payload["new_owner"].as_str().map(owner_name),
        Some("parent")
    );
    // The tool's outcome may have come before the drain was heard: the model call reserved
    // with it was then abandoned, and the next owner dispatched it again.
    let abandoned = kinds
        .windows(2)
        .any(|w| w == [EventKind::ModelStarted, EventKind::RunReleased]);
    assert_eq!(
        released[0].payload.get("abandoned").is_some(),
        abandoned,
        "{}",
        released[0].payload
    );
    let order: Vec<EventKind> = kinds
        .iter()
        .copied()
        .skip_while(|k| *k != EventKind::ToolFinished)
        .filter(|k| !abandoned || *k != EventKind::ModelStarted)
        .take(4)
        .collect();
    assert_eq!(
        order,
        [
            EventKind::ToolFinished,
            EventKind::RunReleased,
            EventKind::RunResumed,
            EventKind::RunHandedOver
        ]
    );
    agentrt::testkit::assert_no_run_leased(&store);
}

/// The configured owner of a stored lease owner (`NAME/suffix`).
fn owner_name(owner: &str) -> &str {
    owner.split('/').next().unwrap_or(owner)
}

#[test]
fn past_the_deadline_a_tool_that_ignores_its_cancellation_is_left_as_a_crash() {
    let db = TempStore::new();
    drop(db.open());
    let gate = tempfile::tempdir().unwrap();
    let gate = gate.path().join("never");
    let child = {
        let mut child = child_mid_tool(&db.location(), &gate, "ignore");
        sigterm(&child);
        let drained = child.report("DRAINED");
        assert_eq!(drained, "handed_over=0 left_running=1");
        child
    };
    let mut child = child;
    assert!(child.process.wait().unwrap().success());

    // Exactly a crash: the step stays in flight under the dead child's lease, until its TTL.
    let store = db.open();
    let run_id = RunId::from("deploy-1");
    let kinds_left = kinds(&store.events(&run_id).unwrap());
    assert_eq!(
        kinds_left.last(),
        Some(&EventKind::ToolStarted),
        "{kinds_left:?}"
    );
    assert!(store.lease(&run_id).unwrap().is_some(), "the lease is held");

    // The next owner takes it over once the lease expires, and reconciles the call: this tool
    // is idempotent, so it runs again, once.
    let tool = RecordingTool::new("provision").idempotent(true);
    let (store, agent) = (db.open(), agent(tool.clone()));
    let settled = with_system(|| async move {
        let config = Config::default()
            .lease_owner("parent")
            .recovery(Recovery::default().every(Duration::from_millis(100)));
        let sup = Supervisor::builder(store)
            .config(config)
            .agent("provision", agent)
            .start()
            .unwrap();
        let (_inbox, mut rx) = subscribed(&sup).await;
        settled::heard(&mut rx, 1).await
    });
    assert!(matches!(settled[0].result, Ok(Outcome::Succeeded { .. })));
    let events = db.open().events(&run_id).unwrap();
    let kinds = kinds(&events);
    assert!(kinds.contains(&EventKind::LeaseTakenOver), "{kinds:?}");
    assert!(kinds.contains(&EventKind::StepInterrupted), "{kinds:?}");
    assert_eq!(of_kind(&events, EventKind::StepReconciled).len(), 1);
    assert!(!kinds.contains(&EventKind::RunReleased), "{kinds:?}");
    assert_eq!(tool.executions().len(), 1);
}
