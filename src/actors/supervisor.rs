//! `Supervisor`: the front door. Holds the agent registry and the runs this process executes,
//! and spawns one `RunActor` per run.

mod admission;
mod config;
mod drain;
mod operator;
mod recovery;
mod schedules;
mod waits;
mod watch;

pub use admission::DEFAULT_MAX_CONCURRENT_RUNS;
use config::lease_owner;
pub use config::{Config, DEFAULT_ANSWER_WATCH, DEFAULT_LEASE_TTL};
pub use drain::{
    DEFAULT_DRAIN_DEADLINE, DEFAULT_DRAIN_GRACE, Drain, DrainReport, drain_on_signal,
    stop_on_signal,
};
#[cfg(feature = "web")]
pub(crate) use drain::{IsDraining, Signals};
pub use operator::{CancelRun, DecideAndResume, ForkRun, RecordApproval};
pub use recovery::Recovery;
pub use waits::{AnswerQuestion, DeliverEvent};
pub use watch::Watch;

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
    time::SystemTime,
};

use actix::{
    Actor, Addr, Arbiter, AsyncContext, Context, Handler, Message, Recipient, ResponseFuture,
};
use serde_json::Value;
use tokio::sync::oneshot;

use super::{
    lease_keeper::{HeldLeases, LeaseKeeper, Renewer, SubscribeLeaseLost},
    run::{Agents, Done, Execute, Job, RunActor},
    store::{ReadState, StoreActor, StoreHandle},
};
use crate::{
    agent::{Agent, Cancellation},
    error::{Error, Result},
    store::{Store, model::Holder, moves},
    types::{Outcome, RunId, RunReply},
};

/// The actor an application talks to: it starts, resumes and cancels runs, and records
/// approvals.
///
/// Build it with [`Supervisor::builder`] inside a running actix system.
pub struct Supervisor {
    store: Store,
    store_actor: StoreHandle,
    keeper: Addr<LeaseKeeper>,
    /// The keeper's thread; stopped with the supervisor.
    keeper_arbiter: Arbiter,
    holder: Holder,
    agents: Agents,
    /// The runs this supervisor executes now, each with the signal that cancels it and the
    /// number of the call that executes it.
    executing: HashMap<RunId, (u64, Cancellation)>,
    calls: u64,
    /// Told of every run this supervisor executed that came to rest.
    settled_subscribers: Vec<Recipient<RunSettled>>,
    recovery: Option<Recovery>,
    recovering: recovery::Recovering,
    /// The most runs executing at once, and the runs that wait for a slot.
    max_running: usize,
    admission: admission::Admission,
    watching: watch::Watching,
    draining: drain::Draining,
    /// The clock of `Config::clock`: timers fall due by it.
    clock: Arc<dyn crate::clock::Clock>,
    waking: waits::Waking,
    scheduling: schedules::Scheduling,
}

/// Assembles a [`Supervisor`].
pub struct SupervisorBuilder {
    store: Store,
    config: Config,
    agents: BTreeMap<String, Arc<Agent>>,
}

impl SupervisorBuilder {
    /// Sets the configuration.
    pub fn config(mut self, config: Config) -> Self {
        self.config = config;
        self
    }

    /// Registers `agent` under `name`: runs started with this name execute it.
    pub fn agent(mut self, name: impl Into<String>, agent: Agent) -> Self {
        self.agents.insert(name.into(), Arc::new(agent));
        self
    }

