//! `StoreActor`: the only writer. A sync actor on its own thread that applies the moves
//! submitted to it, so nothing blocking runs on the arbiters that host runs. Moves that arrive
//! while a commit is syncing are committed together (group commit): one `BEGIN IMMEDIATE`
//! transaction, each move all-or-nothing, each caller answered only after the commit and its
//! log sync, which a thread of its own does while the actor applies the next group. The
//! exception: moves sent through [`StoreHandle::apply_written`] (a run's model reservation)
//! are answered once written; the next commit's sync, or the actor's own when its watch for
//! the next move ends, makes them durable.

use std::{
    future::Future,
    sync::{Arc, Condvar, Mutex, mpsc},
    time::{Duration, Instant},
};

use actix::{Actor, Addr, Handler, Message, SyncArbiter, SyncContext};
use rusqlite::{Connection, Transaction};

use tokio::sync::oneshot;

use super::lease_keeper::RenewalPending;
use crate::{
    clock::Clock,
    error::{Error, Result},
    store::{
        Isolation, LogSync, Now, Store, log_pages,
        sql::{self, Renewal},
    },
    types::RunId,
};

/// A move's work. It may be applied twice (see [`Store::transact_group`]), with the same
/// clock reading and on the same state each time.
type ApplyFn<R> = Box<dyn FnMut(&Transaction<'_>, &mut Now<'_>) -> Result<R> + Send>;
type ReadFn<R> = Box<dyn FnOnce(&Connection) -> Result<R> + Send>;

/// A move the store actor is about to apply, or has committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoveInfo {
    /// What the move does (`"create_run"`, `"finish_tool"`, `"record_approval"`, ...).
    pub name: &'static str,
    /// The run it moves.
    pub run_id: RunId,
}

/// Watches the moves of a supervisor's store actor ([`Config::observer`]): for metrics,
/// tracing, or telling listeners that a run has new events.
///
/// `before_apply` runs on the thread that owns the write connection, with no transaction open.
/// `after_commit` and `committed` run once the moves are durable: on that thread too, or, for
/// a group whose log sync was left to the log-sync thread (see `docs/persistence.md`), on the
/// log-sync thread, while `before_apply` may run for the next group. They come in commit
/// order, one group at a time. A slow observer delays every move of the supervisor.
///
/// [`Config::observer`]: crate::Config::observer
pub trait MoveObserver: Send + Sync + 'static {
    /// The move is about to be applied: nothing of it is written yet.
    fn before_apply(&self, info: &MoveInfo) {
        let _ = info;
    }

    /// The move committed (and, at `synchronous=FULL`, is on disk). Its caller has not been
    /// answered yet, unless it asked to be answered once the move was written: a run's model
    /// reservation (see `docs/runs.md`), whose loop may already be calling the model.
    fn after_commit(&self, info: &MoveInfo) {
        let _ = info;
    }

    /// One transaction committed, making `moves` durable together (in the order they were
    /// applied): a group commit holds moves of many runs, and a run's loop commits a move
    /// together with the one that follows it when no side effect lies between them. Called
    /// after [`after_commit`](Self::after_commit) of each of them.
    fn committed(&self, moves: &[&MoveInfo]) {
        let _ = moves;
    }
}

/// Owns the write side of a [`Store`] for one supervisor.
pub(crate) struct StoreActor {
    store: Store,
    clock: Arc<dyn Clock>,
    observer: Option<Arc<dyn MoveObserver>>,
    queue: Queue,
    policy: CommitPolicy,
    renewal: RenewalPending,
    last_checkpoint: Instant,
    checkpoint_took: Duration,
    /// The syncer thread's queue: groups committed without their log sync, in commit order.
    /// `None` when groups sync in their own commit (no group commit, `NORMAL`, `EXTRA`,
    /// `:memory:`, not Unix, or the thread could not be started).
    syncer: Option<mpsc::Sender<UnsyncedGroup>>,
    unsynced: Arc<Unsynced>,
    /// The moves of groups committed without their sync whose callers were answered once the
    /// moves were in the log ([`StoreHandle::apply_written`]), one entry per group, in commit
    /// order. The next sync of the log makes them durable, and the observer hears of them then.
    written: Vec<Vec<MoveInfo>>,
}

/// Groups committed whose log sync has not completed yet: their callers wait, and the store
/// actor's other messages wait for them (see [`StoreActor::wait_synced`]).
#[derive(Default)]
struct Unsynced {
    groups: Mutex<usize>,
    synced: Condvar,
}

