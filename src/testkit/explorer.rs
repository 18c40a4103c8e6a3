//! The crash-point explorer: crash a run at every move, resume it, and check that nothing ran
//! twice without a reconciliation saying so, and that nothing was lost.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use serde_json::{Value, json};
use tokio::sync::watch;

use super::{ManualClock, TempStore, resume_when_free, with_system};
use crate::{
    Agent, Answer, AnswerQuestion, Approval, Clock, Config, DeliverEvent, Delivery, Error, Event,
    EventKind, MoveInfo, MoveObserver, Outcome, PendingCall, Reconciliation, RecordApproval,
    Recovery, Result, RunId, RunReply, RunSettled, RunState, SpawnRun, StartRun, Store,
    SubscribeRuns, Supervisor, Tool, ToolContext, ToolError, Wait, WaitKind, Watch, async_trait,
};

/// [`CaseReport::crash_thread`] of a crash on the store actor's thread.
pub const STORE_THREAD: &str = "store-actor";

/// The name the explored agent is registered under.
const AGENT: &str = "explored";

/// Where the supervisor executing the run dies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CrashPoint {
    /// Right before the k-th move (from 1) is applied: nothing of it is written, and whatever
    /// happened before it was sent (a tool call, say) has happened.
    BeforeApply(usize),
    /// Right after the k-th move commits, before its caller hears of it.
    AfterCommit(usize),
}

/// What one crash case did and found.
#[derive(Debug, Clone)]
pub struct CaseReport {
    /// Where it crashed.
    pub crash: CrashPoint,
    /// False when the run finished before reaching the crash point.
    pub crashed: bool,
    /// The final state of the first run.
    pub state: Option<RunState>,
    /// The final state of every run the case left, the explored runs' children included, by
    /// id.
    pub runs: BTreeMap<RunId, RunState>,
    /// Tool executions, over the crashed and the recovering supervisors.
    pub executions: usize,
    /// The tool executions by idempotency key (`RUN/STEP`), over the crashed and the
    /// recovering supervisors.
    pub executed: BTreeMap<String, usize>,
    /// The thread the crash stopped first: the store actor's ([`STORE_THREAD`]), or, for a
    /// group whose log sync was deferred, the log-sync thread (`agentrt-log-sync`), or, on
    /// PostgreSQL, the writer lane's that applies the move (`agentrt-pg-writer-N`); `None`
    /// when the runs finished before the crash point.
    pub crash_thread: Option<String>,
    /// The invariants that did not hold; empty when all did.
    pub violations: Vec<Violation>,
}

/// What a whole exploration found.
#[derive(Debug, Clone)]
pub struct Exploration {
    /// The moves of the run without a crash.
    pub moves: usize,
    /// Those moves, in the order they committed: what each crash point `k` crashes at.
    pub committed: Vec<MoveInfo>,
    /// One report per crash point.
    pub cases: Vec<CaseReport>,
}

impl Exploration {
    /// The cases that found a violation.
    pub fn failures(&self) -> Vec<&CaseReport> {
        self.cases
            .iter()
            .filter(|case| !case.violations.is_empty())
            .collect()
    }

    /// Panics, listing every violation, unless all invariants held in every case.
    pub fn assert_holds(&self) {
        let failures = self.failures();
        assert!(
            failures.is_empty(),
            "{} of {} crash cases broke an invariant: {failures:#?}",
            failures.len(),
            self.cases.len()
        );
    }
}

type Approver = Arc<dyn Fn(&PendingCall) -> bool + Send + Sync>;
type Answerer = Arc<dyn Fn(&Wait) -> Value + Send + Sync>;

/// Crashes a run at every move and checks the invariants after each resume.
///
/// For every k from 1 to the number of moves of an uncrashed run, and for each of
/// [`CrashPoint::BeforeApply`] and [`CrashPoint::AfterCommit`], it runs the agent on a fresh
/// database, crashes its supervisor there (the actix system goes away; the thread applying
/// the move stops where it stands, and the store writes nothing more once the transactions it
/// had open have ended), resumes with fresh supervisors (starting the run again if it was
/// never inserted, and resuming it if that start finds it inserted after all; approving or
/// denying where asked, waiting out the dead supervisor's lease) until the run finishes, and
/// checks:
///
/// - the run finished;
/// - each tool call's side effect ran at most as many times as its attempts were started, and
///   an attempt after the first was started only after a `step.reconciled` chose to run it
///   again;
/// - each interrupted step was reconciled exactly once;
/// - the sequence numbers are gapless, every event is well formed, every started step
///   finished;
/// - no run is left leased.
///
/// With [`waits`](Self::waits), the supervisors resume the runs by themselves, and every run
/// (child runs included) must finish with no wait left.
///
/// `make_agent` is called once per case: the tools it returns are that case's world (their
/// state persists from the crashed supervisor to the recovering one, like an external system).
///
/// ```
/// use agentrt::testkit::{Explorer, RecordingTool, ScriptedModel};
/// use agentrt::{Agent, ModelResponse, ToolCall};
/// use serde_json::json;
///
/// let exploration = Explorer::new(|| {
///     let model = ScriptedModel::new(vec![
///         ModelResponse::calls(vec![ToolCall::new("c1", "charge", json!({"cents": 100}))]),
///         ModelResponse::answer("charged"),
///     ]);
///     Agent::new(model).tool(RecordingTool::new("charge").idempotent(true))
/// })
/// .explore();
/// exploration.assert_holds();
/// assert_eq!(exploration.cases.len(), 2 * exploration.moves);
/// ```
pub struct Explorer {
    make_agent: Box<dyn Fn() -> Agent>,
    /// Agents registered beside the explored one (a child run's), by name.
    others: Vec<(String, Box<dyn Fn() -> Agent>)>,
    input: Value,
    ttl: Duration,
    approve: Approver,
    answer: Answerer,
    runs: usize,
    waits: bool,
}

