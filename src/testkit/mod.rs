//! Helpers for testing agents built on agentrt (cargo feature `testkit`): a scripted model, a
//! recording tool, deterministic clocks, temporary stores, and an actix system whose end is a
//! crash.
//!
//! ```
//! use agentrt::{Agent, Outcome, StartRun, Supervisor, ToolCall, ModelResponse};
//! use agentrt::testkit::{with_system, RecordingTool, ScriptedModel, TempStore};
//! use serde_json::json;
//!
//! let db = TempStore::new();
//! let lookup = RecordingTool::new("lookup");
//! let model = ScriptedModel::new(vec![
//!     ModelResponse::calls(vec![ToolCall::new("c1", "lookup", json!({"q": "x"}))]),
//!     ModelResponse::answer("done"),
//! ]);
//! let agent = Agent::new(model).tool(lookup.clone());
//! let reply = with_system(|| async move {
//!     let supervisor = Supervisor::builder(db.open()).agent("demo", agent).start().unwrap();
//!     supervisor.send(StartRun::new("demo", json!({}))).await.unwrap()
//! });
//! assert!(matches!(reply.unwrap().outcome, Outcome::Succeeded { .. }));
//! assert_eq!(lookup.executions().len(), 1);
//! ```

mod explorer;
mod fenced;
mod raw;

pub use explorer::{
    CaseReport, CrashPoint, Exploration, Explorer, STORE_THREAD, Violation, check_invariants,
};
pub use fenced::{Admission, Application, FencedResource, FencedTool, Refusal};
pub use raw::WriteBlock;

/// The runs whose leases a supervisor renews now: send it to the
/// [`Supervisor`](crate::Supervisor) to see what its lease keeper holds.
pub use crate::actors::lease_keeper::HeldLeases;
/// The fault-injection seam of an SQLite store; see [`faults`].
pub use crate::store::sqlite::faults::{FaultKind, Faults};

/// The fault-injection seam of `store`'s SQLite backend, if it has that backend: count its log
/// syncs and the writes and syncs SQLite makes of its files, or make the next one fail.
pub fn faults(store: &Store) -> Option<&Faults> {
    crate::sqlite::Sqlite::of(store).map(|sqlite| &sqlite.faults)
}

use std::{
    collections::{BTreeMap, VecDeque},
    future::Future,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    time::{Duration, SystemTime},
};

use serde_json::{Value, json};
use tokio::sync::{Semaphore, watch};

use crate::{
    Clock, Error, LeaseLost, Model, ModelError, ModelRequest, ModelResponse, Reconciliation,
    Result, ResumeRun, RunId, RunReply, Store, Supervisor, Tool, ToolContext, ToolError,
    async_trait,
    types::{ChatMessage, ToolSpec},
};

/// PostgreSQL for tests: the server, and a schema of its own for each store.
#[cfg(feature = "postgres")]
pub mod postgres {
    pub use crate::store::postgres::testing::{SERVER_VARIABLE, Schema, server};
}

/// Moves the wall clock that lease times are read from (never [`Config::clock`]'s), for this
/// whole process, until dropped: how a test shows that a loop judges its own lease by the
/// monotonic clock, whatever the wall clock does. Every thread sees it, so a test that uses it
/// should have its test binary to itself, or hold a lock around it.
///
/// [`Config::clock`]: crate::Config::clock
#[derive(Debug)]
#[must_use = "the shift ends when the guard is dropped"]
pub struct WallClockShift(i64);

impl WallClockShift {
    /// Moves the wall clock forward by `millis` milliseconds (back, for a negative number),
    /// on top of any other shift in force.
    pub fn by(millis: i64) -> Self {
        crate::clock::WALL_SHIFT.fetch_add(millis, Ordering::SeqCst);
        WallClockShift(millis)
    }
}

impl Drop for WallClockShift {
    fn drop(&mut self) {
        crate::clock::WALL_SHIFT.fetch_sub(self.0, Ordering::SeqCst);
    }
}

