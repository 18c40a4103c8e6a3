//! `agentrt schedules` lists the schedules; `agentrt schedule pause NAME` and `agentrt
//! schedule resume NAME` pause and resume one.

use std::path::Path;

use agentrt::{Schedule, Store};
use clap::Subcommand;

use super::{Outcome, done, open_for_writing, print_json, table, time, write_failed};

/// What `agentrt schedule` does to a schedule.
#[derive(Subcommand)]
pub(crate) enum ScheduleCommand {
    /// Pause a schedule: it starts no run until resumed (the runs it started go on).
    Pause { name: String },
    /// Resume a paused schedule: its next run is the first occurrence after now; those that
    /// came while it was paused do not start.
    Resume { name: String },
}

/// Lists the schedules, by name: each one's agent, expression, what becomes of missed
/// occurrences, and its next run (or that it is paused).
pub(crate) fn list(store: &Store, json: bool) -> Outcome {
    let schedules = store.schedules().map_err(|e| e.to_string())?;
    if json {
        return print_json(&schedules);
    }
    let mut table = table(&["SCHEDULE", "AGENT", "CRON (UTC)", "MISSED", "NEXT"]);
    for schedule in &schedules {
        let next = match (schedule.paused, schedule.next_at) {
            (true, _) => "paused".to_owned(),
            (false, Some(at)) => time(at),
            (false, None) => String::new(),
        };
        table.add_row(vec![
            schedule.name.clone(),
            schedule.agent.clone(),
            schedule.cron.clone(),
            schedule.missed.to_string(),
            next,
        ]);
    }
    done(false, &table.trim_fmt(), &schedules)
}

/// Pauses or resumes a schedule; prints what became of it.
pub(crate) fn write(path: &Path, command: ScheduleCommand, json: bool) -> Outcome {
    let store = open_for_writing(path)?;
    let (schedule, what): (Schedule, _) = match command {
        ScheduleCommand::Pause { name } => (
            store
                .pause_schedule(&name)
                .map_err(|e| write_failed(path, e))?,
            "paused",
        ),
        ScheduleCommand::Resume { name } => (
            store
                .resume_schedule(&name)
                .map_err(|e| write_failed(path, e))?,
            "resumed",
        ),
    };
    let text = match (schedule.paused, schedule.next_at) {
        (false, Some(next)) => format!(
            "schedule {} {what}; its next run is at {}",
            schedule.name,
            time(next)
        ),
        _ => format!("schedule {} {what}", schedule.name),
    };
    done(json, &text, &schedule)
}
