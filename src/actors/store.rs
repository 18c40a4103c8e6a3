//! `StoreActor`: the only writer. A sync actor on its own thread that applies each move in one
//! `BEGIN IMMEDIATE` transaction, so nothing blocking runs on the arbiters that host runs.

use std::{sync::Arc, time::Duration};

use actix::{Actor, Addr, Handler, Message, SyncArbiter, SyncContext};
use rusqlite::{Connection, Transaction};

use crate::{
    clock::Clock,
    error::Result,
    store::{
        Now, Store,
        sql::{self, Renewal},
    },
    types::RunId,
};

type ApplyFn<R> = Box<dyn FnOnce(&Transaction<'_>, &mut Now<'_>) -> Result<R> + Send>;
type ReadFn<R> = Box<dyn FnOnce(&Connection) -> Result<R> + Send>;

/// A move the store actor is about to apply, or has committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoveInfo {
    /// What the move does (`"create_run"`, `"finish_tool"`, `"record_approval"`, ...).
    pub name: &'static str,
    /// The run it moves.
    pub run_id: RunId,
}

/// Watches the moves of a supervisor's store actor ([`Config::observer`]), on the store
/// actor's thread: for metrics, tracing, or telling listeners that a run has new events.
///
/// Both calls run on the thread that owns the write connection, between moves, with no
/// transaction open: a slow observer delays every move of the supervisor.
///
/// [`Config::observer`]: crate::Config::observer
pub trait MoveObserver: Send + Sync + 'static {
    /// The move is about to be applied: nothing of it is written yet.
    fn before_apply(&self, info: &MoveInfo) {
        let _ = info;
    }

    /// The move committed; its caller has not been answered yet.
    fn after_commit(&self, info: &MoveInfo) {
        let _ = info;
    }
}

/// Owns the write side of a [`Store`] for one supervisor.
pub(crate) struct StoreActor {
    store: Store,
    clock: Arc<dyn Clock>,
    observer: Option<Arc<dyn MoveObserver>>,
}

impl StoreActor {
    /// Starts the actor on a thread of its own.
    pub(crate) fn start(
        store: Store,
        clock: Arc<dyn Clock>,
        observer: Option<Arc<dyn MoveObserver>>,
    ) -> Addr<StoreActor> {
        // The factory runs again if the actor stops; it only clones handles, so a restart
        // yields the same actor on the same connection.
        SyncArbiter::start(1, move || StoreActor {
            store: store.clone(),
            clock: clock.clone(),
            observer: observer.clone(),
        })
    }
}

impl Actor for StoreActor {
    type Context = SyncContext<Self>;
}

/// One state move: `apply` runs inside its own transaction, committed only if it succeeds.
pub(crate) struct ApplyMove<R> {
    info: MoveInfo,
    apply: ApplyFn<R>,
}

impl<R> ApplyMove<R> {
    /// A move named `name` of run `run_id`, that `apply` carries out.
    pub(crate) fn new(
        name: &'static str,
        run_id: &RunId,
        apply: impl FnOnce(&Transaction<'_>, &mut Now<'_>) -> Result<R> + Send + 'static,
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

impl<R: Send + 'static> Message for ApplyMove<R> {
    type Result = Result<R>;
}

impl<R: Send + 'static> Handler<ApplyMove<R>> for StoreActor {
    type Result = Result<R>;

    fn handle(&mut self, msg: ApplyMove<R>, _: &mut SyncContext<Self>) -> Result<R> {
        if let Some(observer) = &self.observer {
            observer.before_apply(&msg.info);
        }
        let result = self.store.transact(&*self.clock, msg.apply);
        match (&result, &self.observer) {
            (Ok(_), Some(observer)) => observer.after_commit(&msg.info),
            (Err(err), _) => {
                tracing::debug!(r#move = msg.info.name, run_id = %msg.info.run_id, %err, "move refused")
            }
            (Ok(_), None) => {}
        }
        result
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
        self.store.read(msg.read)
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
        self.store
            .read(|conn| sql::release(conn, &msg.run_id, &msg.owner))
    }
}
