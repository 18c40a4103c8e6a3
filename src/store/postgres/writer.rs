//! The write side: an operator's move, and a supervisor's lanes of group commits and its
//! lease keeper's connection.
//!
//! A supervisor's moves go to one of its writer connections (its lanes): a run's moves to one
//! lane while any of them is unanswered, so that they commit in the order they were submitted,
//! and other runs' to the same lane or, under load, to another, in parallel (see `lanes`). A
//! lane commits every move that queued behind its last commit as one transaction, each move in
//! a savepoint of its own should one be refused: one round trip to the disk for the whole
//! group. A group whose callers all asked to be answered once written commits with
//! `synchronous_commit = off`: the server answers before its log reaches the disk, and any
//! later synchronous commit (whose flush covers every record before its own) makes it durable.

use std::{
    sync::{Arc, Mutex, PoisonError, RwLockReadGuard, mpsc},
    time::{Duration, Instant},
};

use super::{
    Postgres,
    conn::{Conn, Noted, Pg, off_runtime, take_noted},
    lanes::Lanes,
    link::{Direct, Link},
    pipe::{Behind, PipeConn},
    sql::PgTx,
};
use crate::{
    clock::Clock,
    error::{Error, Result},
    metrics,
    store::{
        backend::{
            Durability, GroupFailure, Isolation, LeaseWrites, MoveKind, MoveObserver, Pending,
            Reads, Renewer, Session, Tx, Writer,
        },
        model::{Now, Renewal},
        moves,
        pulse::Bell,
    },
    types::RunId,
};

/// How often a transaction that met another's (a deadlock, a key taken meanwhile) or a
/// broken connection is applied again before its callers are told it failed.
const TRIES: u32 = 20;

/// From this try on, a group is applied move by move, each in a savepoint of its own, and a
/// key found taken inside a move refuses that move alone: a key still taken after a group was
/// applied again is the move's own (a step it inserts exists), not a race with another
/// writer, which the tries before have let settle. A deadlock or a serialization failure is
/// still applied again.
const CONFLICTS_REFUSE_FROM: u32 = 3;

impl Postgres {
    /// Stops the store's writes for good, as the death of its process would: waits until every
    /// write transaction it has open (a lane's group, a renewal, a release) has ended, committed
    /// or not, and lets no other begin. For the testkit's crashes, which stop one lane's thread
    /// in the observer while the other lanes may be committing.
    #[cfg(feature = "testkit")]
    pub(crate) fn stop_writes(&self) {
        *self.stopped.write().unwrap_or_else(PoisonError::into_inner) = true;
    }

