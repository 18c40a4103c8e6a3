//! One run, one OpenTelemetry trace: the spans of every execution of a run (its start, its
//! takeover by another supervisor after a crash, its resume after an approval) share a trace
//! id, which no other run's spans have.

use std::sync::OnceLock;

use agentrt::{
    Agent, EventKind, Outcome, RunId, StartRun, Store,
    testkit::{Behaviour, RecordingTool, ScriptedModel, TempStore, resume_when_free, with_system},
};
use opentelemetry::{
    Value,
    trace::{SpanId, TraceId, TracerProvider as _},
};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use serde_json::json;
use tracing_subscriber::{Registry, layer::SubscriberExt};

use crate::support::{PATIENCE, call_then_answer, email_approved_by_carol, fast_lease, supervise};

/// The spans every test of this binary exports. The subscriber is the process's: the runs'
/// spans are made on the actix systems' threads, which the tests start.
fn exporter() -> &'static InMemorySpanExporter {
    static EXPORTER: OnceLock<InMemorySpanExporter> = OnceLock::new();
    EXPORTER.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        // A simple processor exports each span as it ends: what ended before a crash is out.
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("trace_per_run"));
        tracing::subscriber::set_global_default(Registry::default().with(layer)).unwrap();
        exporter
    })
}

fn finished() -> Vec<SpanData> {
    exporter().get_finished_spans().unwrap()
}

fn attribute(span: &SpanData, key: &str) -> Option<Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.clone())
}

fn text(span: &SpanData, key: &str) -> Option<String> {
    attribute(span, key).map(|value| value.as_str().into_owned())
}

/// The spans of the executions of `run_id`, in the order they started.
fn executions(spans: &[SpanData], run_id: &str) -> Vec<SpanData> {
    let mut runs: Vec<SpanData> = spans
        .iter()
        .filter(|s| {
            s.name.starts_with("invoke_agent ") && text(s, "run_id").as_deref() == Some(run_id)
        })
        .cloned()
        .collect();
    runs.sort_by_key(|s| s.start_time);
    runs
}

/// The trace the run's `run.started` keeps.
fn stored_trace(store: &Store, run_id: &RunId) -> TraceId {
    let started = store.events(run_id).unwrap().remove(0);
    assert_eq!(started.kind, EventKind::RunStarted);
    let traceparent = started.payload["trace"]["traceparent"]
        .as_str()
        .unwrap_or_else(|| panic!("run.started keeps a trace: {}", started.payload));
    TraceId::from_hex(traceparent.split('-').nth(1).unwrap()).unwrap()
}

fn charge_then_answer() -> ScriptedModel {
    call_then_answer("charge-1", "charge", json!({"cents": 5}), "charged")
}

#[test]
fn a_run_taken_over_after_a_crash_stays_one_trace() {
    exporter();
    let db = TempStore::new();
    let run_id = RunId::from("traced-crash");
    let model = charge_then_answer();
    // Idempotent: the takeover calls it again rather than asking an operator.
    let charge = RecordingTool::new("charge").idempotent(true);
    charge.set_behaviour(Behaviour::Block);

    // The first supervisor: the run is in its tool call when the system goes away.
    let (store, agent) = (db.open(), Agent::new(model.clone()).tool(charge.clone()));
    let (waiting, id) = (charge.clone(), run_id.clone());
    let before_crash = with_system(|| async move {
        let supervisor = supervise(store, fast_lease(), "billing", agent);
        actix_rt::spawn(supervisor.send(StartRun::new("billing", json!({})).with_id(id)));
        waiting.wait_executions(1).await;
        // What this process exported before it died: the model call had ended.
        finished()
    });
    // Of this run: the other tests of this binary export into the same exporter meanwhile.
    let kept = stored_trace(&db.open(), &run_id);
    let first_model_call = before_crash
        .iter()
        .find(|s| {
            s.name == "chat"
                && attribute(s, "step") == Some(Value::I64(1))
                && s.span_context.trace_id() == kept
        })
        .cloned()
        .unwrap_or_else(|| {
            panic!("the first model call ended before the crash: {before_crash:#?}")
        });

    // A second supervisor, on a store opened anew, takes the run over once the lease lapses.
    charge.set_behaviour(Behaviour::Succeed);
    let (store, agent) = (db.open(), Agent::new(model).tool(charge.clone()));
    let id = run_id.clone();
    let outcome = with_system(|| async move {
        let supervisor = supervise(store, fast_lease(), "billing", agent);
        let reply = resume_when_free(&supervisor, &id, PATIENCE).await;
        // Another run, for contrast: a trace of its own.
        let other = StartRun::new("billing", json!({})).with_id("traced-other");
        supervisor.send(other).await.unwrap().unwrap();
        reply.unwrap().outcome
    });
    assert!(matches!(outcome, Outcome::Succeeded { .. }), "{outcome:?}");

    let trace = first_model_call.span_context.trace_id();
    assert_eq!(stored_trace(&db.open(), &run_id), trace);
    let spans = finished();
    let runs = executions(&spans, run_id.as_str());
    assert!(runs.len() >= 2, "a start and a takeover: {runs:#?}");
    for run in &runs {
        assert_eq!(run.span_context.trace_id(), trace, "{run:#?}");
    }
    let owners: Vec<String> = runs.iter().filter_map(|s| text(s, "owner")).collect();
    assert!(
        owners.len() == runs.len() && owners.first() != owners.last(),
        "spans from both owners: {owners:?}"
    );
    let takeover = runs.last().unwrap();
    assert_eq!(text(takeover, "execution").as_deref(), Some("takeover"));
    assert_eq!(attribute(takeover, "fencing_token"), Some(Value::I64(2)));
    // The takeover's tool call and the model's final answer are in the trace too.
    let calls: Vec<&SpanData> = spans
        .iter()
        .filter(|s| s.span_context.trace_id() == trace && s.name == "execute_tool charge")
        .collect();
    assert!(
        calls
            .iter()
            .any(|s| attribute(s, "fencing_token") == Some(Value::I64(2))),
        "the tool call after the takeover: {calls:#?}"
    );

    let other = executions(&spans, "traced-other");
    assert_eq!(other.len(), 1, "{other:#?}");
    assert_ne!(
        other[0].span_context.trace_id(),
        trace,
        "another run, another trace"
    );
}

#[test]
fn a_resume_after_an_approval_continues_the_trace() {
    exporter();
    let db = TempStore::new();
    let outcome = email_approved_by_carol(db.open(), "traced-approval");
    assert!(matches!(outcome, Outcome::Succeeded { .. }), "{outcome:?}");

    let runs = executions(&finished(), "traced-approval");
    assert_eq!(runs.len(), 2, "the start and the resume: {runs:#?}");
    let (start, resume) = (&runs[0], &runs[1]);
    assert_eq!(text(resume, "execution").as_deref(), Some("resume"));
    assert_eq!(
        resume.span_context.trace_id(),
        start.span_context.trace_id()
    );
    // The resume's parent is the start's span, restored from the store.
    assert_eq!(resume.parent_span_id, start.span_context.span_id());
    assert_eq!(
        start.parent_span_id,
        SpanId::INVALID,
        "a run begins a trace"
    );
    assert_eq!(
        stored_trace(&db.open(), &RunId::from("traced-approval")),
        start.span_context.trace_id()
    );
}
