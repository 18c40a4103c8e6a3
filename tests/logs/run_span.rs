//! A run's tracing span names its agent once, whether the call started the run or resumed it.

use std::sync::{Arc, Mutex};

use agentrt::{Outcome, testkit::TempStore};
use tracing::{
    Subscriber,
    field::{Field, Visit},
    span::{Attributes, Id, Record},
};
use tracing_subscriber::{Registry, layer::Context, prelude::*};

use crate::support::email_approved_by_carol;

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
    let outcome = email_approved_by_carol(db.open(), "r1");
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