impl Explorer {
    /// Explores the runs of the agents `make_agent` builds, with input `{}`, approving every
    /// call that waits for a person.
    pub fn new(make_agent: impl Fn() -> Agent + 'static) -> Self {
        Explorer {
            make_agent: Box::new(make_agent),
            input: Value::Object(Default::default()),
            ttl: Duration::from_millis(100),
            approve: Arc::new(|_| true),
            answer: Arc::new(|_| json!("yes")),
            others: Vec::new(),
            runs: 1,
            waits: false,
        }
    }

    /// Registers the agents `make_agent` builds as `name` on every supervisor, beside the
    /// explored one: the agent of the child runs an explored run delegates to
    /// ([`Agent::delegate`]). Built once per case, like the explored agent; its tools are
    /// witnessed too.
    pub fn agent(
        mut self,
        name: impl Into<String>,
        make_agent: impl Fn() -> Agent + 'static,
    ) -> Self {
        self.others.push((name.into(), Box::new(make_agent)));
        self
    }

    /// Explores runs that wait for a person's answer, an event, a time or a child run, and
    /// checks that no wake-up is lost. The supervisors (the one that crashes and the one that
    /// recovers) then recover and watch the change feed, with a [`ManualClock`] of the case's
    /// own, and the explorer resumes nothing itself: it starts the runs (again, if the crash
    /// came before their insert) and then acts only as the world would, once per wait, through
    /// the supervisor: answers each question ([`answer_with`](Self::answer_with)), moves the
    /// clock to each timer's time, delivers each event waited for (id `RUN/STEP`, payload
    /// `{}`), and decides each call that waits for an approval
    /// ([`approve_with`](Self::approve_with)). The supervisors must bring every run, child runs
    /// included, to its end; each is checked as the explored runs are, and none may be left
    /// with a wait.
    pub fn waits(mut self) -> Self {
        self.waits = true;
        self
    }

    /// How a person answers each question ([`Agent::ask_person`]) when the explorer explores
    /// [`waits`](Self::waits): `"yes"` by default.
    pub fn answer_with(mut self, answer: impl Fn(&Wait) -> Value + Send + Sync + 'static) -> Self {
        self.answer = Arc::new(answer);
        self
    }

    /// Runs `runs` runs of the agent at once (1 by default), so that their moves share group
    /// commits and the crash points include groups whose log sync was left to the log-sync
    /// thread. The moves are counted over all runs, in the order they happen, which differs a
    /// little from one execution to the next; every case is checked run by run.
    pub fn concurrent_runs(mut self, runs: usize) -> Self {
        self.runs = runs.max(1);
        self
    }

    /// The ids of the explored runs.
    fn run_ids(&self) -> Vec<RunId> {
        (1..=self.runs)
            .map(|i| match i {
                1 => RunId::from(AGENT),
                i => RunId::from(format!("{AGENT}-{i}").as_str()),
            })
            .collect()
    }

    /// The run's input.
    pub fn input(mut self, input: Value) -> Self {
        self.input = input;
        self
    }

    /// Decides each call that waits for a person: approve (true) or deny.
    pub fn approve_with(
        mut self,
        approve: impl Fn(&PendingCall) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.approve = Arc::new(approve);
        self
    }

    /// The lease TTL of the supervisors (100 ms by default): how long each case waits for the
    /// crashed supervisor's lease to expire.
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// Runs the agent once without a crash and counts its committed moves.
    pub fn count_moves(&self) -> usize {
        self.committed_moves().len()
    }

    /// Runs the agent once without a crash; its committed moves, in order.
    fn committed_moves(&self) -> Vec<MoveInfo> {
        let db = TempStore::new();
        let counter = MoveCounter::default();
        let (agents, _) = self.witnessed_agents();
        let consumer = self.consumer();
        let config = consumer.config(self.ttl).observer(counter.clone());
        let store = db.open();
        let result = with_system(|| async move {
            let sup = start_supervisor(store.clone(), config, agents).map_err(|e| e.to_string())?;
            consumer.drive(&sup, &store, true).await
        });
        if let Err(err) = result {
            panic!("the uncrashed run failed: {err}");
        }
        std::mem::take(&mut *counter.committed.lock().unwrap())
    }

    /// Crashes at every move, before it is applied and after it commits.
    pub fn explore(&self) -> Exploration {
        let committed = self.committed_moves();
        let moves = committed.len();
        let cases = (1..=moves)
            .flat_map(|k| [CrashPoint::BeforeApply(k), CrashPoint::AfterCommit(k)])
            .map(|crash| self.run_case(crash))
            .collect();
        Exploration {
            moves,
            committed,
            cases,
        }
    }

