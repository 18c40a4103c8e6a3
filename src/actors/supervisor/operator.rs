//! An operator's messages: fork, cancel, and a decision on a waiting call (recorded alone or
//! with the resume that acts on it). Each is one move, the same whichever door it comes
//! through.

use actix::{
    ActorFutureExt, AsyncContext, Context, Handler, Message, ResponseActFuture, WrapFuture,
};

use super::{ExecuteRun, Execution, Supervisor};
use crate::{
    actors::run::Job,
    error::{Error, Result},
    store::{backend::Durability, moves},
    types::{Approval, RunId, RunReply},
};

/// Forks a run at a step and executes the fork, answering when the call returns, like
/// [`ResumeRun`](crate::ResumeRun): the new run (id `new_id`, or a random one) has the
/// origin's agent and input and copies of its steps before `at` (completed tool calls are not
/// run again), and its model is asked again at step `at`. How a failed or cancelled run is retried, or another
/// answer at step `at` explored. The origin is only read, in any state.
///
/// The fork is one move, written before anything executes ([`Store::fork`](crate::Store::fork) writes the same
/// without executing it); this supervisor then takes the new run over as a resume does. Its
/// refusals write nothing: an origin whose agent is not registered here is
/// [`Error::UnknownAgent`]; `at` 0, a tool step or a step past the one after the origin's
/// last is [`Error::InvalidInput`]; a step before `at` that has not finished is a state error;
/// an existing `new_id` is [`Error::RunExists`]. See `docs/runs.md` ("Forking a run").
#[derive(Debug, Clone, Message)]
#[rtype(result = "Result<RunReply>")]
pub struct ForkRun {
    /// The run forked.
    pub run_id: RunId,
    /// The step the fork asks the model again at: a model step of the origin, or the step after
    /// its last.
    pub at: u32,
    /// The new run's id; a random one when `None`.
    pub new_id: Option<RunId>,
}

impl ForkRun {
    /// Fork `run_id` at step `at`, into a run with a random id.
    pub fn new(run_id: impl Into<RunId>, at: u32) -> Self {
        ForkRun {
            run_id: run_id.into(),
            at,
            new_id: None,
        }
    }

    /// Uses `new_id` as the new run's id.
    pub fn with_id(mut self, new_id: impl Into<RunId>) -> Self {
        self.new_id = Some(new_id.into());
        self
    }
}

impl Handler<ForkRun> for Supervisor {
    type Result = Execution;

    fn handle(&mut self, msg: ForkRun, ctx: &mut Context<Self>) -> Self::Result {
        if let Err(err) = self.refuse_if_draining() {
            return Box::pin(std::future::ready(Err(err)));
        }
        let ForkRun { run_id, at, new_id } = msg;
        let new_id = new_id.unwrap_or_else(RunId::random);
        let fork = moves::ForkRun {
            trace: crate::trace_context::forked(&new_id, &run_id, at),
            run_id: new_id.clone(),
            origin: run_id,
            at,
            agents: Some(self.agents.keys().cloned().collect()),
        };
        let fork = self.store_actor.apply(fork, Durability::Durable);
        let supervisor = ctx.address();
        Box::pin(async move {
            let copied = fork.await?;
            tracing::info!(run_id = %new_id, at, copied, "run forked");
            let execute = ExecuteRun {
                run_id: new_id,
                job: Job::Resume,
            };
            supervisor
                .send(execute)
                .await
                .map_err(|_| Error::StoreUnavailable)?
        })
    }
}

/// An operator cancels a run that is running or waiting. A tool running at that moment is told
/// through its cancellation signal; its outcome is still recorded, marked late. The run may be
/// executed by another supervisor: one with [`Config::watch`](crate::Config::watch) tells its tool
/// too.
#[derive(Debug, Clone, Message)]
#[rtype(result = "Result<()>")]
pub struct CancelRun {
    /// The run.
    pub run_id: RunId,
    /// Why, for the record.
    pub reason: String,
}

