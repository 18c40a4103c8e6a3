//! `LeaseKeeper`: renews the leases of the runs its supervisor executes, every `lease_ttl / 3`,
//! moves each run's deadline (its [`Grant`]) on at each renewal, and tells the run's actor and
//! every subscriber when one is lost.
//!
//! It lives on an arbiter (thread) of its own, because on a file store it renews through a
//! blocking connection of its own: a consumer holding the store's other connections, or a busy
//! writer, cannot starve it.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use super::store::{RenewLeases, StoreActor};
use crate::{
    error::{Error, Result},
    metrics,
    store::{
        backend,
        model::{Grant, LeaseRow, Renewal},
    },
    types::{LeaseLostReason, RunId, RunState},
};
use actix::{
    Actor, ActorFutureExt, Addr, AsyncContext, Context, Handler, Message, MessageResult, Recipient,
    WrapFuture,
};

/// A supervisor lost the lease of a run it was executing: sent to the run's actor and to every
/// subscriber ([`SubscribeLeaseLost`](crate::SubscribeLeaseLost)). JSON:
/// `{"run_id": "r1", "owner": "billing/0a1b2c3d4e5f", "reason": {"kind": "expired"}}`.
#[derive(Debug, Clone, PartialEq, Eq, Message, serde::Serialize, serde::Deserialize)]
#[rtype(result = "()")]
pub struct LeaseLost {
    /// The run.
    pub run_id: RunId,
    /// The owner that lost it (this supervisor's).
    pub owner: String,
    /// Why.
    pub reason: LeaseLostReason,
}

/// How renewals reach the database.
pub(crate) enum Renewer {
    /// A connection of the keeper's own (an SQLite file, say).
    Own(Box<dyn backend::Renewer>),
    /// Through the store actor's writer, where the backend has no second connection (SQLite's
    /// `:memory:`, whose one connection is the whole database).
    Store(Addr<StoreActor>),
}

struct Held {
    /// The run's token and deadline, moved on at each renewal: the loop judges its lease by it.
    grant: Grant,
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
    /// The reason each loss was told with, until the call that lost it returns: the call ends
    /// with the same one (see [`Lost`]).
    told: HashMap<RunId, LeaseLostReason>,
}