/// Runs `f` in a fresh actix system and tears the system down when its future completes.
///
/// Whatever is still executing then (a run blocked in a tool, say) is dropped where it stands,
/// with no further write: this is how a test crashes a supervisor. The store it used stays on
/// disk for the next system to resume.
pub fn with_system<F, Fut, R>(f: F) -> R
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = R>,
{
    let system = actix::System::new();
    let result = system.block_on(f());
    drop(system);
    result
}

/// The variable that chooses the backend of every [`TempStore`]: `postgres` for a schema of
/// its own on the server named by `AGENTRT_TEST_POSTGRES_URL` (with the `postgres` feature),
/// anything else (or nothing) for an SQLite file.
pub const BACKEND_VARIABLE: &str = "AGENTRT_TEST_BACKEND";

/// Whether [`TempStore`]s are PostgreSQL schemas in this process (see [`BACKEND_VARIABLE`]).
pub fn on_postgres() -> bool {
    std::env::var(BACKEND_VARIABLE).is_ok_and(|backend| backend == "postgres")
}

/// A temporary store, removed when dropped: an SQLite file in a temporary directory, or, when
/// [`BACKEND_VARIABLE`] says `postgres`, a schema of its own on the test server, so that a
/// behaviour test runs unchanged on either backend.
pub struct TempStore {
    dir: tempfile::TempDir,
    #[cfg(feature = "postgres")]
    schema: Option<postgres::Schema>,
}

impl TempStore {
    /// A new temporary directory (and schema, on PostgreSQL); the database is created at first
    /// [`TempStore::open`].
    ///
    /// # Panics
    ///
    /// On PostgreSQL, when the test server does not answer.
    pub fn new() -> Self {
        TempStore {
            dir: tempfile::tempdir().expect("a temporary directory"),
            #[cfg(feature = "postgres")]
            // On a thread of its own, as the schema's drop: so that a test may make one on an
            // actix thread.
            schema: on_postgres().then(|| {
                std::thread::spawn(|| {
                    let server = postgres::server()
                        .expect("AGENTRT_TEST_BACKEND=postgres needs a test server");
                    postgres::Schema::new(&server)
                })
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            }),
        }
    }

    /// A new temporary directory whose database is an SQLite file, whatever
    /// [`BACKEND_VARIABLE`] says: for a test of what only the SQLite backend does (its files,
    /// its migrations, its faults, the command line's file handling), which then tests SQLite
    /// on every pass.
    pub fn sqlite() -> Self {
        TempStore {
            dir: tempfile::tempdir().expect("a temporary directory"),
            #[cfg(feature = "postgres")]
            schema: None,
        }
    }

    /// The SQLite database file's path (a file beside the schema, on PostgreSQL, which
    /// nothing opens unless a test does).
    pub fn path(&self) -> PathBuf {
        self.dir.path().join("agentrt.db")
    }

    /// Where the store is, as [`Store::connect`] and the command line take it: the file's
    /// path, or the schema's URL.
    pub fn location(&self) -> String {
        #[cfg(feature = "postgres")]
        if let Some(schema) = &self.schema {
            return schema.url();
        }
        self.path().display().to_string()
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Opens the database (each call is a new handle, as a new process would have).
    pub fn open(&self) -> Store {
        Store::connect(&self.location()).expect("the temporary store opens")
    }
}

impl Drop for TempStore {
    fn drop(&mut self) {
        #[cfg(feature = "postgres")]
        if let Some(schema) = self.schema.take() {
            // The schema is dropped on the server through a connection of its own, on a thread
            // of its own: the driver blocks on a runtime, which an actix thread may not do.
            let _ = std::thread::spawn(move || drop(schema)).join();
        }
    }
}

impl Default for TempStore {
    fn default() -> Self {
        TempStore::new()
    }
}

/// A clock that always says the same time.
#[derive(Debug, Clone, Copy)]
pub struct FixedClock(pub SystemTime);

impl Clock for FixedClock {
    fn now(&self) -> SystemTime {
        self.0
    }
}

/// A clock that runs with the system's, moved ahead by the test: how a timer's due time or a
/// schedule's next occurrence is reached without waiting for it. Clones share the offset.
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    ahead_ms: Arc<AtomicU64>,
}