    /// Starts the supervisor, its store actor and its lease keeper, each on a thread of its
    /// own. Must be called inside a running actix system. Fails if the backend cannot open
    /// the supervisor's connections (the lease keeper's, say).
    pub fn start(self) -> Result<Addr<Supervisor>> {
        let ttl = self.config.effective_ttl();
        let holder = Holder {
            owner: lease_owner(self.config.lease_owner.as_deref()).into(),
            ttl,
            margin: self.config.effective_margin()?,
        };
        let (store_actor, renewer) = StoreActor::start(
            &self.store,
            self.config.clock.clone(),
            self.config.observer.clone(),
            self.config.answer_watch,
        )?;
        let renewer = match renewer {
            Some(renewer) => Renewer::Own(renewer),
            None => Renewer::Store(store_actor.addr().clone()),
        };
        // A supervisor that recovers watches the feed too, for the runs a drain released: it
        // takes them over at once instead of at its next pass. Only a configured watch acts
        // on decisions.
        let decisions = self.config.watch.is_some();
        let watch = (self.config.watch.clone())
            .or_else(|| self.config.recovery.as_ref().map(|_| Watch::default()));
        let watcher = match watch {
            Some(watch) => Some((watch, self.store.watcher()?)),
            None => None,
        };
        let keeper_arbiter = Arbiter::new();
        let owner = holder.owner.clone();
        let keeper = LeaseKeeper::start_in_arbiter(&keeper_arbiter.handle(), move |_| {
            LeaseKeeper::new(owner, ttl, renewer)
        });
        tracing::info!(owner = %holder.owner, ?ttl, "supervisor starting");
        // A child of an agent registered nowhere would leave its parent waiting: said now.
        for (name, agent) in &self.agents {
            for (tool, registered) in &agent.tools {
                if let Some(crate::builtin::WaitTool::Child { agent: child, .. }) = &registered.wait
                    && !self.agents.contains_key(child)
                {
                    tracing::warn!(agent = %name, %tool, child_agent = %child, "a delegating tool names an agent this supervisor does not register: its child runs wait for a supervisor that does");
                }
            }
        }
        Ok(Supervisor {
            store: self.store,
            store_actor,
            keeper,
            keeper_arbiter,
            holder,
            agents: Arc::new(self.agents),
            executing: HashMap::new(),
            calls: 0,
            settled_subscribers: Vec::new(),
            recovery: self.config.recovery.clone(),
            recovering: Default::default(),
            max_running: self.config.max_concurrent_runs,
            admission: Default::default(),
            watching: watch::Watching::new(watcher, decisions),
            draining: Default::default(),
            clock: self.config.clock.clone(),
            waking: Default::default(),
            scheduling: Default::default(),
        }
        .start())
    }
}

impl Supervisor {
    /// A builder for a supervisor over `store`.
    pub fn builder(store: Store) -> SupervisorBuilder {
        SupervisorBuilder {
            store,
            config: Config::default(),
            agents: BTreeMap::new(),
        }
    }

    /// Executes the run, now or once a slot is free, and answers when the call it serves
    /// returns.
    ///
    /// The execution runs in a task of its own, not in the supervisor's context: a context
    /// polls every future it holds at each wake-up, and with thousands of runs at once that
    /// would cost each run's every move a pass over all the others.
    fn execute(&mut self, run_id: RunId, job: Job, ctx: &mut Context<Self>) -> Execution {
        if let Err(err) = self.refuse_if_draining() {
            return Box::pin(std::future::ready(Err(err)));
        }
        let held = self.executing.contains_key(&run_id) || self.admission.holds(&run_id);
        if matches!(job, Job::Start { .. }) {
            // A start under an id no run may have is refused before anything executes (the
            // insert would refuse it too). A start of a run this supervisor executes or holds
            // for its turn: the run exists, or its insert is being written. Told so at once,
            // as the insert would tell it, never that it is leased, which tells the caller to
            // retry.
            let refused = match run_id.check() {
                Err(err) => Some(err),
                Ok(()) => held.then(|| Error::RunExists(run_id.clone())),
            };
            if let Some(err) = refused {
                return Box::pin(std::future::ready(Err(err)));
            }
        }
        if held {
            // Executing it in another call, or about to: refuse, naming our own lease,
            // without a write.
            let (owner, ttl, id) = (
                self.holder.owner.to_string(),
                self.holder.ttl,
                run_id.clone(),
            );
            let read = self
                .store_actor
                .addr()
                .send(ReadState::new(move |reads| moves::lease(reads, &id)));
            return Box::pin(async move {
                let expires_at = match read.await? {
                    Ok(Some(lease)) => lease.expires_at,
                    // Not leased yet, or not even inserted: its start is being written.
                    Ok(None) | Err(Error::RunNotFound(_)) => SystemTime::now() + ttl,
                    Err(err) => return Err(err),
                };
                Err(Error::RunLeased {
                    run_id,
                    owner,
                    expires_at,
                })
            });
        }
        self.admit(run_id, job, ctx)
    }

