//! A run's OpenTelemetry trace context (feature `otel`), kept in its `run.started` event as a
//! W3C `traceparent`, so that every execution of the run (its start, each resume, each
//! takeover, in whichever process) joins one trace. Without the feature a run keeps none, and
//! nothing here makes a span.

#[cfg(feature = "otel")]
use opentelemetry::{
    Context,
    trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState},
};
#[cfg(feature = "otel")]
use serde_json::Value;
#[cfg(feature = "otel")]
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::types::RunId;

/// The trace context a new run keeps: that of the current span, its first execution's.
pub(crate) fn started() -> Option<String> {
    #[cfg(feature = "otel")]
    {
        traceparent(&tracing::Span::current())
    }
    #[cfg(not(feature = "otel"))]
    {
        None
    }
}

/// The trace context of a run inserted to wait for a slot: a span of its own marks the insert
/// and begins the run's trace, which its executions join.
pub(crate) fn queued(run_id: &RunId, agent: &str) -> Option<String> {
    #[cfg(feature = "otel")]
    {
        let span = tracing::info_span!(
            parent: None,
            "queue",
            run_id = %run_id,
            agent,
            otel.name = format!("queue_run {agent}"),
        );
        traceparent(&span)
    }
    #[cfg(not(feature = "otel"))]
    {
        let _ = (run_id, agent);
        None
    }
}

/// The trace context of a fork: a new trace, begun by a span that marks the fork and names its
/// origin; the fork's executions join it.
pub(crate) fn forked(run_id: &RunId, origin: &RunId, at: u32) -> Option<String> {
    #[cfg(feature = "otel")]
    {
        let span = tracing::info_span!(
            parent: None,
            "fork",
            run_id = %run_id,
            forked_from = %origin,
            at,
            otel.name = "fork_run",
        );
        traceparent(&span)
    }
    #[cfg(not(feature = "otel"))]
    {
        let _ = (run_id, origin, at);
        None
    }
}

/// The W3C `traceparent` of `span`; `None` when it belongs to no trace (no OpenTelemetry layer
/// is installed, or the span is disabled).
#[cfg(feature = "otel")]
fn traceparent(span: &tracing::Span) -> Option<String> {
    let context = span.context();
    let span = context.span();
    let span = span.span_context();
    span.is_valid().then(|| {
        format!(
            "00-{}-{}-{:02x}",
            span.trace_id(),
            span.span_id(),
            span.trace_flags().to_u8()
        )
    })
}

/// Makes the trace kept in `started` (a `run.started` payload) the parent of `span`, which
/// must not have been entered yet. A payload without one (a run started without this
/// feature, or with no layer) leaves `span` the root of a trace of its own.
#[cfg(feature = "otel")]
pub(crate) fn set_parent(span: &tracing::Span, started: &Value) {
    let Some(traceparent) = started
        .pointer("/trace/traceparent")
        .and_then(Value::as_str)
    else {
        return;
    };
    let Some(parent) = parse(traceparent) else {
        tracing::debug!(
            traceparent,
            "the run's stored trace context is not a traceparent"
        );
        return;
    };
    let parent = Context::new().with_remote_span_context(parent);
    if let Err(err) = span.set_parent(parent) {
        tracing::debug!(%err, "the run's span could not join its trace");
    }
}

/// Parses a version-00 `traceparent`: `00-TRACE_ID-SPAN_ID-FLAGS`, in lowercase hex.
#[cfg(feature = "otel")]
fn parse(traceparent: &str) -> Option<SpanContext> {
    let mut parts = traceparent.split('-');
    let (version, trace_id, span_id, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |part: &str, len: usize| {
        part.len() == len
            && part
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    if version != "00"
        || parts.next().is_some()
        || !hex(trace_id, 32)
        || !hex(span_id, 16)
        || !hex(flags, 2)
    {
        return None;
    }
    let context = SpanContext::new(
        TraceId::from_hex(trace_id).ok()?,
        SpanId::from_hex(span_id).ok()?,
        TraceFlags::new(u8::from_str_radix(flags, 16).ok()?),
        true,
        TraceState::default(),
    );
    context.is_valid().then_some(context)
}

#[cfg(all(test, feature = "otel"))]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_parses_back_to_its_ids() {
        let parsed = parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        assert_eq!(
            parsed.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(parsed.span_id().to_string(), "00f067aa0ba902b7");
        assert!(parsed.is_sampled());
        assert!(parsed.is_remote());
    }

    #[test]
    fn what_is_not_a_traceparent_is_refused() {
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-00",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6-00f067aa0ba902b7-01",
            "00-+bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert!(parse(bad).is_none(), "{bad:?}");
        }
    }
}