impl ManualClock {
    /// The system's time, until moved.
    pub fn new() -> Self {
        ManualClock::default()
    }

    /// Moves the clock (and its clones) `by` ahead.
    pub fn advance(&self, by: Duration) {
        self.ahead_ms
            .fetch_add(by.as_millis() as u64, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> SystemTime {
        SystemTime::now() + Duration::from_millis(self.ahead_ms.load(Ordering::SeqCst))
    }
}

/// A clock that counts its readings, each one millisecond after the last. Clones share the
/// count.
#[derive(Debug, Clone)]
pub struct CountingClock {
    start: SystemTime,
    reads: Arc<AtomicU64>,
}

impl CountingClock {
    /// Starts at `start`.
    pub fn starting_at(start: SystemTime) -> Self {
        CountingClock {
            start,
            reads: Arc::new(AtomicU64::new(0)),
        }
    }

    /// How many times it was read.
    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::SeqCst)
    }
}

impl Default for CountingClock {
    fn default() -> Self {
        CountingClock::starting_at(SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000))
    }
}

impl Clock for CountingClock {
    fn now(&self) -> SystemTime {
        let read = self.reads.fetch_add(1, Ordering::SeqCst);
        self.start + Duration::from_millis(read)
    }
}

/// Counts entries into a call and holds them until released.
#[derive(Debug)]
struct Gate {
    entered: watch::Sender<usize>,
    released: Semaphore,
}

impl Gate {
    fn new() -> Self {
        Gate {
            entered: watch::Sender::new(0),
            released: Semaphore::new(0),
        }
    }

    fn enter(&self) {
        self.entered.send_modify(|count| *count += 1);
    }

    async fn wait_entered(&self, count: usize) {
        let mut rx = self.entered.subscribe();
        rx.wait_for(|entered| *entered >= count)
            .await
            .expect("the gate lives");
    }

    async fn hold(&self) {
        self.released
            .acquire()
            .await
            .expect("the gate lives")
            .forget();
    }
}

/// A model that answers from a script: its n-th response answers the n-th turn (the number of
/// earlier responses in the conversation), so a call dispatched again gets the same answer.
/// An agent whose `map_input` adds example `ChatMessage::Assistant` turns shifts the script by as
/// many.
#[derive(Clone)]
pub struct ScriptedModel {
    inner: Arc<ModelInner>,
}

struct ModelInner {
    script: Vec<Result<ModelResponse, ModelError>>,
    block_turn: Mutex<Option<usize>>,
    /// Per turn: the errors its next calls fail with, before the script answers.
    failures: Mutex<BTreeMap<usize, VecDeque<ModelError>>>,
    calls: AtomicUsize,
    seen: Mutex<Vec<SeenRequest>>,
    gate: Gate,
}

/// One call a [`ScriptedModel`] was given: what the model was asked.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct SeenRequest {
    /// The model step.
    pub step: u32,
    /// The attempt of the step.
    pub attempt: u32,
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// The tools offered.
    pub tools: Vec<ToolSpec>,
}

impl ScriptedModel {
    /// Answers with `responses`, in order; a turn past the end is a model error.
    pub fn new(responses: Vec<ModelResponse>) -> Self {
        ScriptedModel::with_results(responses.into_iter().map(Ok).collect())
    }

    /// Answers with `results`, errors included.
    pub fn with_results(script: Vec<Result<ModelResponse, ModelError>>) -> Self {
        ScriptedModel {
            inner: Arc::new(ModelInner {
                script,
                block_turn: Mutex::new(None),
                failures: Mutex::new(BTreeMap::new()),
                calls: AtomicUsize::new(0),
                seen: Mutex::new(Vec::new()),
                gate: Gate::new(),
            }),
        }
    }

    /// Calls for turn `turn` (from 0) block until [`ScriptedModel::release`].
    pub fn block_at_turn(self, turn: usize) -> Self {
        *self.inner.block_turn.lock().unwrap() = Some(turn);
        self
    }

