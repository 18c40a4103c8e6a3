//! The web API, its event streams, its tokens, the service example and the console in a
//! browser, over real HTTP on 127.0.0.1.

#[path = "../support/mod.rs"]
mod support;

mod concurrent_starts;
mod console_browser;
mod draining;
mod event_cursors;
mod idle_reads;
mod run_ids;
mod schedules;
mod service;
mod web_api;
mod web_auth;
mod web_streams;
mod web_waits;
