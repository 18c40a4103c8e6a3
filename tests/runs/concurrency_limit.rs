//! A supervisor executes at most its configured number of runs at once; the others wait their
//! turn, durably: inserted before they wait, with no lease, so that a crash loses none.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use agentrt::{
    Agent, Config, EventKind, ModelResponse, Outcome, RunId, RunState, SpawnRun, StartRun, Tool,
    ToolCall, ToolContext, ToolError, async_trait,
    testkit::{Behaviour, RecordingTool, ScriptedModel, TempStore, with_system},
};
use serde_json::{Value, json};

use settled::{heard, subscribed};

use crate::support::{settled, spawn, supervise};

/// Counts the calls in progress and keeps the most seen at once: a run executes one tool
/// call at a time, so this is a floor under the runs executing at once.
#[derive(Clone, Default)]
struct Overlap {
    now: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
    calls: Arc<AtomicUsize>,
}

#[async_trait(?Send)]
impl Tool for Overlap {
    fn name(&self) -> &str {
        "work"
    }

    async fn call(&self, _: &ToolContext, _: &Value) -> Result<Value, ToolError> {
        let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        self.calls.fetch_add(1, Ordering::SeqCst);
        // Long enough for the other slots' runs to reach their call too.
        actix_rt::time::sleep(Duration::from_millis(5)).await;
        self.now.fetch_sub(1, Ordering::SeqCst);
        Ok(json!("done"))
    }
}

fn work_then_answer() -> ScriptedModel {
    ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new("c1", "work", json!({}))]),
        ModelResponse::answer("done"),
    ])
}

fn queued(events: &[agentrt::Event]) -> bool {
    events[0].kind == EventKind::RunStarted && events[0].payload["queued"] == json!(true)
}

#[test]
fn the_concurrency_limit_holds_with_a_thousand_runs_started_at_once() {
    const RUNS: usize = 1_000;
    const LIMIT: usize = 10;
    let db = TempStore::new();
    let tool = Overlap::default();
    let (store, probe) = (db.open(), tool.clone());
    let answered = with_system(|| async move {
        let config = Config::default()
            .max_concurrent_runs(LIMIT)
            .lease_ttl(Duration::from_secs(5));
        let sup = supervise(
            store.clone(),
            config,
            "work",
            Agent::new(work_then_answer()).tool(probe),
        );
        let (_inbox, mut rx) = subscribed(&sup).await;
        let spawns = (0..RUNS).map(|n| {
            sup.send(SpawnRun::new("work", json!({ "n": n })).with_id(format!("run-{n:04}")))
        });
        let ids: Vec<RunId> = futures_util::future::join_all(spawns)
            .await
            .into_iter()
            .map(|answer| answer.unwrap().unwrap())
            .collect();
        // Every run answered for is in the store, executing or waiting its turn.
        let stored = store.runs(None).unwrap();
        assert_eq!(stored.len(), RUNS, "every answered run is durable");
        let settled = heard(&mut rx, RUNS).await;
        (ids, settled)
    });
    let (ids, settled) = answered;
    assert_eq!(ids.len(), RUNS);
    assert_eq!(settled.len(), RUNS);
    for s in &settled {
        assert!(
            matches!(s.result, Ok(Outcome::Succeeded { .. })),
            "{}: {:?}",
            s.run_id,
            s.result
        );
    }
    let most = tool.most.load(Ordering::SeqCst);
    assert!(
        most <= LIMIT,
        "{most} runs executed at once, past the limit"
    );
    assert!(most > 1, "runs executed side by side ({most} at most)");
    assert_eq!(tool.calls.load(Ordering::SeqCst), RUNS, "one call per run");

    let store = db.open();
    let mut waited = 0;
    for id in &ids {
        assert_eq!(store.run(id).unwrap().state, RunState::Succeeded);
        let events = store.events(id).unwrap();
        if queued(&events) {
            waited += 1;
            // Its turn came: it was taken over with the first fencing token.
            let resumed = events
                .iter()
                .find(|e| e.kind == EventKind::RunResumed)
                .expect("a queued run is resumed when its turn comes");
            assert_eq!(resumed.payload["fencing_token"], json!(1));
        }
    }
    assert!(
        waited > 0,
        "with {RUNS} runs and {LIMIT} slots, some waited"
    );
    agentrt::testkit::assert_no_run_leased(&store);
}

#[test]
fn a_run_past_the_limit_waits_in_the_store_and_its_start_answers_at_its_end() {
    let db = TempStore::new();
    let tool = RecordingTool::new("work").behaviour(Behaviour::Block);
    let (store, probe) = (db.open(), tool.clone());
    with_system(|| async move {
        let sup = supervise(
            store.clone(),
            Config::default().max_concurrent_runs(1),
            "work",
            Agent::new(work_then_answer()).tool(probe.clone()),
        );
        let (_inbox, mut rx) = subscribed(&sup).await;
        spawn(&sup, "work", "first").await;
        probe.wait_executions(1).await;
        // The only slot is taken: the second run is inserted and waits, nobody holding it.
        let second = sup.send(StartRun::new("work", json!({})).with_id("second"));
        let second = actix_rt::spawn(second);
        let id = RunId::from("second");
        let stored = loop {
            if let Ok(events) = store.events(&id)
                && !events.is_empty()
            {
                break events;
            }
            actix_rt::task::yield_now().await;
        };
        assert!(queued(&stored), "{stored:?}");
        assert_eq!(store.run(&id).unwrap().state, RunState::Running);
        assert_eq!(
            store.lease(&id).unwrap(),
            None,
            "nobody holds a waiting run"
        );
        assert_eq!(
            probe.executions().len(),
            1,
            "the second run has not executed"
        );
        // Two permits: the first run's call returns, then the second run's, in its turn.
        probe.release();
        probe.release();
        let reply = second.await.unwrap().unwrap().unwrap();
        assert!(matches!(reply.outcome, Outcome::Succeeded { .. }));
        let settled = heard(&mut rx, 2).await;
        assert!(
            settled
                .iter()
                .all(|s| matches!(s.result, Ok(Outcome::Succeeded { .. })))
        );
    });
}

#[test]
fn a_run_cancelled_while_it_waits_its_turn_ends_cancelled_and_settles() {
    let db = TempStore::new();
    let tool = RecordingTool::new("work").behaviour(Behaviour::Block);
    let (store, probe) = (db.open(), tool.clone());
    let settled = with_system(|| async move {
        let sup = supervise(
            store.clone(),
            Config::default().max_concurrent_runs(1),
            "work",
            Agent::new(work_then_answer()).tool(probe.clone()),
        );
        let (_inbox, mut rx) = subscribed(&sup).await;
        spawn(&sup, "work", "first").await;
        probe.wait_executions(1).await;
        spawn(&sup, "work", "waits").await;
        // Cancelled through the store, as another process would, before its turn comes.
        store.cancel(&RunId::from("waits"), "not needed").unwrap();
        probe.release();
        heard(&mut rx, 2).await
    });
    let waits = settled
        .iter()
        .find(|s| s.run_id.as_str() == "waits")
        .expect("the cancelled run settles");
    assert_eq!(
        waits.result,
        Ok(Outcome::Cancelled {
            reason: "not needed".into()
        })
    );
    assert_eq!(
        tool.executions().len(),
        1,
        "the cancelled run executed nothing"
    );
}