    /// Held while a write transaction is open; `None` once the writes were stopped.
    fn writing(&self) -> Option<RwLockReadGuard<'_, bool>> {
        let stopped = self.stopped.read().unwrap_or_else(PoisonError::into_inner);
        (!*stopped).then_some(stopped)
    }

    /// A connection of the store's idle ones, or a new one.
    pub(super) fn connection(&self) -> Result<Conn> {
        let idle = self.idle.lock().expect("the idle connections").pop();
        match idle {
            Some(conn) if conn.is_usable() => Ok(conn),
            _ => Conn::open(&self.config, &self.options)
                .map_err(|err| super::open::unreachable(&self.shown, err)),
        }
    }

    /// A new pipelining connection, for a writer lane.
    fn pipe(&self) -> Result<PipeConn> {
        PipeConn::open(&self.config, &self.options)
            .map_err(|err| super::open::unreachable(&self.shown, err))
    }

    /// Keeps `conn` for the next inspection or operator's move, if it is still usable.
    pub(super) fn give_back(&self, conn: Conn) {
        if conn.is_usable() {
            let mut idle = self.idle.lock().expect("the idle connections");
            if idle.len() < 4 {
                idle.push(conn);
            }
        }
    }

    /// Runs `read` in a read-only transaction that sees one snapshot.
    pub(super) fn read_snapshot(
        &self,
        read: &mut (dyn FnMut(&mut dyn Reads) -> Result<()> + Send),
    ) -> Result<()> {
        let mut conn = self.connection()?;
        let result = read_on(&mut conn, read);
        take_noted();
        self.give_back(conn);
        result
    }

    /// Applies `apply` in a transaction of its own on `conn`, committed when it returns `Ok`,
    /// again after a conflict or on a new connection after a broken one (nothing committed),
    /// until `deadline` if one is given. `lock`: the reads of runs lock them (a move's), or not
    /// (a renewal's, which must not wait for a row another transaction holds).
    fn transact_on(
        &self,
        conn: &mut Option<Conn>,
        clock: &dyn Clock,
        lock: bool,
        deadline: Option<Instant>,
        apply: &mut dyn FnMut(&mut PgTx<'_>, &mut Now<'_>) -> Result<()>,
    ) -> Result<()> {
        let mut reading = None;
        let mut tries = 0;
        loop {
            tries += 1;
            let Some(_writing) = self.writing() else {
                return Err(Error::CommitFailed(
                    "the store's writes were stopped".into(),
                ));
            };
            let out_of_time = deadline.is_some_and(|deadline| Instant::now() >= deadline);
            let mut current = match conn.take() {
                Some(current) if current.is_usable() => current,
                _ => self.connection()?,
            };
            take_noted();
            let attempt = (|| {
                let (client, statements) = current.parts();
                let mut tx = client.transaction().pg()?;
                let mut now = Now::resume(clock, reading);
                let mut link = Direct {
                    tx: &mut tx,
                    statements,
                };
                let applied = apply(&mut PgTx::new(&mut link, lock), &mut now);
                reading = now.reading();
                if take_noted() != Noted::Nothing {
                    return Ok(Err(applied.err()));
                }
                applied?;
                match tx.commit() {
                    Ok(()) => Ok(Ok(())),
                    Err(err) => match commit_failure(err) {
                        CommitError::Again(err) => Ok(Err(Some(err))),
                        CommitError::Failed(failure) => Err(failure.error()),
                    },
                }
            })();
            match attempt {
                Ok(Ok(())) => {
                    *conn = Some(current);
                    return Ok(());
                }
                // Met another transaction, or the connection broke before the commit: nothing
                // was committed.
                Ok(Err(err)) if tries < TRIES && !out_of_time => {
                    if current.is_usable() {
                        *conn = Some(current);
                    }
                    tracing::debug!(?err, tries, "a transaction is applied again");
                    back_off(tries);
                }
                Ok(Err(err)) => {
                    return Err(err.unwrap_or_else(|| {
                        Error::CommitFailed("the transaction kept meeting others".into())
                    }));
                }
                Err(err) => {
                    if current.is_usable() {
                        *conn = Some(current);
                    }
                    return Err(err);
                }
            }
        }
    }
}

/// A short random pause, longer with each try, so that two transactions that met do not meet
/// again at once.
fn back_off(tries: u32) {
    let millis = rand::random_range(1..=5 * u64::from(tries.min(10)));
    std::thread::sleep(Duration::from_millis(millis));
}

