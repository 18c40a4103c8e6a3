//! The helpers of the behaviour tests, in one place: each test binary (`tests/<area>/main.rs`)
//! includes this module tree once, as `crate::support`. Each binary uses its own part.

#![allow(dead_code)]

pub mod child;
pub mod cli;
#[cfg(any(feature = "openai", feature = "anthropic"))]
pub mod fake_llm;
#[cfg(feature = "web")]
pub mod metrics;
pub mod migrations;
pub mod settled;
#[cfg(feature = "web")]
pub mod web;

// The examples' own helpers that tests check too; the examples include them from there.
#[path = "../../examples/support/chaos_classes.rs"]
pub mod chaos_classes;
#[path = "../../examples/support/chaos_hosts.rs"]
pub mod chaos_hosts;
#[path = "../../examples/support/quickstart_agent.rs"]
pub mod quickstart_agent;