    /// One case: run until `crash`, crash, recover, check.
    pub fn run_case(&self, crash: CrashPoint) -> CaseReport {
        let db = TempStore::new();
        let run_ids = self.run_ids();
        let (agents, witness) = self.witnessed_agents();
        let crasher = Crasher::new(crash);
        // The world of the case (its clock included), the same for both supervisors.
        let consumer = self.consumer();

        // The supervisor that dies.
        let store = db.open();
        let dead_store = store.clone();
        let (config, watcher, driver, first_agents) = (
            consumer.config(self.ttl).observer(crasher.clone()),
            crasher.clone(),
            consumer.clone(),
            agents.clone(),
        );
        with_system(|| async move {
            let Ok(sup) = start_supervisor(store.clone(), config, first_agents) else {
                return;
            };
            let mut crashed = watcher.crashed.subscribe();
            tokio::select! {
                // The crash point lies beyond the runs' last move; or, with waits, the
                // consumer read the runs finished before it heard of the crash.
                _ = driver.drive(&sup, &store, true) => {}
                _ = crashed.wait_for(|crashed| *crashed) => {}
            }
        });
        let crashed = crasher.is_dead();

        // Nothing of the dead supervisor commits while the runs recover.
        let dead_writer = stop_writes(&dead_store);

        // A fresh supervisor recovers until the runs finish.
        let mut violations = Vec::new();
        let (store, config, driver) = (db.open(), consumer.config(self.ttl), consumer.clone());
        let recovered = with_system(|| async move {
            let sup = match start_supervisor(store.clone(), config, agents) {
                Ok(sup) => sup,
                Err(err) => return vec![format!("starting a supervisor: {err}")],
            };
            driver.recover(&sup, &store).await
        });
        violations.extend(recovered.into_iter().map(Violation::Recovery));
        let store = db.open();
        let mut checked = run_ids.clone();
        if self.waits {
            // The explored runs' children too.
            let runs = store.runs(None).unwrap_or_default();
            checked.extend(
                runs.into_iter()
                    .map(|run| run.id)
                    .filter(|id| !run_ids.contains(id)),
            );
        }
        let mut executions = witness.executions();
        let total = executions.len();
        let mut executed: BTreeMap<String, usize> = BTreeMap::new();
        for (key, _) in &executions {
            *executed.entry(key.clone()).or_default() += 1;
        }
        for id in &checked {
            // Each run's own executions: its idempotency keys are `RUN/STEP` (a child's id is
            // its parent's key, so only the last part is the step).
            let (own, others): (Vec<_>, Vec<_>) = executions.into_iter().partition(|(key, _)| {
                key.rsplit_once('/').map(|(run, _)| run) == Some(id.as_str())
            });
            violations.extend(check_invariants(&store, id, &own));
            executions = others;
        }
        // Executions of no explored run.
        let mut strays: BTreeMap<String, usize> = BTreeMap::new();
        for (key, _) in executions {
            *strays.entry(key).or_default() += 1;
        }
        violations.extend(
            strays
                .into_iter()
                .map(|(key, ran)| Violation::Unrecorded { key, ran }),
        );
        if self.waits {
            match store.waits(None, None, crate::MAX_PAGE_LIMIT) {
                Ok(waits) => {
                    violations.extend(waits.into_iter().map(|wait| Violation::LeftWaiting {
                        run_id: wait.run_id,
                        kind: wait.kind,
                    }))
                }
                Err(err) => violations.push(Violation::Unreadable(err.to_string())),
            }
        }
        let runs = checked
            .iter()
            .filter_map(|id| Some((id.clone(), store.run(id).ok()?.state)))
            .collect();
        let report = CaseReport {
            crash,
            crashed,
            state: store.run(&run_ids[0]).ok().map(|run| run.state),
            runs,
            executions: total,
            executed,
            crash_thread: crasher.thread.lock().unwrap().clone(),
            violations,
        };
        // The case is checked: the dead supervisor's threads may end (without a write: they
        // unwind from the observer), and free what they hold.
        crasher.release();
        drop(dead_writer);
        report
    }

    /// How a case's runs are driven, with a world (a clock) of its own.
    fn consumer(&self) -> Consumer {
        Consumer {
            ids: self.run_ids(),
            input: self.input.clone(),
            approve: self.approve.clone(),
            answer: self.answer.clone(),
            clock: self.waits.then(ManualClock::new),
        }
    }

    /// Fresh agents (the explored one first, as [`AGENT`]) whose tools report every execution
    /// to the returned witness. Built-in tools (the waits) are never called: they stay as they
    /// are.
    fn witnessed_agents(&self) -> (Vec<(String, Agent)>, Witness) {
        let witness = Witness::default();
        let witnessed = |mut agent: Agent| {
            let tools = std::mem::take(&mut agent.tools);
            for (name, registered) in tools {
                if registered.wait.is_some() {
                    agent.tools.insert(name, registered);
                    continue;
                }
                agent = agent.shared_tool(Arc::new(Witnessed {
                    inner: registered.tool.clone(),
                    witness: witness.clone(),
                }));
            }
            agent
        };
        let mut agents = vec![(AGENT.to_owned(), witnessed((self.make_agent)()))];
        for (name, make_agent) in &self.others {
            agents.push((name.clone(), witnessed(make_agent())));
        }
        (agents, witness)
    }
}

/// Stops the writes of a crashed supervisor's store, as the death of its process would: once
/// the transactions it may have had open when the crash stopped one of its threads have ended,
/// committed or not, nothing more of it commits. An SQLite store's writer is held until the
/// returned guard is dropped (once the case is checked). A PostgreSQL store commits on several
/// writer threads (its lanes), each with a connection of its own: the crash stops one of them
/// in the observer while another may be committing a group it let through just before, so the
/// store waits for every group in flight and stops for good.
fn stop_writes(store: &Store) -> Option<std::sync::MutexGuard<'_, rusqlite::Connection>> {
    #[cfg(feature = "postgres")]
    if let Some(postgres) = store
        .backend()
        .as_any()
        .downcast_ref::<crate::store::postgres::Postgres>()
    {
        postgres.stop_writes();
        return None;
    }
    crate::sqlite::Sqlite::of(store).map(|sqlite| sqlite.writer_lock())
}

fn start_supervisor(
    store: Store,
    config: Config,
    agents: Vec<(String, Agent)>,
) -> Result<actix::Addr<Supervisor>> {
    agents
        .into_iter()
        .fold(
            Supervisor::builder(store).config(config),
            |builder, (name, agent)| builder.agent(name, agent),
        )
        .start()
}

/// How long a consumer waits for the runs to finish, after which a recovery has failed.
const PATIENCE: Duration = Duration::from_secs(30);

/// The consumer of a case, and its world: starts the explored runs and drives them to their
/// ends, the same way before and after the crash.
#[derive(Clone)]
struct Consumer {
    ids: Vec<RunId>,
    input: Value,
    approve: Approver,
    answer: Answerer,
    /// With waits explored, the case's clock: the supervisors wake the runs, and the consumer
    /// only acts as the world.
    clock: Option<ManualClock>,
}

impl Consumer {
    /// The supervisors' configuration: with waits, they recover, watch, and tell time by the
    /// case's clock.
    fn config(&self, ttl: Duration) -> Config {
        let config = Config::default().lease_ttl(ttl);
        match &self.clock {
            None => config,
            Some(clock) => config
                .clock(clock.clone())
                .watch(Watch::default().every(Duration::from_millis(10)))
                .recovery(
                    Recovery::default()
                        .every(Duration::from_millis(50))
                        .jitter(Duration::ZERO),
                ),
        }
    }