    /// Spawns the run's actor and answers when the call it serves returns; the slot it took
    /// goes to the next run that waits.
    fn execute_now(&mut self, run_id: RunId, job: Job, ctx: &mut Context<Self>) -> Execution {
        self.calls += 1;
        let call = self.calls;
        let cancellation = Cancellation::new();
        self.executing
            .insert(run_id.clone(), (call, cancellation.clone()));
        let actor = RunActor::new(cancellation).start();
        let (reply, ended) = oneshot::channel();
        let supervisor = ctx.address();
        let done = Done::new({
            let run_id = run_id.clone();
            move |result| {
                supervisor.do_send(Ended {
                    run_id,
                    call,
                    result,
                    reply,
                })
            }
        });
        actor.do_send(Execute {
            done,
            run_id: run_id.clone(),
            job,
            agents: self.agents.clone(),
            store: self.store_actor.clone(),
            keeper: self.keeper.clone(),
            holder: self.holder.clone(),
            draining: self.draining.signal.clone(),
            clock: self.clock.clone(),
        });
        // A supervisor that stopped meanwhile answers nothing: its store is gone with it.
        Box::pin(async move { ended.await.unwrap_or(Err(Error::StoreUnavailable)) })
    }
}

/// What a call answers: the end of the execution it asked for.
type Execution = ResponseFuture<Result<RunReply>>;

/// A call that executed a run returned; its caller is answered once the supervisor has
/// freed its slot and told the subscribers.
#[derive(Message)]
#[rtype(result = "()")]
struct Ended {
    run_id: RunId,
    call: u64,
    result: Result<RunReply>,
    reply: oneshot::Sender<Result<RunReply>>,
}

impl Handler<Ended> for Supervisor {
    type Result = ();

    fn handle(&mut self, msg: Ended, ctx: &mut Context<Self>) {
        let Ended {
            run_id,
            call,
            result,
            reply,
        } = msg;
        if self
            .executing
            .get(&run_id)
            .is_some_and(|(owner, _)| *owner == call)
        {
            self.executing.remove(&run_id);
        }
        self.tell_settled(&run_id, &result);
        self.drained_execution_ended(&run_id, &result);
        self.watched_execution_ended(&run_id, &result, ctx);
        self.waiting_execution_ended(&result, ctx);
        self.admit_waiting(ctx);
        self.slot_freed(ctx);
        let _ = reply.send(result);
    }
}

/// Executes a run, for a call that first wrote something of its own (a fork).
#[derive(Message)]
#[rtype(result = "Result<RunReply>")]
struct ExecuteRun {
    run_id: RunId,
    job: Job,
}

impl Handler<ExecuteRun> for Supervisor {
    type Result = Execution;

    fn handle(&mut self, msg: ExecuteRun, ctx: &mut Context<Self>) -> Execution {
        self.execute(msg.run_id, msg.job, ctx)
    }
}

impl Supervisor {
    /// Tells the subscribers how a call that executed `run_id` ended; not of a call refused
    /// before it executed anything (an unknown agent, an id taken, a lease held elsewhere, a
    /// finished run).
    fn tell_settled(&mut self, run_id: &RunId, result: &Result<RunReply>) {
        let result = match result {
            Ok(reply) => Ok(reply.outcome.clone()),
            Err(
                Error::UnknownAgent(_)
                | Error::RunExists(_)
                | Error::RunLeased { .. }
                | Error::RunState { .. }
                | Error::RunNotFound(_),
            ) => return,
            Err(err) => Err(err.to_string()),
        };
        // `do_send` ignores the mailbox's capacity: a slow subscriber delays nothing and
        // misses nothing.
        self.settled_subscribers.retain(Recipient::connected);
        for recipient in &self.settled_subscribers {
            recipient.do_send(RunSettled {
                run_id: run_id.clone(),
                result: result.clone(),
            });
        }
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        // The keeper renews for as long as the supervisor lives, and not a tick longer.
        self.keeper_arbiter.stop();
    }
}

impl Actor for Supervisor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        // The mailbox keeps actix's default capacity: past it, callers' `send`s wait, which is
        // the back-pressure a burst of StartRun should meet.
        tracing::debug!(store = ?self.store, "supervisor started");
        self.start_recovery(ctx);
        self.start_watch(ctx);
        self.start_waking(ctx);
    }
}

/// Starts a run of a registered agent and answers when the call returns: the run finished,
/// paused for an approval, or was cancelled.
///
/// ```no_run
/// # use agentrt::{StartRun, Supervisor};
/// # async fn demo(supervisor: actix::Addr<Supervisor>) -> agentrt::Result<()> {
/// let reply = supervisor
///     .send(StartRun::new("support", serde_json::json!({"ticket": 42})).with_id("ticket-42"))
///     .await
///     .expect("supervisor is running")?;
/// println!("{}: {:?}", reply.run_id, reply.outcome);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Message)]
#[rtype(result = "Result<RunReply>")]
pub struct StartRun {
    /// The registered agent's name.
    pub agent: String,
    /// The run's input.
    pub input: Value,
    /// The run's id; a random one when `None`. An id that exists is refused, so a retried
    /// request cannot start a run twice.
    pub run_id: Option<RunId>,
}

