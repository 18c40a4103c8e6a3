//! `GET /metrics` over HTTP: a run whose supervisor crashes mid-tool is taken over by a second
//! one and finishes, and the scrape's counters move by what happened.
//!
//! The recorder is the process's, so this test compares a scrape before with one after, and
//! takes its turn at it ([`one_at_a_time`]).

use std::{
    collections::HashMap,
    net::SocketAddr,
    time::{Duration, Instant},
};

use crate::support::metrics::{self, one_at_a_time, serve};
use agentrt::{
    Agent, Config, Drain, ModelResponse, Recovery, RunId, RunState, StartRun, Supervisor, ToolCall,
    Usage,
    testkit::{Behaviour, RecordingTool, ScriptedModel, TempStore, resume_when_free, with_system},
};
use serde_json::json;

use crate::support::supervise;

/// A short TTL: renewals come every 100 ms, and a crashed supervisor's run is free soon.
const TTL: Duration = Duration::from_millis(300);

/// How long a condition is waited for at most: far longer than it takes.
const PATIENCE: Duration = Duration::from_secs(20);

/// One sample of a scrape: its name with its labels as printed, and its value.
type Samples = HashMap<String, f64>;

/// The samples of a scrape in the text format, each line checked as it is read.
fn parse(body: &str) -> Samples {
    let mut samples = Samples::new();
    for line in body.lines() {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect("a series and a value");
        let value: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("a number in {line:?}"));
        assert!(
            series.starts_with("agentrt_"),
            "every series is the runtime's: {line:?}"
        );
        assert!(
            samples.insert(series.to_owned(), value).is_none(),
            "{series} printed once"
        );
    }
    samples
}

fn scrape(address: SocketAddr) -> Samples {
    let metrics::Scrape {
        status,
        content_type,
        body,
    } = metrics::scrape(address);
    assert!(status.contains(" 200 "), "{status}");
    assert!(content_type.starts_with("text/plain"), "{content_type}");
    parse(&body)
}

/// A series' value, 0 when it is not printed yet (a counter nobody incremented).
fn value(samples: &Samples, series: &str) -> f64 {
    samples.get(series).copied().unwrap_or(0.0)
}

fn delta(before: &Samples, after: &Samples, series: &str) -> f64 {
    value(after, series) - value(before, series)
}