    /// Starts the runs (or, without `start`, those not found) and drives them to their ends.
    async fn drive(
        &self,
        sup: &actix::Addr<Supervisor>,
        store: &Store,
        start: bool,
    ) -> std::result::Result<(), String> {
        match &self.clock {
            Some(clock) => self.settle(sup, store, clock, start).await,
            None => drive_all(sup, &self.ids, &self.input, &self.approve, start)
                .await
                .map_err(|err| err.to_string()),
        }
    }

    /// Drives the runs to their ends after a crash; what failed, run by run.
    async fn recover(&self, sup: &actix::Addr<Supervisor>, store: &Store) -> Vec<String> {
        if self.clock.is_some() {
            return self
                .drive(sup, store, false)
                .await
                .err()
                .into_iter()
                .collect();
        }
        let mut failed = Vec::new();
        // One after the other, each to its end: one run's failure does not hide another's.
        for id in &self.ids {
            let outcome = match store.run(id) {
                // It finished before the crash: nothing to resume.
                Ok(run) if run.state.is_finished() => Ok(()),
                // Resumed; or, if the crash came before the run was inserted, started again
                // as the consumer would.
                found => recover(sup, id, self.input.clone(), &self.approve, found.is_ok())
                    .await
                    .map(drop),
            };
            if let Err(err) = outcome {
                failed.push(format!("{id}: {err}"));
            }
        }
        failed
    }

    /// With waits: spawns the runs (all of them when `start`, else those not found), then
    /// acts as the world on every run of the store until all have finished, resuming none:
    /// the supervisor must wake each.
    async fn settle(
        &self,
        sup: &actix::Addr<Supervisor>,
        store: &Store,
        clock: &ManualClock,
        start: bool,
    ) -> std::result::Result<(), String> {
        let unavailable = |_| "the supervisor stopped".to_owned();
        let settled = Settled::default();
        let subscribe = SubscribeRuns(actix::Actor::start(settled.clone()).recipient());
        sup.send(subscribe).await.map_err(unavailable)?;
        for id in &self.ids {
            if !start && !matches!(store.run(id), Err(Error::RunNotFound(_))) {
                continue;
            }
            let spawn = SpawnRun::new(AGENT, self.input.clone()).with_id(id.clone());
            match sup.send(spawn).await.map_err(unavailable)? {
                // Inserted after all by the crashed supervisor: recovery takes it up.
                Ok(_) | Err(Error::RunExists(_)) => {}
                Err(err) => return Err(format!("{id}: starting it: {err}")),
            }
        }
        let deadline = Instant::now() + PATIENCE;
        // The waits already acted on: (run, step, since).
        let mut acted = BTreeSet::new();
        // The runs seen before their end: this supervisor ends each, and tells so once the
        // call that ended it has returned (after its last move's observer, where a crash
        // stops it).
        let mut seen_open = BTreeSet::new();
        loop {
            let read = |err: Error| format!("reading the runs: {err}");
            let open: Vec<_> = store
                .runs(None)
                .map_err(read)?
                .into_iter()
                .filter(|run| !run.state.is_finished())
                .collect();
            seen_open.extend(open.iter().map(|run| run.id.clone()));
            if open.is_empty() && settled.all(&seen_open) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let open: Vec<String> = open
                    .iter()
                    .map(|run| format!("{} stayed {}", run.id, run.state))
                    .collect();
                return Err(open.join(", "));
            }
            for run in &open {
                self.act(sup, store, clock, run, &mut acted).await?;
            }
            actix_rt::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Does what the world does for `run`, if it waits: answers, decides, lets time pass,
    /// delivers the event; each wait once.
    async fn act(
        &self,
        sup: &actix::Addr<Supervisor>,
        store: &Store,
        clock: &ManualClock,
        run: &crate::Run,
        acted: &mut BTreeSet<(RunId, u32, std::time::SystemTime)>,
    ) -> std::result::Result<(), String> {
        let unavailable = |_| "the supervisor stopped".to_owned();
        let failed = |what: &str, err: Error| format!("{}: {what}: {err}", run.id);
        if run.state == RunState::WaitingForApproval {
            // Listed until its decision is recorded, and the consumer waits for that.
            let pending = store
                .pending_calls(&run.id)
                .map_err(|err| failed("reading its pending calls", err))?;
            for call in pending {
                let approval = if (self.approve)(&call) {
                    Approval::approve(run.id.clone(), call.call_id, "explorer")
                } else {
                    Approval::deny(run.id.clone(), call.call_id, "explorer")
                };
                match sup
                    .send(RecordApproval(approval))
                    .await
                    .map_err(unavailable)?
                {
                    Err(err) if !err.is_run_state() => return Err(failed("deciding", err)),
                    _ => {}
                }
            }
            return Ok(());
        }
        if run.state.waits_for().is_none() {
            return Ok(());
        }
        // Read again: it may have moved since it was listed.
        let Some(wait) = store
            .wait(&run.id)
            .map_err(|err| failed("reading its wait", err))?
        else {
            return Ok(());
        };
        if wait.kind == WaitKind::Timer {
            // Time passes until the timer's time: the supervisor's clock, read on.
            let due = wait.due_at.unwrap_or(wait.since);
            if let Ok(ahead) = due.duration_since(clock.now()) {
                clock.advance(ahead + Duration::from_millis(1));
            }
            return Ok(());
        }
        if !acted.insert((run.id.clone(), wait.step, wait.since)) {
            return Ok(());
        }
        let outcome = match wait.kind {
            WaitKind::Answer => {
                let answer = Answer {
                    run_id: run.id.clone(),
                    call_id: wait.call_id.clone(),
                    answer: (self.answer)(&wait),
                    by: "explorer".into(),
                };
                sup.send(AnswerQuestion(answer))
                    .await
                    .map_err(unavailable)?
            }
            WaitKind::Event => {
                let delivery = Delivery {
                    run_id: run.id.clone(),
                    name: wait.key.clone(),
                    event_id: crate::store::model::idempotency_key(&run.id, wait.step),
                    payload: json!({}),
                };
                sup.send(DeliverEvent(delivery))
                    .await
                    .map_err(unavailable)?
                    .map(drop)
            }
            // A child's end wakes its parent.
            WaitKind::Child | WaitKind::Timer => Ok(()),
        };
        match outcome {
            // Answered or resumed meanwhile (before a crash, say).
            Err(err) if !err.is_run_state() => Err(failed("acting on its wait", err)),
            _ => Ok(()),
        }
    }
}

/// Drives a run to its end as a consumer would: start it (when `start`) or resume it, decide
/// every call that waits for a person, wait out leases of dead supervisors.
async fn drive(
    sup: &actix::Addr<Supervisor>,
    run_id: &RunId,
    input: Value,
    approve: &Approver,
    start: bool,
) -> Result<RunReply> {
    let patience = Duration::from_secs(30);
    let mut reply = if start {
        sup.send(StartRun::new(AGENT, input).with_id(run_id.clone()))
            .await
            .map_err(|_| Error::StoreUnavailable)?
    } else {
        resume_when_free(sup, run_id, patience).await
    };
    loop {
        match reply {
            Ok(RunReply {
                outcome: Outcome::WaitingForApproval { pending },
                ..
            }) => {
                let approval = if approve(&pending) {
                    Approval::approve(run_id.clone(), pending.call_id, "explorer")
                } else {
                    Approval::deny(run_id.clone(), pending.call_id, "explorer")
                };
                sup.send(RecordApproval(approval))
                    .await
                    .map_err(|_| Error::StoreUnavailable)??;
                reply = resume_when_free(sup, run_id, patience).await;
            }
            // The loop lost its lease (a stalled machine): a consumer resumes.
            Err(Error::LeaseLost { .. }) => reply = resume_when_free(sup, run_id, patience).await,
            other => return other,
        }
    }
}

/// Drives a run to its end after a crash, as a consumer would: resumes it if it was `found`;
/// otherwise starts it again, and resumes it if the start finds it inserted after all (a commit
/// the dead process had sent may land after the consumer looked), as [`Error::RunExists`] says.
async fn recover(
    sup: &actix::Addr<Supervisor>,
    run_id: &RunId,
    input: Value,
    approve: &Approver,
    found: bool,
) -> Result<RunReply> {
    match drive(sup, run_id, input.clone(), approve, !found).await {
        Err(Error::RunExists(_)) if !found => drive(sup, run_id, input, approve, false).await,
        other => other,
    }
}

/// Drives `ids` at once, as many consumers would.
async fn drive_all(
    sup: &actix::Addr<Supervisor>,
    ids: &[RunId],
    input: &Value,
    approve: &Approver,
    start: bool,
) -> Result<()> {
    let runs = ids
        .iter()
        .map(|id| drive(sup, id, input.clone(), approve, start));
    for outcome in futures_util::future::join_all(runs).await {
        outcome?;
    }
    Ok(())
}

/// The runs whose execution a supervisor told ended with the run finished.
#[derive(Clone, Default)]
struct Settled(Arc<Mutex<BTreeSet<RunId>>>);

impl Settled {
    fn all(&self, runs: &BTreeSet<RunId>) -> bool {
        runs.is_subset(&self.0.lock().unwrap())
    }
}

impl actix::Actor for Settled {
    type Context = actix::Context<Self>;
}

impl actix::Handler<RunSettled> for Settled {
    type Result = ();

