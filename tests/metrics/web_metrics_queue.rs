//! `GET /metrics` shows the runs waiting for a free slot of a supervisor: a second run queued
//! behind a first that holds the only slot, then none once both have finished.
//!
//! The recorder is the process's, so this test takes its turn at it ([`one_at_a_time`]).

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use crate::support::metrics::{self, one_at_a_time, serve};
use agentrt::{
    Agent, Config, ModelResponse, Outcome, StartRun, ToolCall,
    testkit::{Behaviour, RecordingTool, ScriptedModel, TempStore, with_system},
};
use serde_json::json;

use crate::support::supervise;

/// How long a condition is waited for at most: far longer than it takes.
const PATIENCE: Duration = Duration::from_secs(20);

/// The value of `series` in a scrape of `/agentrt/metrics`; 0 when it is not printed.
fn scraped(address: SocketAddr, series: &str) -> f64 {
    let metrics::Scrape { status, body, .. } = metrics::scrape(address);
    assert!(
        status.starts_with("HTTP/1.0 200") || status.starts_with("HTTP/1.1 200"),
        "{status}"
    );
    body.lines()
        .filter_map(|line| line.rsplit_once(' '))
        .find(|(name, _)| *name == series)
        .map(|(_, value)| value.parse().expect("a number"))
        .unwrap_or(0.0)
}

/// Scrapes until `series` reads `expected`.
fn wait_for(address: SocketAddr, series: &str, expected: f64) {
    let deadline = Instant::now() + PATIENCE;
    while scraped(address, series) != expected {
        assert!(Instant::now() < deadline, "{series} never read {expected}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_run_waiting_for_a_slot_is_scraped_as_queued_until_its_turn() {
    let _turn = one_at_a_time();
    let db = TempStore::new();
    let address = serve(db.open());
    assert_eq!(scraped(address, "agentrt_queued_runs"), 0.0);

    // The first run holds the only slot in its tool until the second is scraped as queued.
    // (The second, once its turn comes, blocks in the tool in turn, until the system ends.)
    let model = ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new("c1", "hold", json!({}))]),
        ModelResponse::answer("done"),
    ]);
    let hold = RecordingTool::new("hold").behaviour(Behaviour::Block);
    let agent = Agent::new(model).tool(hold.clone());
    let store = db.open();
    let first = with_system(|| async move {
        let supervisor = supervise(
            store,
            Config::default().max_concurrent_runs(1),
            "work",
            agent,
        );
        let first =
            actix_rt::spawn(supervisor.send(StartRun::new("work", json!({})).with_id("r1")));
        hold.wait_executions(1).await;
        actix_rt::spawn(supervisor.send(StartRun::new("work", json!({})).with_id("r2")));
        actix_rt::task::spawn_blocking(move || wait_for(address, "agentrt_queued_runs", 1.0))
            .await
            .unwrap();
        hold.release();
        let first = first.await.unwrap().unwrap().unwrap().outcome;
        // The first run's end gives the second its turn, with this supervisor still up.
        actix_rt::task::spawn_blocking(move || wait_for(address, "agentrt_queued_runs", 0.0))
            .await
            .unwrap();
        first
    });
    assert!(matches!(first, Outcome::Succeeded { .. }), "{first:?}");
}
