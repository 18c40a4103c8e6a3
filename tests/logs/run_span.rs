//! A run's tracing span names its agent once, whether the call started the run or resumed it.

use std::sync::{Arc, Mutex};

use agentrt::{
    Agent, Approval, ModelResponse, Outcome, RecordApproval, RequireApprovalFor, ResumeRun,
    StartRun, Supervisor, ToolCall,
    testkit::{RecordingTool, ScriptedModel, TempStore, with_system},
};
use serde_json::json;
use tracing::{
    Subscriber,
    field::{Field, Visit},
    span::{Attributes, Id, Record},
};
use tracing_subscriber::{Registry, layer::Context, prelude::*};

/// Every value given to the `agent` field of `run` spans, span by span.
#[derive(Clone, Default)]
struct AgentFields(Arc<Mutex<Vec<(u64, String)>>>);

struct Values<'a>(&'a mut Vec<String>);

impl Visit for Values<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "agent" {
            self.0.push(value.to_owned());
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "agent" {
            self.0.push(format!("{value:?}"));
        }
    }
}

impl<S: Subscriber> tracing_subscriber::Layer<S> for AgentFields {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _: Context<'_, S>) {
        if attrs.metadata().name() == "run" {
            let mut values = Vec::new();
            attrs.record(&mut Values(&mut values));
            let mut seen = self.0.lock().unwrap();
            seen.extend(values.into_iter().map(|value| (id.into_u64(), value)));
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _: Context<'_, S>) {
        let mut recorded = Vec::new();
        values.record(&mut Values(&mut recorded));
        let mut seen = self.0.lock().unwrap();
        seen.extend(recorded.into_iter().map(|value| (id.into_u64(), value)));
    }
}

#[test]
fn a_started_and_a_resumed_run_each_name_their_agent_once() {
    let fields = AgentFields::default();
    let subscriber = Registry::default().with(fields.clone());
    let _guard = tracing::subscriber::set_default(subscriber);

    let db = TempStore::new();
    let store = db.open();
    let model = ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new("c1", "email", json!({}))]),
        ModelResponse::answer("sent"),
    ]);
    let email = RecordingTool::new("email");
    let agent = Agent::new(model)
        .tool(email)
        .policy(RequireApprovalFor::tools(["email"]));
    let outcome = with_system(|| async move {
        let sup = Supervisor::builder(store)
            .agent("support", agent)
            .start()
            .unwrap();
        let started = sup.send(StartRun::new("support", json!({})).with_id("r1"));
        let started = started.await.unwrap().unwrap();
        assert!(matches!(
            started.outcome,
            Outcome::WaitingForApproval { .. }
        ));
        let approval = Approval::approve("r1", "c1", "carol");
        sup.send(RecordApproval(approval)).await.unwrap().unwrap();
        sup.send(ResumeRun::new("r1"))
            .await
            .unwrap()
            .unwrap()
            .outcome
    });
    assert!(matches!(outcome, Outcome::Succeeded { .. }), "{outcome:?}");

    let seen = fields.0.lock().unwrap().clone();
    let mut spans: Vec<u64> = seen.iter().map(|(span, _)| *span).collect();
    spans.dedup();
    assert_eq!(
        spans.len(),
        2,
        "a span for the start and one for the resume: {seen:?}"
    );
    for span in spans {
        let values: Vec<&str> = seen
            .iter()
            .filter(|(id, _)| *id == span)
            .map(|(_, value)| value.as_str())
            .collect();
        assert_eq!(values, ["support"], "the agent field, once: {seen:?}");
    }
}
