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
