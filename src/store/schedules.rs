//! Schedules in the store: putting, listing, pausing, resuming and deleting them. A
//! supervisor with recovery starts their runs (`actors/supervisor/schedules.rs`).

use super::{
    Store,
    moves::{DeleteSchedule, PauseSchedule, PutSchedule, ResumeSchedule},
};
use crate::{
    clock::SystemClock,
    error::{Error, Result},
    schedule::Schedule,
};

impl Store {
    /// Makes a schedule, or replaces the one of its name, stamped by the system clock; returns
    /// it as stored, with its next occurrence.
    ///
    /// A new schedule's next occurrence is the first after now. A replaced one keeps its next
    /// occurrence when its expression is unchanged, so that an application may put its
    /// schedules at every start without losing an occurrence that came while it was down (its
    /// [`Missed`](crate::Missed) then says what becomes of it); a changed expression takes the
    /// first occurrence after now. A replaced schedule stays paused or not as it was:
    /// [`Schedule::paused`] applies to a new one only.
    ///
    /// An invalid name or cron expression is [`Error::InvalidInput`], and nothing is written.
    ///
    /// ```
    /// use agentrt::{Schedule, Store, serde_json::json};
    ///
    /// let store = Store::in_memory()?;
    /// let put = store.put_schedule(&Schedule::new("nightly", "0 2 * * *", "reports", json!({})))?;
    /// assert!(put.next_at.is_some());
    /// assert!(store.put_schedule(&Schedule::new("bad", "0 25 * * *", "reports", json!({}))).is_err());
    /// # Ok::<(), agentrt::Error>(())
    /// ```
    pub fn put_schedule(&self, schedule: &Schedule) -> Result<Schedule> {
        self.apply(&SystemClock, PutSchedule::new(schedule.clone()))
    }

    /// Every schedule, by name.
    pub fn schedules(&self) -> Result<Vec<Schedule>> {
        let rows = self.read(|reads| reads.schedules())?;
        Ok(rows.iter().map(|row| row.public()).collect())
    }

    /// The schedule `name`; [`Error::ScheduleNotFound`] when there is none.
    pub fn schedule(&self, name: &str) -> Result<Schedule> {
        self.read(|reads| reads.schedule(name))?
            .map(|row| row.public())
            .ok_or_else(|| Error::ScheduleNotFound(name.to_owned()))
    }

    /// Pauses schedule `name`, stamped by the system clock: it starts nothing until resumed
    /// (the runs it started go on). A paused schedule stays paused; an unknown name is
    /// [`Error::ScheduleNotFound`]. Returns the schedule.
    pub fn pause_schedule(&self, name: &str) -> Result<Schedule> {
        self.apply(&SystemClock, PauseSchedule::new(name))
    }

    /// Resumes schedule `name`, stamped by the system clock: its next run is the first
    /// occurrence after now; those that came while it was paused do not start. A schedule
    /// that is not paused is left as it is; an unknown name is [`Error::ScheduleNotFound`].
    /// Returns the schedule.
    pub fn resume_schedule(&self, name: &str) -> Result<Schedule> {
        self.apply(&SystemClock, ResumeSchedule::new(name))
    }

    /// Deletes schedule `name`; the runs it started are kept. An unknown name is
    /// [`Error::ScheduleNotFound`].
    pub fn delete_schedule(&self, name: &str) -> Result<()> {
        self.apply(&SystemClock, DeleteSchedule::new(name))
    }
}
