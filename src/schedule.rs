//! Schedules: a run of an agent at each occurrence of a cron expression, and what becomes of
//! the occurrences nobody started in time.

use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{
    cron::Cron,
    error::{Error, Result},
    types::RunId,
};

/// What a schedule does with occurrences that came while no supervisor of its agent started
/// them (every replica was down, say): an occurrence found more than [`MISSED_AFTER`] after
/// its time is missed.
///
/// JSON: `"skip"` or `"catch_up"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Missed {
    /// None of the missed occurrences starts: the next run is the first occurrence after now.
    #[default]
    Skip,
    /// The latest missed occurrence starts, once, however many were missed; then the first
    /// after now.
    CatchUp,
}

impl Missed {
    /// `skip` or `catch_up`.
    pub fn as_str(self) -> &'static str {
        match self {
            Missed::Skip => "skip",
            Missed::CatchUp => "catch_up",
        }
    }
}

impl std::fmt::Display for Missed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

/// How late a supervisor may find an occurrence and still start it under [`Missed::Skip`]: a
/// minute. A supervisor with recovery looks at the time of each occurrence it knows of, so a
/// live one is late by a pass at most.
pub const MISSED_AFTER: Duration = Duration::from_secs(60);

/// A run of `agent` with `input` at each occurrence of `cron`, read in UTC. Each occurrence
/// starts once, whichever replica starts it: the run's id is the schedule's name, `@`, and
/// the occurrence's time (`nightly@2026-12-03T02:00:00Z`). Put with
/// [`Store::put_schedule`](crate::Store::put_schedule); a supervisor with
/// [`Config::recovery`](crate::Config::recovery) and the agent starts its runs.
///
/// ```
/// use agentrt::{Missed, Schedule, serde_json::json};
///
/// let nightly = Schedule::new("nightly", "0 2 * * *", "reports", json!({"kind": "daily"}))
///     .missed(Missed::CatchUp);
/// # let _ = nightly;
/// ```
///
/// `cron` has five fields (minute, hour, day of the month, month, day of the week: `*`,
/// values, ranges `a-b`, lists `a,b` and steps `/n`, names such as `MON` and `JAN`), or one
/// of `@hourly`, `@daily`, `@weekly`, `@monthly`, `@yearly`. See `docs/schedules.md`.
///
/// JSON: `{"name": "nightly", "agent": "reports", "input": {...}, "cron": "0 2 * * *",
/// "missed": "catch_up", "paused": false, "next_at": 1796263200000}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Schedule {
    /// Its name: 1 to [`Schedule::MAX_NAME_LEN`] letters, digits, `-`, `_` or `.`.
    pub name: String,
    /// The agent its runs are of.
    pub agent: String,
    /// The input of each of its runs.
    pub input: Value,
    /// When its runs start, in UTC.
    pub cron: String,
    /// What becomes of the occurrences nobody started in time.
    pub missed: Missed,
    /// A paused schedule starts nothing; resumed, its next run is the first occurrence after
    /// the resume.
    pub paused: bool,
    /// The next occurrence not started yet, by the clock of the supervisor or store that put
    /// or advanced it; `None` for a schedule not stored yet (a put ignores it).
    #[serde(default, with = "crate::types::opt_millis")]
    pub next_at: Option<SystemTime>,
}

impl Schedule {
    /// The longest name: with `@` and an occurrence's 20 characters, a run id's
    /// [`RunId::MAX_LEN`] is not reached.
    pub const MAX_NAME_LEN: usize = 100;

    /// A schedule of `agent` with `input` at each occurrence of `cron`, not paused, skipping
    /// missed occurrences.
    pub fn new(
        name: impl Into<String>,
        cron: impl Into<String>,
        agent: impl Into<String>,
        input: Value,
    ) -> Self {
        Schedule {
            name: name.into(),
            agent: agent.into(),
            input,
            cron: cron.into(),
            missed: Missed::Skip,
            paused: false,
            next_at: None,
        }
    }

    /// What becomes of missed occurrences.
    pub fn missed(mut self, missed: Missed) -> Self {
        self.missed = missed;
        self
    }

    /// Puts it paused, when it is new (a put keeps whether a stored one is paused: pausing and
    /// resuming are an operator's).
    pub fn paused(mut self, paused: bool) -> Self {
        self.paused = paused;
        self
    }

    /// The id of the run of occurrence `at` (milliseconds since the Unix epoch) of schedule
    /// `name`.
    pub(crate) fn run_id(name: &str, at: i64) -> RunId {
        RunId::from(format!("{name}@{}", crate::cron::utc_seconds(at)))
    }