impl StartRun {
    /// A run of `agent` with `input`.
    pub fn new(agent: impl Into<String>, input: Value) -> Self {
        StartRun {
            agent: agent.into(),
            input,
            run_id: None,
        }
    }

    /// Uses `run_id` as the run's id.
    pub fn with_id(mut self, run_id: impl Into<RunId>) -> Self {
        self.run_id = Some(run_id.into());
        self
    }
}

impl Handler<StartRun> for Supervisor {
    type Result = Execution;

    fn handle(&mut self, msg: StartRun, ctx: &mut Context<Self>) -> Self::Result {
        if !self.agents.contains_key(&msg.agent) {
            return Box::pin(std::future::ready(Err(Error::UnknownAgent(msg.agent))));
        }
        let run_id = msg.run_id.unwrap_or_else(RunId::random);
        self.execute(
            run_id,
            Job::Start {
                agent: msg.agent,
                input: msg.input,
                started: None,
            },
            ctx,
        )
    }
}

/// Starts a run of a registered agent and answers with its id as soon as the run is durable,
/// while the supervisor drives it; [`SubscribeRuns`] and the store tell how it ends.
///
/// It answers with the same errors as [`StartRun`] when the run cannot be started: an unknown
/// agent, or an id that exists or that this supervisor executes now ([`Error::RunExists`]).
/// An error of the store itself (`CommitUnknown`, `SyncFailed`) is
/// ambiguous: the insert may have reached the database, and another process's recovery then
/// executes it. Give runs ids of your own ([`SpawnRun::with_id`]) to find out, and to retry
/// without starting a run twice. Once answered, the run's execution is the supervisor's, and
/// its end (finished, waiting for an approval, cancelled, or stopped with an error such as a
/// lost lease) reaches every [`RunSettled`] subscriber. One exception: a run past the
/// concurrency limit waits its turn with no lease ([`Config::max_concurrent_runs`]), and
/// another replica's recovery may take it first; its end then reaches that replica's
/// subscribers, not this one's.
///
/// ```no_run
/// # use agentrt::{SpawnRun, Supervisor};
/// # async fn demo(supervisor: actix::Addr<Supervisor>) -> agentrt::Result<()> {
/// let run_id = supervisor
///     .send(SpawnRun::new("support", serde_json::json!({"ticket": 42})))
///     .await
///     .expect("supervisor is running")?;
/// println!("started {run_id}");
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Message)]
#[rtype(result = "Result<RunId>")]
pub struct SpawnRun {
    /// The registered agent's name.
    pub agent: String,
    /// The run's input.
    pub input: Value,
    /// The run's id; a random one when `None`. An id that exists is refused.
    pub run_id: Option<RunId>,
}

impl SpawnRun {
    /// A run of `agent` with `input`.
    pub fn new(agent: impl Into<String>, input: Value) -> Self {
        SpawnRun {
            agent: agent.into(),
            input,
            run_id: None,
        }
    }

    /// Uses `run_id` as the run's id.
    pub fn with_id(mut self, run_id: impl Into<RunId>) -> Self {
        self.run_id = Some(run_id.into());
        self
    }
}

impl Handler<SpawnRun> for Supervisor {
    type Result = ResponseFuture<Result<RunId>>;

    fn handle(&mut self, msg: SpawnRun, ctx: &mut Context<Self>) -> Self::Result {
        if !self.agents.contains_key(&msg.agent) {
            return Box::pin(std::future::ready(Err(Error::UnknownAgent(msg.agent))));
        }
        let run_id = msg.run_id.unwrap_or_else(RunId::random);
        let (started, on_start) = tokio::sync::oneshot::channel();
        let (failed, on_failure) = tokio::sync::oneshot::channel();
        let job = Job::Start {
            agent: msg.agent,
            input: msg.input,
            started: Some(started),
        };
        let execution = self.execute(run_id.clone(), job, ctx);
        actix_rt::spawn(async move {
            // Heard only when the run never started: the caller was answered otherwise.
            if let Err(err) = execution.await {
                let _ = failed.send(err);
            }
        });
        Box::pin(async move {
            match on_start.await {
                Ok(()) => Ok(run_id),
                Err(_) => Err(on_failure.await.unwrap_or(Error::StoreUnavailable)),
            }
        })
    }
}

