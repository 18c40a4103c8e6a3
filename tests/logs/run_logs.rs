//! What an operator reads in the logs: a line, with structured fields, when a run starts,
//! waits for an approval, is resumed, finishes, fails, is taken over after a crash, or loses
//! its lease.

use std::{
    io::Write,
    sync::{Arc, Mutex, OnceLock},
};

use agentrt::{
    Agent, Config, ModelError, ModelResponse, Outcome, RunId, StartRun, SubscribeLeaseLost,
    ToolCall,
    testkit::{Behaviour, LeaseLostLog, RecordingTool, ScriptedModel, TempStore, with_system},
};
use serde_json::json;

use crate::support::{
    PATIENCE, call_then_answer, crash_in_tool, email_approved_by_carol, fast_lease,
    resume_when_free_on, supervise,
};

/// Every line this binary's tests log. The subscriber is the process's: the lines come from
/// the actix systems' threads and from the lease keepers' own.
#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn lines() -> &'static Lines {
    static LINES: OnceLock<Lines> = OnceLock::new();
    LINES.get_or_init(|| {
        let lines = Lines::default();
        let writer = lines.clone();
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .init();
        lines
    })
}

/// The fields of the lines with `message` about `run_id`: what follows the message (the
/// event's own fields, not its spans').
fn logged(level: &str, message: &str, run_id: &str) -> Vec<String> {
    let text = String::from_utf8(lines().0.lock().unwrap().clone()).unwrap();
    let id = format!("run_id={run_id} ");
    text.lines()
        .filter(|line| line.contains(&format!(" {level} ")))
        .filter_map(|line| line.split_once(&format!(": {message} ")))
        .map(|(_, fields)| format!("{fields} "))
        .filter(|fields| fields.starts_with(&id))
        .collect()
}

fn assert_logged(level: &str, message: &str, run_id: &str, fields: &[&str]) {
    let found = logged(level, message, run_id);
    assert!(
        found
            .iter()
            .any(|line| fields.iter().all(|f| line.contains(&format!("{f} ")))),
        "{level} {message:?} with {fields:?}, among {found:#?}"
    );
}

#[test]
fn a_run_that_waits_is_approved_and_finishes_says_so_at_each_step() {
    lines();
    let db = TempStore::new();
    let outcome = email_approved_by_carol(db.open(), "logs-approved");
    assert!(matches!(outcome, Outcome::Succeeded { .. }), "{outcome:?}");

    let run = "logs-approved";
    assert_logged(
        "INFO",
        "run started",
        run,
        &["agent=support", "fencing_token=1"],
    );
    assert_logged(
        "INFO",
        "run waiting for approval",
        run,
        &["step=2", "call_id=c1", "tool=email", "reason=policy"],
    );
    assert_logged(
        "INFO",
        "run resumed",
        run,
        &[
            "call_id=c1",
            "tool=email",
            "approved=true",
            "decided_by=carol",
            "fencing_token=2",
        ],
    );
    // A model step, the tool call, the model's answer.
    assert_logged("INFO", "run finished", run, &["state=SUCCEEDED", "steps=3"]);
}

#[test]
fn a_failing_run_logs_its_error() {
    lines();
    let db = TempStore::new();
    let store = db.open();
    let model = ScriptedModel::with_results(vec![Err(ModelError::fatal("the key was revoked"))]);
    let outcome = with_system(|| async move {
        let supervisor = supervise(store, Config::default(), "support", Agent::new(model));
        let start = StartRun::new("support", json!({})).with_id("logs-failed");
        supervisor.send(start).await.unwrap().unwrap().outcome
    });
    assert!(matches!(outcome, Outcome::Failed { .. }), "{outcome:?}");

    let found = logged("INFO", "run failed", "logs-failed");
    assert!(
        found.iter().any(|line| line.contains("state=FAILED ")
            && line.contains("steps=1 ")
            && line.contains("the key was revoked")),
        "{found:#?}"
    );
    assert!(logged("INFO", "run finished", "logs-failed").is_empty());
}

#[test]
fn a_run_taken_over_after_a_crash_names_the_owner_it_was_taken_from() {
    lines();
    let db = TempStore::new();
    let model = call_then_answer("c1", "charge", json!({}), "charged");
    let charge = RecordingTool::new("charge").idempotent(true);
    charge.set_behaviour(Behaviour::Block);
    let agent = Agent::new(model.clone()).tool(charge.clone());
    let start = StartRun::new("billing", json!({})).with_id("logs-crashed");
    // The system goes away with the tool in flight.
    crash_in_tool(&db, "billing", agent, start, &charge);
    let first = db.open().lease(&RunId::from("logs-crashed")).unwrap();
    let first = first.expect("the crashed owner's lease is left").owner;

    charge.set_behaviour(Behaviour::Succeed);
    let agent = Agent::new(model).tool(charge);
    let id = RunId::from("logs-crashed");
    let outcome = resume_when_free_on(db.open(), fast_lease(), "billing", agent, &id, PATIENCE);
    assert!(matches!(
        outcome.unwrap().outcome,
        Outcome::Succeeded { .. }
    ));

    assert_logged(
        "INFO",
        "run taken over",
        "logs-crashed",
        &[
            &format!("previous_owner={first}"),
            "fencing_token=2",
            "interrupted=1",
        ],
    );
}

#[test]
fn a_lease_lost_to_a_cancel_is_a_warning_and_the_run_finishes_cancelled() {
    lines();
    let db = TempStore::new();
    let model = ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new("c1", "slow", json!({}))]),
        ModelResponse::answer("done"),
    ]);
    let slow = RecordingTool::new("slow").behaviour(Behaviour::BlockIgnoringCancel);
    let agent = Agent::new(model).tool(slow.clone());
    let (store, operator) = (db.open(), db.open());
    let outcome = with_system(|| async move {
        let supervisor = supervise(store, fast_lease(), "support", agent);
        let lost = LeaseLostLog::new();
        supervisor
            .send(SubscribeLeaseLost(lost.recipient()))
            .await
            .unwrap();
        let start = StartRun::new("support", json!({})).with_id("logs-cancelled");
        let call = supervisor.send(start);
        let call = actix_rt::spawn(async move { call.await.unwrap() });
        slow.wait_executions(1).await;
        // Cancelled through another connection: the supervisor hears of it at its next renewal.
        operator
            .cancel(&RunId::from("logs-cancelled"), "wrong customer")
            .unwrap();
        lost.wait_for(1).await;
        slow.release();
        call.await.unwrap().unwrap().outcome
    });
    assert!(matches!(outcome, Outcome::Cancelled { .. }), "{outcome:?}");

    let run = "logs-cancelled";
    assert_logged(
        "WARN",
        "lease lost",
        run,
        &["fencing_token=1", "reason=released or cancelled"],
    );
    assert_logged(
        "INFO",
        "run finished",
        run,
        &["state=CANCELLED", "reason=wrong customer"],
    );
}