impl CancelRun {
    /// Cancel `run_id` for `reason`.
    pub fn new(run_id: impl Into<RunId>, reason: impl Into<String>) -> Self {
        CancelRun {
            run_id: run_id.into(),
            reason: reason.into(),
        }
    }
}

impl Handler<CancelRun> for Supervisor {
    type Result = ResponseActFuture<Self, Result<()>>;

    fn handle(&mut self, msg: CancelRun, _: &mut Context<Self>) -> Self::Result {
        let CancelRun { run_id, reason } = msg;
        let cancel = moves::CancelRun {
            run_id: run_id.clone(),
            reason,
        };
        let cancel = self.store_actor.apply(cancel, Durability::Durable);
        Box::pin(
            cancel
                .into_actor(self)
                .map(move |result, this: &mut Supervisor, _| {
                    // The run, and the child runs below it cancelled in the same move.
                    let below = result.as_ref().map_or(&[][..], Vec::as_slice);
                    if result.is_ok() {
                        for id in std::iter::once(&run_id).chain(below) {
                            if let Some((_, cancellation)) = this.executing.get(id) {
                                cancellation.fire();
                            }
                        }
                        tracing::info!(%run_id, children = below.len(), "run cancelled");
                    }
                    result.map(|_| ())
                }),
        )
    }
}

/// Records an operator's approval or denial of a waiting tool call. Resume the run afterwards
/// with [`ResumeRun`](crate::ResumeRun), or let a supervisor with
/// [`Config::watch`](crate::Config::watch) (this one included) resume it.
#[derive(Debug, Clone, Message)]
#[rtype(result = "Result<()>")]
pub struct RecordApproval(pub Approval);

impl Handler<RecordApproval> for Supervisor {
    type Result = ResponseActFuture<Self, Result<()>>;

    fn handle(&mut self, msg: RecordApproval, _: &mut Context<Self>) -> Self::Result {
        let approval = msg.0;
        let record = moves::RecordApproval { approval };
        let record = self.store_actor.apply(record, Durability::Durable);
        Box::pin(record.into_actor(self))
    }
}

/// Records an operator's approval or denial of a waiting tool call, then resumes the run, as
/// [`RecordApproval`] then [`ResumeRun`](crate::ResumeRun) would: answers when the resumed call returns. The
/// decision stays recorded when the resume is refused (another process resumed the run
/// first, say).
#[derive(Debug, Clone, Message)]
#[rtype(result = "Result<RunReply>")]
pub struct DecideAndResume(pub Approval);

impl Handler<DecideAndResume> for Supervisor {
    type Result = Execution;

    fn handle(&mut self, msg: DecideAndResume, ctx: &mut Context<Self>) -> Self::Result {
        if let Err(err) = self.refuse_if_draining() {
            return Box::pin(std::future::ready(Err(err)));
        }
        let approval = msg.0;
        let run_id = approval.run_id.clone();
        // Before the decision commits: the watch, which hears of it, leaves the resume to us.
        self.claim(&run_id);
        let record = moves::RecordApproval { approval };
        let record = self.store_actor.apply(record, Durability::Durable);
        let supervisor = ctx.address();
        Box::pin(async move {
            let recorded = record.await;
            supervisor
                .send(Decided { run_id, recorded })
                .await
                .map_err(|_| Error::StoreUnavailable)?
        })
    }
}

/// A `DecideAndResume`'s decision was recorded (or failed to be): the run is resumed, and the
/// watch no longer leaves it to this call.
#[derive(Message)]
#[rtype(result = "Result<RunReply>")]
struct Decided {
    run_id: RunId,
    recorded: Result<()>,
}

impl Handler<Decided> for Supervisor {
    type Result = Execution;

    fn handle(&mut self, msg: Decided, ctx: &mut Context<Self>) -> Execution {
        let Decided { run_id, recorded } = msg;
        self.unclaim(&run_id, recorded.is_ok(), ctx);
        match recorded {
            Ok(()) => self.execute(run_id, Job::Resume, ctx),
            Err(err) => Box::pin(std::future::ready(Err(err))),
        }
    }
}
