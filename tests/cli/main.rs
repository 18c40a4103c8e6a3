//! The `agentrt` command line, run as a binary against seeded databases.

#[path = "../support/mod.rs"]
mod support;

mod cli;
mod cli_read_only;
mod cli_serve;
mod cli_special_files;
mod cli_waits;
mod decisions_from_elsewhere;
mod schedules;
