//! A supervisor's writer on SQLite: group commit with savepoints, the log sync left to a
//! thread of its own while the next group is applied, the answer once written, and
//! checkpoints between groups.
//!
//! Moves that arrive while a commit is syncing are committed together, up to
//! [`Options::max_group`](super::Options::max_group) of them: one `BEGIN IMMEDIATE`
//! transaction, each move all-or-nothing, each caller answered only after the commit and its
//! log sync. The exception: a caller that asked to be answered once written (a run's model
//! reservation) is answered after the commit, before its sync; the next commit's sync, or the
//! writer's own when the store actor finds no more moves, makes it durable.

use std::{
    sync::{Arc, Condvar, Mutex, MutexGuard, atomic::Ordering, mpsc},
    time::{Duration, Instant},
};

use rusqlite::{Connection, Transaction, TransactionBehavior};

use super::error::{Db, db_error, is_io, noted_io_error, take_io_error};
use super::{
    database::{Sqlite, lock},
    log::{log_pages, take_commit_frames},
    options::Synchronous,
    renewal::RenewalPending,
    sql::Sql,
};
use crate::{
    clock::Clock,
    error::{Error, Result},
    metrics,
    store::{
        backend::{
            Durability, GroupFailure, Isolation, MoveInfo, MoveObserver, Pending, Reads, Session,
            Tx, Writer,
        },
        model::{Now, Renewal},
        moves,
    },
    types::RunId,
};

/// How often the writer checkpoints while it commits, at most.
const CHECKPOINT_PERIOD: Duration = Duration::from_millis(100);

/// How long the writer lets the log grow, at most, however long its copies take.
const MAX_CHECKPOINT_PERIOD: Duration = Duration::from_secs(2);

/// How large the writer lets the log grow, at most, in pages (125 MiB of 4 KiB pages). Each
/// copy costs about the pages the runs in flight touched since the last one, whatever the
/// log's length, so a longer log means fewer copies. The price: a log of up to this size on
/// disk, read once by the next process to open the database after a crash.
const MAX_LOG_PAGES: u32 = 32_000;

/// When a group commit's log reaches the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LogSync {
    /// In the commit, as the store's [`Synchronous`] says.
    InCommit,
    /// Later, by [`Sqlite::sync_log`], before anyone is told of the group's moves.
    Deferred,
}

