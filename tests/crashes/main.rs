//! Crashes: the crash-point explorer, the crash properties, a supervisor crashed mid-step and
//! resumed, a tool's progress kept across a killed process, and the chaos run's accounting and
//! hosts.

#[path = "../support/mod.rs"]
mod support;

mod chaos_classes;
mod chaos_hosts;
mod crash_explorer;
mod crash_properties;
mod crash_recovery;
mod tool_progress;
