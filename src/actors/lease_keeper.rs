//! `LeaseKeeper`: renews the leases of the runs its supervisor executes, every `lease_ttl / 3`
//! on the wall clock, and tells the run's actor and every subscriber when one is lost.
//!
//! It lives on an arbiter (thread) of its own, because on a file store it renews through a
//! blocking connection of its own: a consumer holding the store's other connections, or a busy
//! writer, cannot starve it.

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use actix::{
    Actor, ActorFutureExt, Addr, AsyncContext, Context, Handler, Message, MessageResult, Recipient,
    WrapFuture,
};
use rusqlite::Connection;

use super::store::{RenewLeases, StoreActor};
use crate::{
    error::{Error, Result},
    store::{
        sql::{self, LeaseRow, Renewal},
        wall_millis,
    },
    types::{LeaseLostReason, RunId, RunState},
};

/// A supervisor lost the lease of a run it was executing: sent to the run's actor and to every
/// subscriber ([`SubscribeLeaseLost`](crate::SubscribeLeaseLost)).
#[derive(Debug, Clone, PartialEq, Eq, Message)]
#[rtype(result = "()")]
pub struct LeaseLost {
    /// The run.
    pub run_id: RunId,
    /// The owner that lost it (this supervisor's).
    pub owner: String,
    /// Why.
    pub reason: LeaseLostReason,
}

/// Set while the keeper waits for the write lock to renew: the supervisor's store actor holds
/// back its next commit meanwhile, since back-to-back commits would otherwise leave the lock
/// free for too short a time for the renewal to ever get it.
#[derive(Clone, Default)]
pub(crate) struct RenewalPending(Arc<AtomicBool>);

impl RenewalPending {
    fn announce(&self, pending: bool) {
        self.0.store(pending, Ordering::SeqCst);
    }

    /// Called by the store actor before a commit: waits (briefly) for a pending renewal.
    pub(crate) fn yield_to_renewal(&self) {
        let deadline = Instant::now() + Duration::from_millis(20);
        while self.0.load(Ordering::SeqCst) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

/// One renewal on the keeper's own connection, which waits for no lock: this retries in short
/// naps until one period has passed, while `pending` holds back the store actor's next commit.
fn renew_on(
    conn: &Connection,
    owner: &str,
    held: &[RunId],
    ttl: Duration,
    pending: &RenewalPending,
) -> Result<Renewal> {
    pending.announce(true);
    let deadline = Instant::now() + LeaseKeeper::period(ttl);
    let renewal = loop {
        match sql::renew(conn, owner, held, ttl) {
            Err(err) if err.is_busy() && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_micros(200))
            }
            other => break other,
        }
    };
    pending.announce(false);
    renewal
}

/// How renewals reach the database.
pub(crate) enum Renewer {
    /// A file store: a connection of the keeper's own.
    Connection(Connection),
    /// `:memory:`: the store actor's connection, which is the whole database.
    Store(Addr<StoreActor>),
}

struct Held {
    /// The expiry as last stamped or renewed (wall-clock milliseconds).
    expires_at: i64,
    recipient: Recipient<LeaseLost>,
}

/// Keeps one supervisor's leases alive.
pub(crate) struct LeaseKeeper {
    owner: Arc<str>,
    ttl: Duration,
    renewer: Renewer,
    held: HashMap<RunId, Held>,
    subscribers: Vec<Recipient<LeaseLost>>,
    /// A renewal through the store actor is on its way: the next tick waits for it.
    renewing: bool,
    /// Tells this supervisor's store actor that a renewal waits for the write lock.
    pending: RenewalPending,
}

impl LeaseKeeper {
    pub(crate) fn new(
        owner: Arc<str>,
        ttl: Duration,
        renewer: Renewer,
        pending: RenewalPending,
    ) -> Self {
        LeaseKeeper {
            owner,
            ttl,
            renewer,
            held: HashMap::new(),
            subscribers: Vec::new(),
            renewing: false,
            pending,
        }
    }

    /// How often it renews: a third of the TTL, so that two renewals can fail before a lease
    /// expires.
    pub(crate) fn period(ttl: Duration) -> Duration {
        (ttl / 3).max(Duration::from_millis(1))
    }

    fn tick(&mut self, ctx: &mut Context<Self>) {
        if self.held.is_empty() || self.renewing {
            return;
        }
        let held: Vec<RunId> = self.held.keys().cloned().collect();
        match &self.renewer {
            Renewer::Connection(conn) => {
                // The connection waits for no lock: this loop does, in short naps, while the
                // store actor of this supervisor holds back its next commit (see
                // `RenewalPending`), so a busy writer cannot starve the renewal.
                let renewal = renew_on(conn, &self.owner, &held, self.ttl, &self.pending);
                self.settle(renewal);
            }
            Renewer::Store(store) => {
                self.renewing = true;
                let renew = store.send(RenewLeases {
                    owner: self.owner.clone(),
                    held,
                    ttl: self.ttl,
                });
                ctx.spawn(renew.into_actor(self).map(|renewal, this, _| {
                    this.renewing = false;
                    this.settle(renewal.unwrap_or(Err(Error::StoreUnavailable)));
                }));
            }
        }
    }