    fn handle(&mut self, settled: RunSettled, _: &mut actix::Context<Self>) {
        if let Ok(Outcome::Succeeded { .. } | Outcome::Failed { .. } | Outcome::Cancelled { .. }) =
            settled.result
        {
            self.0.lock().unwrap().insert(settled.run_id);
        }
    }
}

/// Records committed moves.
#[derive(Clone, Default)]
struct MoveCounter {
    committed: Arc<Mutex<Vec<MoveInfo>>>,
}

impl MoveObserver for MoveCounter {
    fn after_commit(&self, info: &MoveInfo) {
        self.committed.lock().unwrap().push(info.clone());
    }
}

/// Stops the thread that applies the move at the crash point for good, and says so.
#[derive(Clone)]
struct Crasher {
    at: CrashPoint,
    applying: Arc<AtomicUsize>,
    committed: Arc<AtomicUsize>,
    crashed: Arc<watch::Sender<bool>>,
    /// The thread the crash stopped first.
    thread: Arc<Mutex<Option<String>>>,
    /// Set once the case is checked: the stopped threads may end.
    released: Arc<(Mutex<bool>, std::sync::Condvar)>,
}

/// What a stopped thread unwinds with once its case is checked (no panic message).
struct Released;

impl Crasher {
    fn new(at: CrashPoint) -> Self {
        Crasher {
            at,
            applying: Arc::default(),
            committed: Arc::default(),
            crashed: Arc::new(watch::Sender::new(false)),
            thread: Arc::default(),
            released: Arc::default(),
        }
    }

    /// Lets the stopped threads end.
    fn release(&self) {
        let (released, wake) = &*self.released;
        *released.lock().unwrap() = true;
        wake.notify_all();
    }

    /// The calling thread stops here, as if its process died, and never runs again: the store
    /// actor's thread or a PostgreSQL writer lane's (which then hold no transaction), or the
    /// log-sync thread (whose groups' callers then never hear of them). Every thread that
    /// reaches the observer afterwards stops too, so nothing is applied, answered or observed
    /// after the crash: a writer thread stops before its next group, holding no transaction.
    /// A group another lane let through just before is still being applied: [`stop_writes`]
    /// waits for it.
    fn die(&self) -> ! {
        if !self.crashed.send_replace(true) {
            // The store actor's thread has no name of its own.
            let name = std::thread::current()
                .name()
                .unwrap_or(STORE_THREAD)
                .to_owned();
            *self.thread.lock().unwrap() = Some(name);
        }
        let (released, wake) = &*self.released;
        let mut released = released.lock().unwrap();
        while !*released {
            released = wake.wait(released).unwrap();
        }
        drop(released);
        // Ends the thread, once the case is checked, without a write: the observer is called
        // outside any transaction. Its resources (connections, the log's descriptor) go with it.
        std::panic::resume_unwind(Box::new(Released))
    }

