//! An application that installed a metrics recorder of its own before mounting the API keeps
//! it: the runtime's counters go to that recorder, and `GET /metrics` still answers with the
//! runs by state, saying where the rest went.
//!
//! The recorder is the process's, so this test is alone in its binary.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use crate::support::metrics::{Scrape, scrape, serve};
use agentrt::{
    Agent, Config, ModelResponse, Outcome, StartRun, Usage,
    testkit::{ScriptedModel, TempStore, with_system},
};
use metrics::{
    Counter, CounterFn, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};
use serde_json::json;

use crate::support::supervise;

/// The application's recorder: the sum of each counter, by name.
#[derive(Clone, Default)]
struct Tally(Arc<Mutex<HashMap<String, u64>>>);

impl Tally {
    fn get(&self, name: &str) -> u64 {
        self.0.lock().unwrap().get(name).copied().unwrap_or(0)
    }
}

struct Count {
    name: String,
    tally: Tally,
}

impl CounterFn for Count {
    fn increment(&self, value: u64) {
        *self
            .tally
            .0
            .lock()
            .unwrap()
            .entry(self.name.clone())
            .or_default() += value;
    }

    fn absolute(&self, value: u64) {
        self.tally
            .0
            .lock()
            .unwrap()
            .insert(self.name.clone(), value);
    }
}

impl Recorder for Tally {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(Arc::new(Count {
            name: key.name().to_owned(),
            tally: self.clone(),
        }))
    }

    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }

    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

#[test]
fn with_the_applications_recorder_the_counters_go_there_and_the_scrape_keeps_the_store_gauges() {
    let tally = Tally::default();
    metrics::set_global_recorder(tally.clone()).expect("no recorder yet");

    let db = TempStore::new();
    let address = serve(db.open());
    let mut answer = ModelResponse::answer("done");
    answer.usage = Some(Usage::new(40, 2));
    let agent = Agent::new(ScriptedModel::new(vec![answer]));
    let store = db.open();
    let reply = with_system(|| async move {
        let supervisor = supervise(store, Config::default(), "echo", agent);
        supervisor.send(StartRun::new("echo", json!({}))).await
    })
    .unwrap()
    .unwrap();
    assert!(matches!(reply.outcome, Outcome::Succeeded { .. }));

    assert_eq!(tally.get("agentrt_model_tokens_total"), 42);
    assert_eq!(tally.get("agentrt_runs_finished_total"), 1);

    let Scrape { status, body, .. } = scrape(address);
    assert!(status.contains(" 200 "), "{status}");
    let first = body.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("# ") && first.contains("application's recorder"),
        "{body}"
    );
    assert!(
        body.lines()
            .any(|line| line == r#"agentrt_runs{state="SUCCEEDED"} 1"#),
        "{body}"
    );
    assert!(!body.contains("agentrt_model_tokens_total"), "{body}");
}
