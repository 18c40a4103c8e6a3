//! Reading the change feed: what a watcher makes of the changes after its cursor, written
//! once for every backend over the feed's four reads.

use std::collections::HashSet;

use super::backend::{Change, ChangeKind, Changes};
use crate::{error::Result, types::RunId};

/// A backend's reads of its change feed, in one snapshot.
pub(crate) trait Feed {
    /// The id of the last change in the feed; 0 for an empty one.
    fn last_change(&mut self) -> Result<i64>;
    /// The changes after `cursor`, in order, each with its id.
    fn changes_after(&mut self, cursor: i64) -> Result<Vec<(i64, Change)>>;
    /// Every run that waits for approval with its decision recorded, as decided changes.
    fn decided_waiting_runs(&mut self) -> Result<Vec<Change>>;
    /// Whether `run_id` waits for approval with its decision recorded: a decision already
    /// acted on (the run resumed, and maybe paused again since) is no longer news.
    fn waits_decided(&mut self, run_id: &RunId) -> Result<bool>;
}

/// Where the feed stands, and the runs decided while nobody watched: a first poll's reading.
pub(crate) fn start(feed: &mut dyn Feed) -> Result<(i64, Changes)> {
    let last = feed.last_change()?;
    let changes = Changes {
        changes: feed.decided_waiting_runs()?,
        resync: true,
    };
    Ok((last, changes))
}

/// The changes after `cursor` and the cursor after them; `None` when there are none. A gap
/// after the cursor (the feed dropped changes this reader had not read) makes a resync: the
/// decided runs are read from the runs themselves.
pub(crate) fn after(feed: &mut dyn Feed, cursor: i64) -> Result<Option<(i64, Changes)>> {
    let rows = feed.changes_after(cursor)?;
    let Some(&(last, _)) = rows.last() else {
        return Ok(None);
    };
    // Ids are given one after the other, with no gaps: a first id past the next one means the
    // trimming took changes this reader never read.
    let behind = rows[0].0 > cursor + 1;
    let mut changes = Vec::new();
    let mut decided = HashSet::new();
    for (_, change) in rows {
        // The decisions as this snapshot has them: one acted on already is no news, nor is a
        // run twice.
        if change.kind == ChangeKind::Decided
            && (behind
                || !decided.insert(change.run_id.clone())
                || !feed.waits_decided(&change.run_id)?)
        {
            continue;
        }
        changes.push(change);
    }
    if behind {
        changes.extend(feed.decided_waiting_runs()?);
    }
    Ok(Some((
        last,
        Changes {
            changes,
            resync: behind,
        },
    )))
}
