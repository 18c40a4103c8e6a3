//! `RunActor`: executes one run's loop, from the call that started or resumed it until that call
//! returns. Every move goes to the store's writer before and after each side effect.
//!
//! The loop ([`run_loop`]) plans the next move and commits it; each kind of step has a file of
//! its own: [`start`] (the first move of a call), [`model`], [`tool`], [`decision`] (resuming a
//! decision), [`reconcile`], [`handover`] (a drain's release); [`lease`] holds the waits for
//! the lease's start margin, and [`outcome`] how a call ends. The loop's state is private to [`run_loop`]: a step sees the
//! run through its methods (the run's id and agent, the lease, the cancellation signal, the
//! store, the model's request), and changes it only by committing moves and folding them in.

mod decision;
mod handover;
mod lease;
mod model;
mod outcome;
mod reconcile;
mod run_loop;
mod start;
mod tool;
mod wait;

use std::{
    any::Any, cell::RefCell, collections::BTreeMap, panic::AssertUnwindSafe, rc::Rc, sync::Arc,
};

use actix::{
    Actor, ActorContext, ActorFutureExt, Addr, AsyncContext, Context, Handler, Message,
    ResponseActFuture, WrapFuture,
};
use futures_util::FutureExt;
use serde_json::Value;
use tracing::Instrument;

use self::run_loop::{Env, RunLoop};
use super::{
    lease_keeper::{LeaseKeeper, LeaseLost, Lost, Release},
    store::{ReleaseLease, StoreActor, StoreHandle},
};
use crate::{
    agent::{Agent, Cancellation},
    error::{Error, Result},
    metrics,
    store::model::{Grant, Holder},
    types::{LeaseLostReason, RunId, RunReply},
};

/// The registry a supervisor hands to its runs: agent name to agent.
pub(crate) type Agents = Arc<BTreeMap<String, Arc<Agent>>>;

/// Executes one run; stops when the call it serves returns.
pub(crate) struct RunActor {
    cancellation: Cancellation,
    /// Set when the lease keeper reports this run's lease lost.
    lease_lost: Rc<RefCell<Option<LeaseLostReason>>>,
}

impl RunActor {
    pub(crate) fn new(cancellation: Cancellation) -> Self {
        RunActor {
            cancellation,
            lease_lost: Rc::default(),
        }
    }
}

impl Actor for RunActor {
    type Context = Context<Self>;
}

impl Handler<LeaseLost> for RunActor {
    type Result = ();

    /// The loop stops before its next side effect; the tool running now is told through its
    /// cancellation signal (its outcome is written only if the lease is still held).
    fn handle(&mut self, msg: LeaseLost, _: &mut Context<Self>) {
        *self.lease_lost.borrow_mut() = Some(msg.reason);
        self.cancellation.fire();
    }
}

/// What the call asks of the run.
pub(crate) enum Job {
    /// Insert the run, then execute it. `started`, when given, hears once the insert is
    /// durable: the insert then commits alone and synced, where a call that waits for the
    /// end commits it with the first model reservation.
    Start {
        agent: String,
        input: Value,
        started: Option<tokio::sync::oneshot::Sender<()>>,
    },
    /// Continue a run that waits for approval, or whose executor died.
    Resume,
    /// Execute a run inserted to wait for a slot, now that its turn came: as a resume, except
    /// that a run cancelled while it waited ends the call cancelled (its start's outcome),
    /// not refused.
    Turn,
}

/// Execute the run; `done` hears the call's outcome.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Execute {
    /// Told the call's outcome when the run's actor is done with it.
    pub done: Done,
    pub run_id: RunId,
    pub job: Job,
    pub agents: Agents,
    pub store: StoreHandle,
    pub keeper: Addr<LeaseKeeper>,
    pub holder: Holder,
    /// The supervisor's drain signals.
    pub draining: DrainSignal,
    /// `Config::clock`: a timer's time is reckoned by it.
    pub clock: Arc<dyn crate::clock::Clock>,
}

