//! The start margin: its tests move the process's wall clock and install the process's log
//! subscriber, so they are alone in their binary.

#[path = "../support/mod.rs"]
mod support;

mod start_margin;