    /// The next calls for turn `turn` (from 0) fail with `errors`, one each, in order; the
    /// calls after them answer from the script. How a test plays a flaky server: a
    /// [retryable](ModelError::retryable) error is tried again by the agent's model policy.
    pub fn failing_at_turn(self, turn: usize, errors: Vec<ModelError>) -> Self {
        self.inner
            .failures
            .lock()
            .unwrap()
            .entry(turn)
            .or_default()
            .extend(errors);
        self
    }

    /// Lets one blocked call answer.
    pub fn release(&self) {
        self.inner.gate.released.add_permits(1);
    }

    /// Completes once `count` calls have been dispatched to this model.
    pub async fn wait_calls(&self, count: usize) {
        self.inner.gate.wait_entered(count).await
    }

    /// The conversation each call was given, in the order of the calls.
    pub fn seen(&self) -> Vec<Vec<ChatMessage>> {
        let seen = self.inner.seen.lock().unwrap();
        seen.iter()
            .map(|request| request.messages.clone())
            .collect()
    }

    /// Each call's request, in the order of the calls.
    pub fn requests(&self) -> Vec<SeenRequest> {
        self.inner.seen.lock().unwrap().clone()
    }

    /// How many calls were dispatched.
    pub fn calls(&self) -> usize {
        self.inner.calls.load(Ordering::SeqCst)
    }
}

#[async_trait(?Send)]
impl Model for ScriptedModel {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        let turn = request
            .messages
            .iter()
            .filter(|m| matches!(m, ChatMessage::Assistant(_)))
            .count();
        self.inner.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.seen.lock().unwrap().push(SeenRequest {
            step: request.step,
            attempt: request.attempt,
            messages: request.messages.to_vec(),
            tools: request.tools.to_vec(),
        });
        self.inner.gate.enter();
        let failure = self
            .inner
            .failures
            .lock()
            .unwrap()
            .get_mut(&turn)
            .and_then(VecDeque::pop_front);
        if let Some(error) = failure {
            return Err(error);
        }
        if *self.inner.block_turn.lock().unwrap() == Some(turn) {
            self.inner.gate.hold().await;
        }
        self.inner.script.get(turn).cloned().unwrap_or_else(|| {
            Err(ModelError::new(format!(
                "the script has no response for turn {turn}"
            )))
        })
    }
}

/// What a [`RecordingTool`] does when called.
#[derive(Debug, Clone, PartialEq)]
pub enum Behaviour {
    /// Returns its output at once.
    Succeed,
    /// Waits until [`RecordingTool::release`], or until its cancellation signal fires (then
    /// fails).
    Block,
    /// Waits until [`RecordingTool::release`], whatever its cancellation signal says: a side
    /// effect that cannot be recalled once begun.
    BlockIgnoringCancel,
    /// Returns this error.
    Fail(String),
    /// Panics.
    Panic,
    /// Sleeps, then returns its output.
    Sleep(Duration),
}

/// How a [`RecordingTool`] answers a reconcile question.
#[derive(Debug, Clone, PartialEq)]
pub enum ReconcileHook {
    /// It has no hook.
    None,
    /// Always this answer.
    Answer(Reconciliation),
    /// Looks the idempotency key up in its own log: applied (with the output it returned) if an
    /// execution with that key is recorded, not applied otherwise.
    FromLog,
}

/// One execution of a [`RecordingTool`]: its side effect, as recorded when the call began.
#[derive(Debug, Clone, PartialEq)]
pub struct Execution {
    /// The run.
    pub run_id: String,
    /// The step.
    pub step: u32,
    /// The call id.
    pub call_id: String,
    /// The attempt.
    pub attempt: u32,
    /// The idempotency key.
    pub idempotency_key: String,
    /// The fencing token of the lease it ran under.
    pub fencing_token: crate::FencingToken,
    /// The arguments.
    pub args: Value,
}

/// A tool that records every execution (its side effect) and can block, fail, panic or sleep.
/// Clones share the record.
#[derive(Clone)]
pub struct RecordingTool {
    inner: Arc<ToolInner>,
}

struct ToolInner {
    name: String,
    idempotent: AtomicBool,
    behaviour: Mutex<Behaviour>,
    hook: Mutex<ReconcileHook>,
    executions: Mutex<Vec<Execution>>,
    reconciles: Mutex<Vec<Execution>>,
    gate: Gate,
}

