//! The store actor copies the write-ahead log into the database file on its own schedule while
//! it commits, so the log does not grow without bound while a supervisor runs.

use std::time::{Duration, Instant};

use agentrt::{
    Agent, Config, ModelResponse, Outcome, StartRun, ToolCall,
    testkit::{RecordingTool, ScriptedModel, TempStore, with_system},
};
use serde_json::json;

use crate::support::supervise;

fn file_len(path: &std::path::Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

#[test]
fn the_store_actor_checkpoints_the_log_while_it_commits() {
    // An SQLite file on either pass: its log and its checkpoints are the SQLite backend's.
    let db = TempStore::sqlite();
    let store = db.open();
    // Kept open past the actors' system, whose threads may or may not have let theirs go by
    // the time the log is looked at: the log is deleted with the last connection.
    let open = store.clone();
    let path = db.path();
    let wal = path.with_extension("db-wal");
    // Every connection has automatic checkpoints off: only the store actor's schedule copies
    // pages into the database file while the store is open.
    let before = file_len(&path);
    let model = ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new(
            "a",
            "t",
            json!({ "pad": "x".repeat(2000) }),
        )]),
        ModelResponse::answer("done"),
    ]);
    let agent = Agent::new(model).tool(RecordingTool::new("t"));
    let runs = with_system(move || async move {
        let sup = supervise(store, Config::default(), "a", agent);
        // Runs until the database file grows: the schedule copies once per period of commits.
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut runs = 0;
        while file_len(&path) <= before {
            assert!(
                Instant::now() < deadline,
                "nothing was copied into the database file after {runs} runs"
            );
            let reply = sup
                .send(StartRun::new("a", json!({})))
                .await
                .unwrap()
                .unwrap();
            assert!(matches!(reply.outcome, Outcome::Succeeded { .. }));
            runs += 1;
        }
        runs
    });
    assert!(runs > 0);
    assert!(file_len(&wal) > 0, "the log is still in use, not deleted");
    drop(open);
}