    /// Acts on a renewal: new expiries for the runs renewed, `LeaseLost` for the runs lost.
    fn settle(&mut self, renewal: Result<Renewal>) {
        let wall = wall_millis();
        match renewal {
            Ok(Renewal {
                expires_at,
                renewed,
                missing,
            }) => {
                for run_id in renewed {
                    if let Some(held) = self.held.get_mut(&run_id) {
                        held.expires_at = expires_at;
                    }
                }
                for (run_id, row) in missing {
                    let Some(held) = self.held.get(&run_id) else {
                        continue;
                    };
                    match self.why_lost(held, row, wall) {
                        Some(reason) => self.lost(run_id, reason),
                        // Released by its own call, which is returning: not a loss.
                        None => {
                            self.held.remove(&run_id);
                        }
                    }
                }
            }
            Err(err) => {
                tracing::warn!(%err, "lease renewal failed; retrying at the next tick");
                let expired: Vec<RunId> = self
                    .held
                    .iter()
                    .filter(|(_, held)| held.expires_at <= wall)
                    .map(|(id, _)| id.clone())
                    .collect();
                for run_id in expired {
                    self.lost(run_id, LeaseLostReason::Expired);
                }
            }
        }
    }

    fn why_lost(&self, held: &Held, row: Option<LeaseRow>, wall: i64) -> Option<LeaseLostReason> {
        if held.expires_at <= wall {
            return Some(LeaseLostReason::Expired);
        }
        match row {
            None => Some(LeaseLostReason::ReleasedOrCancelled),
            Some(LeaseRow {
                owner: Some(owner), ..
            }) if *owner != *self.owner => Some(LeaseLostReason::TakenBy(owner)),
            Some(LeaseRow {
                state: RunState::Cancelled,
                ..
            }) => Some(LeaseLostReason::ReleasedOrCancelled),
            Some(_) => None,
        }
    }

    fn lost(&mut self, run_id: RunId, reason: LeaseLostReason) {
        let Some(held) = self.held.remove(&run_id) else {
            return;
        };
        tracing::warn!(%run_id, %reason, "lease lost");
        let lost = LeaseLost {
            run_id,
            owner: self.owner.to_string(),
            reason,
        };
        held.recipient.do_send(lost.clone());
        self.subscribers.retain(|subscriber| subscriber.connected());
        for subscriber in &self.subscribers {
            subscriber.do_send(lost.clone());
        }
    }
}

impl Actor for LeaseKeeper {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(Self::period(self.ttl), |this, ctx| this.tick(ctx));
    }
}

/// Keep renewing this run's lease (just stamped, until `expires_at`) and tell `recipient` if it
/// is lost.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Hold {
    pub run_id: RunId,
    pub expires_at: i64,
    pub recipient: Recipient<LeaseLost>,
}

impl Handler<Hold> for LeaseKeeper {
    type Result = ();

    fn handle(&mut self, msg: Hold, _: &mut Context<Self>) {
        self.held.insert(
            msg.run_id,
            Held {
                expires_at: msg.expires_at,
                recipient: msg.recipient,
            },
        );
    }
}

/// Stop renewing this run's lease: the call executing it returned.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Release {
    pub run_id: RunId,
}

impl Handler<Release> for LeaseKeeper {
    type Result = ();

    fn handle(&mut self, msg: Release, _: &mut Context<Self>) {
        self.held.remove(&msg.run_id);
    }
}

/// Subscribes a recipient to every `LeaseLost` of a supervisor. Send it to the
/// [`Supervisor`](crate::Supervisor).
#[derive(Message)]
#[rtype(result = "()")]
pub struct SubscribeLeaseLost(pub Recipient<LeaseLost>);

impl Handler<SubscribeLeaseLost> for LeaseKeeper {
    type Result = ();

    fn handle(&mut self, msg: SubscribeLeaseLost, _: &mut Context<Self>) {
        self.subscribers.push(msg.0);
    }
}

/// The runs whose leases a supervisor renews now. Send it to the
/// [`Supervisor`](crate::Supervisor).
#[derive(Debug, Clone, Copy, Default, Message)]
#[rtype(result = "Vec<RunId>")]
pub struct HeldLeases;

impl Handler<HeldLeases> for LeaseKeeper {
    type Result = MessageResult<HeldLeases>;

    fn handle(&mut self, _: HeldLeases, _: &mut Context<Self>) -> Self::Result {
        let mut held: Vec<RunId> = self.held.keys().cloned().collect();
        held.sort();
        MessageResult(held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{clock::SystemClock, store::Store};

    #[test]
    fn a_renewal_gets_the_write_lock_from_a_writer_committing_back_to_back() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("db.sqlite")).unwrap();
        let holder = sql::Holder {
            owner: "me/000000000001".into(),
            ttl: Duration::from_millis(300),
        };
        let run_id = RunId::from("r");
        store
            .transact(&SystemClock, |tx, now| {
                sql::create_run(tx, now, &run_id, "a", &serde_json::json!({}), &holder)
            })
            .unwrap();

        // A writer that commits back to back, yielding only as the store actor does.
        let pending = RenewalPending::default();
        let (writer, yielding) = (store.clone(), pending.clone());
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let busy = std::thread::spawn(move || {
            while !stopped.load(Ordering::SeqCst) {
                yielding.yield_to_renewal();
                writer
                    .transact(&SystemClock, |tx, _| {
                        Ok(tx.execute("UPDATE runs SET updated_at = updated_at + 1", [])?)
                    })
                    .unwrap();
            }
        });
        let conn = store.renewal_connection(Duration::ZERO).unwrap().unwrap();
        for _ in 0..20 {
            let renewal = renew_on(
                &conn,
                &holder.owner,
                std::slice::from_ref(&run_id),
                holder.ttl,
                &pending,
            )
            .unwrap();
            assert_eq!(renewal.renewed, std::slice::from_ref(&run_id));
        }
        stop.store(true, Ordering::SeqCst);
        busy.join().unwrap();
    }
}