    fn is_dead(&self) -> bool {
        *self.crashed.borrow()
    }
}

impl MoveObserver for Crasher {
    fn before_apply(&self, _: &MoveInfo) {
        let k = self.applying.fetch_add(1, Ordering::SeqCst) + 1;
        if self.is_dead() || self.at == CrashPoint::BeforeApply(k) {
            self.die();
        }
    }

    fn after_commit(&self, _: &MoveInfo) {
        let k = self.committed.fetch_add(1, Ordering::SeqCst) + 1;
        if self.is_dead() || self.at == CrashPoint::AfterCommit(k) {
            self.die();
        }
    }

    fn committed(&self, _: &[&MoveInfo]) {
        if self.is_dead() {
            self.die();
        }
    }
}

/// The executions of the explored agent's tools: (idempotency key, attempt).
#[derive(Clone, Default)]
struct Witness(Arc<Mutex<Vec<(String, u32)>>>);

impl Witness {
    fn executions(&self) -> Vec<(String, u32)> {
        self.0.lock().unwrap().clone()
    }
}

/// A tool that tells the witness of each execution before it begins.
struct Witnessed {
    inner: Arc<dyn Tool>,
    witness: Witness,
}

#[async_trait(?Send)]
impl Tool for Witnessed {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn description(&self) -> &str {
        self.inner.description()
    }

    fn parameters(&self) -> Value {
        self.inner.parameters()
    }

    fn idempotent(&self) -> bool {
        self.inner.idempotent()
    }

    async fn call(&self, ctx: &ToolContext, args: &Value) -> std::result::Result<Value, ToolError> {
        self.witness
            .0
            .lock()
            .unwrap()
            .push((ctx.idempotency_key.clone(), ctx.attempt));
        self.inner.call(ctx, args).await
    }

    async fn reconcile(&self, ctx: &ToolContext, args: &Value) -> Option<Reconciliation> {
        self.inner.reconcile(ctx, args).await
    }
}

/// An invariant that did not hold.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Violation {
    /// Driving the run to its end failed.
    Recovery(String),
    /// The run or its events could not be read.
    Unreadable(String),
    /// The run did not finish.
    NotFinished(RunState),
    /// A lease was left on the run.
    LeftLeased(String),
    /// The log is not gapless or well formed.
    MalformedLog(String),
    /// A step was interrupted more (or less) often than reconciled.
    Unreconciled {
        /// The step.
        step: u32,
        /// Its interruptions.
        interrupted: usize,
        /// Its reconciliations.
        reconciled: usize,
    },
    /// An attempt was started again without a reconciliation choosing to.
    UnjustifiedAttempt {
        /// The step.
        step: u32,
        /// Attempts started.
        started: usize,
        /// Reconciliations that chose to run it again.
        run_again: usize,
    },
    /// A side effect ran more often than its attempts were started.
    DuplicateExecution {
        /// The step.
        step: u32,
        /// Executions seen.
        ran: usize,
        /// Attempts started.
        started: usize,
    },
    /// A step started and never finished in a finished run.
    NeverFinished {
        /// The step.
        step: u32,
    },
    /// Executions of a call no step recorded starting.
    Unrecorded {
        /// The idempotency key.
        key: String,
        /// Executions seen.
        ran: usize,
    },
    /// A run was left with a wait once every run had finished, or was given up on.
    LeftWaiting {
        /// The run.
        run_id: RunId,
        /// What it waits for.
        kind: WaitKind,
    },
}

impl Violation {
    /// True for a side effect run more than its recorded attempts allow.
    pub fn is_duplicate(&self) -> bool {
        matches!(
            self,
            Violation::UnjustifiedAttempt { .. }
                | Violation::DuplicateExecution { .. }
                | Violation::Unrecorded { .. }
        )
    }

    /// True for something missing from the log: an event, a finish, a reconciliation.
    pub fn is_lost(&self) -> bool {
        matches!(
            self,
            Violation::MalformedLog(_)
                | Violation::Unreconciled { .. }
                | Violation::NeverFinished { .. }
                | Violation::NotFinished(_)
                | Violation::LeftWaiting { .. }
        )
    }
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Violation::Recovery(err) => write!(f, "the recovery failed: {err}"),
            Violation::Unreadable(err) => write!(f, "the run cannot be read: {err}"),
            Violation::NotFinished(state) => write!(f, "the run did not finish: {state}"),
            Violation::LeftLeased(lease) => write!(f, "the run is left leased: {lease}"),
            Violation::MalformedLog(what) => write!(f, "the log is malformed: {what}"),
            Violation::Unreconciled {
                step,
                interrupted,
                reconciled,
            } => {
                write!(
                    f,
                    "step {step}: {interrupted} interruptions, {reconciled} reconciliations"
                )
            }
            Violation::UnjustifiedAttempt {
                step,
                started,
                run_again,
            } => {
                write!(
                    f,
                    "step {step}: {started} attempts started, {run_again} reconciliations chose to run again"
                )
            }
            Violation::DuplicateExecution { step, ran, started } => {
                write!(
                    f,
                    "step {step}: the side effect ran {ran} times for {started} recorded starts"
                )
            }
            Violation::NeverFinished { step } => {
                write!(f, "step {step} started and never finished")
            }
            Violation::Unrecorded { key, ran } => write!(
                f,
                "{ran} execution(s) with key {key} that no step recorded starting"
            ),
            Violation::LeftWaiting { run_id, kind } => {
                write!(f, "run {run_id} was left waiting for {kind}")
            }
        }
    }
}

