//! An application that installed a metrics recorder of its own before mounting the API keeps
//! it: the runtime's counters go to that recorder, and `GET /metrics` still answers with the
//! runs by state, saying where the rest went.
//!
//! The recorder is the process's, so this test is alone in its binary.

use std::{
    collections::HashMap,
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    sync::{Arc, Mutex},
};

use crate::support::metrics::serve;
use agentrt::{
    Agent, ModelResponse, Outcome, StartRun, Supervisor, Usage,
    testkit::{ScriptedModel, TempStore, with_system},
};
use metrics::{
    Counter, CounterFn, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};
use serde_json::json;

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

/// `GET /agentrt/metrics`: the status line and the body.
fn scrape(address: SocketAddr) -> (String, String) {
    let mut stream = TcpStream::connect(address).expect("the server accepts");
    // HTTP/1.0: the body ends where the connection does.
    stream
        .write_all(b"GET /agentrt/metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").expect("a head and a body");
    (
        head.lines().next().unwrap_or_default().to_owned(),
        body.to_owned(),
    )
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
        let supervisor = Supervisor::builder(store)
            .agent("echo", agent)
            .start()
            .unwrap();
        supervisor.send(StartRun::new("echo", json!({}))).await
    })
    .unwrap()
    .unwrap();
    assert!(matches!(reply.outcome, Outcome::Succeeded { .. }));

    assert_eq!(tally.get("agentrt_model_tokens_total"), 42);
    assert_eq!(tally.get("agentrt_runs_finished_total"), 1);

    let (status, body) = scrape(address);
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
