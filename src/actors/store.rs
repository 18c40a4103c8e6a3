//! `StoreActor`: the queue between the actors and the backend's writer. A sync actor on its
//! own thread: the moves submitted to it are handed to the writer in batches (everything that
//! arrived while the last batch was committing), so nothing blocking runs on the arbiters that
//! host runs. The writer commits each batch with the durability each caller asked for and
//! answers the callers; the actor's other messages (reads, renewals through the writer,
//! releases) wait until what was committed before them is durable.

use std::{
    future::Future,
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use actix::{Actor, Addr, Handler, Message, SyncArbiter, SyncContext};
use tokio::sync::oneshot;

use crate::{
    clock::Clock,
    error::{Error, Result},
    store::{
        Store,
        backend::{
            Durability, GroupFailure, Isolation, MoveInfo, MoveKind, MoveObserver, Pending, Reads,
            Renewer, Tx, Writer,
        },
        model::{Now, Renewal},
    },
    types::RunId,
};

/// A move's work. It may be applied twice (see [`Pending::apply`]), with the same clock
/// reading and on the same state each time.
type ApplyFn<R> = Box<dyn FnMut(&mut dyn Tx, &mut Now<'_>) -> Result<R> + Send>;
type ReadFn<R> = Box<dyn FnMut(&mut dyn Reads) -> Result<R> + Send>;

/// Hands the queued moves to the backend's writer for one supervisor.
pub(crate) struct StoreActor {
    writer: SharedWriter,
    queue: Queue,
    /// Rung after each batch: the web API's streams wake to read what it wrote.
    bell: Arc<crate::store::pulse::Bell>,
}

/// The writer, shared by every instance the actor's factory makes.
type SharedWriter = Arc<Mutex<Box<dyn Writer>>>;

/// How long one Drain keeps committing before the actor's other messages get their turn.
const DRAIN_SLICE: Duration = Duration::from_millis(5);

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
    fn lock(&self) -> MutexGuard<'_, Vec<Box<dyn Pending>>> {
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
    /// Opens a session of `store`'s backend and starts the actor on a thread of its own; moves
    /// reach it through the returned handle. Also returns the session's renewer, if it has one
    /// (otherwise renewals go through the actor).
    pub(crate) fn start(
        store: &Store,
        clock: Arc<dyn Clock>,
        observer: Option<Arc<dyn MoveObserver>>,
    ) -> Result<(StoreHandle, Option<Box<dyn Renewer>>)> {
        let session = store.session(clock, observer)?;
        let bell = store.bell().clone();
        let writer: SharedWriter = Arc::new(Mutex::new(session.writer));
        let queue = Queue::default();
        let shared = queue.clone();
        // The factory runs again if the actor stops; it only clones handles, so a restart
        // yields the same actor on the same writer and queue.
        let addr = SyncArbiter::start(1, move || StoreActor {
            writer: writer.clone(),
            queue: shared.clone(),
            bell: bell.clone(),
        });
        Ok((StoreHandle { addr, queue }, session.renewer))
    }

    fn writer(&self) -> MutexGuard<'_, Box<dyn Writer>> {
        // A panic inside the writer leaves it as a failed commit would: its callers unanswered
        // (their replies dropped), the next batch committed afresh.
        self.writer
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// What arrived during the last commit, or within the writer's watch after it: a loop
    /// answered by that commit sends its next move within microseconds, and catching it here
    /// saves two thread wake-ups (ours, and the Drain's).
    fn next_batch(&self, watch: Duration) -> Vec<Box<dyn Pending>> {
        let until = Instant::now() + watch;
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

impl Actor for StoreActor {
    type Context = SyncContext<Self>;
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
        let watch = self.writer().watch();
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
            let more_queued = !self.queue.lock().is_empty();
            self.writer().commit(batch, more_queued);
            self.bell.ring();
            batch = self.next_batch(watch);
        }
        // Nothing more came: what was answered once written is made durable now.
        self.writer().idle();
    }
}

/// A read that sees every committed move, answered once what it saw is durable.
pub(crate) struct ReadState<R> {
    read: ReadFn<R>,
}

impl<R> ReadState<R> {
    pub(crate) fn new(read: impl FnMut(&mut dyn Reads) -> Result<R> + Send + 'static) -> Self {
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
        let mut read = msg.read;
        let mut value = None;
        self.writer().read(&mut |reads| {
            value = Some(read(reads)?);
            Ok(())
        })?;
        value.ok_or_else(|| Error::CommitFailed("the backend never ran the read".into()))
    }
}

/// One renewal tick through the store actor (a backend without a renewal connection, such as
/// SQLite's `:memory:`, whose only connection is the writer's).
#[derive(Message)]
#[rtype(result = "Result<Renewal>")]
pub(crate) struct RenewLeases {
    pub owner: Arc<str>,
    /// Each run with the fencing token of its lease.
    pub held: Vec<(RunId, u64)>,
    pub ttl: Duration,
}

impl Handler<RenewLeases> for StoreActor {
    type Result = Result<Renewal>;

    fn handle(&mut self, msg: RenewLeases, _: &mut SyncContext<Self>) -> Result<Renewal> {
        self.writer().renew(&msg.owner, &msg.held, msg.ttl)
    }
}

/// Releases a lease a returning call still holds: compare-and-set on the owner and the
/// fencing token, no event and no clock.
#[derive(Message)]
#[rtype(result = "Result<bool>")]
pub(crate) struct ReleaseLease {
    pub run_id: RunId,
    pub owner: Arc<str>,
    pub token: u64,
}

impl Handler<ReleaseLease> for StoreActor {
    type Result = Result<bool>;

    fn handle(&mut self, msg: ReleaseLease, _: &mut SyncContext<Self>) -> Result<bool> {
        self.writer().release(&msg.run_id, &msg.owner, msg.token)
    }
}

/// How the rest of the supervisor reaches its store actor.
#[derive(Clone)]
pub(crate) struct StoreHandle {
    addr: Addr<StoreActor>,
    queue: Queue,
}

impl StoreHandle {
    /// Submits a move; completes with its result once it committed (or was refused), with the
    /// durability asked for: see [`Durability`].
    pub(crate) fn apply<R: Send + 'static>(
        &self,
        mv: ApplyMove<R>,
        durability: Durability,
    ) -> impl Future<Output = Result<R>> + 'static {
        let (reply, answer) = oneshot::channel();
        let pending = PendingMove {
            info: mv.info,
            apply: mv.apply,
            reading: None,
            result: None,
            reply,
            durability,
        };
        self.submit(Box::new(pending));
        async move { answer.await.map_err(|_| Error::StoreUnavailable)? }
    }

    /// Submits `first` and `then` to be committed in one transaction, `then` applied only if
    /// `first` was and `proceed` says so of its result, each all-or-nothing with its own
    /// clock reading: for a move whose successor is known before the commit and no side
    /// effect lies between them. Completes once they committed, with `durability`, with
    /// `first`'s result (an error if it was refused) and `then`'s (`None` if it was not
    /// attempted).
    pub(crate) fn apply_then<A: Send + 'static, B: Send + 'static>(
        &self,
        first: ApplyMove<A>,
        then: ApplyMove<B>,
        proceed: fn(&A) -> bool,
        durability: Durability,
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
            durability,
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
    /// A move of kind `kind` of run `run_id`, that `apply` carries out.
    pub(crate) fn new(
        kind: MoveKind,
        run_id: &RunId,
        apply: impl FnMut(&mut dyn Tx, &mut Now<'_>) -> Result<R> + Send + 'static,
    ) -> Self {
        ApplyMove {
            info: MoveInfo {
                kind,
                run_id: run_id.clone(),
            },
            apply: Box::new(apply),
        }
    }
}

struct PendingMove<R> {
    info: MoveInfo,
    apply: ApplyFn<R>,
    /// The clock reading of an earlier attempt.
    reading: Option<i64>,
    result: Option<Result<R>>,
    reply: oneshot::Sender<Result<R>>,
    durability: Durability,
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

    fn durability(&self) -> Durability {
        self.durability
    }

    fn apply(&mut self, tx: &mut dyn Tx, clock: &dyn Clock, _: Isolation) -> bool {
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
    durability: Durability,
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

    fn durability(&self) -> Durability {
        self.durability
    }

    fn apply(&mut self, tx: &mut dyn Tx, clock: &dyn Clock, isolation: Isolation) -> bool {
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
fn in_savepoint<R>(tx: &mut dyn Tx, f: impl FnOnce(&mut dyn Tx) -> Result<R>) -> Result<Result<R>> {
    tx.savepoint("agentrt_then")?;
    let result = f(tx);
    if result.is_err() {
        tx.rollback_to("agentrt_then")?;
    }
    tx.release_savepoint("agentrt_then")?;
    Ok(result)
}

/// What a caller is answered: its move's refusal, or its result if the group committed (and
/// synced).
pub(crate) fn final_result<R>(
    result: Option<Result<R>>,
    failed: Option<&GroupFailure>,
) -> Result<R> {
    match (result, failed) {
        (Some(Err(err)), _) => Err(err),
        (Some(Ok(value)), None) => Ok(value),
        (_, Some(failure)) => Err(failure.error()),
        (None, None) => Err(Error::CommitFailed("the move was never applied".into())),
    }
}

fn refused_logged<R>(info: &MoveInfo, result: Result<R>) -> Result<R> {
    if let Err(err) = &result {
        tracing::debug!(r#move = %info.kind, run_id = %info.run_id, %err, "move refused");
    }
    result
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use serde_json::json;

    use super::*;
    use crate::{
        clock::SystemClock,
        sqlite::{Options, Sqlite},
        store::{
            model::{Grant, Holder},
            moves::Move,
        },
    };

    /// Counts its readings.
    #[derive(Default)]
    struct Counting(AtomicU64);

    impl Clock for Counting {
        fn now(&self) -> std::time::SystemTime {
            self.0.fetch_add(1, Ordering::SeqCst);
            std::time::SystemTime::now()
        }
    }

    /// The runs of each committed group, in the order the observer heard of them.
    #[derive(Default)]
    struct Groups(Mutex<Vec<Vec<String>>>);

    impl MoveObserver for Groups {
        fn committed(&self, moves: &[&MoveInfo]) {
            let runs = moves.iter().map(|m| m.run_id.to_string()).collect();
            self.0.lock().unwrap().push(runs);
        }
    }

    /// A move that creates run `r{n}` (reading the clock), then is refused if `refuse`.
    fn create(n: u32, refuse: bool) -> ApplyMove<()> {
        let run_id = RunId::from(format!("r{n}"));
        let id = run_id.clone();
        let grant = Grant::new(Holder {
            owner: "me/000000000001".into(),
            ttl: Duration::from_secs(30),
            margin: Duration::from_secs(10),
        });
        ApplyMove::new(MoveKind::CreateRun, &run_id, move |tx, now| {
            Move::new(tx, now, &id).create_run("a", &json!({}), &grant)?;
            if refuse {
                return Err(Error::InvalidInput("refused after writing".into()));
            }
            Ok(())
        })
    }

    fn run_ids(store: &Store) -> Vec<String> {
        let runs = store.runs(None).unwrap();
        let mut ids: Vec<String> = runs.into_iter().map(|run| run.id.to_string()).collect();
        ids.sort();
        ids
    }

    fn syncs(store: &Store) -> usize {
        Sqlite::of(store).unwrap().faults.syncs()
    }

    #[test]
    fn a_move_refused_in_a_group_is_rolled_back_alone_and_no_move_reads_the_clock_twice() {
        let store = Options::new()
            .commit_spin(Duration::ZERO)
            .in_memory()
            .unwrap();
        let clock = Arc::new(Counting::default());
        let groups = Arc::new(Groups::default());
        let committed = actix::System::new().block_on({
            let (store, clock, groups) = (store.clone(), clock.clone(), groups.clone());
            async move {
                let (handle, _) = StoreActor::start(&store, clock, Some(groups)).unwrap();
                // Hold the store thread until every move is queued: they form one group.
                let (release, gate) = std::sync::mpsc::channel::<()>();
                handle.addr().do_send(ReadState::new(move |_| {
                    gate.recv().ok();
                    Ok(())
                }));
                let moves = vec![
                    actix_rt::spawn(handle.apply(create(1, false), Durability::Durable)),
                    actix_rt::spawn(handle.apply(create(2, true), Durability::Durable)),
                    actix_rt::spawn(handle.apply(create(3, false), Durability::Durable)),
                ];
                let pair = actix_rt::spawn(handle.apply_then(
                    create(4, false),
                    create(5, true),
                    |_| true,
                    Durability::Durable,
                ));
                actix_rt::task::yield_now().await;
                release.send(()).unwrap();
                let mut committed = Vec::new();
                for mv in moves {
                    committed.push(mv.await.unwrap().is_ok());
                }
                let (_, then) = pair.await.unwrap().unwrap();
                committed.push(then.unwrap().is_ok());
                committed
            }
        });
        assert_eq!(committed, [true, false, true, false]);
        // The refused move's run is gone, the others' stand (the pair's first move too).
        assert_eq!(run_ids(&store), ["r1", "r3", "r4"]);
        assert_eq!(
            *groups.0.lock().unwrap(),
            [vec!["r1", "r3", "r4"]],
            "one group, three moves committed"
        );
        // The group was applied twice (without savepoints, then with): one reading per move.
        assert_eq!(clock.0.load(Ordering::SeqCst), 5);
    }

    #[test]
    fn a_refusal_is_answered_only_after_a_sync_even_when_written_was_enough_and_an_accepted_lone_move_needs_none()
     {
        let dir = tempfile::tempdir().unwrap();
        let store = Options::new()
            .commit_spin(Duration::ZERO)
            .open(dir.path().join("db.sqlite"))
            .unwrap();
        let before = syncs(&store);
        let (accepted, syncs_after_accepted, refused) = actix::System::new().block_on({
            let store = store.clone();
            async move {
                let (handle, _) = StoreActor::start(&store, Arc::new(SystemClock), None).unwrap();
                let accepted = handle
                    .apply(create(1, false), Durability::Durable)
                    .await
                    .is_ok();
                let after = syncs(&store);
                // Refused, perhaps on what another process committed and has not synced yet:
                // the refusal must not be told before that is durable.
                let refused = handle
                    .apply(create(2, true), Durability::Durable)
                    .await
                    .is_err();
                // So is one answered when written otherwise.
                let refused_written = handle
                    .apply(create(3, true), Durability::Written)
                    .await
                    .is_err();
                (accepted, after, refused && refused_written)
            }
        });
        assert!(accepted && refused);
        assert_eq!(
            syncs_after_accepted, before,
            "a lone move syncs in its commit"
        );
        assert_eq!(syncs(&store), before + 2, "each refusal synced the log");
    }

    #[test]
    fn a_move_answered_when_written_is_made_durable_by_the_next_commit_or_by_a_sync_of_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.sqlite");
        // Long enough that the move sent after an answer is always caught.
        let store = Options::new()
            .commit_spin(Duration::from_secs(2))
            .open(&path)
            .unwrap();
        let observer = Arc::new(Groups::default());
        let before = syncs(&store);
        let syncs_after_followed = actix::System::new().block_on({
            let (store, observer) = (store.clone(), observer.clone());
            let watched = observer.clone();
            async move {
                let (handle, _) =
                    StoreActor::start(&store, Arc::new(SystemClock), Some(watched)).unwrap();
                // A reservation, answered once written; the move after it syncs both.
                handle
                    .apply(create(1, false), Durability::Written)
                    .await
                    .unwrap();
                handle
                    .apply(create(2, false), Durability::Durable)
                    .await
                    .unwrap();
                let after = syncs(&store);
                // A reservation that nothing follows is synced when the watch ends.
                handle
                    .apply(create(3, false), Durability::Written)
                    .await
                    .unwrap();
                let deadline = Instant::now() + Duration::from_secs(10);
                while observer.0.lock().unwrap().len() < 3 {
                    assert!(
                        Instant::now() < deadline,
                        "the lone reservation was never synced"
                    );
                    actix_rt::time::sleep(Duration::from_millis(5)).await;
                }
                after
            }
        });
        assert_eq!(
            syncs_after_followed, before,
            "the answer's commit synced the reservation with it"
        );
        assert_eq!(syncs(&store), before + 1, "the lone one synced itself");
        // Each group is told once durable, in commit order.
        assert_eq!(
            *observer.0.lock().unwrap(),
            [vec!["r1"], vec!["r2"], vec!["r3"]]
        );
        drop(store);
        assert_eq!(run_ids(&Store::open(&path).unwrap()), ["r1", "r2", "r3"]);
    }
}