/// Hears how a call of a run's actor ended, once: from the actor, or, when dropped untold (the
/// actor stopped before it took the call, or its call was dropped partway: a panic outside
/// the loop's own catch, the system's shutdown), as the store's loss. The actor tells it
/// itself, so that the supervisor needs no task per run to wait for the actor's reply.
pub(crate) struct Done(Option<Box<dyn FnOnce(Result<RunReply>) + Send>>);

impl Done {
    pub(crate) fn new(tell: impl FnOnce(Result<RunReply>) + Send + 'static) -> Self {
        Done(Some(Box::new(tell)))
    }

    fn tell(mut self, result: Result<RunReply>) {
        if let Some(tell) = self.0.take() {
            tell(result);
        }
    }
}

impl Drop for Done {
    fn drop(&mut self) {
        if let Some(tell) = self.0.take() {
            tell(Err(Error::StoreUnavailable));
        }
    }
}

/// What a draining supervisor tells its runs: `started` when the drain begins (each run is
/// handed over at its next step boundary), `cut` at its deadline (the tool calls still
/// running get their cancellation signal).
#[derive(Clone, Default)]
pub(crate) struct DrainSignal {
    pub started: tokio_util::sync::CancellationToken,
    pub cut: tokio_util::sync::CancellationToken,
}

impl Handler<Execute> for RunActor {
    type Result = ResponseActFuture<Self, ()>;

    fn handle(&mut self, msg: Execute, ctx: &mut Context<Self>) -> Self::Result {
        let done = msg.done;
        // A resumed run's agent is known once the run is read, and recorded then: the field
        // is declared empty so that it is written once either way. So is the execution's
        // kind (start, resume, takeover) and the fencing token it takes.
        let span = tracing::info_span!(
            "run",
            run_id = %msg.run_id,
            agent = tracing::field::Empty,
            execution = tracing::field::Empty,
            owner = %msg.holder.owner,
            fencing_token = tracing::field::Empty,
            otel.name = tracing::field::Empty,
        );
        if let Job::Start { agent, .. } = &msg.job {
            span.record("agent", agent.as_str());
            #[cfg(feature = "otel")]
            span.record("otel.name", format!("invoke_agent {agent}"));
        }
        // A resume or a takeover joins the trace the run's start began.
        #[cfg(feature = "otel")]
        let joins = (!matches!(msg.job, Job::Start { .. }))
            .then(|| (msg.run_id.clone(), msg.store.clone()));
        let env = Env {
            run_id: msg.run_id.clone(),
            store: msg.store.clone(),
            keeper: msg.keeper.clone(),
            grant: Grant::new(msg.holder),
            recipient: ctx.address().recipient(),
            cancellation: self.cancellation.clone(),
            lease_lost: self.lease_lost.clone(),
            draining: msg.draining,
            clock: msg.clock,
        };
        let (run_id, store, keeper, grant) = (
            env.run_id.clone(),
            env.store.clone(),
            env.keeper.clone(),
            env.grant.clone(),
        );
        // Boxed, as its calls are in it: what a run holds while it waits on one is that call's
        // state, not room for the largest of every path. Made out here, so that what it takes
        // is not also kept in the future below.
        let execute = Box::pin(RunLoop::execute(msg.job, msg.agents, env));
        let work = async move {
            // A panic outside the model's and tools' calls (which are caught where they run)
            // still ends the call like an error: the lease is released below.
            let result = AssertUnwindSafe(execute)
                .catch_unwind()
                .await
                .unwrap_or_else(|panic| {
                    Err(Error::Panicked {
                        run_id: run_id.clone(),
                        step: 0,
                        what: "the run loop".into(),
                        message: panic_message(panic),
                    })
                });
            // A loss this call found itself is told to the subscribers; one the keeper told
            // them of first gives the call its reason: both hear the same.
            let result = match result {
                Err(Error::LeaseLost { run_id, reason }) => {
                    let lost = Lost {
                        run_id: run_id.clone(),
                        token: grant.token(),
                        reason: reason.clone(),
                    };
                    let reason = Box::pin(keeper.send(lost)).await.unwrap_or(reason);
                    Err(Error::LeaseLost { run_id, reason })
                }
                other => other,
            };
            keeper.do_send(Release {
                run_id: run_id.clone(),
            });
            // A call that acquired nothing has nothing to release; a handover released it.
            let released = matches!(result, Err(Error::HandedOver { .. }));
            if result.is_err() && grant.token() != 0 && !released {
                // Paused and finished runs released the lease in their move; any other return
                // releases it here, so another process need not wait out the TTL.
                let released = Box::pin(store.addr().send(ReleaseLease {
                    run_id: run_id.clone(),
                    owner: grant.holder.owner.clone(),
                    token: grant.token(),
                }))
                .await;
                if let Ok(Err(err)) | Err(err) = released.map_err(Error::from) {
                    tracing::warn!(%err, "could not release the lease; it will expire");
                }
            }
            if let Ok(outcome) = &result {
                metrics::run_returned(outcome);
            }
            result.map(|outcome| RunReply { run_id, outcome })
        };
        // The parent is set before the span is first entered: it is fixed from then on.
        #[cfg(feature = "otel")]
        let work = async move {
            if let Some((run_id, store)) = &joins {
                Box::pin(join_trace(&span, run_id, store)).await;
            }
            work.instrument(span).await
        };
        #[cfg(not(feature = "otel"))]
        let work = work.instrument(span);
        Box::pin(work.into_actor(self).map(move |result, _, ctx| {
            ctx.stop();
            done.tell(result);
        }))
    }
}