/// `read` in a read-only repeatable-read transaction on `conn`: one snapshot for all of it.
pub(super) fn in_snapshot<R>(
    conn: &mut Conn,
    read: impl FnOnce(&mut PgTx<'_>) -> Result<R>,
) -> Result<R> {
    let (client, statements) = conn.parts();
    let mut tx = client
        .build_transaction()
        .isolation_level(postgres::IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .pg()?;
    let mut link = Direct {
        tx: &mut tx,
        statements,
    };
    let value = read(&mut PgTx::new(&mut link, false))?;
    tx.commit().pg()?;
    Ok(value)
}

/// An inspection read in one snapshot on `conn`.
pub(super) fn read_on(
    conn: &mut Conn,
    read: &mut dyn FnMut(&mut dyn Reads) -> Result<()>,
) -> Result<()> {
    in_snapshot(conn, |pg| read(pg))
}

/// One move in a transaction of its own, outside any supervisor.
pub(super) fn transact(
    store: &Postgres,
    clock: &dyn Clock,
    apply: &mut (dyn FnMut(&mut dyn Tx, &mut Now<'_>) -> Result<()> + Send),
) -> Result<()> {
    let mut conn = None;
    let result = store.transact_on(&mut conn, clock, true, None, &mut |pg, now| apply(pg, now));
    if let Some(conn) = conn {
        store.give_back(conn);
    }
    result
}

/// Starts the write side of a supervisor: its lanes, each a thread with a connection of its
/// own, and its lease keeper's connection.
pub(super) fn session(
    store: Arc<Postgres>,
    clock: Arc<dyn Clock>,
    observer: Option<Arc<dyn MoveObserver>>,
    bell: Arc<Bell>,
) -> Result<Session> {
    // The first connections open here, so that a server that does not answer fails the start.
    let renewer = PgRenewer {
        conn: Some(store.connection()?),
        store: store.clone(),
    };
    let observed = Arc::new(Mutex::new(observer));
    let mut lanes = Vec::new();
    for index in 0..store.options.writers {
        let (send, receive) = mpsc::channel();
        let mut lane = Lane {
            store: store.clone(),
            clock: clock.clone(),
            observed: observed.clone(),
            bell: bell.clone(),
            conn: Some(store.pipe()?),
        };
        std::thread::Builder::new()
            .name(format!("agentrt-pg-writer-{index}"))
            .spawn(move || lane.run(receive))
            .map_err(|err| Error::CommitFailed(format!("starting a writer thread: {err}")))?;
        lanes.push(send);
    }
    let lanes = Arc::new(Lanes::new(lanes, store.options.spill_at));
    Ok(Session {
        writer: Box::new(PgWriter {
            store,
            lanes: lanes.clone(),
            conn: None,
        }),
        renewer: Some(Box::new(renewer)),
        router: Some(lanes),
    })
}

/// A supervisor's writer: it hands each move to its run's lane and returns; the lane answers.
/// A supervisor's moves reach the lanes straight from its runs' threads (the session's
/// router); this writer takes the batches of a caller that drives it (the conformance suite's
/// groups).
struct PgWriter {
    store: Arc<Postgres>,
    lanes: Arc<Lanes>,
    /// For the writer's reads and lease writes.
    conn: Option<Conn>,
}

impl PgWriter {
    fn conn(&mut self) -> Result<Conn> {
        match self.conn.take() {
            Some(conn) if conn.is_usable() => Ok(conn),
            _ => self.store.connection(),
        }
    }
}

impl Writer for PgWriter {
    fn commit(&mut self, batch: Vec<Box<dyn Pending>>, _more_queued: bool) {
        let mut by_lane: Vec<Vec<Box<dyn Pending>>> =
            (0..self.lanes.len()).map(|_| Vec::new()).collect();
        for pending in batch {
            let (lane, pending) = self.lanes.assign(pending);
            by_lane[lane].push(pending);
        }
        for (lane, moves) in by_lane.into_iter().enumerate() {
            if !moves.is_empty() {
                self.lanes.send(lane, moves);
            }
        }
    }

    fn watch(&self) -> Duration {
        // A commit returns at once; the lanes gather what queues behind their own commits.
        Duration::ZERO
    }

    fn idle(&mut self) {
        // The server's log writer makes what was answered once written durable within a few
        // of its delays (`wal_writer_delay`), and any synchronous commit at once.
    }

    fn read(&mut self, read: &mut dyn FnMut(&mut dyn Reads) -> Result<()>) -> Result<()> {
        let mut conn = self.conn()?;
        let result = read_on(&mut conn, read);
        take_noted();
        if conn.is_usable() {
            self.conn = Some(conn);
        }
        result
    }

    fn renew(&mut self, owner: &str, held: &[(RunId, u64)], ttl: Duration) -> Result<Renewal> {
        let mut renewal = None;
        let clock = &crate::clock::SystemClock;
        self.store
            .transact_on(&mut self.conn, clock, false, None, &mut |pg, _| {
                renewal = Some(moves::renew(pg, owner, held, ttl)?);
                Ok(())
            })?;
        renewal.ok_or_else(|| Error::CommitFailed("the renewal was not applied".into()))
    }

    fn release(&mut self, run_id: &RunId, owner: &str, token: u64) -> Result<bool> {
        let mut released = false;
        let clock = &crate::clock::SystemClock;
        self.store
            .transact_on(&mut self.conn, clock, true, None, &mut |pg, _| {
                released = pg.release_lease(run_id, owner, token)?;
                Ok(())
            })?;
        Ok(released)
    }
}

/// One writer connection and the thread that commits through it.
struct Lane {
    store: Arc<Postgres>,
    clock: Arc<dyn Clock>,
    /// The observer, shared by the lanes: it hears of one group at a time.
    observed: Arc<Mutex<Option<Arc<dyn MoveObserver>>>>,
    /// Rung once a group has committed: the lanes commit apart from the store actor.
    bell: Arc<Bell>,
    conn: Option<PipeConn>,
}

/// The run a pending move moves.
fn run_of(pending: &dyn Pending) -> Option<&RunId> {
    pending.infos().first().map(|info| &info.run_id)
}

/// What became of one attempt at a group.
enum Attempt {
    Committed,
    /// Nothing was committed; applying it again may succeed.
    Again(String),
    Failed(GroupFailure),
}

impl Lane {
    fn run(&mut self, receive: mpsc::Receiver<Vec<Box<dyn Pending>>>) {
        while let Ok(mut batch) = receive.recv() {
            if self.store.options.group_commit {
                // Everything that queued while the last group committed goes in this one.
                while let Ok(more) = receive.try_recv() {
                    batch.extend(more);
                }
                self.commit(batch);
            } else {
                for pending in batch {
                    self.commit(vec![pending]);
                }
            }
        }
    }

    fn observer(&self) -> Option<Arc<dyn MoveObserver>> {
        self.observed.lock().expect("the observer").clone()
    }

    /// Commits `batch` as one transaction and answers its callers.
    fn commit(&mut self, mut batch: Vec<Box<dyn Pending>>) {
        // Each move locks its run's row first: in the order of the runs' ids, as a renewal
        // locks them, two transactions that lock several runs cannot deadlock on each other.
        // The sort is stable, so one run's moves keep their order.
        batch.sort_by(|a, b| run_of(&**a).cmp(&run_of(&**b)));
        let observer = self.observer();
        if let Some(observer) = &observer {
            // Before the transaction opens: an observer that stops here holds no lock.
            let _one_group = self.observed.lock().expect("the observer");
            batch
                .iter()
                .flat_map(|pending| pending.infos())
                .for_each(|info| observer.before_apply(info));
        }
        // Held until the group has committed or failed (after the observer, where a crash
        // stops its thread), so that a stop of the store's writes waits for it; a group that
        // comes after the stop is dropped unwritten, its callers unanswered.
        let store = self.store.clone();
        let Some(writing) = store.writing() else {
            return;
        };
        let started = Instant::now();
        let mut tries = 0;
        let failure = loop {
            tries += 1;
            match self.attempt(&mut batch, tries >= CONFLICTS_REFUSE_FROM) {
                Attempt::Committed => break None,
                Attempt::Again(why) if tries < TRIES => {
                    tracing::debug!(why, tries, moves = batch.len(), "a group is applied again");
                    back_off(tries);
                }
                Attempt::Again(why) => break Some(GroupFailure::Commit(why)),
                Attempt::Failed(failure) => break Some(failure),
            }
        };
        drop(writing);
        if failure.is_none() {
            self.bell.ring();
        }
        if let Some(observer) = &observer
            && failure.is_none()
        {
            let _one_group = self.observed.lock().expect("the observer");
            let committed: Vec<_> = batch.iter().flat_map(|pending| pending.applied()).collect();
            committed
                .iter()
                .for_each(|info| observer.after_commit(info));
            if !committed.is_empty() {
                observer.committed(&committed);
            }
        }
        match &failure {
            None => {
                let moves: usize = batch.iter().map(|pending| pending.applied().len()).sum();
                metrics::group_committed(moves, started.elapsed());
            }
            Some(failure) => {
                tracing::error!(?failure, moves = batch.len(), "a group commit failed")
            }
        }
        for pending in batch {
            pending.answer(failure.as_ref());
        }
    }

    /// One try at `batch`; `conflicts_refuse`: a key found taken inside a move refuses it alone.
    fn attempt(&mut self, batch: &mut [Box<dyn Pending>], conflicts_refuse: bool) -> Attempt {
        let mut conn = match self.conn.take() {
            Some(conn) if conn.is_usable() => conn,
            _ => match self.store.pipe() {
                Ok(conn) => conn,
                Err(err) => return Attempt::Failed(GroupFailure::Commit(err.to_string())),
            },
        };
        let pipelined = self.store.options.pipeline;
        let attempt = attempt_on(&mut conn, batch, &*self.clock, pipelined, conflicts_refuse);
        if conn.is_usable() {
            self.conn = Some(conn);
        }
        attempt
    }
}

/// One attempt at committing `batch` in one transaction on `conn`: straight in, its writes
/// pipelined when `pipelined`; then, should a move be refused (or a pipelined write be found
/// to have been), again with each move in a savepoint of its own and every statement answered
/// before the next. With `conflicts_refuse`, move by move from the start, and a key found taken
/// inside a move refuses that move alone instead of the whole attempt.
fn attempt_on(
    conn: &mut PipeConn,
    batch: &mut [Box<dyn Pending>],
    clock: &dyn Clock,
    pipelined: bool,
    conflicts_refuse: bool,
) -> Attempt {
    let written = batch
        .iter()
        .all(|pending| pending.durability() == Durability::Written);
    let mut begin = String::from("BEGIN;");
    if written {
        begin.push_str(" SET LOCAL synchronous_commit = off;");
    }
    let small = batch.len() <= SMALL_GROUP;
    begin.push_str(plans_for(small));
    conn.small_groups(small);
    take_noted();
    conn.direct = !pipelined || conflicts_refuse;
    let mut isolation = if conflicts_refuse {
        Isolation::Savepoint
    } else {
        Isolation::Shared
    };
    loop {
        conn.begin(&begin);
        if conn.direct {
            // Unpipelined, the BEGIN is answered before the first statement is sent.
            conn.settle();
        }
        let (stands, failed) = apply_group(conn, batch, clock, isolation, conflicts_refuse);
        if stands && failed.is_none() && conn.may_commit_behind() {
            // Every write sent fails on the server should it not stand: the COMMIT goes
            // behind them, and one wait answers all.
            match conn.commit_behind() {
                Behind::Committed => return Attempt::Committed,
                Behind::Failed(err) => {
                    return match commit_failure(err) {
                        CommitError::Again(err) => Attempt::Again(err.to_string()),
                        CommitError::Failed(failure) => Attempt::Failed(failure),
                    };
                }
                Behind::Unknown => {
                    let why = "a write was refused without failing, and the COMMIT was answered";
                    return Attempt::Failed(GroupFailure::Unknown(why.into()));
                }
                Behind::RolledBack => match take_noted() {
                    noted @ (Noted::Broken | Noted::Conflict | Noted::KeyTaken) => {
                        return Attempt::Again(format!("{noted:?} while applying the group"));
                    }
                    // A write was refused: each move in a savepoint of its own now, every
                    // statement answered at once.
                    Noted::Nothing => {
                        isolation = Isolation::Savepoint;
                        conn.direct = true;
                        continue;
                    }
                },
            }
        }
        // Every write sent is answered: a failed or refused one spoils the transaction.
        let settled = conn.settle();
        let noted = take_noted();
        let attempt = match (noted, failed) {
            (Noted::Broken | Noted::Conflict | Noted::KeyTaken, _) => Some(Attempt::Again(
                format!("{noted:?} while applying the group"),
            )),
            // A pipelined write was refused (any statement after it fails saying only that),
            // or a move was: each move in a savepoint of its own now, every statement
            // answered at once.
            (Noted::Nothing, ref failed) if !settled || (failed.is_none() && !stands) => {
                if isolation == Isolation::Savepoint {
                    // Statement by statement already: the BEGIN itself failed.
                    roll_back(conn);
                    return Attempt::Again("the transaction could not begin".into());
                }
                if !roll_back(conn) {
                    return Attempt::Again("the connection broke while rolling back".into());
                }
                isolation = Isolation::Savepoint;
                conn.direct = true;
                continue;
            }
            (Noted::Nothing, Some(err)) => Some(Attempt::Failed(GroupFailure::of(&err))),
            (Noted::Nothing, None) => None,
        };
        if let Some(attempt) = attempt {
            roll_back(conn);
            return attempt;
        }
        if !conn.stands() {
            roll_back(conn);
            return Attempt::Again("a write of the group was not answered as expected".into());
        }
        return match conn.finish("COMMIT") {
            Ok(()) => Attempt::Committed,
            Err(err) => match commit_failure(err) {
                CommitError::Again(err) => Attempt::Again(err.to_string()),
                CommitError::Failed(failure) => Attempt::Failed(failure),
            },
        };
    }
}

/// Groups of at most this many moves run on plans made once per statement: the groups of a
/// process with up to a few dozen runs at once. Planning each such group's statements for its
/// own values cost more than running them, and hashing a growing table is slower than a few
/// dozen index lookups; a process with hundreds of runs makes groups of hundreds, where
/// hashing pays.
const SMALL_GROUP: usize = 64;

/// How the server plans a group's statements. A lane sends the same few statements, each with
/// arrays of the group's rows. Planned anew for each group's values, the statements of a small
/// group cost the server more to plan than to run, so a small group's run on one plan per
/// statement, made once: index lookups in nested loops, which suit a few rows whatever the
/// tables' statistics say (a new table has none, and a plan made from none would scan and
/// hash it, at a cost growing with the table for as long as the plan is kept). A large group
/// is planned as the server chooses, for its own rows, where hashing them may pay. The two are
/// prepared apart (see [`PipeConn::small_groups`]).
fn plans_for(small: bool) -> &'static str {
    if small {
        " SET LOCAL plan_cache_mode = force_generic_plan; SET LOCAL enable_seqscan = off; \
         SET LOCAL enable_hashjoin = off; SET LOCAL enable_mergejoin = off;"
    } else {
        ""
    }
}

/// Applies every move of `batch` in the open transaction: whether all stand, and the error of
/// a statement that failed outside any move (a savepoint's). With `conflicts_refuse`, a key
/// found taken inside a move in a savepoint of its own is that move's refusal only.
fn apply_group(
    conn: &mut PipeConn,
    batch: &mut [Box<dyn Pending>],
    clock: &dyn Clock,
    isolation: Isolation,
    conflicts_refuse: bool,
) -> (bool, Option<Error>) {
    let pipelined = conn.pipelines();
    let mut pg = PgTx::new(conn, true).conflicts_refuse(conflicts_refuse);
    match isolation {
        Isolation::Shared => {
            if pipelined {
                let mut runs: Vec<String> = batch
                    .iter()
                    .flat_map(|pending| pending.infos())
                    .map(|info| info.run_id.as_str().to_owned())
                    .collect();
                // A child run (`PARENT/STEP`) that finishes writes its parent's rows: the
                // parent's row is locked with the group's, before the child's as its id sorts
                // first, the order a cancel of the parent takes them in too.
                let parents: Vec<String> = runs
                    .iter()
                    .filter_map(|id| id.rsplit_once('/').map(|(parent, _)| parent.to_owned()))
                    .collect();
                runs.extend(parents);
                runs.sort();
                runs.dedup();
                let locked = if steady(batch) {
                    pg.lock_group_behind(runs)
                } else {
                    pg.lock_group(runs)
                };
                if locked.is_err() {
                    // Applied again move by move, where such an error refuses one move only
                    // (a conflict or a broken connection is noted: the group is tried again).
                    return (false, None);
                }
            }
            let stands = batch
                .iter_mut()
                .all(|pending| pending.apply(&mut pg, clock, Isolation::Shared));
            if let Err(err) = pg.send_held() {
                return (false, Some(err));
            }
            (stands, None)
        }
        Isolation::Savepoint => {
            for pending in batch.iter_mut() {
                let step = (|| {
                    pg.savepoint("agentrt_move")?;
                    if !pending.apply(&mut pg, clock, Isolation::Savepoint) {
                        pg.rollback_to("agentrt_move")?;
                    }
                    pg.release_savepoint("agentrt_move")
                })();
                if let Err(err) = step {
                    return (false, Some(err));
                }
            }
            (true, None)
        }
    }
}

/// Whether every move of `batch` is one of a loop's steps under its lease: such moves need
/// neither the clock nor to know which runs exist, so their group's lock is sent without
/// waiting for it and, with nothing else to read, the group usually costs one round trip. A
/// group with any other move (one that takes a lease or makes a run, an operator's) waits for
/// its lock, which reads both at once.
fn steady(batch: &[Box<dyn Pending>]) -> bool {
    batch
        .iter()
        .flat_map(|pending| pending.infos())
        .all(|info| {
            matches!(
                info.kind,
                MoveKind::BeginModelStep
                    | MoveKind::FinishModelStep
                    | MoveKind::FailModelAttempt
                    | MoveKind::BeginModelAttempt
                    | MoveKind::DecideTool
                    | MoveKind::RejectTool
                    | MoveKind::FinishTool
                    | MoveKind::RecordProgress
                    | MoveKind::TimeOutTool
                    | MoveKind::FailRun
            )
        })
}

/// Rolls the open transaction back; a connection that cannot is not trusted with another.
fn roll_back(conn: &mut PipeConn) -> bool {
    match conn.finish("ROLLBACK") {
        Ok(()) => true,
        Err(err) => {
            tracing::debug!(%err, "a writer connection could not roll back; it is closed");
            conn.discard();
            false
        }
    }
}

/// What a failed COMMIT means.
enum CommitError {
    /// The server refused it and rolled it back (a serialization failure, a deferred
    /// constraint): applying it again may succeed.
    Again(Error),
    Failed(GroupFailure),
}

/// A COMMIT that failed: rolled back only when the server says so with an error of a class
/// that rolls back (40: transaction rollback; 23: a deferred constraint); any other error, a
/// broken connection or a server shutting down among them, leaves it unknown whether the
/// commit reached the disk.
fn commit_failure(err: postgres::Error) -> CommitError {
    let class = err.code().map(|code| code.code()[..2].to_owned());
    let err = super::conn::pg_error(err);
    take_noted();
    match class.as_deref() {
        Some("40") => CommitError::Again(err),
        Some("23") => CommitError::Failed(GroupFailure::of(&err)),
        _ => CommitError::Failed(GroupFailure::Unknown(err.to_string())),
    }
}

/// The lease keeper's connection.
struct PgRenewer {
    store: Arc<Postgres>,
    conn: Option<Conn>,
}

impl Renewer for PgRenewer {
    fn renew(
        &mut self,
        owner: &str,
        held: &[(RunId, u64)],
        ttl: Duration,
        patience: Duration,
    ) -> Result<Renewal> {
        let timeout = format!(
            "SET LOCAL statement_timeout = {0}; SET LOCAL lock_timeout = {0}",
            patience.as_millis().max(1)
        );
        let (store, conn) = (&self.store, &mut self.conn);
        // A tick gives up after its patience, tries and reconnections included, so that it
        // cannot outlive the leases it renews.
        let deadline = Instant::now() + patience;
        // The lease keeper ticks on an actix arbiter.
        off_runtime(|| {
            let mut renewal = None;
            let clock = &crate::clock::SystemClock;
            store.transact_on(conn, clock, false, Some(deadline), &mut |pg, _| {
                pg.link.batch(&timeout)?;
                renewal = Some(moves::renew(pg, owner, held, ttl)?);
                Ok(())
            })?;
            renewal.ok_or_else(|| Error::CommitFailed("the renewal was not applied".into()))
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::json;

    use super::*;
    use crate::store::{
        backend::{Durability, Router},
        model::{Grant, Holder},
        moves::{CreateRun, Leased},
        queue,
    };

    #[test]
    fn a_move_routed_to_a_lane_whose_thread_is_gone_is_answered_that_nothing_was_committed() {
        let (lane, gone) = mpsc::channel();
        drop(gone);
        let grant = Grant::new(Holder {
            owner: "me/000000000001".into(),
            ttl: Duration::from_secs(30),
            margin: Duration::from_secs(10),
        });
        let create = CreateRun {
            by: Leased::new(&RunId::from("r1"), &grant),
            agent: "a".into(),
            input: json!({}),
            trace: None,
        };
        let (pending, mut answer) = queue::pending(create, Durability::Durable);
        Lanes::new(vec![lane], 1).route(pending);
        let answered = answer
            .try_recv()
            .expect("answered at once, on the caller's thread");
        assert!(
            matches!(answered, Err(Error::CommitFailed(_))),
            "{answered:?}"
        );
    }
}
