//! Runs and approvals: starting, spawning, cancelling and forking runs, policy decisions and
//! approvals, bad input, the conversation a model sees, tool schemas, tool timeouts and
//! heartbeats, the concurrency limit and what is written before each side effect.

#[path = "../support/mod.rs"]
mod support;

mod approvals;
mod background_runs;
mod bad_input;
mod cancel;
mod concurrency_limit;
mod concurrent_starts;
mod conversation;
mod fork;
mod golden_run;
mod json_shape;
mod run_ids;
mod tool_schemas;
mod tool_timeouts;
mod waits;
mod write_ahead;