/// Scrapes until `series` has moved past `before`'s value.
fn wait_for_increase(address: SocketAddr, before: &Samples, series: &str) {
    let deadline = Instant::now() + PATIENCE;
    while value(&scrape(address), series) <= value(before, series) {
        assert!(Instant::now() < deadline, "{series} never moved");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn used(mut response: ModelResponse, input: u64, output: u64) -> ModelResponse {
    response.usage = Some(Usage::new(input, output));
    response
}

/// Charge (in flight at the crash), then a lookup that fails, then the answer.
fn script() -> ScriptedModel {
    ScriptedModel::new(vec![
        used(
            ModelResponse::calls(vec![ToolCall::new("c1", "charge", json!({}))]),
            100,
            10,
        ),
        used(
            ModelResponse::calls(vec![ToolCall::new("l1", "lookup", json!({}))]),
            200,
            20,
        ),
        used(ModelResponse::answer("charged"), 300, 30),
    ])
}

#[test]
fn a_takeover_and_its_finished_run_move_the_scraped_counters() {
    let _turn = one_at_a_time();
    let db = TempStore::new();
    let address = serve(db.open());
    let before = scrape(address);
    assert_eq!(value(&before, r#"agentrt_runs{state="SUCCEEDED"}"#), 0.0);

    let model = script();
    let charge = RecordingTool::new("charge")
        .idempotent(true)
        .behaviour(Behaviour::Block);
    let lookup = RecordingTool::new("lookup").behaviour(Behaviour::Fail("no such order".into()));
    let agent = || {
        Agent::new(model.clone())
            .tool(charge.clone())
            .tool(lookup.clone())
    };
    let config = || Config::default().lease_ttl(TTL);

    // The first supervisor holds the run with the charge in flight until a renewal is
    // scraped, then its system goes away with no further write.
    let (store, first, blocked) = (db.open(), agent(), charge.clone());
    let scraped = before.clone();
    with_system(|| async move {
        let supervisor = supervise(store, config(), "billing", first);
        actix_rt::spawn(supervisor.send(StartRun::new("billing", json!({})).with_id("run-1")));
        blocked.wait_executions(1).await;
        actix_rt::task::spawn_blocking(move || {
            wait_for_increase(address, &scraped, "agentrt_lease_renewals_total")
        })
        .await
        .unwrap();
    });
    let run_id = RunId::from("run-1");
    assert_eq!(db.open().run(&run_id).unwrap().state, RunState::Running);

    // The second takes it over once the dead lease expires, runs the charge again (it is
    // idempotent), the failing lookup, and finishes.
    charge.set_behaviour(Behaviour::Succeed);
    let (store, second, id) = (db.open(), agent(), run_id.clone());
    let reply = with_system(|| async move {
        let supervisor = supervise(store, config(), "billing", second);
        resume_when_free(&supervisor, &id, PATIENCE).await
    })
    .unwrap();
    assert!(
        matches!(reply.outcome, agentrt::Outcome::Succeeded { .. }),
        "{:?}",
        reply.outcome
    );

    let after = scrape(address);
    assert_eq!(delta(&before, &after, "agentrt_takeovers_total"), 1.0);
    assert!(delta(&before, &after, "agentrt_lease_renewals_total") > 0.0);
    assert_eq!(
        delta(
            &before,
            &after,
            r#"agentrt_model_tokens_total{direction="input"}"#
        ),
        600.0
    );
    assert_eq!(
        delta(
            &before,
            &after,
            r#"agentrt_model_tokens_total{direction="output"}"#
        ),
        60.0
    );
    assert_eq!(delta(&before, &after, "agentrt_tool_errors_total"), 1.0);
    // Three model calls answered; the charge twice (the second run of it answered) and the
    // lookup once, less the charge the crash cut short.
    assert_eq!(
        delta(
            &before,
            &after,
            r#"agentrt_step_duration_seconds_count{kind="model"}"#
        ),
        3.0
    );
    assert_eq!(
        delta(
            &before,
            &after,
            r#"agentrt_step_duration_seconds_count{kind="tool"}"#
        ),
        2.0
    );
    assert_eq!(
        delta(
            &before,
            &after,
            r#"agentrt_runs_finished_total{state="SUCCEEDED"}"#
        ),
        1.0
    );
    assert!(value(&after, r#"agentrt_runs{state="SUCCEEDED"}"#) >= 1.0);
    assert_eq!(value(&after, r#"agentrt_runs{state="RUNNING"}"#), 0.0);
    assert!(delta(&before, &after, "agentrt_commit_moves_count") > 0.0);
    assert!(
        value(&after, r#"agentrt_commit_moves_bucket{le="+Inf"}"#)
            == value(&after, "agentrt_commit_moves_count"),
        "a histogram, not a summary"
    );
    assert_eq!(value(&after, "agentrt_queued_runs"), 0.0);
}

#[test]
fn a_drain_and_the_takeover_after_it_move_the_handover_counters_not_the_takeovers() {
    let _turn = one_at_a_time();
    let db = TempStore::new();
    let address = serve(db.open());
    let before = scrape(address);
    // Both series are scraped from the start, at whatever earlier tests left them.
    for side in ["released", "taken"] {
        let series = format!(r#"agentrt_handovers_total{{side="{side}"}}"#);
        assert!(before.contains_key(&series), "{series} is scraped");
    }

    let charge = RecordingTool::new("charge").behaviour(Behaviour::Block);
    let agent = || {
        Agent::new(script())
            .tool(charge.clone())
            .tool(RecordingTool::new("lookup"))
    };
    let (old_store, heir_store, probe) = (db.open(), db.open(), charge.clone());
    let (old_agent, heir_agent) = (agent(), agent());
    with_system(|| async move {
        let heir = Supervisor::builder(heir_store)
            .config(
                Config::default().recovery(Recovery::default().every(Duration::from_secs(3600))),
            )
            .agent("billing", heir_agent)
            .start()
            .unwrap();
        let (_inbox, mut rx) = crate::support::settled::subscribed(&heir).await;
        let old = supervise(old_store, Config::default(), "billing", old_agent);
        old.send(agentrt::SpawnRun::new("billing", json!({})).with_id("run-1"))
            .await
            .unwrap()
            .unwrap();
        probe.wait_executions(1).await;
        // The blocked charge is told at the deadline, returns, and the run is handed over.
        let drain = Drain::within(Duration::from_millis(50)).grace(PATIENCE);
        assert!(old.send(drain).await.unwrap().is_clean());
        crate::support::settled::heard(&mut rx, 1).await;
    });

    let after = scrape(address);
    let released = r#"agentrt_handovers_total{side="released"}"#;
    let taken = r#"agentrt_handovers_total{side="taken"}"#;
    assert_eq!(delta(&before, &after, released), 1.0);
    assert_eq!(delta(&before, &after, taken), 1.0);
    assert_eq!(delta(&before, &after, "agentrt_takeovers_total"), 0.0);
}
