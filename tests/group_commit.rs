//! Group commit: moves of different runs that arrive together share one transaction, and
//! every run's log is exactly what it would be with one commit per move.

use agentrt::{
    Agent, Config, EventKind, ModelResponse, Outcome, RunId, StartRun, Supervisor, ToolCall,
    testkit::{RecordingTool, ScriptedModel, TempStore, with_system},
};
use serde_json::json;

const RUNS: usize = 40;

fn agent() -> Agent {
    let model = ScriptedModel::new(vec![
        ModelResponse::calls(vec![
            ToolCall::new("a", "t", json!({})),
            ToolCall::new("b", "t", json!({})),
        ]),
        ModelResponse::calls(vec![ToolCall::new("c", "t", json!({}))]),
        ModelResponse::answer("done"),
    ]);
    Agent::new(model).tool(RecordingTool::new("t"))
}

/// Runs `RUNS` runs at once; returns each run's event kinds and steps.
fn logs(group_commit: bool) -> Vec<Vec<(EventKind, Option<u32>, u64)>> {
    let db = TempStore::new();
    let store = db.open();
    with_system(|| async move {
        let config = Config::default().group_commit(group_commit);
        let sup = Supervisor::builder(store)
            .config(config)
            .agent("a", agent())
            .start()
            .unwrap();
        let calls: Vec<_> = (0..RUNS)
            .map(|i| {
                actix_rt::spawn(sup.send(StartRun::new("a", json!({})).with_id(format!("r{i}"))))
            })
            .collect();
        for call in calls {
            let reply = call.await.unwrap().unwrap().unwrap();
            assert_eq!(
                reply.outcome,
                Outcome::Succeeded {
                    output: "done".into()
                }
            );
        }
    });
    let store = db.open();
    (0..RUNS)
        .map(|i| {
            store
                .events(&RunId::from(format!("r{i}").as_str()))
                .unwrap()
                .into_iter()
                .map(|e| (e.kind, e.step, e.seq))
                .collect()
        })
        .collect()
}

#[test]
fn concurrent_runs_log_the_same_events_in_the_same_order_with_and_without_group_commit() {
    let grouped = logs(true);
    let single = logs(false);
    assert_eq!(grouped, single);
    // And that is the ordinary sequence: gapless, every step started and finished.
    for log in &grouped {
        assert_eq!(log.len(), 1 + 3 * 2 + 3 * 3 + 1);
        assert!(
            log.iter()
                .enumerate()
                .all(|(i, (_, _, seq))| *seq == i as u64 + 1)
        );
        assert_eq!(log.last().unwrap().0, EventKind::RunFinished);
    }
}
