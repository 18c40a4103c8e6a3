//! Schedules: an operator's put, pause, resume and delete of a schedule, and a supervisor's
//! start (or skip) of its due occurrence. A schedule's move names, as its run, the prefix its
//! runs' ids share (`nightly@`); an occurrence's names the occurrence's run.

use serde_json::json;

use super::{Move, guard::Cx};
use crate::{
    cron::Cron,
    error::{Error, Result},
    schedule::{Due, Schedule},
    store::{backend::MoveKind, model::ScheduleRow},
    types::RunId,
};

/// The run id a move of schedule `name` as a whole names: the prefix of its runs' ids.
fn runs_of(name: &str) -> RunId {
    RunId::from(format!("{name}@"))
}

/// The schedule `name`, or not found.
fn stored(cx: &mut Cx<'_, '_>, name: &str) -> Result<ScheduleRow> {
    cx.tx
        .schedule(name)?
        .ok_or_else(|| Error::ScheduleNotFound(name.to_owned()))
}

/// Makes schedule `schedule.name`, or replaces the one of that name: its agent, input,
/// expression and what becomes of missed occurrences. A new one's next occurrence is the first
/// after now; a replaced one keeps its next occurrence if its expression is the same (an
/// application that puts its schedules at each start loses no occurrence that is due), else
/// takes the first after now, and keeps whether it is paused. An invalid name or expression is
/// refused unchanged. Returns the schedule as stored.
pub(crate) struct PutSchedule {
    runs: RunId,
    schedule: Schedule,
}

impl PutSchedule {
    pub(crate) fn new(schedule: Schedule) -> Self {
        PutSchedule {
            runs: runs_of(&schedule.name),
            schedule,
        }
    }
}

impl Move for PutSchedule {
    type Output = Schedule;

    fn kind(&self) -> MoveKind {
        MoveKind::PutSchedule
    }

    fn run_id(&self) -> &RunId {
        &self.runs
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<Schedule> {
        let schedule = &self.schedule;
        let cron = schedule.check()?;
        let now = cx.now.millis();
        let found = cx.tx.schedule(&schedule.name)?;
        let next_at = match &found {
            Some(found) if found.cron == schedule.cron => found.next_at,
            _ => first_after(&cron, now)?,
        };
        let row = ScheduleRow {
            name: schedule.name.clone(),
            agent: schedule.agent.clone(),
            input: schedule.input.clone(),
            cron: schedule.cron.clone(),
            missed: schedule.missed,
            paused: found.as_ref().map_or(schedule.paused, |found| found.paused),
            next_at,
            created_at: found.as_ref().map_or(now, |found| found.created_at),
            updated_at: now,
        };
        cx.tx.put_schedule(&row)?;
        Ok(row.public())
    }
}

/// The first occurrence of `cron` after `now`.
fn first_after(cron: &Cron, now: i64) -> Result<i64> {
    cron.next_after(now).ok_or_else(|| {
        Error::InvalidInput("the cron expression has no occurrence in the years ahead".into())
    })
}

/// Pauses schedule `name`: it starts nothing until resumed. Pausing a paused schedule changes
/// nothing; an unknown one is not found. Returns the schedule.
pub(crate) struct PauseSchedule {
    runs: RunId,
    name: String,
}

impl PauseSchedule {
    pub(crate) fn new(name: &str) -> Self {
        PauseSchedule {
            runs: runs_of(name),
            name: name.to_owned(),
        }
    }
}

impl Move for PauseSchedule {
    type Output = Schedule;

    fn kind(&self) -> MoveKind {
        MoveKind::PauseSchedule
    }

    fn run_id(&self) -> &RunId {
        &self.runs
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<Schedule> {
        let mut row = stored(cx, &self.name)?;
        if !row.paused {
            let now = cx.now.millis();
            cx.tx.set_schedule_paused(&self.name, true, None, now)?;
            (row.paused, row.updated_at) = (true, now);
        }
        Ok(row.public())
    }
}

/// Resumes schedule `name`: its next run is the first occurrence after now (what came while it
/// was paused does not start, whatever its [`Missed`](crate::Missed)). Resuming a schedule that is not paused
/// changes nothing; an unknown one is not found. Returns the schedule.
pub(crate) struct ResumeSchedule {
    runs: RunId,
    name: String,
}

impl ResumeSchedule {
    pub(crate) fn new(name: &str) -> Self {
        ResumeSchedule {
            runs: runs_of(name),
            name: name.to_owned(),
        }
    }
}

impl Move for ResumeSchedule {
    type Output = Schedule;

    fn kind(&self) -> MoveKind {
        MoveKind::ResumeSchedule
    }

