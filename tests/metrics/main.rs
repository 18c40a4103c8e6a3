//! `GET /metrics`: agentrt's recorder is the process's, so this binary holds only the tests
//! that read it, one at a time.

#[path = "../support/mod.rs"]
mod support;

mod web_metrics;
mod web_metrics_queue;
