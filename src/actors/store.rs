//! `StoreActor`: drains the store's move queue into the backend's writer. A sync actor on its
//! own thread: the moves queued for it are handed to the writer in batches (everything that
//! arrived while the last batch was committing), so nothing blocking runs on the arbiters that
//! host runs. The writer commits each batch with the durability each caller asked for and
//! answers the callers; the actor's other messages (reads, renewals through the writer,
//! releases) wait until what was committed before them is durable.
//!
//! A backend whose connections each commit their own share of the runs (PostgreSQL's lanes) takes
//! the moves straight from the handle instead, through its router: each lane's thread gathers
//! its own batches, and a hop through this thread would only add a thread wake-up to every
//! commit. A move that a read or release must see is therefore awaited before it is sent.

use std::{
    future::Future,
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use crate::{
    clock::Clock,
    error::{Error, Result},
    store::{
        Store,
        backend::{Durability, MoveObserver, Pending, Reads, Renewer, Router, Writer},
        model::Renewal,
        moves::Move,
        queue::{self, MoveQueue, PairResult},
        watch::watched,
    },
    types::RunId,
};
use actix::{Actor, Addr, Handler, Message, SyncArbiter, SyncContext};

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

/// The queue this actor drains, shared with the handles that fill it.
type Queue = Arc<MoveQueue>;

impl StoreActor {
    /// Opens a session of `store`'s backend and starts the actor on a thread of its own; moves
    /// reach it through the returned handle. Also returns the session's renewer, if it has one
    /// (otherwise renewals go through the actor).
    pub(crate) fn start(
        store: &Store,
        clock: Arc<dyn Clock>,
        observer: Option<Arc<dyn MoveObserver>>,
        answer_watch: Duration,
    ) -> Result<(StoreHandle, Option<Box<dyn Renewer>>)> {
        let session = store.session(clock, observer)?;
        let router = session.router;
        // A backend with a router commits on a server: an answer takes a round trip, longer
        // than a watch, and a watching client would take the CPU a server on the same machine
        // needs. With one CPU, a watching thread takes it from the writer it waits for.
        let one_cpu = std::thread::available_parallelism().is_ok_and(|cpus| cpus.get() < 2);
        let answer_watch = if router.is_some() || one_cpu {
            Duration::ZERO
        } else {
            answer_watch
        };
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
        let handle = StoreHandle {
            addr,
            queue,
            router,
            answer_watch,
        };
        Ok((handle, session.renewer))
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
    fn next_batch(&self, watch: Duration, max_batch: usize) -> Vec<Box<dyn Pending>> {
        // While this thread watches, a move submitted needs no Drain of its own: it is taken
        // here, and its caller saves the message (and its thread the wake-up it tries).
        self.queue.request_drain();
        let until = Instant::now() + watch;
        loop {
            let batch = self.queue.take(max_batch);
            if !batch.is_empty() || Instant::now() >= until {
                // A move submitted from here on requests a Drain again; one submitted before
                // that did not, and is taken now (or by this Drain's next batches).
                self.queue.drain_started();
                return if batch.is_empty() {
                    self.queue.take(max_batch)
                } else {
                    batch
                };
            }
            std::hint::spin_loop();
        }
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
        self.queue.drain_started();
        // At most the writer's bound: the rest stays queued, first for the next batch.
        let max_batch = self.writer().max_batch();
        // Empty when an earlier Drain took these moves with its own.
        let mut batch = self.queue.take(max_batch);
        let started = Instant::now();
        let watch = self.writer().watch();
        while !batch.is_empty() {
            if started.elapsed() >= DRAIN_SLICE {
                // The other messages (reads, releases, renewals in memory) get their turn;
                // these moves are first in the queue for the next Drain.
                self.queue.requeue(batch);
                if self.queue.request_drain() {
                    ctx.address().do_send(Drain);
                }
                return;
            }
            let more_queued = !self.queue.is_empty();
            self.writer().commit(batch, more_queued);
            self.bell.ring();
            batch = self.next_batch(watch, max_batch);
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
    /// The backend's route straight to the connection that commits a move, if it has one:
    /// the moves then skip the actor's queue (its other messages still go through it).
    router: Option<Arc<dyn Router>>,
    /// How long a caller polls a move's answer before its thread sleeps (see [`watched`]).
    answer_watch: Duration,
}

impl StoreHandle {
    /// Submits a move; completes with its result once it committed (or was refused), with the
    /// durability asked for: see [`Durability`].
    pub(crate) fn apply<M: Move>(
        &self,
        mv: M,
        durability: Durability,
    ) -> impl Future<Output = Result<M::Output>> + 'static {
        let answer = if let Some(router) = &self.router {
            let (pending, answer) = queue::pending(mv, durability);
            router.route(pending);
            futures_util::future::Either::Left(queue::answered(answer))
        } else {
            let (answer, drain) = self.queue.push(mv, durability);
            if drain {
                self.addr.do_send(Drain);
            }
            futures_util::future::Either::Right(answer)
        };
        watched(answer, self.answer_watch)
    }

    /// Submits `first` and `then` to be committed in one transaction: see
    /// [`MoveQueue::push_pair`].
    pub(crate) fn apply_then<A: Move, B: Move>(
        &self,
        first: A,
        then: B,
        proceed: fn(&A::Output) -> bool,
        durability: Durability,
    ) -> impl Future<Output = PairResult<A, B>> + 'static {
        let answer = if let Some(router) = &self.router {
            let (pending, answer) = queue::pending_pair(first, then, proceed, durability);
            router.route(pending);
            futures_util::future::Either::Left(answer)
        } else {
            let (answer, drain) = self.queue.push_pair(first, then, proceed, durability);
            if drain {
                self.addr.do_send(Drain);
            }
            futures_util::future::Either::Right(answer)
        };
        watched(answer, self.answer_watch)
    }

    /// The actor, for messages other than moves.
    pub(crate) fn addr(&self) -> &Addr<StoreActor> {
        &self.addr
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;
    use crate::{
        clock::SystemClock,
        sqlite::{Options, Sqlite},
        store::{
            backend::{MoveInfo, MoveKind},
            moves::{CreateRun, Cx, Move},
        },
        types::RunId,
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

    /// A run's insert (reading the clock), then refused if `refuse`.
    struct Create {
        create: CreateRun,
        refuse: bool,
    }

    impl Move for Create {
        type Output = ();

        fn kind(&self) -> MoveKind {
            self.create.kind()
        }

        fn run_id(&self) -> &RunId {
            self.create.run_id()
        }

        fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<()> {
            self.create.apply(cx)?;
            if self.refuse {
                return Err(Error::InvalidInput("refused after writing".into()));
            }
            Ok(())
        }
    }

    /// A move that creates run `r{n}`, then is refused if `refuse`.
    fn create(n: u32, refuse: bool) -> Create {
        let create = queue::tests::create_run(&format!("r{n}"));
        Create { create, refuse }
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
                let (handle, _) =
                    StoreActor::start(&store, clock, Some(groups), Duration::ZERO).unwrap();
                // Hold the store thread until every move is queued: they form one group.
                let release = hold(&handle);
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

    /// Moves queued together beyond `max_group` are committed in groups of at most that many
    /// (a pair of one run's moves counting as one), in the order they were queued.
    #[test]
    fn moves_queued_together_beyond_the_group_bound_commit_in_bounded_groups_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let options = Options::new().commit_spin(Duration::ZERO).max_group(2);
        bounded_groups_in_order(options.clone().open(dir.path().join("db.sqlite")).unwrap());
        // In memory, where no group syncs, too.
        bounded_groups_in_order(options.in_memory().unwrap());
    }

    /// Holds the store actor's thread (in a read) until the returned sender sends or drops.
    fn hold(handle: &StoreHandle) -> std::sync::mpsc::Sender<()> {
        let (release, gate) = std::sync::mpsc::channel::<()>();
        handle.addr().do_send(ReadState::new(move |_| {
            gate.recv().ok();
            Ok(())
        }));
        release
    }

    fn bounded_groups_in_order(store: Store) {
        let groups = Arc::new(Groups::default());
        let committed = actix::System::new().block_on({
            let (store, groups) = (store.clone(), groups.clone());
            async move {
                let clock = Arc::new(Counting::default());
                let (handle, _) =
                    StoreActor::start(&store, clock, Some(groups), Duration::ZERO).unwrap();
                // Hold the store thread until every move is queued: they arrive together.
                let release = hold(&handle);
                let pair = actix_rt::spawn(handle.apply_then(
                    create(1, false),
                    create(2, false),
                    |_| true,
                    Durability::Durable,
                ));
                let moves: Vec<_> = (3..=6)
                    .map(|n| actix_rt::spawn(handle.apply(create(n, false), Durability::Durable)))
                    .collect();
                actix_rt::task::yield_now().await;
                release.send(()).unwrap();
                let (_, then) = pair.await.unwrap().unwrap();
                let mut committed = vec![then.unwrap().is_ok()];
                for mv in moves {
                    committed.push(mv.await.unwrap().is_ok());
                }
                committed
            }
        });
        assert_eq!(committed, [true; 5]);
        assert_eq!(run_ids(&store), ["r1", "r2", "r3", "r4", "r5", "r6"]);
        assert_eq!(
            *groups.0.lock().unwrap(),
            [vec!["r1", "r2", "r3"], vec!["r4", "r5"], vec!["r6"]],
            "groups of at most two entries, the pair one of them, in order"
        );
    }

    #[test]
    fn a_refusal_is_answered_after_a_sync_when_the_log_may_hold_an_unsynced_commit_and_an_accepted_lone_move_needs_none()
     {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db.sqlite");
        let store = Options::new()
            .commit_spin(Duration::ZERO)
            .open(&path)
            .unwrap();
        let before = syncs(&store);
        // Another process's commit, left unsynced as a group whose sync is deferred is.
        let unsynced_commit = || {
            rusqlite::Connection::open(&path)
                .unwrap()
                .execute_batch(
                    "PRAGMA synchronous = OFF; \
                     UPDATE runs SET updated_at = updated_at + 1 WHERE id = 'r1'",
                )
                .unwrap();
        };
        let counts = actix::System::new().block_on({
            let store = store.clone();
            async move {
                let (handle, _) =
                    StoreActor::start(&store, Arc::new(SystemClock), None, Duration::ZERO).unwrap();
                let mut counts = Vec::new();
                assert!(
                    handle
                        .apply(create(1, false), Durability::Durable)
                        .await
                        .is_ok()
                );
                counts.push(syncs(&store));
                // Refused with nothing unsynced it could rest on: no sync.
                assert!(
                    handle
                        .apply(create(2, true), Durability::Durable)
                        .await
                        .is_err()
                );
                counts.push(syncs(&store));
                // Refused, perhaps on what another process committed and has not synced yet:
                // the refusal must not be told before that is durable (synced by the group's
                // own commit, or after it).
                let durable = || !Sqlite::of(&store).unwrap().log_may_hold_unsynced();
                unsynced_commit();
                assert!(!durable());
                assert!(
                    handle
                        .apply(create(3, true), Durability::Durable)
                        .await
                        .is_err()
                );
                assert!(
                    durable(),
                    "a refusal was told before what it read was durable"
                );
                // So is one answered when written otherwise.
                unsynced_commit();
                assert!(
                    handle
                        .apply(create(4, true), Durability::Written)
                        .await
                        .is_err()
                );
                assert!(
                    durable(),
                    "a refusal was told before what it read was durable"
                );
                counts
            }
        });
        assert_eq!(
            counts,
            [before, before],
            "a lone move syncs in its commit, and a refusal with nothing unsynced to rest on \
             syncs nothing more"
        );
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
                    StoreActor::start(&store, Arc::new(SystemClock), Some(watched), Duration::ZERO)
                        .unwrap();
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
