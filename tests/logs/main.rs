//! What a run logs and the spans it opens: the log subscriber is the process's.

#[path = "../support/mod.rs"]
mod support;

mod run_logs;
mod run_span;