/// A run that a supervisor executed came to rest: the call that executed it returned. Sent to
/// the recipients of [`SubscribeRuns`] when a call (a [`StartRun`], a [`SpawnRun`], a
/// [`ResumeRun`], a recovery) returns, except when it returned an error that refuses a run
/// without executing it: [`Error::UnknownAgent`], [`Error::RunExists`], [`Error::RunLeased`],
/// [`Error::RunNotFound`] and state errors ([`Error::is_run_state`]). A resume that finds the
/// run still waiting settles it again as waiting; a cancel of a run no call executes settles
/// nothing (read the store).
#[derive(Debug, Clone, PartialEq, Message)]
#[rtype(result = "()")]
pub struct RunSettled {
    /// The run.
    pub run_id: RunId,
    /// How the call ended: the run finished, paused for an approval or was cancelled
    /// (`Ok`), or its execution stopped with an error (`Err`, the error's message: a lost
    /// lease, a store that failed, a handover to another replica by a drain), after which a
    /// resume (or that replica) takes it on.
    pub result: std::result::Result<Outcome, String>,
}

/// Subscribes a recipient to every [`RunSettled`] of a supervisor. A recipient whose actor
/// has stopped is dropped.
#[derive(Message)]
#[rtype(result = "()")]
pub struct SubscribeRuns(pub Recipient<RunSettled>);

impl Handler<SubscribeRuns> for Supervisor {
    type Result = ();

    fn handle(&mut self, msg: SubscribeRuns, _: &mut Context<Self>) {
        self.settled_subscribers.push(msg.0);
    }
}

/// Resumes a run, whatever made it stop, and answers when the call returns, like [`StartRun`].
/// What it does depends on what it finds:
///
/// - **A run waiting for an approval whose decision is recorded**: it moves the run back to
///   `RUNNING`, takes the lease, and acts on the decision (runs the call, or tells the model it
///   was denied), in one compare-and-set: of two resumers one wins, the other gets a state
///   error ([`Error::is_run_state`]).
/// - **A run still waiting** (no decision recorded yet): it changes nothing and answers
///   [`Outcome::WaitingForApproval`](crate::Outcome::WaitingForApproval) again, naming the
///   call.
/// - **A `RUNNING` run whose executor died** (its lease expired, or nobody holds it): it takes
///   the run over. Every step in flight is marked interrupted and reconciled exactly once (see
///   `docs/reconciliation.md`) before the loop goes on. A run under another owner's live lease,
///   or one this supervisor executes in another call, is refused with [`Error::RunLeased`],
///   writing nothing: retry after its `expires_at`.
///
/// A finished run is a state error.
#[derive(Debug, Clone, Message)]
#[rtype(result = "Result<RunReply>")]
pub struct ResumeRun {
    /// The run.
    pub run_id: RunId,
}

impl ResumeRun {
    /// Resume `run_id`.
    pub fn new(run_id: impl Into<RunId>) -> Self {
        ResumeRun {
            run_id: run_id.into(),
        }
    }
}

impl Handler<ResumeRun> for Supervisor {
    type Result = Execution;

    fn handle(&mut self, msg: ResumeRun, ctx: &mut Context<Self>) -> Self::Result {
        self.execute(msg.run_id, Job::Resume, ctx)
    }
}

/// Registers (or replaces) an agent on a running supervisor. Runs already executing keep the
/// agent they started with.
#[derive(Message)]
#[rtype(result = "()")]
pub struct RegisterAgent {
    /// The name runs refer to it by.
    pub name: String,
    /// The agent.
    pub agent: Agent,
}

impl Handler<RegisterAgent> for Supervisor {
    type Result = ();

    fn handle(&mut self, msg: RegisterAgent, _: &mut Context<Self>) {
        let mut agents = (*self.agents).clone();
        agents.insert(msg.name, Arc::new(msg.agent));
        self.agents = Arc::new(agents);
    }
}

impl Handler<SubscribeLeaseLost> for Supervisor {
    type Result = ();

    fn handle(&mut self, msg: SubscribeLeaseLost, _: &mut Context<Self>) {
        self.keeper.do_send(msg);
    }
}

impl Handler<HeldLeases> for Supervisor {
    type Result = ResponseFuture<Vec<RunId>>;

    fn handle(&mut self, msg: HeldLeases, _: &mut Context<Self>) -> Self::Result {
        let held = self.keeper.send(msg);
        Box::pin(async move { held.await.unwrap_or_default() })
    }
}