impl RecordingTool {
    /// A tool named `name` that succeeds, is not idempotent, and has no reconcile hook.
    pub fn new(name: impl Into<String>) -> Self {
        RecordingTool {
            inner: Arc::new(ToolInner {
                name: name.into(),
                idempotent: AtomicBool::new(false),
                behaviour: Mutex::new(Behaviour::Succeed),
                hook: Mutex::new(ReconcileHook::None),
                executions: Mutex::new(Vec::new()),
                reconciles: Mutex::new(Vec::new()),
                gate: Gate::new(),
            }),
        }
    }

    /// Declares the tool idempotent (or not).
    pub fn idempotent(self, idempotent: bool) -> Self {
        self.inner.idempotent.store(idempotent, Ordering::SeqCst);
        self
    }

    /// Sets what a call does.
    pub fn behaviour(self, behaviour: Behaviour) -> Self {
        self.set_behaviour(behaviour);
        self
    }

    /// Changes what the next calls do.
    pub fn set_behaviour(&self, behaviour: Behaviour) {
        *self.inner.behaviour.lock().unwrap() = behaviour;
    }

    /// Sets the reconcile hook.
    pub fn reconcile_hook(self, hook: ReconcileHook) -> Self {
        *self.inner.hook.lock().unwrap() = hook;
        self
    }

    /// The executions so far, in order.
    pub fn executions(&self) -> Vec<Execution> {
        self.inner.executions.lock().unwrap().clone()
    }

    /// The reconcile questions asked so far, in order.
    pub fn reconciles(&self) -> Vec<Execution> {
        self.inner.reconciles.lock().unwrap().clone()
    }

    /// Completes once `count` executions have begun.
    pub async fn wait_executions(&self, count: usize) {
        self.inner.gate.wait_entered(count).await
    }

    /// Lets one blocked call return.
    pub fn release(&self) {
        self.inner.gate.released.add_permits(1);
    }

    fn output(&self, ctx: &ToolContext) -> Value {
        json!({ "tool": self.inner.name, "idempotency_key": ctx.idempotency_key })
    }

    fn record(ctx: &ToolContext, args: &Value) -> Execution {
        Execution {
            run_id: ctx.run_id.to_string(),
            step: ctx.step,
            call_id: ctx.call_id.clone(),
            attempt: ctx.attempt,
            idempotency_key: ctx.idempotency_key.clone(),
            fencing_token: ctx.fencing_token,
            args: args.clone(),
        }
    }
}

#[async_trait(?Send)]
impl Tool for RecordingTool {
    fn name(&self) -> &str {
        &self.inner.name
    }

    fn idempotent(&self) -> bool {
        self.inner.idempotent.load(Ordering::SeqCst)
    }

    async fn call(&self, ctx: &ToolContext, args: &Value) -> Result<Value, ToolError> {
        self.inner
            .executions
            .lock()
            .unwrap()
            .push(Self::record(ctx, args));
        self.inner.gate.enter();
        let behaviour = self.inner.behaviour.lock().unwrap().clone();
        match behaviour {
            Behaviour::Succeed => Ok(self.output(ctx)),
            Behaviour::Block => {
                tokio::select! {
                    _ = self.inner.gate.hold() => Ok(self.output(ctx)),
                    _ = ctx.cancellation.cancelled() => Err(ToolError::new("stopped: its cancellation signal fired")),
                }
            }
            Behaviour::BlockIgnoringCancel => {
                self.inner.gate.hold().await;
                Ok(self.output(ctx))
            }
            Behaviour::Fail(message) => Err(ToolError::new(message)),
            Behaviour::Panic => panic!("{} panicked on purpose", self.inner.name),
            Behaviour::Sleep(duration) => {
                actix_rt::time::sleep(duration).await;
                Ok(self.output(ctx))
            }
        }
    }