impl Unsynced {
    fn count(&self) -> std::sync::MutexGuard<'_, usize> {
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

/// How long one Drain keeps committing before the actor's other messages get their turn.
const DRAIN_SLICE: Duration = Duration::from_millis(5);

/// How often the store actor checkpoints while it commits, at most.
const CHECKPOINT_PERIOD: Duration = Duration::from_millis(100);

/// How long the store actor lets the log grow, at most, however long its copies take.
const MAX_CHECKPOINT_PERIOD: Duration = Duration::from_secs(2);

/// How large the store actor lets the log grow, at most, in pages (125 MiB of 4 KiB pages).
/// Each copy costs about the pages the runs in flight touched since the last one (with a
/// thousand runs, their newest pages: some 3,000 of them, and a sync of the database file),
/// whatever the log's length, so a longer log means fewer copies. The price: a log of up to
/// this size on disk, read once by the next process to open the database after a crash.
const MAX_LOG_PAGES: u32 = 32_000;

/// How the store actor commits the moves it is sent.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CommitPolicy {
    /// Moves that arrive together share one transaction.
    pub group: bool,
    /// How long to watch for the next move after a commit before parking the thread.
    pub spin: Duration,
}

/// Moves waiting for the store actor, in the order they were submitted.
type Queue = Arc<MoveQueue>;

#[derive(Default)]
struct MoveQueue {
    moves: Mutex<Vec<Box<dyn Pending>>>,
    /// A Drain is in the actor's mailbox and has not taken the queue yet: a move submitted
    /// meanwhile needs no Drain of its own. At most one Drain waits in the mailbox, so the
    /// actor's other messages wait for at most one of them.
    drain_sent: std::sync::atomic::AtomicBool,
}

impl MoveQueue {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Box<dyn Pending>>> {
        self.moves
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether a Drain must be sent: none is waiting.
    fn needs_drain(&self) -> bool {
        !self
            .drain_sent
            .swap(true, std::sync::atomic::Ordering::SeqCst)
    }
}

impl StoreActor {
    /// Starts the actor on a thread of its own; moves reach it through the returned handle.
    pub(crate) fn start(
        store: Store,
        clock: Arc<dyn Clock>,
        observer: Option<Arc<dyn MoveObserver>>,
        policy: CommitPolicy,
        renewal: RenewalPending,
    ) -> StoreHandle {
        let queue = Queue::default();
        let shared = queue.clone();
        let unsynced = Arc::new(Unsynced::default());
        let syncer = (policy.group && store.defers_sync())
            .then(|| spawn_syncer(store.clone(), observer.clone()))
            .flatten();
        // The factory runs again if the actor stops; it only clones handles, so a restart
        // yields the same actor on the same connection, queue and syncer.
        let addr = SyncArbiter::start(1, move || StoreActor {
            store: store.clone(),
            clock: clock.clone(),
            observer: observer.clone(),
            queue: shared.clone(),
            policy,
            renewal: renewal.clone(),
            last_checkpoint: Instant::now(),
            checkpoint_took: Duration::ZERO,
            syncer: syncer.clone(),
            unsynced: unsynced.clone(),
            written: Vec::new(),
        });
        StoreHandle { addr, queue }
    }

    /// Commits `batch` as one group, each caller answered only once the group is durable.
    ///
    /// While other moves wait (more than one in the batch, some in the queue, a group still
    /// syncing), the group's log sync is left to the syncer thread: this thread goes on with the
    /// next group instead of waiting for the disk, and the runs answered by one sync form the
    /// next group while the one after is applied. A move alone syncs in its commit, which saves
    /// a thread hand-off.
    ///
    /// A batch whose callers all asked to be answered once their moves are in the log commits
    /// without its sync too, and is answered at once (see [`commit`](Self::commit)).
    fn commit_group(&mut self, batch: Vec<Box<dyn Pending>>) {
        let defer = self.syncer.is_some()
            && (batch.len() > 1
                || !self.unsynced.is_empty()
                || !self.queue.lock().is_empty()
                || batch.iter().all(|pending| pending.answered_when_written()));
        let sync = if defer {
            LogSync::Deferred
        } else {
            LogSync::InCommit
        };
        self.commit(batch, sync);
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
            // Sticky: the store refuses to commit from now on (see `Store::sync_log`).
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
    /// ([`StoreHandle::apply_written`]) is answered at once, unless a move of it was refused
    /// (a refusal may rest on another process's group, not yet durable): its moves wait in
    /// `written` for the next sync, and the observer hears of them then.
    fn commit(&mut self, mut batch: Vec<Box<dyn Pending>>, sync: LogSync) {
        let committed = self.apply_group(&mut batch, sync);
        if committed.is_ok()
            && sync == LogSync::Deferred
            && batch
                .iter()
                .all(|pending| pending.answered_when_written() && !pending.refused())
        {
            let applied: Vec<MoveInfo> = batch
                .iter()
                .flat_map(|pending| pending.applied())
                .cloned()
                .collect();
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
                    match syncer.send(UnsyncedGroup::new(written, batch, &self.unsynced)) {
                        Ok(()) => return,
                        // The syncer thread is gone: sync here.
                        Err(mpsc::SendError(mut returned)) => {
                            batch = returned.take();
                            return finish_group(
                                self.observer.as_deref(),
                                std::mem::take(&mut returned.written),
                                batch,
                                GroupFailure::of_result(self.store.sync_log()),
                            );
                        }
                    }
                }
                GroupFailure::of_result(self.store.sync_log())
            }
            // A move refused in a group that synced in its commit may have been refused on
            // another process's group, readable but not yet durable (a run id taken by an
            // insert that a power cut would undo, say); a group that wrote nothing did not
            // sync at all.
            Ok(()) if batch.iter().any(|pending| pending.refused()) => {
                GroupFailure::of_result(self.store.sync_after_read())
            }
            Ok(()) => None,
            Err(err) => Some(GroupFailure::of(&err)),
        };
        finish_group(self.observer.as_deref(), written, batch, failure);
    }

