//! A subscriber that keeps every `RunSettled` a supervisor sends it, shared by the tests of
//! background runs and recovery.

use std::time::Duration;

use actix::{Actor, Addr, Context, Handler, Message};
use agentrt::{RunSettled, SubscribeRuns, Supervisor};
use tokio::sync::watch;

/// Keeps every `RunSettled` it is sent.
pub struct Settled(watch::Sender<Vec<RunSettled>>);

impl Actor for Settled {
    type Context = Context<Self>;
}

impl Handler<RunSettled> for Settled {
    type Result = ();

    fn handle(&mut self, msg: RunSettled, _: &mut Context<Self>) {
        self.0.send_modify(|seen| seen.push(msg));
    }
}

/// What a [`Settled`] has heard, once it has handled every message sent to it before.
#[derive(Message)]
#[rtype(result = "Vec<RunSettled>")]
pub struct Heard;

impl Handler<Heard> for Settled {
    type Result = Vec<RunSettled>;

    fn handle(&mut self, _: Heard, _: &mut Context<Self>) -> Vec<RunSettled> {
        self.0.borrow().clone()
    }
}

/// A subscriber, and a way to wait for what it hears.
pub fn subscriber() -> (Addr<Settled>, watch::Receiver<Vec<RunSettled>>) {
    let (tx, rx) = watch::channel(Vec::new());
    (Settled(tx).start(), rx)
}

/// Waits until `count` settlements were heard; a settlement that never comes fails the test,
/// rather than hang it.
#[allow(dead_code)]
pub async fn heard(rx: &mut watch::Receiver<Vec<RunSettled>>, count: usize) -> Vec<RunSettled> {
    let heard = actix_rt::time::timeout(
        Duration::from_secs(60),
        rx.wait_for(|seen| seen.len() >= count),
    );
    heard.await.expect("settled in time").unwrap().clone()
}

/// A subscriber of `supervisor`'s settlements (see [`subscriber`]), once subscribed.
pub async fn subscribed(
    supervisor: &Addr<Supervisor>,
) -> (Addr<Settled>, watch::Receiver<Vec<RunSettled>>) {
    let (settled, rx) = subscriber();
    supervisor
        .send(SubscribeRuns(settled.clone().recipient()))
        .await
        .unwrap();
    (settled, rx)
}
