//! Retention: purging finished runs with everything stored of them, in short transactions,
//! and giving the space they held back to the disk. Written once for every backend, on the
//! primitives of the storage boundary.

use std::{collections::HashSet, time::SystemTime};

use serde::{Deserialize, Serialize};

use super::{
    Store,
    backend::{Purged, Reads},
    health::Space,
};
use crate::{
    clock::{SystemClock, to_millis},
    error::{Error, Result},
    types::{RunId, RunState},
};

/// The runs a purge takes per transaction unless told otherwise: short enough that a running
/// supervisor's moves wait little behind one, long enough that a large purge takes few.
pub const DEFAULT_PURGE_BATCH: usize = 200;

/// The most runs a purge takes per transaction.
pub const MAX_PURGE_BATCH: usize = 1000;

/// The most run ids a [`PurgeReport`] lists; its counts cover every run.
pub const PURGE_REPORT_IDS: usize = 1000;

/// Which finished runs [`Store::purge`] deletes, with their steps, events and approvals.
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use agentrt::{Purge, Store};
///
/// let store = Store::in_memory()?;
/// let month_ago = SystemTime::now() - Duration::from_secs(30 * 24 * 3600);
/// let report = store.purge(&Purge::finished_before(month_ago).dry_run(true))?;
/// assert_eq!(report.runs, 0);
/// # Ok::<(), agentrt::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Purge {
    selection: Selection,
    dry_run: bool,
    batch: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Selection {
    /// The finished runs whose last move (their finish) came before this time (milliseconds
    /// since the Unix epoch).
    FinishedBefore(i64),
    /// These runs, each of which must have finished.
    Runs(Vec<RunId>),
}

impl Purge {
    /// Every run that finished (SUCCEEDED, FAILED or CANCELLED) before `time`: whose last move,
    /// its `updated_at` as the supervisor's clock stamped it, came before `time`. Runs that have
    /// not finished are never selected.
    pub fn finished_before(time: SystemTime) -> Purge {
        Purge::of(Selection::FinishedBefore(to_millis(time)))
    }

    /// These runs, each of which must exist and have finished: if one does not, the purge
    /// deletes nothing and says which ([`Error::RunNotFound`], or a state error). An id given
    /// twice counts once.
    pub fn runs<I>(ids: I) -> Purge
    where
        I: IntoIterator,
        I::Item: Into<RunId>,
    {
        Purge::of(Selection::Runs(ids.into_iter().map(Into::into).collect()))
    }

    fn of(selection: Selection) -> Purge {
        Purge {
            selection,
            dry_run: false,
            batch: DEFAULT_PURGE_BATCH,
        }
    }

    /// Only count what would be deleted: nothing is written (a read-only store can do it).
    pub fn dry_run(mut self, dry_run: bool) -> Self {
        self.dry_run = dry_run;
        self
    }

    /// Runs deleted per transaction, from 1 to [`MAX_PURGE_BATCH`] (default
    /// [`DEFAULT_PURGE_BATCH`]); another value is refused with [`Error::InvalidInput`].
    pub fn batch(mut self, runs: usize) -> Self {
        self.batch = runs;
        self
    }
}

/// What [`Store::purge`] deleted, or, for a dry run, would delete. JSON: its fields by name,
/// `space` `null` for a dry run.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[non_exhaustive]
pub struct PurgeReport {
    /// Nothing was written: the counts are what a purge would delete now.
    pub dry_run: bool,
    /// Runs deleted.
    pub runs: u64,
    /// Their steps.
    pub steps: u64,
    /// Their events.
    pub events: u64,
    /// Their approvals.
    pub approvals: u64,
    /// The ids of the runs deleted, in the order they were (by age: oldest finish first; by
    /// id: as given), the first [`PURGE_REPORT_IDS`] of them.
    pub run_ids: Vec<RunId>,
    /// The transactions it took (a dry run: the reads).
    pub batches: u64,
    /// The database's size and free space after the purge; `None` for a dry run.
    pub space: Option<Space>,
}

impl Store {
    /// Deletes the finished runs `purge` selects, with their steps, events and approvals, in
    /// transactions of [`Purge::batch`] runs each, then gives the space they held back to the
    /// disk (see `docs/persistence.md`, "Retention"). A run that has not finished (RUNNING or
    /// WAITING_FOR_APPROVAL) is never deleted: each delete checks the run's state in the same
    /// statement, and the database refuses to delete any row of such a run. A fork keeps its
    /// own copies of its origin's events, so purging the origin leaves the fork whole.
    ///
    /// A dry run ([`Purge::dry_run`]) writes nothing and works on a read-only store. Each
    /// transaction is committed on its own: a purge that fails part way keeps what it deleted
    /// so far, and may be run again.
    pub fn purge(&self, purge: &Purge) -> Result<PurgeReport> {
        if !(1..=MAX_PURGE_BATCH).contains(&purge.batch) {
            return Err(Error::InvalidInput(format!(
                "a purge batch of {} runs: give from 1 to {MAX_PURGE_BATCH}",
                purge.batch
            )));
        }
        let mut report = PurgeReport {
            dry_run: purge.dry_run,
            ..PurgeReport::default()
        };
        match &purge.selection {
            Selection::FinishedBefore(before) => self.purge_by_age(*before, purge, &mut report)?,
            Selection::Runs(ids) => self.purge_by_id(ids, purge, &mut report)?,
        }
        if !purge.dry_run {
            report.space = Some(self.backend().reclaim()?);
        }
        Ok(report)
    }