    /// Waits until every group committed so far is durable: a read or a lease write answered
    /// by this actor must not tell of a move that a power loss would undo.
    fn wait_synced(&mut self) {
        self.unsynced.wait_empty();
        self.sync_written();
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

/// Tells the observer and the callers of a group what became of it, and the observer of the
/// groups answered before their sync that this group's sync made durable (`written`).
fn finish_group(
    observer: Option<&dyn MoveObserver>,
    written: Vec<Vec<MoveInfo>>,
    batch: Vec<Box<dyn Pending>>,
    failure: Option<GroupFailure>,
) {
    match &failure {
        None => {
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
}

impl UnsyncedGroup {
    fn new(
        written: Vec<Vec<MoveInfo>>,
        batch: Vec<Box<dyn Pending>>,
        unsynced: &Arc<Unsynced>,
    ) -> Self {
        unsynced.add();
        UnsyncedGroup {
            written,
            batch,
            unsynced: Arc::clone(unsynced),
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
/// store actor goes on applying the next group. `None` if the thread cannot be started (each
/// group then syncs in its own commit).
fn spawn_syncer(
    store: Store,
    observer: Option<Arc<dyn MoveObserver>>,
) -> Option<mpsc::Sender<UnsyncedGroup>> {
    let (groups, committed) = mpsc::channel::<UnsyncedGroup>();
    let spawned = std::thread::Builder::new()
        .name("agentrt-log-sync".into())
        .spawn(move || {
            // Ends when the last store actor holding the sender is gone, after the groups it
            // sent.
            while let Ok(first) = committed.recv() {
                let groups: Vec<_> = std::iter::once(first).chain(committed.try_iter()).collect();
                let failure = GroupFailure::of_result(store.sync_log());
                for mut group in groups {
                    let written = std::mem::take(&mut group.written);
                    finish_group(observer.as_deref(), written, group.take(), failure.clone());
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

impl Actor for StoreActor {
    type Context = SyncContext<Self>;
}

/// How the rest of the supervisor reaches its store actor.
#[derive(Clone)]
pub(crate) struct StoreHandle {
    addr: Addr<StoreActor>,
    queue: Queue,
}

impl StoreHandle {
    /// Submits a move; completes with its result once it committed (or was refused).
    pub(crate) fn apply<R: Send + 'static>(
        &self,
        mv: ApplyMove<R>,
    ) -> impl Future<Output = Result<R>> + 'static {
        self.single(mv, false)
    }

    /// Submits a move that needs to be written before its caller goes on, not durable: it
    /// completes once the move is committed to the log, before the sync that makes it durable,
    /// which the next commit's does (the log keeps a prefix of its commits). Before the sync, a
    /// crash of the process loses nothing; a power loss undoes this move, and no later move
    /// survives without it. For a run's model reservation: a model call has no external side
    /// effect. In a group with any move that waits for its sync, and where groups sync in
    /// their commit (no log-sync thread: no group commit, `NORMAL`, `EXTRA`, `:memory:`, not
    /// Unix), like [`apply`](Self::apply).
    pub(crate) fn apply_written<R: Send + 'static>(
        &self,
        mv: ApplyMove<R>,
    ) -> impl Future<Output = Result<R>> + 'static {
        self.single(mv, true)
    }

    fn single<R: Send + 'static>(
        &self,
        mv: ApplyMove<R>,
        when_written: bool,
    ) -> impl Future<Output = Result<R>> + 'static {
        let (reply, answer) = oneshot::channel();
        let pending = PendingMove {
            info: mv.info,
            apply: mv.apply,
            reading: None,
            result: None,
            reply,
            when_written,
        };
        self.submit(Box::new(pending));
        async move { answer.await.map_err(|_| Error::StoreUnavailable)? }
    }

    /// Submits `first` and `then` to be committed in one transaction, `then` applied only if
    /// `first` was and `proceed` says so of its result, each all-or-nothing with its own
    /// clock reading: for a move whose successor is known before the commit and no side
    /// effect lies between them. Completes once they committed, with `first`'s result (an
    /// error if it was refused) and `then`'s (`None` if it was not attempted).
    pub(crate) fn apply_then<A: Send + 'static, B: Send + 'static>(
        &self,
        first: ApplyMove<A>,
        then: ApplyMove<B>,
        proceed: fn(&A) -> bool,
    ) -> impl Future<Output = Result<(A, Option<Result<B>>)>> + 'static {
        self.pair(first, then, proceed, false)
    }

    /// [`apply_then`](Self::apply_then), completing once both are written, as
    /// [`apply_written`](Self::apply_written) does.
    pub(crate) fn apply_then_written<A: Send + 'static, B: Send + 'static>(
        &self,
        first: ApplyMove<A>,
        then: ApplyMove<B>,
        proceed: fn(&A) -> bool,
    ) -> impl Future<Output = Result<(A, Option<Result<B>>)>> + 'static {
        self.pair(first, then, proceed, true)
    }

    fn pair<A: Send + 'static, B: Send + 'static>(
        &self,
        first: ApplyMove<A>,
        then: ApplyMove<B>,
        proceed: fn(&A) -> bool,
        when_written: bool,
    ) -> impl Future<Output = Result<(A, Option<Result<B>>)>> + 'static {
        let (reply, answer) = oneshot::channel();
        let pending = PendingPair {
            infos: [first.info, then.info],
            first: first.apply,
            then: then.apply,
            proceed,
            readings: [None; 2],
            result: None,
            reply,
            when_written,
        };
        self.submit(Box::new(pending));
        async move { answer.await.map_err(|_| Error::StoreUnavailable)? }
    }

    fn submit(&self, pending: Box<dyn Pending>) {
        self.queue.lock().push(pending);
        if self.queue.needs_drain() {
            self.addr.do_send(Drain);
        }
    }

    /// The actor, for messages other than moves.
    pub(crate) fn addr(&self) -> &Addr<StoreActor> {
        &self.addr
    }
}

/// One state move: `apply` runs inside a group's transaction, committed only if it succeeds.
pub(crate) struct ApplyMove<R> {
    info: MoveInfo,
    apply: ApplyFn<R>,
}

impl<R> ApplyMove<R> {
    /// A move named `name` of run `run_id`, that `apply` carries out.
    pub(crate) fn new(
        name: &'static str,
        run_id: &RunId,
        apply: impl FnMut(&Transaction<'_>, &mut Now<'_>) -> Result<R> + Send + 'static,
    ) -> Self {
        ApplyMove {
            info: MoveInfo {
                name,
                run_id: run_id.clone(),
            },
            apply: Box::new(apply),
        }
    }
}

/// A submitted move (or pair of moves), type-erased for the queue.
trait Pending: Send {
    /// The moves it makes, in order.
    fn infos(&self) -> &[MoveInfo];
    /// The moves it made once applied.
    fn applied(&self) -> &[MoveInfo];
    /// Whether a move of it was refused.
    fn refused(&self) -> bool;
    /// Whether its caller is answered once it is in the log, before its sync.
    fn answered_when_written(&self) -> bool;
    /// Applies the move inside the group's transaction, keeping its result (replacing the one
    /// of an earlier attempt); false when it was refused, or when only part of it stands and
    /// the group must be applied again with savepoints.
    fn apply(&mut self, tx: &Transaction<'_>, clock: &dyn Clock, isolation: Isolation) -> bool;
    /// Answers the caller: its own result, unless the group failed to commit or to sync.
    fn answer(self: Box<Self>, failed: Option<&GroupFailure>);
}

struct PendingMove<R> {
    info: MoveInfo,
    apply: ApplyFn<R>,
    /// The clock reading of an earlier attempt.
    reading: Option<i64>,
    result: Option<Result<R>>,
    reply: oneshot::Sender<Result<R>>,
    when_written: bool,
}

impl<R: Send> Pending for PendingMove<R> {
    fn infos(&self) -> &[MoveInfo] {
        std::slice::from_ref(&self.info)
    }

    fn applied(&self) -> &[MoveInfo] {
        match self.result {
            Some(Ok(_)) => self.infos(),
            _ => &[],
        }
    }

    fn refused(&self) -> bool {
        matches!(self.result, Some(Err(_)))
    }

    fn answered_when_written(&self) -> bool {
        self.when_written
    }

    fn apply(&mut self, tx: &Transaction<'_>, clock: &dyn Clock, _: Isolation) -> bool {
        let mut now = Now::resume(clock, self.reading);
        let result = refused_logged(&self.info, (self.apply)(tx, &mut now));
        self.reading = now.reading();
        let applied = result.is_ok();
        self.result = Some(result);
        applied
    }

    fn answer(self: Box<Self>, failed: Option<&GroupFailure>) {
        // The caller may be gone (its system stopped): nobody to answer.
        let _ = self.reply.send(final_result(self.result, failed));
    }
}

/// Two moves of one run committed together; the second applied only if the first was, in a
/// savepoint of its own so that its refusal keeps the first.
struct PendingPair<A, B> {
    infos: [MoveInfo; 2],
    first: ApplyFn<A>,
    then: ApplyFn<B>,
    /// Whether `then` is attempted, given `first`'s result.
    proceed: fn(&A) -> bool,
    /// The clock readings of an earlier attempt.
    readings: [Option<i64>; 2],
    result: Option<Result<(A, Option<Result<B>>)>>,
    reply: oneshot::Sender<Result<(A, Option<Result<B>>)>>,
    when_written: bool,
}

impl<A: Send, B: Send> Pending for PendingPair<A, B> {
    fn infos(&self) -> &[MoveInfo] {
        &self.infos
    }

    fn applied(&self) -> &[MoveInfo] {
        match &self.result {
            Some(Ok((_, Some(Ok(_))))) => &self.infos,
            Some(Ok(_)) => &self.infos[..1],
            _ => &[],
        }
    }

    fn refused(&self) -> bool {
        matches!(self.result, Some(Err(_)) | Some(Ok((_, Some(Err(_))))))
    }

    fn answered_when_written(&self) -> bool {
        self.when_written
    }

    fn apply(&mut self, tx: &Transaction<'_>, clock: &dyn Clock, isolation: Isolation) -> bool {
        let mut now = Now::resume(clock, self.readings[0]);
        let first = refused_logged(&self.infos[0], (self.first)(tx, &mut now));
        self.readings[0] = now.reading();
        let a = match first {
            Ok(a) => a,
            Err(err) => {
                self.result = Some(Err(err));
                return false;
            }
        };
        if !(self.proceed)(&a) {
            self.result = Some(Ok((a, None)));
            return true;
        }
        let mut now = Now::resume(clock, self.readings[1]);
        let then = &mut self.then;
        let b = match isolation {
            Isolation::Shared => Ok(then(tx, &mut now)),
            Isolation::Savepoint => in_savepoint(tx, |tx| then(tx, &mut now)),
        };
        self.readings[1] = now.reading();
        let b = match b {
            Ok(b) => refused_logged(&self.infos[1], b),
            // The savepoint itself failed: nothing of the pair may stand.
            Err(err) => {
                self.result = Some(Err(err));
                return false;
            }
        };
        // Without a savepoint of its own, a refused second move cannot be rolled back alone:
        // the group is applied again with savepoints.
        let stands = b.is_ok() || isolation == Isolation::Savepoint;
        self.result = Some(Ok((a, Some(b))));
        stands
    }

    fn answer(self: Box<Self>, failed: Option<&GroupFailure>) {
        let _ = self.reply.send(final_result(self.result, failed));
    }
}

/// Runs `f` in a savepoint nested in the move's own: rolled back alone if it is refused. The
/// outer error is the savepoint's own failure, which must fail the whole move.
fn in_savepoint<R>(
    tx: &Transaction<'_>,
    f: impl FnOnce(&Transaction<'_>) -> Result<R>,
) -> Result<Result<R>> {
    tx.prepare_cached("SAVEPOINT agentrt_then")?.execute([])?;
    let result = f(tx);
    if result.is_err() {
        tx.prepare_cached("ROLLBACK TO agentrt_then")?.execute([])?;
    }
    tx.prepare_cached("RELEASE agentrt_then")?.execute([])?;
    Ok(result)
}

/// Why a group's callers get an error instead of their results.
#[derive(Debug, Clone)]
enum GroupFailure {
    /// Nothing of the group was committed.
    Commit(String),
    /// The group may have been committed, and may not be durable.
    Sync(String),
}

impl GroupFailure {
    fn of(err: &Error) -> Self {
        match err {
            Error::SyncFailed(message) => GroupFailure::Sync(message.clone()),
            err => GroupFailure::Commit(err.to_string()),
        }
    }

    /// The failure, if any, of a commit or a sync.
    fn of_result(result: Result<()>) -> Option<Self> {
        result.err().map(|err| GroupFailure::of(&err))
    }

    fn error(&self) -> Error {
        match self {
            GroupFailure::Commit(message) => Error::CommitFailed(message.clone()),
            GroupFailure::Sync(message) => Error::SyncFailed(message.clone()),
        }
    }
}

/// What a caller is answered: its move's refusal, or its result if the group committed (and
/// synced).
fn final_result<R>(result: Option<Result<R>>, failed: Option<&GroupFailure>) -> Result<R> {
    match (result, failed) {
        (Some(Err(err)), _) => Err(err),
        (Some(Ok(value)), None) => Ok(value),
        (_, Some(failure)) => Err(failure.error()),
        (None, None) => Err(Error::CommitFailed("the move was never applied".into())),
    }
}

fn refused_logged<R>(info: &MoveInfo, result: Result<R>) -> Result<R> {
    if let Err(err) = &result {
        tracing::debug!(r#move = info.name, run_id = %info.run_id, %err, "move refused");
    }
    result
}

impl StoreActor {
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
            // The next period tries again; the log only grows meanwhile.
            tracing::warn!(%err, "a checkpoint failed");
        }
        self.last_checkpoint = Instant::now();
        self.checkpoint_took = self.last_checkpoint - started;
    }

    /// What arrived during the last commit, or within the spin after it: a loop answered by
    /// that commit sends its next move within microseconds, and catching it here saves two
    /// thread wake-ups (ours, and the Drain's).
    fn next_batch(&self) -> Vec<Box<dyn Pending>> {
        let until = Instant::now() + self.policy.spin;
        loop {
            let batch = self.take_queue();
            if !batch.is_empty() || Instant::now() >= until {
                return batch;
            }
            std::hint::spin_loop();
        }
    }

    /// Puts `batch` back at the head of the queue.
    fn requeue(&self, mut batch: Vec<Box<dyn Pending>>) {
        let mut queue = self.queue.lock();
        batch.append(&mut queue);
        *queue = batch;
    }

    fn take_queue(&self) -> Vec<Box<dyn Pending>> {
        std::mem::take(&mut *self.queue.lock())
    }
}

/// Apply what the queue holds.
#[derive(Message)]
#[rtype(result = "()")]
struct Drain;

impl Handler<Drain> for StoreActor {
    type Result = ();

    fn handle(&mut self, _: Drain, ctx: &mut SyncContext<Self>) {
        // From here on, a move submitted after the queue is taken sends a Drain of its own.
        self.queue
            .drain_sent
            .store(false, std::sync::atomic::Ordering::SeqCst);
        // Empty when an earlier Drain took these moves with its own.
        let mut batch = self.take_queue();
        let started = Instant::now();
        while !batch.is_empty() {
            if started.elapsed() >= DRAIN_SLICE {
                // The other messages (reads, releases, renewals in memory) get their turn;
                // these moves are first in the queue for the next Drain.
                self.requeue(batch);
                if self.queue.needs_drain() {
                    ctx.address().do_send(Drain);
                }
                return;
            }
            if self.policy.group {
                // Everything that arrived while the last commit was syncing: one commit.
                self.commit_group(batch);
            } else {
                for pending in batch {
                    self.commit(vec![pending], LogSync::InCommit);
                }
            }
            self.checkpoint_if_due();
            batch = self.next_batch();
        }
        // Nothing more came: the groups answered when written are synced now.
        self.sync_written();
    }
}

/// A read on the writer's connection, which sees every committed move.
pub(crate) struct ReadState<R> {
    read: ReadFn<R>,
}

impl<R> ReadState<R> {
    pub(crate) fn new(read: impl FnOnce(&Connection) -> Result<R> + Send + 'static) -> Self {
        ReadState {
            read: Box::new(read),
        }
    }
}

impl<R: Send + 'static> Message for ReadState<R> {
    type Result = Result<R>;
}

impl<R: Send + 'static> Handler<ReadState<R>> for StoreActor {
    type Result = Result<R>;

    fn handle(&mut self, msg: ReadState<R>, _: &mut SyncContext<Self>) -> Result<R> {
        self.wait_synced();
        let value = self.store.read(msg.read)?;
        // What it read may be another process's group, committed and not yet synced: the
        // caller (a resume, say) decides on it.
        self.store.sync_after_read()?;
        Ok(value)
    }
}

/// One renewal tick through the store actor (a `:memory:` store, whose only connection is the
/// writer's): one UPDATE outside any transaction.
#[derive(Message)]
#[rtype(result = "Result<Renewal>")]
pub(crate) struct RenewLeases {
    pub owner: Arc<str>,
    pub held: Vec<RunId>,
    pub ttl: Duration,
}

impl Handler<RenewLeases> for StoreActor {
    type Result = Result<Renewal>;

    fn handle(&mut self, msg: RenewLeases, _: &mut SyncContext<Self>) -> Result<Renewal> {
        self.wait_synced();
        self.store
            .read(|conn| sql::renew(conn, &msg.owner, &msg.held, msg.ttl))
    }
}

/// Releases a lease a returning call still holds: compare-and-set on the owner, no event and
/// no clock.
#[derive(Message)]
#[rtype(result = "Result<bool>")]
pub(crate) struct ReleaseLease {
    pub run_id: RunId,
    pub owner: Arc<str>,
}

impl Handler<ReleaseLease> for StoreActor {
    type Result = Result<bool>;

    fn handle(&mut self, msg: ReleaseLease, _: &mut SyncContext<Self>) -> Result<bool> {
        self.wait_synced();
        self.store
            .read(|conn| sql::release(conn, &msg.run_id, &msg.owner))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;

    /// Counts its readings.
    #[derive(Default)]
    struct Counting(AtomicU64);

    impl Clock for Counting {
        fn now(&self) -> std::time::SystemTime {
            self.0.fetch_add(1, Ordering::SeqCst);
            std::time::SystemTime::now()
        }
    }

    /// The number of moves of each committed group.
    #[derive(Default)]
    struct Groups(Mutex<Vec<usize>>);

    impl MoveObserver for Groups {
        fn committed(&self, moves: &[&MoveInfo]) {
            self.0.lock().unwrap().push(moves.len());
        }
    }

    /// A move that writes `value` (reading the clock), then is refused if `refuse`.
    fn write(value: i64, refuse: bool) -> ApplyMove<()> {
        ApplyMove::new("write", &RunId::from("r"), move |tx, now| {
            tx.execute(
                "INSERT INTO scratch (value, at) VALUES (?1, ?2)",
                [value, now.millis()],
            )?;
            if refuse {
                return Err(Error::InvalidInput("refused after writing".into()));
            }
            Ok(())
        })
    }

    #[test]
    fn a_move_refused_in_a_group_is_rolled_back_alone_and_no_move_reads_the_clock_twice() {
        let store = Store::in_memory().unwrap();
        store
            .read(
                |conn| Ok(conn.execute_batch("CREATE TABLE scratch (value INTEGER, at INTEGER)")?),
            )
            .unwrap();
        let clock = Arc::new(Counting::default());
        let groups = Arc::new(Groups::default());
        let (committed, values) = actix::System::new().block_on({
            let (store, clock, groups) = (store.clone(), clock.clone(), groups.clone());
            async move {
                let handle = StoreActor::start(
                    store,
                    clock,
                    Some(groups.clone()),
                    CommitPolicy {
                        group: true,
                        spin: Duration::ZERO,
                    },
                    RenewalPending::default(),
                );
                // Hold the store thread until every move is queued: they form one group.
                let (release, gate) = std::sync::mpsc::channel::<()>();
                handle.addr().do_send(ReadState::new(move |_| {
                    gate.recv().ok();
                    Ok(())
                }));
                let moves = vec![
                    actix_rt::spawn(handle.apply(write(1, false))),
                    actix_rt::spawn(handle.apply(write(2, true))),
                    actix_rt::spawn(handle.apply(write(3, false))),
                ];
                let pair =
                    actix_rt::spawn(handle.apply_then(write(4, false), write(5, true), |_| true));
                actix_rt::task::yield_now().await;
                release.send(()).unwrap();
                let mut committed = Vec::new();
                for mv in moves {
                    committed.push(mv.await.unwrap().is_ok());
                }
                let (_, then) = pair.await.unwrap().unwrap();
                committed.push(then.unwrap().is_ok());
                let values = handle
                    .addr()
                    .send(ReadState::new(|conn| {
                        let mut stmt = conn.prepare("SELECT value FROM scratch ORDER BY value")?;
                        let values = stmt
                            .query_map([], |row| row.get::<_, i64>(0))?
                            .collect::<rusqlite::Result<Vec<_>>>()?;
                        Ok(values)
                    }))
                    .await
                    .unwrap()
                    .unwrap();
                (committed, values)
            }
        });
        assert_eq!(committed, [true, false, true, false]);
        // The refused move's row is gone, the others' stand (the pair's first move too).
        assert_eq!(values, [1, 3, 4]);
        assert_eq!(
            *groups.0.lock().unwrap(),
            [3],
            "one group, three moves committed"
        );
        // The group was applied twice (without savepoints, then with): one reading per move.
        assert_eq!(clock.0.load(Ordering::SeqCst), 5);
    }

    #[test]
    fn a_refusal_is_answered_only_after_a_sync_even_when_written_was_enough_and_an_accepted_lone_move_needs_none()
     {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("db.sqlite")).unwrap();
        store
            .read(
                |conn| Ok(conn.execute_batch("CREATE TABLE scratch (value INTEGER, at INTEGER)")?),
            )
            .unwrap();
        let before = store.log_syncs();
        let (accepted, syncs_after_accepted, refused) = actix::System::new().block_on({
            let store = store.clone();
            async move {
                let handle = StoreActor::start(
                    store.clone(),
                    Arc::new(crate::clock::SystemClock),
                    None,
                    CommitPolicy {
                        group: true,
                        spin: Duration::ZERO,
                    },
                    RenewalPending::default(),
                );
                let accepted = handle.apply(write(1, false)).await.is_ok();
                let syncs = store.log_syncs();
                // Refused, perhaps on what another process committed and has not synced yet:
                // the refusal must not be told before that is durable.
                let refused = handle.apply(write(2, true)).await.is_err();
                // So is one answered when written otherwise.
                let refused_written = handle.apply_written(write(3, true)).await.is_err();
                (accepted, syncs, refused && refused_written)
            }
        });
        assert!(accepted && refused);
        assert_eq!(
            syncs_after_accepted, before,
            "a lone move syncs in its commit"
        );
        assert_eq!(store.log_syncs(), before + 2, "each refusal synced the log");
    }

    /// The values each committed group wrote, in the order the observer heard of them.
    #[derive(Default)]
    struct Written(Mutex<Vec<Vec<&'static str>>>);

    impl MoveObserver for Written {
        fn committed(&self, moves: &[&MoveInfo]) {
            self.0
                .lock()
                .unwrap()
                .push(moves.iter().map(|m| m.name).collect());
        }
    }

    fn named(name: &'static str, value: i64) -> ApplyMove<()> {
        ApplyMove::new(name, &RunId::from("r"), move |tx, now| {
            tx.execute(
                "INSERT INTO scratch (value, at) VALUES (?1, ?2)",
                [value, now.millis()],
            )?;
            Ok(())
        })
    }

    #[test]
    fn a_move_answered_when_written_is_made_durable_by_the_next_commit_or_by_a_sync_of_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("db.sqlite")).unwrap();
        store
            .read(
                |conn| Ok(conn.execute_batch("CREATE TABLE scratch (value INTEGER, at INTEGER)")?),
            )
            .unwrap();
        let observer = Arc::new(Written::default());
        let before = store.log_syncs();
        let syncs_after_followed = actix::System::new().block_on({
            let (store, observer) = (store.clone(), observer.clone());
            let watched = observer.clone();
            async move {
                let handle = StoreActor::start(
                    store.clone(),
                    Arc::new(crate::clock::SystemClock),
                    Some(watched),
                    CommitPolicy {
                        group: true,
                        // Long enough that the move sent after an answer is always caught.
                        spin: Duration::from_secs(2),
                    },
                    RenewalPending::default(),
                );
                // A reservation, answered once written; the move after it syncs both.
                handle.apply_written(named("reserve", 1)).await.unwrap();
                handle.apply(named("answer", 2)).await.unwrap();
                let syncs = store.log_syncs();
                // A reservation that nothing follows is synced when the watch ends.
                handle.apply_written(named("alone", 3)).await.unwrap();
                let deadline = Instant::now() + Duration::from_secs(10);
                while observer.0.lock().unwrap().len() < 3 {
                    assert!(
                        Instant::now() < deadline,
                        "the lone reservation was never synced"
                    );
                    actix_rt::time::sleep(Duration::from_millis(5)).await;
                }
                syncs
            }
        });
        assert_eq!(
            syncs_after_followed, before,
            "the answer's commit synced the reservation with it"
        );
        assert_eq!(store.log_syncs(), before + 1, "the lone one synced itself");
        // Each group is told once durable, in commit order.
        assert_eq!(
            *observer.0.lock().unwrap(),
            [vec!["reserve"], vec!["answer"], vec!["alone"]]
        );
        let values: Vec<i64> = Store::open(dir.path().join("db.sqlite"))
            .unwrap()
            .connection()
            .prepare("SELECT value FROM scratch ORDER BY value")
            .unwrap()
            .query_map([], |row| row.get(0))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        assert_eq!(values, [1, 2, 3]);
    }
}