/// Makes the trace kept in the run's `run.started` the parent of `span`, the span of this
/// execution, and names the span after the run's agent. A run whose start kept no trace
/// leaves `span` the root of a trace of its own; so does a failed read (the execution's own
/// read of the run then reports the error).
#[cfg(feature = "otel")]
async fn join_trace(span: &tracing::Span, run_id: &RunId, store: &StoreHandle) {
    let id = run_id.clone();
    let read = super::store::ReadState::new(move |reads| reads.first_event(&id));
    match send(store.addr(), read).await {
        Ok(Some(started)) => {
            if let Some(agent) = started.payload["agent"].as_str() {
                span.record("otel.name", format!("invoke_agent {agent}"));
            }
            crate::trace_context::set_parent(span, &started.payload);
        }
        Ok(None) => {}
        Err(err) => tracing::debug!(%run_id, %err, "could not read the run's trace context"),
    }
}

/// Sends a message to the store actor, flattening its mailbox error into ours.
async fn send<M, R>(store: &Addr<StoreActor>, msg: M) -> Result<R>
where
    M: Message<Result = Result<R>> + Send + 'static,
    R: Send + 'static,
    StoreActor: Handler<M>,
{
    store.send(msg).await?
}

/// The message a panic carried.
fn panic_message(panic: Box<dyn Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with no message".into())
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// A `Done` whose hearings are kept.
    fn heard() -> (Done, Arc<Mutex<Vec<Result<RunReply>>>>) {
        let heard = Arc::new(Mutex::new(Vec::new()));
        let done = Done::new({
            let heard = heard.clone();
            move |result| heard.lock().unwrap().push(result)
        });
        (done, heard)
    }

    #[test]
    fn a_call_end_told_is_heard_once_and_one_dropped_untold_is_heard_as_the_stores_loss() {
        let (done, told) = heard();
        done.tell(Err(Error::UnknownAgent("a".into())));
        let told = told.lock().unwrap();
        assert_eq!(
            told.len(),
            1,
            "told once, and the drop after it tells nothing"
        );
        assert!(matches!(told[0], Err(Error::UnknownAgent(_))));

        let (done, dropped) = heard();
        drop(done);
        let dropped = dropped.lock().unwrap();
        assert_eq!(dropped.len(), 1);
        assert!(matches!(dropped[0], Err(Error::StoreUnavailable)));
    }
}
