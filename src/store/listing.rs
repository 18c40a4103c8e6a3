//! Listing runs a page at a time: filters, and a cursor that keeps its place while runs are
//! added.

use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use super::Store;
use crate::{
    clock::to_millis,
    error::{Error, Result},
    types::{Run, RunId, RunState},
};

/// The runs a page holds unless told otherwise.
pub const DEFAULT_PAGE_LIMIT: usize = 100;

/// The most runs a page may hold.
pub const MAX_PAGE_LIMIT: usize = 1000;

/// Which runs [`Store::list_runs`] returns, and from where: filters that combine (a run must
/// match each one given), a page size, and the cursor of the previous page.
///
/// ```
/// use agentrt::{RunQuery, RunState, Store};
///
/// let store = Store::in_memory()?;
/// let mut query = RunQuery::new().agent("billing").state(RunState::Running).limit(50);
/// loop {
///     let page = store.list_runs(&query)?;
///     for run in &page.runs {
///         println!("{} {}", run.id, run.state);
///     }
///     match page.next {
///         Some(next) => query = query.after(next),
///         None => break,
///     }
/// }
/// # Ok::<(), agentrt::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct RunQuery {
    agent: Option<String>,
    state: Option<RunState>,
    since: Option<SystemTime>,
    limit: Option<usize>,
    after: Option<String>,
}

impl RunQuery {
    /// Every run, the first [`DEFAULT_PAGE_LIMIT`] of them.
    pub fn new() -> Self {
        RunQuery::default()
    }

    /// Only the runs of this agent.
    pub fn agent(mut self, agent: impl Into<String>) -> Self {
        self.agent = Some(agent.into());
        self
    }

    /// Only the runs in this state.
    pub fn state(mut self, state: RunState) -> Self {
        self.state = Some(state);
        self
    }

    /// Only the runs created at `time` or later (their `created_at`, as the supervisor's clock
    /// stamped it).
    pub fn since(mut self, time: SystemTime) -> Self {
        self.since = Some(time);
        self
    }

    /// At most this many runs per page, from 1 to [`MAX_PAGE_LIMIT`] (default
    /// [`DEFAULT_PAGE_LIMIT`]); another value is refused with [`Error::InvalidInput`].
    pub fn limit(mut self, runs: usize) -> Self {
        self.limit = Some(runs);
        self
    }

    /// The runs after the cursor of a page ([`RunPage::next`]), as it was given: the next page.
    pub fn after(mut self, cursor: impl Into<String>) -> Self {
        self.after = Some(cursor.into());
        self
    }
}

/// A page of runs, oldest first (by `created_at`, ties by id). JSON: `{"runs": [...], "next":
/// CURSOR}`, `next` `null` on the last page.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct RunPage {
    /// The runs.
    pub runs: Vec<Run>,
    /// The cursor of the next page, for [`RunQuery::after`]; `None` when no run matching the
    /// query follows. Opaque: keep it as it is. It names a place in the order, not an offset,
    /// so runs created meanwhile shift nothing: each run is seen once, new runs on the last
    /// pages.
    pub next: Option<String>,
}

/// A backend's query: the filters, and the place after which the page starts.
pub(crate) struct ListQuery<'a> {
    pub agent: Option<&'a str>,
    pub state: Option<RunState>,
    /// `created_at` at least this (milliseconds since the Unix epoch).
    pub since: Option<i64>,
    /// After this (created_at, id).
    pub after: Option<(i64, RunId)>,
    pub limit: usize,
}

impl Store {
    /// A page of the runs `query` selects, oldest first (see [`RunQuery`]). A limit out of
    /// range or a cursor that is not one this store gave is [`Error::InvalidInput`].
    pub fn list_runs(&self, query: &RunQuery) -> Result<RunPage> {
        let limit = query.limit.unwrap_or(DEFAULT_PAGE_LIMIT);
        if !(1..=MAX_PAGE_LIMIT).contains(&limit) {
            return Err(Error::InvalidInput(format!(
                "a page of {limit} runs: give a limit from 1 to {MAX_PAGE_LIMIT}"
            )));
        }
        let list = ListQuery {
            agent: query.agent.as_deref(),
            state: query.state,
            since: query.since.map(to_millis),
            after: query.after.as_deref().map(decode).transpose()?,
            // One more than the page: whether another page follows.
            limit: limit + 1,
        };
        let mut runs = self.read(|reads| reads.list_runs(&list))?;
        let next = (runs.len() > limit).then(|| {
            runs.truncate(limit);
            encode(runs.last().expect("a full page"))
        });
        Ok(RunPage { runs, next })
    }
}

const CURSOR_PREFIX: &str = "r1.";

/// A cursor: a version, the run's `created_at` in milliseconds, and its id in hex (an id may
/// hold any character).
fn encode(run: &Run) -> String {
    let hex: String = run
        .id
        .as_str()
        .bytes()
        .map(|byte| format!("{byte:02x}"))
        .collect();
    format!("{CURSOR_PREFIX}{}.{hex}", to_millis(run.created_at))
}

fn decode(cursor: &str) -> Result<(i64, RunId)> {
    let malformed = || {
        Error::InvalidInput(format!(
            "{cursor:?} is not a cursor of a page of runs: give back a page's `next` as it was"
        ))
    };
    let (at, hex) = cursor
        .strip_prefix(CURSOR_PREFIX)
        .and_then(|rest| rest.split_once('.'))
        .ok_or_else(malformed)?;
    let at: i64 = at.parse().map_err(|_| malformed())?;
    if hex.len() % 2 != 0 || !hex.is_ascii() {
        return Err(malformed());
    }
    let bytes = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16))
        .collect::<Result<Vec<u8>, _>>()
        .map_err(|_| malformed())?;
    let id = String::from_utf8(bytes).map_err(|_| malformed())?;
    Ok((at, RunId::from(id)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::from_millis;

    #[test]
    fn a_cursor_gives_back_its_place() {
        let run = Run {
            id: RunId::from("order.17/ü"),
            agent: "a".into(),
            input: serde_json::json!({}),
            state: RunState::Running,
            output: None,
            error: None,
            created_at: from_millis(-5),
            updated_at: from_millis(-5),
        };
        assert_eq!(decode(&encode(&run)).unwrap(), (-5, run.id));
    }

    #[test]
    fn a_malformed_cursor_is_invalid_input() {
        for cursor in [
            "", "r1.", "r1.12", "r1.x.61", "r1.1.6", "r1.1.zz", "r2.1.61", "r1.1.ff",
        ] {
            assert!(
                matches!(decode(cursor), Err(Error::InvalidInput(_))),
                "{cursor:?}"
            );
        }
    }
}