impl LeaseKeeper {
    pub(crate) fn new(owner: Arc<str>, ttl: Duration, renewer: Renewer) -> Self {
        LeaseKeeper {
            owner,
            ttl,
            renewer,
            held: HashMap::new(),
            subscribers: Vec::new(),
            renewing: false,
            told: HashMap::new(),
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
        let held: Vec<(RunId, u64)> = self
            .held
            .iter()
            .map(|(run_id, held)| (run_id.clone(), held.grant.token()))
            .collect();
        // Read before the renewal is sent: the deadline it gives is no later than the expiry
        // it writes, which is read from the wall clock after.
        let sent = Instant::now();
        match &mut self.renewer {
            Renewer::Own(renewer) => {
                // A busy database is waited for at most one period, so a stalled tick cannot
                // outlive the lease it renews.
                let patience = Self::period(self.ttl);
                let renewal = renewer.renew(&self.owner, &held, self.ttl, patience);
                self.settle(renewal, &held, sent);
            }
            Renewer::Store(store) => {
                self.renewing = true;
                let renew = store.send(RenewLeases {
                    owner: self.owner.clone(),
                    held: held.clone(),
                    ttl: self.ttl,
                });
                ctx.spawn(renew.into_actor(self).map(move |renewal, this, _| {
                    this.renewing = false;
                    let renewal = renewal.unwrap_or(Err(Error::StoreUnavailable));
                    this.settle(renewal, &held, sent);
                }));
            }
        }
    }

    /// Acts on a renewal of `sent_for` (each run with its token) sent at `sent`: new deadlines
    /// for the runs renewed, `LeaseLost` for the runs lost. A run held under another token
    /// since (its call returned and another acquired it while the renewal was on its way) is
    /// not this renewal's.
    fn settle(&mut self, renewal: Result<Renewal>, sent_for: &[(RunId, u64)], sent: Instant) {
        let sent_for: HashMap<&RunId, u64> = sent_for.iter().map(|(id, t)| (id, *t)).collect();
        let still = |held: &Held, run_id: &RunId| sent_for.get(run_id) == Some(&held.grant.token());
        match renewal {
            Ok(Renewal {
                renewed, missing, ..
            }) => {
                metrics::leases_renewed(renewed.len());
                for run_id in renewed {
                    if let Some(held) = self.held.get(&run_id)
                        && still(held, &run_id)
                    {
                        held.grant.renewed(sent);
                    }
                }
                for (run_id, row) in missing {
                    let Some(held) = self.held.get(&run_id) else {
                        continue;
                    };
                    if !still(held, &run_id) {
                        continue;
                    }
                    match self.why_lost(held, row) {
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
                    .filter(|(_, held)| held.grant.remaining().is_zero())
                    .map(|(id, _)| id.clone())
                    .collect();
                for run_id in expired {
                    self.lost(run_id, LeaseLostReason::Expired);
                }
            }
        }
    }

    /// Why a lease that was not renewed is lost, from its row: another acquisition since
    /// (another token, whoever holds it now), another owner, a cancel, or, still this call's
    /// and RUNNING, a stored expiry that passed by the wall clock (stepped forward, or the host
    /// suspended). `None` when the call itself released it (it paused, finished or returned).
    fn why_lost(&self, held: &Held, row: Option<LeaseRow>) -> Option<LeaseLostReason> {
        let row = match row {
            None => return Some(LeaseLostReason::ReleasedOrCancelled),
            Some(row) => row,
        };
        match (row.owner, row.state) {
            (Some(owner), _) if *owner != *self.owner || row.epoch != held.grant.token() => {
                Some(LeaseLostReason::TakenBy(owner))
            }
            (None, _) if row.epoch != held.grant.token() => {
                Some(LeaseLostReason::ReleasedOrCancelled)
            }
            (_, RunState::Cancelled) => Some(LeaseLostReason::ReleasedOrCancelled),
            (Some(_), RunState::Running) => Some(LeaseLostReason::Expired),
            _ => None,
        }
    }

    fn lost(&mut self, run_id: RunId, reason: LeaseLostReason) {
        let Some(held) = self.held.remove(&run_id) else {
            return;
        };
        let lost = self.tell(run_id, held.grant.token(), reason);
        held.recipient.do_send(lost);
    }

    /// Tells the subscribers of a loss, once per call, and remembers the reason for the call.
    fn tell(&mut self, run_id: RunId, token: u64, reason: LeaseLostReason) -> LeaseLost {
        tracing::warn!(%run_id, owner = %self.owner, fencing_token = token, %reason, "lease lost");
        metrics::lease_lost(&reason);
        self.told.insert(run_id.clone(), reason.clone());
        let lost = LeaseLost {
            run_id,
            owner: self.owner.to_string(),
            reason,
        };
        self.subscribers.retain(|subscriber| subscriber.connected());
        for subscriber in &self.subscribers {
            subscriber.do_send(lost.clone());
        }
        lost
    }
}

impl Actor for LeaseKeeper {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(Self::period(self.ttl), |this, ctx| this.tick(ctx));
    }
}

/// Keep renewing this run's lease (just acquired by `grant`), moving the grant's deadline on,
/// and tell `recipient` if it is lost.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Hold {
    pub run_id: RunId,
    pub grant: Grant,
    pub recipient: Recipient<LeaseLost>,
}

impl Handler<Hold> for LeaseKeeper {
    type Result = ();

    fn handle(&mut self, msg: Hold, _: &mut Context<Self>) {
        self.held.insert(
            msg.run_id,
            Held {
                grant: msg.grant,
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
        self.told.remove(&msg.run_id);
    }
}

/// A call found its run's lease lost (a move of its loop was refused): the keeper tells the
/// subscribers, unless it told them already, and answers with the reason they were told, which
/// is the one the call ends with. Whichever finds the loss first names its reason for both.
#[derive(Message)]
#[rtype(result = "LeaseLostReason")]
pub(crate) struct Lost {
    pub run_id: RunId,
    /// The fencing token of the lease the call held.
    pub token: u64,
    pub reason: LeaseLostReason,
}

impl Handler<Lost> for LeaseKeeper {
    type Result = MessageResult<Lost>;

    fn handle(&mut self, msg: Lost, _: &mut Context<Self>) -> Self::Result {
        if let Some(told) = self.told.get(&msg.run_id) {
            return MessageResult(told.clone());
        }
        // Held or not (a renewal may have dropped a run it found moved by another owner
        // without naming a loss), the subscribers hear of it now.
        self.held.remove(&msg.run_id);
        self.tell(msg.run_id, msg.token, msg.reason.clone());
        MessageResult(msg.reason)
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