/// The invariants of a run after crashes and resumes, given the executions of its tools'
/// side effects as (idempotency key, attempt); returns what did not hold.
pub fn check_invariants(
    store: &Store,
    run_id: &RunId,
    executions: &[(String, u32)],
) -> Vec<Violation> {
    let mut violations = Vec::new();
    let run = match store.run(run_id) {
        Ok(run) => run,
        Err(err) => return vec![Violation::Unreadable(err.to_string())],
    };
    if !matches!(run.state, RunState::Succeeded | RunState::Failed) {
        violations.push(Violation::NotFinished(run.state));
    }
    match store.lease(run_id) {
        Ok(None) => {}
        other => violations.push(Violation::LeftLeased(format!("{other:?}"))),
    }
    let events = match store.events(run_id) {
        Ok(events) => events,
        Err(err) => return vec![Violation::Unreadable(err.to_string())],
    };
    violations.extend(check_log(&events).into_iter().map(Violation::MalformedLog));

    // Per step: interruptions, reconciliations, starts, and the reasons to start again.
    #[derive(Default, Debug)]
    struct Step {
        interrupted: usize,
        reconciled: usize,
        run_again: usize,
        started: usize,
        finished: usize,
    }
    let mut steps: BTreeMap<u32, Step> = BTreeMap::new();
    for event in &events {
        // A drain abandoned a model call: its next attempt is justified.
        if event.kind == EventKind::RunReleased
            && let Some(number) = event.payload["abandoned"]["step"].as_u64()
        {
            steps.entry(number as u32).or_default().run_again += 1;
        }
        let Some(number) = event.step else { continue };
        let step = steps.entry(number).or_default();
        match event.kind {
            // A tool asked to be called again later: its next attempt is justified.
            EventKind::RunWaiting if event.payload["detail"]["retry"] == true => {
                step.run_again += 1
            }
            // A failed model attempt that the model policy tries again.
            EventKind::ModelAttemptFailed => step.run_again += 1,
            // A timed-out call is interrupted by its own loop, and reconciled the same way.
            EventKind::StepInterrupted | EventKind::ToolTimedOut => step.interrupted += 1,
            EventKind::StepReconciled => {
                step.reconciled += 1;
                if matches!(
                    event.payload["action"].as_str(),
                    Some("run_again" | "await_approval" | "dispatch_again")
                ) {
                    step.run_again += 1;
                }
            }
            EventKind::ToolStarted | EventKind::ModelStarted => step.started += 1,
            EventKind::ToolFinished | EventKind::ModelFinished => step.finished += 1,
            _ => {}
        }
    }
    let mut executed: HashMap<&str, usize> = HashMap::new();
    for (key, _) in executions {
        *executed.entry(key.as_str()).or_default() += 1;
    }
    for (&step, counts) in &steps {
        let Step {
            interrupted,
            reconciled,
            run_again,
            started,
            finished,
        } = *counts;
        if interrupted != reconciled {
            violations.push(Violation::Unreconciled {
                step,
                interrupted,
                reconciled,
            });
        }
        if started > 1 + run_again {
            violations.push(Violation::UnjustifiedAttempt {
                step,
                started,
                run_again,
            });
        }
        let key = crate::store::model::idempotency_key(run_id, step);
        let ran = executed.remove(key.as_str()).unwrap_or(0);
        if ran > started {
            violations.push(Violation::DuplicateExecution { step, ran, started });
        }
        if started > 0 && finished == 0 && run.state != RunState::Failed {
            violations.push(Violation::NeverFinished { step });
        }
    }
    for (key, ran) in executed {
        violations.push(Violation::Unrecorded {
            key: key.to_owned(),
            ran,
        });
    }
    violations
}

