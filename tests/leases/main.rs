//! Leases and recovery: one live executor per run, takeovers after a crash or a kill, fencing
//! tokens, and the recovery of runs a dead process left, a parent and its child run included.

#[path = "../support/mod.rs"]
mod support;

mod child_run_process;
mod drain;
mod drain_process;
mod fencing_token;
mod lease;
mod lease_process;
mod recovery;
mod recovery_process;
mod renewal_sync;
