//! The first move of a call: a new run's insert, a waiting run's resume, or a takeover of a
//! run whose owner died. Each takes the lease.

use super::{
    Agents, Job,
    run_loop::{Env, Next, RunLoop},
    send,
};
use crate::{
    actors::store::ReadState,
    error::{Error, Result},
    metrics,
    store::{
        backend::Durability,
        moves::{self, CreateRun, Leased, TakeOver},
    },
    types::{LeaseLostReason, Outcome, RunState},
};

impl RunLoop {
    /// Starts or resumes the run (the first move, which takes the lease), then drives it. The
    /// first move's future is boxed apart and gone before the loop drives: a run holds only
    /// the loop's state while it executes.
    pub(super) async fn execute(job: Job, agents: Agents, env: Env) -> Result<Outcome> {
        match Box::pin(RunLoop::prepare(job, agents, env)).await? {
            Prepared::Drive(run, first_next) => run.finish(first_next).await,
            Prepared::Over(outcome) => Ok(outcome),
        }
    }

    /// The first move: the loop to drive and where it goes next, or the call's outcome when
    /// there is nothing to drive.
    async fn prepare(job: Job, agents: Agents, env: Env) -> Result<Prepared> {
        let find = |name: &str| {
            agents
                .get(name)
                .cloned()
                .ok_or_else(|| Error::UnknownAgent(name.to_owned()))
        };
        let run_id = env.run_id.clone();
        // Where the loop goes after its first move, when it already made its second.
        let mut first_next = Ok(Next::Continue);
        let run = match job {
            Job::Start {
                agent,
                input,
                started,
            } => {
                let found = find(&agent)?;
                let create = CreateRun {
                    by: Leased::new(&run_id, &env.grant),
                    agent: agent.clone(),
                    input: input.clone(),
                    trace: crate::trace_context::started(),
                };
                let mut run = RunLoop::new(env, found, input, Vec::new());
                match started {
                    // Answered once durable: the loop plans its first model call after.
                    // A failed insert drops `started`: the caller reads the error from the call.
                    Some(started) => {
                        Box::pin(run.store().apply(create, Durability::Durable)).await?;
                        let _ = started.send(());
                    }
                    None => {
                        // The first model step's reservation commits with the insert.
                        let next = run.plan();
                        let (_, next) = Box::pin(run.commit_with(create, next, |_| true)).await?;
                        first_next = next;
                    }
                }
                run.taken("start");
                tracing::info!(
                    %run_id,
                    agent = %agent,
                    owner = %run.grant().holder.owner,
                    fencing_token = run.grant().token(),
                    "run started"
                );
                run.hold();
                run
            }
            job @ (Job::Resume | Job::Turn) => {
                let id = run_id.clone();
                let snapshot = send(
                    env.store.addr(),
                    ReadState::new(move |reads| moves::load(reads, &id)),
                )
                .await?;
                tracing::Span::current().record("agent", snapshot.run.agent.as_str());
                let agent = find(&snapshot.run.agent)?;
                match snapshot.run.state {
                    RunState::WaitingForApproval => {
                        let mut run = RunLoop::from_snapshot(&snapshot, agent, env);
                        if let Some(outcome) = Box::pin(run.resume_waiting(&snapshot)).await? {
                            // Nothing was decided: it waits as it did.
                            run.ended(&Ok(outcome.clone()));
                            return Ok(Prepared::Over(outcome));
                        }
                        run
                    }
                    state if state.waits_for().is_some() => {
                        let mut run = RunLoop::from_snapshot(&snapshot, agent, env);
                        if let Some(outcome) = Box::pin(run.resume_wait(&snapshot)).await? {
                            // Not over: it waits as it did.
                            run.ended(&Ok(outcome.clone()));
                            return Ok(Prepared::Over(outcome));
                        }
                        run
                    }
                    RunState::Running => {
                        let take = TakeOver {
                            by: Leased::new(&run_id, &env.grant),
                        };
                        let taken = Box::pin(env.store.apply(take, Durability::Durable)).await?;
                        let (interrupted, previous, snapshot) = (
                            taken.interrupted.len(),
                            taken.previous_owner,
                            taken.snapshot,
                        );
                        let held = previous.is_some();
                        // A run nobody held (a fork, a queued run's turn) is not taken from
                        // anyone.
                        if held {
                            metrics::taken_over();
                        }
                        if taken.handed_over {
                            metrics::handed_over("taken");
                        }
                        let run = RunLoop::from_snapshot(&snapshot, agent, env);
                        run.hold();
                        run.taken("takeover");
                        tracing::info!(
                            %run_id,
                            previous_owner = %previous.as_deref().unwrap_or("none"),
                            owner = %run.grant().holder.owner,
                            fencing_token = run.grant().token(),
                            interrupted,
                            "run taken over"
                        );
                        run
                    }
                    RunState::Cancelled if matches!(job, Job::Turn) => {
                        return Ok(Prepared::Over(Outcome::Cancelled {
                            reason: snapshot.run.error.unwrap_or_default(),
                        }));
                    }
                    state => {
                        return Err(Error::RunState {
                            run_id,
                            state,
                            reason: "a finished run cannot be resumed".into(),
                        });
                    }
                }
            }
        };
        Ok(Prepared::Drive(Box::new(run), first_next))
    }

    /// Drives the loop from `first_next`, where its first move left it, to the call's end.
    async fn finish(mut self: Box<Self>, first_next: Result<Next>) -> Result<Outcome> {
        let run = &mut *self;
        let result = match first_next {
            Ok(Next::Continue) => run.drive().await,
            Ok(Next::Return(outcome)) => Ok(outcome),
            Err(err) => Err(err),
        };
        let result = match result {
            // An operator cancelled the run: the loop stops at its next write.
            Err(Error::RunState {
                state: RunState::Cancelled,
                ..
            }) => Box::pin(run.cancelled()).await,
            // Another owner took the run over while this loop was between writes.
            Err(Error::RunLeased { run_id, owner, .. }) => Err(Error::LeaseLost {
                run_id,
                reason: LeaseLostReason::TakenBy(owner),
            }),
            other => other,
        };
        run.ended(&result);
        result
    }
}

/// What the first move leaves.
enum Prepared {
    /// The loop, to be driven from where its first move left it.
    Drive(Box<RunLoop>, Result<Next>),
    /// The call is over without driving: the run still waits, or was cancelled in its queue.
    Over(Outcome),
}
