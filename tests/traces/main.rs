//! One OpenTelemetry trace per run: the subscriber is the process's, alone in its binary.

#[path = "../support/mod.rs"]
mod support;

mod trace_per_run;
