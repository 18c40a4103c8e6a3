//! `GET /metrics` with the application's own recorder, installed before anything else in the
//! process: alone in its binary.

#[path = "../support/mod.rs"]
mod support;

mod web_metrics_foreign_recorder;