    fn run_id(&self) -> &RunId {
        &self.runs
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<Schedule> {
        let mut row = stored(cx, &self.name)?;
        if row.paused {
            let now = cx.now.millis();
            let cron = Cron::parse(&row.cron)
                .map_err(|err| Error::Corrupt(format!("schedule {}: {err}", row.name)))?;
            let next_at = first_after(&cron, now)?;
            cx.tx
                .set_schedule_paused(&self.name, false, Some(next_at), now)?;
            (row.paused, row.next_at, row.updated_at) = (false, next_at, now);
        }
        Ok(row.public())
    }
}

/// Deletes schedule `name`; the runs it started are kept. An unknown one is not found.
pub(crate) struct DeleteSchedule {
    runs: RunId,
    name: String,
}

impl DeleteSchedule {
    pub(crate) fn new(name: &str) -> Self {
        DeleteSchedule {
            runs: runs_of(name),
            name: name.to_owned(),
        }
    }
}

impl Move for DeleteSchedule {
    type Output = ();

    fn kind(&self) -> MoveKind {
        MoveKind::DeleteSchedule
    }

    fn run_id(&self) -> &RunId {
        &self.runs
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<()> {
        if cx.tx.delete_schedule(&self.name)? {
            Ok(())
        } else {
            Err(Error::ScheduleNotFound(self.name.clone()))
        }
    }
}

/// What an advance did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Advanced {
    /// The occurrence's run was inserted, for a run of this agent: execute it.
    Started { agent: String },
    /// The missed occurrences were skipped.
    Skipped,
    /// A run of the occurrence's id existed already (none was inserted); the schedule moved on.
    Existed,
    /// The schedule was not as the pass read it (another replica advanced it, or an operator
    /// paused, replaced or deleted it): nothing was written.
    Taken,
}

/// A supervisor's pass found schedule `name` due: it moves the schedule's next occurrence
/// from the one the pass read to the first after now (a compare-and-set: of two replicas that
/// read it, one moves it, and the other writes nothing) and, if `due` says so, inserts the run
/// of the occurrence (its id the schedule's name, `@` and the occurrence's time), with no
/// lease, as a run that waits for a slot: whoever executes it first takes it. Its
/// `run.started` says `queued` and names the schedule and the occurrence.
pub(crate) struct AdvanceSchedule {
    /// The occurrence's run.
    pub run_id: RunId,
    /// The schedule as the pass read it.
    pub seen: ScheduleRow,
    pub due: Due,
    /// As [`CreateRun::trace`](super::CreateRun::trace).
    pub trace: Option<String>,
}

impl AdvanceSchedule {
    /// The advance of `seen` for `due`.
    pub(crate) fn new(seen: ScheduleRow, due: Due) -> Self {
        let run_id = Schedule::run_id(&seen.name, due.occurrence);
        let trace = if due.start {
            crate::trace_context::queued(&run_id, &seen.agent)
        } else {
            None
        };
        AdvanceSchedule {
            run_id,
            seen,
            due,
            trace,
        }
    }
}

impl Move for AdvanceSchedule {
    type Output = Advanced;

    fn kind(&self) -> MoveKind {
        if self.due.start {
            MoveKind::StartScheduled
        } else {
            MoveKind::SkipScheduled
        }
    }

    fn run_id(&self) -> &RunId {
        &self.run_id
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<Advanced> {
        let seen = &self.seen;
        // Read (and, where writers run side by side, locked) first: the schedule the pass
        // planned for must still be the one stored.
        let row = match cx.tx.schedule(&seen.name)? {
            Some(row)
                if !row.paused
                    && row.next_at == seen.next_at
                    && row.cron == seen.cron
                    && row.missed == seen.missed =>
            {
                row
            }
            _ => return Ok(Advanced::Taken),
        };
        let now = cx.now.millis();
        if !cx
            .tx
            .advance_schedule(&seen.name, seen.next_at, self.due.next, now)?
        {
            return Ok(Advanced::Taken);
        }
        if !self.due.start {
            return Ok(Advanced::Skipped);
        }
        cx.run_id.check()?;
        if cx.run_state()?.is_some() {
            return Ok(Advanced::Existed);
        }
        cx.tx.insert_run(&crate::store::backend::NewRun {
            run_id: cx.run_id,
            agent: &row.agent,
            input: &row.input,
            at: now,
            lease: None,
        })?;
        let payload = json!({
            "agent": row.agent,
            "input": row.input,
            "fencing_token": 0,
            "queued": true,
            "schedule": { "name": seen.name, "occurrence": self.due.occurrence },
        });
        cx.append_started(payload, self.trace.as_deref())?;
        Ok(Advanced::Started { agent: row.agent })
    }
}