/// The log's own invariants: gapless, well formed, finished once.
fn check_log(events: &[Event]) -> Vec<String> {
    let mut violations = Vec::new();
    for (index, event) in events.iter().enumerate() {
        if event.seq != index as u64 + 1 {
            violations.push(format!(
                "event {} has sequence number {}",
                index + 1,
                event.seq
            ));
        }
        if !event.payload.is_object() {
            violations.push(format!(
                "event {} ({}) has a payload that is not an object",
                event.seq, event.kind
            ));
        }
        let about_a_step = !matches!(
            event.kind,
            EventKind::RunStarted
                | EventKind::RunForked
                | EventKind::RunResumed
                | EventKind::RunFinished
                | EventKind::LeaseTakenOver
                | EventKind::RunReleased
                | EventKind::RunHandedOver
        );
        // An event delivered is about the step that waited for it, or kept for none yet.
        if event.kind == EventKind::EventReceived {
            continue;
        }
        if about_a_step != event.step.is_some() {
            violations.push(format!(
                "event {} ({}) step {:?}",
                event.seq, event.kind, event.step
            ));
        }
    }
    if events.first().map(|e| e.kind) != Some(EventKind::RunStarted) {
        violations.push("the log does not begin with run.started".into());
    }
    let finished = events
        .iter()
        .filter(|e| e.kind == EventKind::RunFinished)
        .count();
    if finished != 1 {
        violations.push(format!("run.finished appears {finished} times"));
    }
    violations
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::{ModelResponse, testkit::ScriptedModel};

    #[test]
    fn a_recovery_that_finds_the_run_inserted_after_all_resumes_it() {
        let db = TempStore::new();
        let id = RunId::from("late");
        let config = || Config::default().lease_ttl(Duration::from_millis(100));
        // A supervisor inserts the run and dies while its model is asked.
        let model = ScriptedModel::new(vec![ModelResponse::answer("done")]).block_at_turn(0);
        let (store, agent, asked, run) = (
            db.open(),
            Agent::new(model.clone()),
            model.clone(),
            id.clone(),
        );
        with_system(|| async move {
            let sup = start_supervisor(store, config(), vec![(AGENT.into(), agent)]).unwrap();
            actix_rt::spawn(sup.send(StartRun::new(AGENT, json!({})).with_id(run)));
            asked.wait_calls(1).await;
        });
        // The consumer looked before the insert committed: it starts the run, which exists.
        let agent = Agent::new(ScriptedModel::new(vec![ModelResponse::answer("done")]));
        let (store, approve): (_, Approver) = (db.open(), Arc::new(|_| true));
        let reply = with_system(|| async move {
            let sup = start_supervisor(store, config(), vec![(AGENT.into(), agent)]).unwrap();
            recover(&sup, &id, json!({}), &approve, false).await
        });
        let outcome = reply.expect("the run is resumed").outcome;
        assert!(matches!(outcome, Outcome::Succeeded { .. }), "{outcome:?}");
    }

    #[cfg(feature = "postgres")]
    mod on_postgres {
        use std::{
            sync::mpsc,
            time::{Duration, Instant},
        };

        use serde_json::json;

        use super::super::*;
        use crate::{
            ModelResponse,
            store::postgres::testing::{Schema, server},
            testkit::ScriptedModel,
        };

        /// Crashes at the first move of run `at`; tells of the moves of other runs it lets through,
        /// with the thread that applies them.
        #[derive(Clone)]
        struct CrashAtRun {
            crasher: Crasher,
            at: RunId,
            applying: Arc<watch::Sender<Vec<(RunId, String)>>>,
        }

        impl MoveObserver for CrashAtRun {
            fn before_apply(&self, info: &MoveInfo) {
                if self.crasher.is_dead() || info.run_id == self.at {
                    self.crasher.die();
                }
                let thread = std::thread::current().name().unwrap_or_default().to_owned();
                self.applying
                    .send_modify(|seen| seen.push((info.run_id.clone(), thread)));
            }

            fn after_commit(&self, _: &MoveInfo) {
                if self.crasher.is_dead() {
                    self.crasher.die();
                }
            }

            fn committed(&self, _: &[&MoveInfo]) {
                if self.crasher.is_dead() {
                    self.crasher.die();
                }
            }
        }

        /// Whether `sql`, a query of one boolean, says true on the schema's server.
        fn holds(schema: &Schema, sql: &str) -> bool {
            schema.client().query_one(sql, &[]).unwrap().get(0)
        }

        /// Waits until `condition` holds, for at most `ttl`; whether it did.
        fn within(ttl: Duration, mut condition: impl FnMut() -> bool) -> bool {
            let deadline = Instant::now() + ttl;
            while !condition() {
                if Instant::now() >= deadline {
                    return false;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            true
        }

        #[test]
        fn a_crash_stops_every_writer_lane_once_the_group_each_had_in_flight_has_ended() {
            let Some(server) = server() else { return };
            let schema = Schema::new(&server);
            // Two runs on different lanes: the second run comes while the first lane has a move
            // unanswered, which spills it to the other (checked below by the threads that
            // applied their moves).
            let open = || {
                crate::postgres::Options::new()
                    .writers(2)
                    .spill_at(1)
                    .open(&schema.url())
                    .unwrap()
            };
            let in_flight = RunId::from("in-flight");
            let crashing = RunId::from("crashing");

            let dead = open();
            // Another connection keeps every write of the runs table waiting (reads go on), so
            // that the group starting `in_flight`, once past its observer, waits inside its
            // transaction while the other lane's crashes.
            let mut blocker = schema.client();
            let mut blocking = blocker.transaction().unwrap();
            blocking
                .batch_execute("LOCK TABLE runs IN SHARE MODE")
                .unwrap();
            let observer = CrashAtRun {
                crasher: Crasher::new(CrashPoint::BeforeApply(0)),
                at: crashing.clone(),
                applying: Arc::new(watch::Sender::new(Vec::new())),
            };
            let (store, watched, ids) = (
                dead.clone(),
                observer.clone(),
                (in_flight.clone(), crashing.clone()),
            );
            let waiting = || {
                holds(
                    &schema,
                    "SELECT count(*) > 0 FROM pg_locks WHERE relation = 'runs'::regclass AND NOT granted",
                )
            };
            with_system(|| async move {
                let agent = Agent::new(ScriptedModel::new(vec![ModelResponse::answer("done")]));
                let config = Config::default().observer(watched.clone());
                let sup = start_supervisor(store, config, vec![(AGENT.into(), agent)]).unwrap();
                let mut applying = watched.applying.subscribe();
                let mut crashed = watched.crasher.crashed.subscribe();
                let start =
                    |id: &RunId| sup.send(StartRun::new(AGENT, json!({})).with_id(id.clone()));
                actix_rt::spawn(start(&ids.0));
                applying
                    .wait_for(|seen| seen.iter().any(|(run, _)| *run == ids.0))
                    .await
                    .unwrap();
                // The group waits for the lock (checked on a thread of its own: the driver blocks).
                let waits = std::thread::scope(|scope| {
                    scope
                        .spawn(|| within(Duration::from_secs(10), waiting))
                        .join()
                        .unwrap()
                });
                assert!(
                    waits,
                    "the group of the first run never waited for the lock"
                );
                actix_rt::spawn(start(&ids.1));
                crashed.wait_for(|crashed| *crashed).await.unwrap();
            });
            let crash_thread = observer.crasher.thread.lock().unwrap().clone();
            let lanes: Vec<_> = observer
                .applying
                .borrow()
                .iter()
                .map(|(_, thread)| Some(thread.clone()))
                .collect();
            assert!(
                !lanes.contains(&crash_thread),
                "the runs shared a lane: {crash_thread:?} and {lanes:?}"
            );

            // The recovery: the dead store stops, then a fresh one reads.
            let (read, has_read) = mpsc::channel();
            let recovery = std::thread::spawn({
                let (recovering, id) = (open(), in_flight.clone());
                move || {
                    let stopped = stop_writes(&dead);
                    let seen = recovering.run(&id).is_ok();
                    read.send(()).unwrap();
                    drop(stopped);
                    seen
                }
            });
            // A stop that waits for the group in flight cannot end while the lock is held: give the
            // recovery a short while to read (it does at once, if it does not wait), then let the
            // group go on.
            let _ = has_read.recv_timeout(Duration::from_millis(500));
            blocking.rollback().unwrap();
            let seen = recovery.join().unwrap();
            // Whatever the dead store's lanes commit now came after the recovery read.
            let later = within(Duration::from_secs(2), || open().run(&in_flight).is_ok());
            observer.crasher.release();
            assert_eq!(
                seen, later,
                "the recovery read the run as inserted: {seen}; the dead store inserted it: {later}"
            );
        }
    }
}
