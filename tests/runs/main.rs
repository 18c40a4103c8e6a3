//! Runs and approvals: starting, spawning, cancelling and forking runs, policy decisions and
//! approvals, bad input, the conversation a model sees, tool schemas, tool timeouts and
//! heartbeats, the concurrency limit, what is written before each side effect, runs that
//! wait, and schedules.

#[path = "../support/mod.rs"]
mod support;

mod approvals;
mod background_runs;
mod bad_input;
mod cancel;
mod child_runs;
mod concurrency_limit;
mod concurrent_starts;
mod conversation;
mod fork;
mod golden_run;
mod json_shape;
mod run_ids;
mod schedules;
mod tool_schemas;
mod tool_timeouts;
mod waits;
mod write_ahead;