impl Sqlite {
    /// The writer connection, at the store's own `synchronous` setting; refused once an I/O
    /// error was met. What the caller does with it is watched from here on: an I/O error
    /// noted on this thread is this use's, which [`IoFailure::fail_if_noted`] then takes.
    ///
    /// [`IoFailure::fail_if_noted`]: super::failure::IoFailure::fail_if_noted
    fn writer(&self) -> Result<MutexGuard<'_, Connection>> {
        self.failure.refuse_if_failed()?;
        let conn = lock(&self.writer);
        // After the lock: no other use of the writer runs on this thread meanwhile.
        take_io_error();
        if self.writer_lowered.load(Ordering::SeqCst) {
            self.restore_synchronous(&conn)?;
        }
        Ok(conn)
    }

    /// The writer's memo of the runs' keys; the caller holds the writer's lock.
    fn run_keys(&self) -> MutexGuard<'_, super::keys::RunKeys> {
        self.keys
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn restore_synchronous(&self, conn: &Connection) -> Result<()> {
        let pragma = format!("PRAGMA synchronous = {}", self.options.synchronous.as_str());
        conn.prepare_cached(&pragma)
            .and_then(|mut restore| restore.execute([]))
            .map_err(|err| {
                Error::SyncFailed(format!("restoring the writer's `{pragma}`: {err}"))
            })?;
        self.writer_lowered.store(false, Ordering::SeqCst);
        Ok(())
    }

    /// Whether a group commit may leave its log sync to [`sync_log`](Self::sync_log): a file
    /// store at [`Synchronous::Full`] (whose log is synced at each commit otherwise), on Unix
    /// (where the deferred sync is tested).
    pub(crate) fn defers_sync(&self) -> bool {
        cfg!(unix) && self.log.is_some() && self.options.synchronous == Synchronous::Full
    }

    /// Runs `moves` as one group commit: one `BEGIN IMMEDIATE` transaction and one commit
    /// for all, each move all-or-nothing. They are first applied straight into the transaction,
    /// which is all it takes when none is refused (the usual case); if one is, or a write one
    /// held back does not stand when it is sent, the transaction is rolled back and the group applied again with each move in a savepoint of its own, so
    /// that a refused move is rolled back alone. `apply` must therefore give the same result
    /// when called again on the same state. An error means nothing was committed, except
    /// [`Error::CommitUnknown`]: an I/O error once the commit may have reached the disk. An
    /// I/O error, wherever met, makes the store refuse every later write.
    ///
    /// With [`LogSync::Deferred`] (and a store that [defers syncs](Self::defers_sync)), the
    /// commit writes the log without syncing it: the caller must [`sync_log`](Self::sync_log)
    /// before it tells anyone of these moves.
    fn transact_group<T>(
        &self,
        moves: &mut [T],
        sync: LogSync,
        apply: impl FnMut(&mut T, &mut dyn Tx, Isolation) -> bool,
    ) -> Result<()> {
        let committed = self.transact_group_watched(moves, sync, apply);
        self.failure.fail_if_noted("committing the moves");
        committed
    }

    fn transact_group_watched<T>(
        &self,
        moves: &mut [T],
        sync: LogSync,
        mut apply: impl FnMut(&mut T, &mut dyn Tx, Isolation) -> bool,
    ) -> Result<()> {
        let mut conn = self.writer()?;
        let defer = sync == LogSync::Deferred && self.defers_sync();
        if defer {
            // Set first: should anything below panic or fail, the next use of the writer puts
            // the setting back before it commits.
            self.writer_lowered.store(true, Ordering::SeqCst);
            conn.prepare_cached("PRAGMA synchronous = NORMAL")
                .db()?
                .execute([])
                .db()?;
        }
        let mut keys = self.run_keys();
        let committed = self.noting_synced_commit(defer, || {
            let tx = conn
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .db()?;
            // Under the write lock: no other connection commits until this one does.
            let version = tx
                .prepare_cached("PRAGMA data_version")
                .and_then(|mut read| read.query_row([], |row| row.get(0)))
                .db()?;
            keys.begin(version);
            let mut sql = Sql(&tx, Some(&mut keys));
            let mut stopped = None;
            let applied = moves.iter_mut().all(|group_move| {
                // The touch and steps a move (or pair) held back are sent once it is applied,
                // the events at the end of the group; a write that does not stand, or fails,
                // has the group applied again move by move.
                let applied = apply(group_move, &mut sql, Isolation::Shared);
                let stands = applied && stood(sql.move_stood());
                stopped = stopped_at_io(&tx);
                stands && stopped.is_none()
            });
            let stands = applied && stood(sql.held_stood());
            if applied {
                stopped = stopped_at_io(&tx);
            }
            if stands && stopped.is_none() {
                let committed = commit(tx);
                match &committed {
                    Ok(()) => keys.committed(),
                    Err(_) => keys.forget_all(),
                }
                return committed;
            }
            // A key learnt in the transaction may be of a run whose insert it rolls back.
            keys.forget_all();
            if let Some(err) = stopped {
                return Err(err);
            }
            drop(tx); // rolls back
            let tx = conn
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .db()?;
            let mut sql = Sql::of(&tx);
            for group_move in moves.iter_mut() {
                sql.savepoint("agentrt_move")?;
                if !apply(group_move, &mut sql, Isolation::Savepoint) {
                    sql.rollback_to("agentrt_move")?;
                }
                if let Some(err) = stopped_at_io(&tx) {
                    return Err(err);
                }
                sql.release_savepoint("agentrt_move")?;
            }
            commit(tx)
        });
        if defer && let Err(err) = self.restore_synchronous(&conn) {
            // The group's own outcome stands (its sync is the caller's); the next use of the
            // writer tries again, and refuses to commit until it succeeds.
            tracing::error!(%err, "restoring the writer's synchronous setting failed");
        }
        committed
    }

    /// Runs `commit`, a commit on the writer (held by the caller) that syncs its log in the
    /// commit unless `deferred`, and then marks the log durable up to it if it did (see
    /// [`LogFile::note_synced_commit`]).
    ///
    /// [`LogFile::note_synced_commit`]: super::log::LogFile::note_synced_commit
    fn noting_synced_commit<R>(
        &self,
        deferred: bool,
        commit: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        // What an earlier use of the writer on this thread left is not this commit's.
        take_commit_frames();
        let generation = self.generation_before(deferred);
        let done = commit();
        let frames = take_commit_frames();
        if !deferred && done.is_ok() {
            self.note_synced_commit(frames, generation);
        }
        done
    }

    /// The log's generation before a commit of the writer that is to sync.
    fn generation_before(&self, deferred: bool) -> Option<[u32; 2]> {
        match &self.log {
            Some(log) if !deferred && self.options.synchronous != Synchronous::Normal => {
                log.generation()
            }
            _ => None,
        }
    }

    /// After a commit of the writer at the store's own setting that ended the log at `frames`
    /// (`None`: it wrote nothing), begun in `generation` of the log: at `FULL` and above it
    /// synced its log, which reads need not do again.
    fn note_synced_commit(&self, frames: Option<u32>, generation: Option<[u32; 2]>) {
        if let (Some(log), Some(frames)) = (&self.log, frames)
            && self.options.synchronous != Synchronous::Normal
        {
            log.note_synced_commit(frames, generation);
        }
    }

    /// Copies what the write-ahead log holds into the database file, without waiting for
    /// readers or blocking writers (a `PASSIVE` checkpoint); nothing to do in memory.
    /// A checkpoint that fails with an I/O error (a page copied, or the file synced) makes the
    /// store refuse every later write.
    pub(super) fn checkpoint(&self) -> Result<()> {
        if self.path.is_some() {
            let checkpointed = self
                .writer()?
                .query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
                .db();
            self.failure.fail_if_noted("a checkpoint");
            checkpointed?;
        }
        Ok(())
    }

    /// Runs `f` on the writer connection outside any move: reads that must see every committed
    /// move, and the lease's single-statement writes (renewal on `:memory:`, release). `what`
    /// names it should it meet an I/O error, which makes the store refuse every later write.
    pub(super) fn on_writer<R>(
        &self,
        what: &str,
        f: impl FnOnce(&mut Sql<'_>) -> Result<R>,
    ) -> Result<R> {
        let conn = self.writer()?;
        let done = f(&mut Sql::of(&conn));
        self.failure.fail_if_noted(what);
        done
    }

    /// [`on_writer`](Self::on_writer) for a statement that commits alone: an I/O error leaves
    /// its fate unknown. It syncs in its commit, at the store's setting (which the writer is
    /// put back to first), as a group does.
    fn write_on_writer<R>(
        &self,
        what: &str,
        f: impl FnOnce(&mut Sql<'_>) -> Result<R>,
    ) -> Result<R> {
        self.on_writer(what, |sql| {
            self.run_keys().forget_all();
            self.noting_synced_commit(false, || super::failure::of_unknown_fate(what, f(sql)))
        })
    }
}

/// Whether the writes held back and sent stood; an error sending them is a refusal, which
/// has the group applied again move by move.
fn stood(sent: Result<bool>) -> bool {
    sent.unwrap_or_else(|err| {
        tracing::debug!(%err, "a held write failed: the group is applied again");
        false
    })
}

/// Commits `tx`. An I/O error at the commit leaves its fate unknown: the frames may have
/// reached the log whole, and a failed sync says nothing of what the disk kept. Any other
/// error rolls it back.
fn commit(tx: Transaction<'_>) -> Result<()> {
    tx.commit().map_err(|err| {
        let unknown = is_io(&err);
        // Noted, for the store to refuse every later write.
        let err = db_error(err);
        if unknown {
            Error::CommitUnknown(err.to_string())
        } else {
            err
        }
    })
}

/// The error that stops a transaction once a statement of it met an I/O error: SQLite may have
/// rolled it back, after which each later statement would commit alone. While the transaction
/// is still open, its rollback leaves nothing written; if SQLite had rolled it back already,
/// a statement after that may have committed alone.
fn stopped_at_io(tx: &Transaction<'_>) -> Option<Error> {
    let why = noted_io_error()?;
    Some(if tx.is_autocommit() {
        Error::CommitUnknown(format!(
            "SQLite rolled the transaction back at an I/O error ({why}); a statement after it \
             may have committed alone"
        ))
    } else {
        Error::CommitFailed(format!("a move met an I/O error: {why}"))
    })
}

/// One move in a transaction of its own on the writer connection: committed when `apply`
/// returns `Ok`, rolled back otherwise.
pub(super) fn transact(
    store: &Sqlite,
    clock: &dyn Clock,
    apply: &mut dyn FnMut(&mut dyn Tx, &mut Now<'_>) -> Result<()>,
) -> Result<()> {
    let committed = (|| {
        let mut conn = store.writer()?;
        // Under the writer's lock: a purge may remove a run whose key the memo holds.
        store.run_keys().forget_all();
        store.noting_synced_commit(false, || {
            let tx = conn
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .db()?;
            let applied = apply(&mut Sql::of(&tx), &mut Now::new(clock));
            if let Some(err) = stopped_at_io(&tx) {
                return Err(err);
            }
            applied?;
            commit(tx)
        })
    })();
    store.failure.fail_if_noted("an operator's move");
    committed
}

/// Starts the write side of a supervisor on `store`.
pub(super) fn session(
    store: Arc<Sqlite>,
    clock: Arc<dyn Clock>,
    observer: Option<Arc<dyn MoveObserver>>,
) -> Result<Session> {
    let renewal = RenewalPending::default();
    // A renewal waits for a busy database at most one period (the keeper's patience), so a
    // stalled tick cannot outlive the lease it renews.
    let renewer = super::renewal::SqliteRenewer::open(&store, renewal.clone())?;
    let syncer = (store.options.group_commit && store.defers_sync())
        .then(|| spawn_syncer(store.clone(), observer.clone()))
        .flatten();
    let writer = SqliteWriter {
        store,
        clock,
        observer,
        renewal,
        last_checkpoint: Instant::now(),
        checkpoint_took: Duration::ZERO,
        syncer,
        unsynced: Arc::default(),
        written: Vec::new(),
    };
    Ok(Session {
        router: None,
        writer: Box::new(writer),
        renewer: renewer.map(|renewer| Box::new(renewer) as _),
    })
}

/// A supervisor's writer.
struct SqliteWriter {
    store: Arc<Sqlite>,
    clock: Arc<dyn Clock>,
    observer: Option<Arc<dyn MoveObserver>>,
    renewal: RenewalPending,
    last_checkpoint: Instant,
    checkpoint_took: Duration,
    /// The syncer thread's queue: groups committed without their log sync, in commit order.
    /// `None` when groups sync in their own commit (no group commit, `NORMAL`, `EXTRA`,
    /// `:memory:`, not Unix, or the thread could not be started).
    syncer: Option<mpsc::Sender<UnsyncedGroup>>,
    unsynced: Arc<Unsynced>,
    /// The moves of groups committed without their sync whose callers were answered once the
    /// moves were in the log, one entry per group, in commit order. The next sync of the log
    /// makes them durable, and the observer hears of them then.
    written: Vec<Vec<MoveInfo>>,
}

/// Groups committed whose log sync has not completed yet: their callers wait, and the writer's
/// reads and lease writes wait for them (see [`SqliteWriter::wait_synced`]).
#[derive(Default)]
struct Unsynced {
    groups: Mutex<usize>,
    synced: Condvar,
}

impl Unsynced {
    fn count(&self) -> MutexGuard<'_, usize> {
        self.groups
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn add(&self) {
        *self.count() += 1;
    }

    fn done(&self) {
        *self.count() -= 1;
        self.synced.notify_all();
    }

    fn is_empty(&self) -> bool {
        *self.count() == 0
    }

    fn wait_empty(&self) {
        let mut count = self.count();
        while *count > 0 {
            count = self
                .synced
                .wait(count)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }
}

impl Writer for SqliteWriter {
    /// Commits `batch` as one group (or, without group commit, each move alone), each caller
    /// answered only once its moves are durable.
    ///
    /// While other moves wait (more than one in the batch, some in the queue, a group still
    /// syncing), the group's log sync is left to the syncer thread: this thread goes on with the
    /// next group instead of waiting for the disk, and the runs answered by one sync form the
    /// next group while the one after is applied. A move alone syncs in its commit, which saves
    /// a thread hand-off. A batch whose callers all asked to be answered once written commits
    /// without its sync too, and is answered at once (see [`SqliteWriter::commit_as`]).
    fn commit(&mut self, batch: Vec<Box<dyn Pending>>, more_queued: bool) {
        if !self.store.options.group_commit {
            for pending in batch {
                self.commit_as(vec![pending], LogSync::InCommit);
            }
        } else {
            self.commit_group(batch, more_queued);
        }
        self.checkpoint_if_due();
    }

    /// [`Options::max_group`](super::Options::max_group) where a group's sync is left to the
    /// syncer thread or is not made at all (`NORMAL`, or a database in memory): there the bound
    /// costs a commit, not a sync, per group. Where each group would sync in its commit
    /// (`EXTRA`; `FULL` with no syncer thread), one large group, one sync.
    fn max_batch(&self) -> usize {
        let syncs_apart = self.syncer.is_some()
            || self.store.options.synchronous == Synchronous::Normal
            || self.store.path().is_none();
        if syncs_apart {
            self.store.options.max_group
        } else {
            usize::MAX
        }
    }

    fn watch(&self) -> Duration {
        self.store.options.commit_spin
    }

    fn idle(&mut self) {
        self.sync_written();
    }

    fn read(&mut self, read: &mut dyn FnMut(&mut dyn Reads) -> Result<()>) -> Result<()> {
        self.wait_synced();
        self.store.on_writer("a read", |sql| {
            super::sql::in_snapshot(sql.0, |snapshot| read(snapshot))
        })?;
        // What it read may be another process's group, committed and not yet synced: the
        // caller (a resume, say) decides on it.
        self.store.sync_after_read()
    }

    fn renew(&mut self, owner: &str, held: &[(RunId, u64)], ttl: Duration) -> Result<Renewal> {
        self.wait_synced();
        self.store
            .write_on_writer("a lease renewal", |sql| moves::renew(sql, owner, held, ttl))
    }

    fn release(&mut self, run_id: &RunId, owner: &str, token: u64) -> Result<bool> {
        self.wait_synced();
        self.store.write_on_writer("a lease release", |sql| {
            use crate::store::backend::LeaseWrites;
            sql.release_lease(run_id, owner, token)
        })
    }
}

impl SqliteWriter {
    /// Commits `batch` as one group, its sync left to the syncer thread when other moves wait
    /// (`more_queued`, more than one in the batch, a group still syncing) or when its callers
    /// all asked to be answered once written.
    fn commit_group(&mut self, batch: Vec<Box<dyn Pending>>, more_queued: bool) {
        let defer = self.syncer.is_some()
            && (batch.len() > 1
                || !self.unsynced.is_empty()
                || more_queued
                || batch
                    .iter()
                    .all(|pending| pending.durability() == Durability::Written));
        let sync = if defer {
            LogSync::Deferred
        } else {
            LogSync::InCommit
        };
        self.commit_as(batch, sync);
    }

    /// Syncs the log for the groups answered before their sync, if any, and tells the observer,
    /// after the groups the log-sync thread holds (committed before them) were told.
    fn sync_written(&mut self) {
        if self.written.is_empty() {
            return;
        }
        self.unsynced.wait_empty();
        let written = std::mem::take(&mut self.written);
        match self.store.sync_log() {
            Ok(()) => observe_durable(self.observer.as_deref(), &written),
            // Sticky: the store refuses to commit from now on (see `Sqlite::sync_log`).
            Err(err) => tracing::error!(%err, groups = written.len(), "a log sync failed"),
        }
    }

    /// Applies `batch` as one transaction, observed before.
    fn apply_group(&self, batch: &mut [Box<dyn Pending>], sync: LogSync) -> Result<()> {
        if let Some(observer) = &self.observer {
            // Before the transaction opens: an observer that stops here holds no lock.
            batch
                .iter()
                .flat_map(|pending| pending.infos())
                .for_each(|info| observer.before_apply(info));
        }
        self.renewal.yield_to_renewal();
        let clock = &*self.clock;
        self.store
            .transact_group(batch, sync, |pending, tx, isolation| {
                pending.apply(tx, clock, isolation)
            })
    }

    /// Commits `batch` as one group: observed before and after, each caller answered only
    /// after the commit and its log sync, which also makes durable the groups answered before
    /// theirs.
    ///
    /// A group committed without its sync whose callers all asked to be answered once written
    /// is answered at once, unless a move of it was refused (a refusal may rest on another
    /// process's group, not yet durable): its moves wait in `written` for the next sync, and
    /// the observer hears of them then.
    fn commit_as(&mut self, mut batch: Vec<Box<dyn Pending>>, sync: LogSync) {
        let started = Instant::now();
        let committed = self.apply_group(&mut batch, sync);
        if committed.is_ok()
            && sync == LogSync::Deferred
            && batch
                .iter()
                .all(|pending| pending.durability() == Durability::Written && !pending.refused())
        {
            let moves = batch.iter().map(|pending| pending.applied().len()).sum();
            metrics::group_committed(moves, started.elapsed());
            // Kept for the observer alone: without one, the group is only counted.
            let applied: Vec<MoveInfo> = match self.observer {
                Some(_) => (batch.iter())
                    .flat_map(|pending| pending.applied())
                    .cloned()
                    .collect(),
                None => Vec::new(),
            };
            self.written.push(applied);
            for pending in batch {
                pending.answer(None);
            }
            return;
        }
        // Nothing of a group that failed to commit was synced: the earlier ones wait on.
        let written = match committed {
            Ok(()) => std::mem::take(&mut self.written),
            Err(_) => Vec::new(),
        };
        let failure = match committed {
            Ok(()) if sync == LogSync::Deferred => {
                if let Some(syncer) = &self.syncer {
                    let group = UnsyncedGroup::new(written, batch, &self.unsynced, started);
                    match syncer.send(group) {
                        Ok(()) => return,
                        // The syncer thread is gone: sync here.
                        Err(mpsc::SendError(mut returned)) => {
                            batch = returned.take();
                            return finish_group(
                                self.observer.as_deref(),
                                std::mem::take(&mut returned.written),
                                batch,
                                GroupFailure::of_sync(self.store.sync_log()),
                                started,
                            );
                        }
                    }
                }
                GroupFailure::of_sync(self.store.sync_log())
            }
            // A move refused in a group that synced in its commit may have been refused on
            // another process's group, readable but not yet durable (a run id taken by an
            // insert that a power cut would undo, say); a group that wrote nothing did not
            // sync at all.
            Ok(()) if batch.iter().any(|pending| pending.refused()) => {
                GroupFailure::of_sync(self.store.sync_after_read())
            }
            Ok(()) => None,
            Err(err) => Some(GroupFailure::of(&err)),
        };
        finish_group(self.observer.as_deref(), written, batch, failure, started);
    }

    /// Waits until every group committed so far is durable: a read or a lease write answered
    /// by this writer must not tell of a move that a power loss would undo.
    fn wait_synced(&mut self) {
        self.unsynced.wait_empty();
        self.sync_written();
    }

    /// Copies the write-ahead log into the database file between two groups, at most once
    /// per [`CHECKPOINT_PERIOD`] while moves are committed, or when the log passes
    /// [`MAX_LOG_PAGES`]. SQLite's own rule (a copy inside whichever commit takes the log past
    /// 1,000 pages) copies after nearly every group when a thousand runs each add pages of
    /// their own; once per period, a page that many moves changed is copied once.
    fn checkpoint_if_due(&mut self) {
        // A copy that took long waits longer for the next one: the writer spends at most a
        // twentieth of its time copying, and a heavy load's copies take in more moves each.
        let period = (self.checkpoint_took * 19).clamp(CHECKPOINT_PERIOD, MAX_CHECKPOINT_PERIOD);
        if self.last_checkpoint.elapsed() < period && log_pages() < MAX_LOG_PAGES {
            return;
        }
        let started = Instant::now();
        if let Err(err) = self.store.checkpoint() {
            // Unless it met an I/O error (which stops every write), the next period tries
            // again; the log only grows meanwhile.
            tracing::warn!(%err, "a checkpoint failed");
        }
        self.last_checkpoint = Instant::now();
        self.checkpoint_took = self.last_checkpoint - started;
    }
}

/// Tells the observer of groups that a sync made durable, answered when they were written.
fn observe_durable(observer: Option<&dyn MoveObserver>, written: &[Vec<MoveInfo>]) {
    let Some(observer) = observer else { return };
    for group in written {
        group.iter().for_each(|info| observer.after_commit(info));
        observer.committed(&group.iter().collect::<Vec<_>>());
    }
}

/// Tells the observer and the callers of a group begun at `started` what became of it, and the
/// observer of the groups answered before their sync that this group's sync made durable
/// (`written`).
fn finish_group(
    observer: Option<&dyn MoveObserver>,
    written: Vec<Vec<MoveInfo>>,
    batch: Vec<Box<dyn Pending>>,
    failure: Option<GroupFailure>,
    started: Instant,
) {
    match &failure {
        None => {
            let moves: usize = batch.iter().map(|pending| pending.applied().len()).sum();
            metrics::group_committed(moves, started.elapsed());
            observe_durable(observer, &written);
            if let Some(observer) = observer {
                let committed: Vec<&MoveInfo> =
                    batch.iter().flat_map(|pending| pending.applied()).collect();
                committed
                    .iter()
                    .for_each(|info| observer.after_commit(info));
                // A group whose every move was refused made nothing durable.
                if !committed.is_empty() {
                    observer.committed(&committed);
                }
            }
        }
        Some(failure) => {
            tracing::error!(?failure, moves = batch.len(), "a group commit failed");
            if !written.is_empty() {
                tracing::error!(
                    groups = written.len(),
                    "groups answered before their sync may not be durable"
                );
            }
        }
    }
    for pending in batch {
        pending.answer(failure.as_ref());
    }
}

/// A group committed without its log sync, on its way to the syncer thread. It is counted in
/// [`Unsynced`] from its creation until it is dropped: after its callers were answered, or
/// unanswered (their replies dropped: `StoreUnavailable`) if the syncer thread died first.
struct UnsyncedGroup {
    /// Groups committed before it and answered when written, which its sync makes durable.
    written: Vec<Vec<MoveInfo>>,
    batch: Vec<Box<dyn Pending>>,
    unsynced: Arc<Unsynced>,
    /// When its transaction began.
    started: Instant,
}

impl UnsyncedGroup {
    fn new(
        written: Vec<Vec<MoveInfo>>,
        batch: Vec<Box<dyn Pending>>,
        unsynced: &Arc<Unsynced>,
        started: Instant,
    ) -> Self {
        unsynced.add();
        UnsyncedGroup {
            written,
            batch,
            unsynced: Arc::clone(unsynced),
            started,
        }
    }

    fn take(&mut self) -> Vec<Box<dyn Pending>> {
        std::mem::take(&mut self.batch)
    }
}

impl Drop for UnsyncedGroup {
    fn drop(&mut self) {
        // Its moves are dropped first, so that nobody waits on the count for a caller still
        // to be answered.
        drop(self.take());
        self.unsynced.done();
    }
}

/// Starts the thread that syncs the log for groups committed without a sync, and then answers
/// their callers: one sync covers every group committed before it began, so while it runs the
/// writer goes on applying the next group. `None` if the thread cannot be started (each group
/// then syncs in its own commit).
fn spawn_syncer(
    store: Arc<Sqlite>,
    observer: Option<Arc<dyn MoveObserver>>,
) -> Option<mpsc::Sender<UnsyncedGroup>> {
    let (groups, committed) = mpsc::channel::<UnsyncedGroup>();
    let spawned = std::thread::Builder::new()
        .name("agentrt-log-sync".into())
        .spawn(move || {
            // Ends when the writer holding the sender is gone, after the groups it sent.
            while let Ok(first) = committed.recv() {
                let groups: Vec<_> = std::iter::once(first).chain(committed.try_iter()).collect();
                let failure = GroupFailure::of_sync(store.sync_log());
                for mut group in groups {
                    let written = std::mem::take(&mut group.written);
                    let started = group.started;
                    finish_group(
                        observer.as_deref(),
                        written,
                        group.take(),
                        failure.clone(),
                        started,
                    );
                }
            }
        });
    match spawned {
        Ok(_) => Some(groups),
        Err(err) => {
            tracing::warn!(%err, "no log-sync thread: each group syncs in its commit");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Store;

    fn synchronous(store: &Sqlite) -> i64 {
        lock(&store.writer)
            .pragma_query_value(None, "synchronous", |r| r.get(0))
            .unwrap()
    }

    #[test]
    fn a_group_whose_sync_is_deferred_leaves_the_writer_syncing_every_other_commit() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("db.sqlite")).unwrap();
        let sqlite = Sqlite::of(&store).unwrap();
        assert!(sqlite.defers_sync());
        for refused in [false, true] {
            sqlite
                .transact_group(&mut [()], LogSync::Deferred, |_, _, _| !refused)
                .unwrap();
            assert_eq!(synchronous(sqlite), 2, "back to FULL after the group");
        }
        sqlite.sync_log().unwrap();
        // NORMAL and in-memory stores sync as configured, in the commit.
        let normal = super::super::Options::new()
            .synchronous(Synchronous::Normal)
            .open(dir.path().join("normal.sqlite"))
            .unwrap();
        assert!(!Sqlite::of(&normal).unwrap().defers_sync());
        let memory = Store::in_memory().unwrap();
        assert!(!Sqlite::of(&memory).unwrap().defers_sync());
        Sqlite::of(&memory).unwrap().sync_log().unwrap();
    }

    #[test]
    fn a_group_that_panics_with_its_sync_deferred_leaves_no_commit_unsynced_after_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("db.sqlite")).unwrap();
        let sqlite = Sqlite::of(&store).unwrap();
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            sqlite.transact_group(&mut [()], LogSync::Deferred, |_, _, _| -> bool {
                panic!("a move panicked")
            })
        }));
        assert!(panicked.is_err());
        // The writer is still at NORMAL; its next use puts FULL back before anything commits.
        let sync: i64 = sqlite
            .on_writer("a read", |sql| {
                sql.0
                    .pragma_query_value(None, "synchronous", |r| r.get(0))
                    .db()
            })
            .unwrap();
        assert_eq!(sync, 2);
    }
}