    async fn reconcile(&self, ctx: &ToolContext, args: &Value) -> Option<Reconciliation> {
        let hook = self.inner.hook.lock().unwrap().clone();
        if hook == ReconcileHook::None {
            return None;
        }
        self.inner
            .reconciles
            .lock()
            .unwrap()
            .push(Self::record(ctx, args));
        match hook {
            ReconcileHook::None => None,
            ReconcileHook::Answer(answer) => Some(answer),
            ReconcileHook::FromLog => {
                let applied = self
                    .executions()
                    .iter()
                    .any(|e| e.idempotency_key == ctx.idempotency_key);
                Some(if applied {
                    Reconciliation::Applied(self.output(ctx))
                } else {
                    Reconciliation::NotApplied
                })
            }
        }
    }
}

/// Resumes a run the way a consumer recovering after a crash should: while it is leased by
/// another owner ([`Error::RunLeased`]), wait until that lease's expiry and ask again; give up
/// with the last `RunLeased` once `patience` has passed.
pub async fn resume_when_free(
    supervisor: &actix::Addr<Supervisor>,
    run_id: &RunId,
    patience: Duration,
) -> Result<RunReply> {
    let deadline = SystemTime::now() + patience;
    loop {
        match supervisor
            .send(ResumeRun::new(run_id.clone()))
            .await
            .map_err(|_| Error::StoreUnavailable)?
        {
            Err(Error::RunLeased { expires_at, .. }) if expires_at < deadline => {
                // Lease times are wall-clock milliseconds: wake just after the expiry.
                let wait = expires_at
                    .duration_since(SystemTime::now())
                    .unwrap_or_default();
                actix_rt::time::sleep(wait + Duration::from_millis(2)).await;
            }
            other => return other,
        }
    }
}

/// Panics unless no run of `store` holds a lease: after every call returned, or after a crash
/// and the resumes that followed, nothing should be left leased.
pub fn assert_no_run_leased(store: &Store) {
    let leased: Vec<(RunId, crate::Lease)> = store
        .runs(None)
        .expect("the runs can be listed")
        .into_iter()
        .filter_map(|run| {
            store
                .lease(&run.id)
                .expect("a listed run exists")
                .map(|lease| (run.id, lease))
        })
        .collect();
    assert!(leased.is_empty(), "runs still leased: {leased:?}");
}

/// Collects the `LeaseLost` messages a supervisor sends; subscribe it with
/// [`SubscribeLeaseLost`](crate::SubscribeLeaseLost).
#[derive(Clone, Default)]
pub struct LeaseLostLog {
    seen: Arc<Mutex<Vec<LeaseLost>>>,
    count: Arc<watch::Sender<usize>>,
}

impl LeaseLostLog {
    /// An empty log.
    pub fn new() -> Self {
        LeaseLostLog::default()
    }

    /// Starts an actor that appends to this log, and returns its recipient.
    pub fn recipient(&self) -> actix::Recipient<LeaseLost> {
        actix::Actor::start(self.clone()).recipient()
    }

    /// The messages so far.
    pub fn seen(&self) -> Vec<LeaseLost> {
        self.seen.lock().unwrap().clone()
    }

    /// Completes once `count` messages have arrived.
    pub async fn wait_for(&self, count: usize) {
        let mut rx = self.count.subscribe();
        rx.wait_for(|seen| *seen >= count)
            .await
            .expect("the log lives");
    }
}

impl actix::Actor for LeaseLostLog {
    type Context = actix::Context<Self>;
}

impl actix::Handler<LeaseLost> for LeaseLostLog {
    type Result = ();

    fn handle(&mut self, msg: LeaseLost, _: &mut actix::Context<Self>) {
        self.seen.lock().unwrap().push(msg);
        self.count.send_modify(|count| *count += 1);
    }
}

/// Writes at `path` an empty database at schema `version` (the first `version` migrations
/// only), as an older agentrt left it: to test an upgrade, add its rows with plain SQL and open
/// it with [`Store::open`].
pub fn database_at_schema(path: &Path, version: u32) {
    let mut conn = rusqlite::Connection::open(path).expect("the file opens");
    crate::store::sqlite::migrations()
        .to_version(&mut conn, version as usize)
        .expect("the migrations apply");
}