    /// Refuses a name a schedule cannot have.
    pub(crate) fn check_name(name: &str) -> Result<()> {
        let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
        if name.is_empty()
            || name.len() > Schedule::MAX_NAME_LEN
            || !name.chars().all(allowed)
            || name == "."
            || name == ".."
        {
            return Err(Error::InvalidInput(format!(
                "schedule name {name:?} is refused: a schedule's name is 1 to {} letters, \
                 digits, '-', '_' or '.' (not \".\" or \"..\"), as it names its runs and its \
                 place in the API's paths",
                Schedule::MAX_NAME_LEN
            )));
        }
        Ok(())
    }

    /// Refuses what cannot be put: a bad name, an agent's empty name, an invalid expression.
    pub(crate) fn check(&self) -> Result<Cron> {
        Schedule::check_name(&self.name)?;
        if self.agent.trim().is_empty() {
            return Err(Error::InvalidInput(format!(
                "schedule {}: its agent's name is empty",
                self.name
            )));
        }
        Cron::parse(&self.cron)
    }
}

/// What a pass does with a schedule whose next occurrence is due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Due {
    /// The latest occurrence at or before now: the one started, or the last one skipped.
    pub occurrence: i64,
    /// Whether it starts.
    pub start: bool,
    /// The first occurrence after now: the schedule's next.
    pub next: i64,
}

/// What becomes of a schedule of `cron` whose next occurrence is `next_at`, at `now` (all in
/// milliseconds); `None` while it is not due. The occurrences due are folded into the latest:
/// it starts if it is on time or missed ones are caught up; the schedule's next is the first
/// occurrence after now.
pub(crate) fn due(cron: &Cron, missed: Missed, next_at: i64, now: i64) -> Option<Due> {
    if next_at > now {
        return None;
    }
    let occurrence = cron
        .latest_at_or_before(now)
        .map_or(next_at, |latest| latest.max(next_at));
    let late = now - occurrence;
    let start = missed == Missed::CatchUp || late <= MISSED_AFTER.as_millis() as i64;
    // A valid expression always has a next occurrence.
    let next = cron.next_after(now).unwrap_or(i64::MAX);
    Some(Due {
        occurrence,
        start,
        next,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> i64 {
        crate::builtin::parse_rfc3339(text).unwrap()
    }

    #[test]
    fn a_due_occurrence_on_time_starts_and_the_next_is_after_now() {
        let cron = Cron::parse("0 * * * *").unwrap();
        let next_at = at("2026-12-03T02:00:00Z");
        assert_eq!(due(&cron, Missed::Skip, next_at, next_at - 1), None);
        let found = due(&cron, Missed::Skip, next_at, at("2026-12-03T02:00:20Z")).unwrap();
        assert_eq!(
            found,
            Due {
                occurrence: next_at,
                start: true,
                next: at("2026-12-03T03:00:00Z"),
            }
        );
    }

    #[test]
    fn missed_occurrences_are_skipped_or_the_latest_is_caught_up_once() {
        let cron = Cron::parse("0 * * * *").unwrap();
        let next_at = at("2026-12-03T02:00:00Z");
        let now = at("2026-12-03T05:30:00Z");
        let skip = due(&cron, Missed::Skip, next_at, now).unwrap();
        assert_eq!(skip.occurrence, at("2026-12-03T05:00:00Z"));
        assert!(!skip.start);
        assert_eq!(skip.next, at("2026-12-03T06:00:00Z"));
        let catch_up = due(&cron, Missed::CatchUp, next_at, now).unwrap();
        assert_eq!(
            catch_up,
            Due {
                start: true,
                ..skip
            }
        );
        // Within a minute of the latest, it is on time, whatever came before it.
        let now = at("2026-12-03T05:00:40Z");
        assert!(due(&cron, Missed::Skip, next_at, now).unwrap().start);
    }

    #[test]
    fn an_occurrence_is_named_by_its_schedule_and_its_utc_time() {
        assert_eq!(
            Schedule::run_id("nightly", at("2026-12-03T02:00:00Z")).as_str(),
            "nightly@2026-12-03T02:00:00Z"
        );
        let longest = Schedule::run_id(&"n".repeat(Schedule::MAX_NAME_LEN), 0);
        assert!(longest.check().is_ok());
    }

    #[test]
    fn a_name_is_letters_digits_dashes_underscores_and_dots() {
        for good in ["nightly", "billing.daily-2", "A_b"] {
            assert!(Schedule::check_name(good).is_ok(), "{good}");
        }
        let long = "x".repeat(Schedule::MAX_NAME_LEN + 1);
        for bad in ["", ".", "..", "a b", "a/b", "a@b", "é", long.as_str()] {
            assert!(
                matches!(Schedule::check_name(bad), Err(Error::InvalidInput(_))),
                "{bad}"
            );
        }
    }
}