    fn purge_by_age(&self, before: i64, purge: &Purge, report: &mut PurgeReport) -> Result<()> {
        // Keyset paging on (updated_at, id): a run not deleted (one that moved meanwhile) is
        // not selected again, so the loop ends.
        let mut after: Option<(i64, RunId)> = None;
        loop {
            let select = |reads: &mut dyn Reads| {
                let after = after.as_ref().map(|(at, id)| (*at, id));
                reads.finished_runs(before, after, purge.batch)
            };
            let (runs, purged) = if purge.dry_run {
                self.read(|reads| {
                    let runs = select(reads)?;
                    let ids: Vec<RunId> = runs.iter().map(|(id, _)| id.clone()).collect();
                    Ok((runs, reads.purge_counts(&ids)?))
                })?
            } else {
                self.transact(&SystemClock, |tx, _| {
                    let runs = select(tx)?;
                    let ids: Vec<RunId> = runs.iter().map(|(id, _)| id.clone()).collect();
                    Ok((runs, tx.delete_finished_runs(&ids)?))
                })?
            };
            if runs.is_empty() {
                return Ok(());
            }
            report.add(&purged);
            if runs.len() < purge.batch {
                return Ok(());
            }
            after = runs.last().map(|(id, at)| (*at, id.clone()));
        }
    }

    fn purge_by_id(&self, ids: &[RunId], purge: &Purge, report: &mut PurgeReport) -> Result<()> {
        let mut seen = HashSet::new();
        let ids: Vec<RunId> = ids
            .iter()
            .filter(|id| seen.insert(id.as_str()))
            .cloned()
            .collect();
        for (n, batch) in ids.chunks(purge.batch).enumerate() {
            // The first transaction checks every id before it deletes anything: a refusal
            // deletes nothing. A finished run stays finished, so later batches need only the
            // guard of each delete.
            let check = |reads: &mut dyn Reads| match n {
                0 => all_finished(reads, &ids),
                _ => Ok(()),
            };
            let purged = if purge.dry_run {
                self.read(|reads| {
                    check(reads)?;
                    reads.purge_counts(batch)
                })?
            } else {
                self.transact(&SystemClock, |tx, _| {
                    check(tx)?;
                    tx.delete_finished_runs(batch)
                })?
            };
            report.add(&purged);
        }
        Ok(())
    }

    /// Rewrites the database compactly, giving all its free space back to the disk, and
    /// switches a database created before retention existed to giving back, after each purge,
    /// the space of what it deleted (SQLite: `auto_vacuum = INCREMENTAL`, then `VACUUM`).
    ///
    /// It blocks every writer for its duration (a supervisor's moves wait, up to their busy
    /// timeout, and fail after it) and needs free disk space up to twice the database's size.
    /// Run it while nothing else writes, after a first large purge of an older database.
    pub fn vacuum(&self) -> Result<Space> {
        self.backend().vacuum()
    }
}

/// Refuses, naming the first, ids that are unknown or of runs that have not finished.
fn all_finished(reads: &mut dyn Reads, ids: &[RunId]) -> Result<()> {
    for id in ids {
        match reads.lease_row(id)? {
            None => return Err(Error::RunNotFound(id.clone())),
            Some(row) if !row.state.is_finished() => {
                return Err(Error::RunState {
                    run_id: id.clone(),
                    state: row.state,
                    reason: not_finished(row.state),
                });
            }
            Some(_) => {}
        }
    }
    Ok(())
}

fn not_finished(state: RunState) -> String {
    let wait = match state {
        RunState::WaitingForApproval => "decide its waiting calls and resume it, or cancel it",
        _ => "let it finish, or cancel it",
    };
    format!("only a finished run can be purged ({wait}); nothing was purged")
}

impl PurgeReport {
    fn add(&mut self, purged: &Purged) {
        self.batches += 1;
        self.runs += purged.runs;
        self.steps += purged.steps;
        self.events += purged.events;
        self.approvals += purged.approvals;
        let room = PURGE_REPORT_IDS.saturating_sub(self.run_ids.len());
        self.run_ids.extend(purged.ids.iter().take(room).cloned());
    }
}
