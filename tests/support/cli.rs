//! The command line's tests: the `agentrt` binary as a command, and the database they run it
//! against, seeded the same way in each of them.

use std::{
    ffi::OsStr,
    path::Path,
    pin::pin,
    time::{Duration, SystemTime},
};

use super::supervise;
use agentrt::{
    Agent, Config, ModelResponse, RequireApprovalFor, RunId, StartRun, Store, Supervisor, ToolCall,
    Usage,
    testkit::{Behaviour, RecordingTool, ScriptedModel, TempStore, with_system},
};
use assert_cmd::Command;
use serde_json::json;

/// The `agentrt` binary, on the database at `db` (a path or a URL).
pub fn agentrt(db: impl AsRef<OsStr>) -> Command {
    let mut command = Command::cargo_bin("agentrt").unwrap();
    command.arg("--db").arg(db);
    command
}

/// A database with a finished run `done`, a run `wait` waiting for approval of call `pay-1`,
/// and a run `crashed` whose process died mid-run (its short lease already stale): [`seed`]'s.
pub fn fixture() -> TempStore {
    let db = TempStore::sqlite();
    seed(&db.path());
    db
}

/// Seeds the database at `path` with a finished run `done`, a run `wait` waiting for approval
/// of call `pay-1`, and a run `crashed` whose process died mid-run (its short lease already
/// stale).
pub fn seed(path: &Path) {
    let script = || {
        let paid = |response: ModelResponse, input_tokens, output_tokens| ModelResponse {
            usage: Some(Usage::new(input_tokens, output_tokens)),
            model: Some("scripted-1".into()),
            ..response
        };
        ScriptedModel::new(vec![
            paid(
                ModelResponse::calls(vec![ToolCall::new("pay-1", "pay", json!({"cents": 100}))]),
                10,
                2,
            ),
            paid(ModelResponse::answer("paid"), 20, 3),
        ])
    };
    let pay = RecordingTool::new("pay");
    let stuck = RecordingTool::new("pay").behaviour(Behaviour::Block);
    let store = Store::open(path).unwrap();
    let (waiting, plain, blocking, probe) = (
        Agent::new(script())
            .tool(pay.clone())
            .policy(RequireApprovalFor::tools(["pay"])),
        Agent::new(script()).tool(pay.clone()),
        Agent::new(script()).tool(stuck.clone()),
        stuck.clone(),
    );
    with_system(|| async move {
        // The default TTL: these runs must finish whatever the machine's pace, and a short lease
        // would be lost if a renewal came late.
        let sup = Supervisor::builder(store.clone())
            .agent("waits", waiting)
            .agent("plain", plain)
            .start()
            .unwrap();
        sup.send(StartRun::new("plain", json!({})).with_id("done"))
            .await
            .unwrap()
            .unwrap();
        sup.send(StartRun::new("waits", json!({})).with_id("wait"))
            .await
            .unwrap()
            .unwrap();
        // A short TTL, so that the lease is stale soon after the crash; not so short that a
        // renewal late on a loaded machine lets it lapse before the tool runs.
        let doomed = supervise(
            store,
            Config::default().lease_ttl(Duration::from_millis(500)),
            "plain",
            blocking,
        );
        // The crash comes once the tool runs, or once the start gives up because a late renewal
        // let the short lease lapse first: either way the run is left RUNNING under a lease of
        // the dead process.
        let started = doomed.send(StartRun::new("plain", json!({})).with_id("crashed"));
        let executing = probe.wait_executions(1);
        futures_util::future::select(pin!(started), pin!(executing)).await;
    });
    // Wait until the stored lease is stale, reading it again after each expiry: the dead
    // process's keeper may renew once more while its thread winds down. A stale lease stays
    // stale: a renewal extends only a live one.
    let store = Store::open(path).unwrap();
    loop {
        let lease = store
            .lease(&RunId::from("crashed"))
            .unwrap()
            .expect("leased");
        match lease.expires_at.duration_since(SystemTime::now()) {
            Ok(wait) => std::thread::sleep(wait + Duration::from_millis(1)),
            Err(_) => break,
        }
    }
}

/// The question of [`seed_waits`]'s run `question`, and its schema.
pub const QUESTION: &str = "Which account?";

/// A database with runs that wait, [`seed_waits`]'s.
pub fn waits_fixture() -> TempStore {
    let db = TempStore::sqlite();
    seed_waits(&db.path());
    db
}

/// Seeds the database file at `path` with [`seed_waits_into`]'s runs, and returns once every
/// connection of the seed has closed.
pub fn seed_waits(path: &Path) {
    seed_waits_into(Store::open(path).unwrap());
    // The supervisor's connections close as its threads wind down, the last one removing the
    // log and its index: a test that compares the files starts once they have. Two connections
    // closing at the same moment on two threads may each see the other open and both leave the
    // log, so a store is opened and closed again until one close finds itself the last.
    let log = path.with_extension("db-wal");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while log.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the seed's store never closed"
        );
        std::thread::sleep(Duration::from_millis(10));
        drop(Store::open(path).unwrap());
    }
}

/// Seeds `store` with runs that wait, each at its call `c1` of step 2, then answer `done`:
/// `question` for an answer to [`QUESTION`] (an object with an `account` string), `confirm`
/// for an answer to `Go ahead?` (any JSON), `payment` for an event named `payment`, `nap` for
/// a timer an hour away (reason `check tomorrow`), and `parent` for its child run `parent/2`
/// of agent `researcher`, which no supervisor executes.
pub fn seed_waits_into(store: Store) {
    let one_call = |tool: &str, args: serde_json::Value| {
        ScriptedModel::new(vec![
            ModelResponse::calls(vec![ToolCall::new("c1", tool, args)]),
            ModelResponse::answer("done"),
        ])
    };
    let schema = json!({
        "type": "object",
        "properties": {"account": {"type": "string"}},
        "required": ["account"]
    });
    let agents = vec![
        (
            "question",
            Agent::new(one_call(
                "ask_person",
                json!({"question": QUESTION, "schema": schema}),
            ))
            .ask_person(),
        ),
        (
            "confirm",
            Agent::new(one_call("ask_person", json!({"question": "Go ahead?"}))).ask_person(),
        ),
        (
            "payment",
            Agent::new(one_call("wait_for_event", json!({"name": "payment"}))).wait_for_event(),
        ),
        (
            "nap",
            Agent::new(one_call(
                "sleep_until",
                json!({"seconds": 3600, "reason": "check tomorrow"}),
            ))
            .sleep_until(),
        ),
        (
            "parent",
            Agent::new(one_call("research", json!({"task": "find the paper"}))).delegate(
                "research",
                "researcher",
                "Hand a research task to the research agent.",
            ),
        ),
    ];
    with_system(|| async move {
        // Each run's agent is named as the run; the child's agent is nobody's here.
        let mut builder = Supervisor::builder(store);
        let ids: Vec<&str> = agents.iter().map(|(id, _)| *id).collect();
        for (id, agent) in agents {
            builder = builder.agent(id, agent);
        }
        let supervisor = builder.start().unwrap();
        for id in ids {
            let reply = supervisor
                .send(StartRun::new(id, json!({})).with_id(id))
                .await
                .unwrap()
                .unwrap();
            assert!(
                matches!(reply.outcome, agentrt::Outcome::Waiting { .. }),
                "{id}: {:?}",
                reply.outcome
            );
        }
    });
}
