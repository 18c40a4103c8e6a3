//! Many starts of one run id at once, as a client that retries or a queue that redelivers
//! sends them: one starts the run, and every other is told that the run exists
//! (`Error::RunExists`), never that it is leased (which tells a caller to retry) nor that it
//! is not found, whether the first still executes it or waits for a slot.

use agentrt::{
    Agent, Config, Error, Outcome, RunId, SpawnRun, StartRun, Store,
    testkit::{Behaviour, RecordingTool, with_system},
};
use futures_util::{StreamExt, stream::FuturesUnordered};
use serde_json::json;

use crate::support::{call_then_answer, supervise};

use agentrt::testkit::TempStore;

/// The starts sent at once.
const STARTS: usize = 50;

/// An agent whose one tool call blocks until the tool is released: the run executes until
/// then.
fn blocking(tool: &RecordingTool) -> Agent {
    Agent::new(call_then_answer("c1", "t", json!({}), "done")).tool(tool.clone())
}

fn blocking_tool() -> RecordingTool {
    RecordingTool::new("t").behaviour(Behaviour::Block)
}

/// Every refusal is `RunExists` of `r1`.
fn all_run_exists(refused: &[Error]) {
    assert_eq!(refused.len(), STARTS - 1);
    for err in refused {
        assert!(
            matches!(err, Error::RunExists(id) if id.as_str() == "r1"),
            "{err:?}"
        );
    }
}

/// The store holds `r1` alone (and `others`), started once.
fn started_once(store: &Store, tool: &RecordingTool, others: usize) {
    assert_eq!(store.runs(None).unwrap().len(), 1 + others);
    let started = store
        .events(&RunId::from("r1"))
        .unwrap()
        .into_iter()
        .filter(|event| event.kind == agentrt::EventKind::RunStarted)
        .count();
    assert_eq!(started, 1);
    let r1 = tool
        .executions()
        .into_iter()
        .filter(|e| e.run_id == "r1")
        .count();
    assert_eq!(r1, 1);
}

#[test]
fn fifty_starts_of_one_id_at_once_start_it_once_and_the_rest_hear_it_exists() {
    let db = TempStore::new();
    let store = db.open();
    let tool = blocking_tool();
    let (refused, reply) = {
        let (store, tool) = (store.clone(), tool.clone());
        with_system(|| async move {
            let supervisor = supervise(store, Config::default(), "a", blocking(&tool));
            let mut calls: FuturesUnordered<_> = (0..STARTS)
                .map(|_| supervisor.send(StartRun::new("a", json!({})).with_id("r1")))
                .collect();
            // The run blocks in its tool: no start can end but by a refusal.
            let mut refused = Vec::new();
            while refused.len() < STARTS - 1 {
                let answer = calls.next().await.unwrap().unwrap();
                refused.push(answer.expect_err("only one start executes the run"));
            }
            tool.release();
            let reply = calls.next().await.unwrap().unwrap();
            (refused, reply)
        })
    };
    let reply = reply.expect("one start executes the run");
    assert!(
        matches!(reply.outcome, Outcome::Succeeded { .. }),
        "{reply:?}"
    );
    all_run_exists(&refused);
    started_once(&store, &tool, 0);
}

#[test]
fn fifty_spawns_of_one_id_at_once_start_it_once_and_the_rest_hear_it_exists() {
    let db = TempStore::new();
    let store = db.open();
    let tool = blocking_tool();
    let answers = {
        let (store, tool) = (store.clone(), tool.clone());
        with_system(|| async move {
            let supervisor = supervise(store, Config::default(), "a", blocking(&tool));
            let calls: FuturesUnordered<_> = (0..STARTS)
                .map(|_| supervisor.send(SpawnRun::new("a", json!({})).with_id("r1")))
                .collect();
            let answers: Vec<_> = calls.map(Result::unwrap).collect().await;
            tool.wait_executions(1).await;
            answers
        })
    };
    let (started, refused): (Vec<_>, Vec<_>) = answers.into_iter().partition(Result::is_ok);
    assert_eq!(started.len(), 1, "{started:?}");
    let refused: Vec<Error> = refused.into_iter().map(Result::unwrap_err).collect();
    all_run_exists(&refused);
    started_once(&store, &tool, 0);
}

#[test]
fn fifty_spawns_of_one_id_waiting_for_a_slot_start_it_once_and_the_rest_hear_it_exists() {
    let db = TempStore::new();
    let store = db.open();
    let tool = blocking_tool();
    let answers = {
        let (store, tool) = (store.clone(), tool.clone());
        with_system(|| async move {
            let config = Config::default().max_concurrent_runs(1);
            let supervisor = supervise(store, config, "a", blocking(&tool));
            // The one slot is taken: r1 is inserted to wait for it, and held meanwhile.
            crate::support::spawn(&supervisor, "a", "busy").await;
            tool.wait_executions(1).await;
            let calls: FuturesUnordered<_> = (0..STARTS)
                .map(|_| supervisor.send(SpawnRun::new("a", json!({})).with_id("r1")))
                .collect();
            let answers: Vec<_> = calls.map(Result::unwrap).collect().await;
            // Its turn comes once the busy run's tool returns.
            tool.release();
            tool.wait_executions(2).await;
            answers
        })
    };
    let (started, refused): (Vec<_>, Vec<_>) = answers.into_iter().partition(Result::is_ok);
    assert_eq!(started.len(), 1, "{started:?}");
    let refused: Vec<Error> = refused.into_iter().map(Result::unwrap_err).collect();
    all_run_exists(&refused);
    started_once(&store, &tool, 1);
}
