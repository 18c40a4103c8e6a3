//! A chaos run with real processes: workers share one database file and start and resume runs
//! in a loop, while the parent kills them with SIGKILL, stops them with SIGSTOP, starves them of
//! CPU, or runs them on a very short lease. Afterwards every run is driven to its end, and
//! every tool execution, as the tools logged it when they acted, is sorted into one class: the
//! first for its idempotency key, an approved re-run, an idempotent retry, a retry after "not
//! applied", a zombie (an owner whose lease was taken over, acting anyway), or unexplained.
//! One summary line says how it went; the exit code is non-zero if anything is unexplained, a
//! fenced effect applied twice, an event was lost or a run was left leased.
//!
//! ```text
//! cargo run --release --features testkit --example chaos -- --seconds 60 --workers 4 --mode stop
//! ```

use std::{
    collections::{HashMap, HashSet},
    fs::{File, OpenOptions},
    io::{self, Write},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use agentrt::{
    Agent, Approval, Config, Decision, Error, EventKind, ModelResponse, Outcome, Reconciliation,
    RecordApproval, RunId, RunState, StartRun, Store, Supervisor, Tool, ToolCall, ToolContext,
    ToolError, async_trait,
    testkit::{
        Admission, FencedResource, ScriptedModel, check_invariants, resume_when_free, with_system,
    },
};
use clap::{Parser, ValueEnum};
use futures_util::StreamExt;
use serde_json::{Value, json};

#[path = "support/chaos_classes.rs"]
mod chaos_classes;

use chaos_classes::{Class, Execution, Fence, classify};

const AGENT: &str = "chaos";

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// SIGKILL a random worker every 0.3 to 2.5 s and start a new one.
    Kill,
    /// SIGSTOP a random worker, SIGCONT it 1 to 6 TTLs later; some plain kills too.
    Stop,
    /// Two busy-looping threads per core beside the workers, and the kills.
    Starve,
    /// An 80 ms lease with a start margin of a third, and the kills.
    ShortTtl,
}

impl Mode {
    fn ttl(self) -> Duration {
        match self {
            Mode::ShortTtl => Duration::from_millis(80),
            _ => Duration::from_millis(500),
        }
    }
}

#[derive(Parser, Debug)]
#[command(about = "Kill, stop and starve agentrt processes and account for every side effect")]
struct Args {
    /// How long to disturb the workers.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// How many worker processes share the database.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u8).range(2..=8))]
    workers: u8,
    /// What is done to the workers.
    #[arg(long, value_enum, default_value_t = Mode::Kill)]
    mode: Mode,
    /// The directory for the database and the logs (a new temporary one if absent).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Runs a worker (used by the parent process).
    #[arg(long, hide = true)]
    worker: Option<u8>,
}

fn main() {
    let args = Args::parse();
    let temp = tempfile::tempdir().expect("a temporary directory");
    let dir = args
        .dir
        .clone()
        .unwrap_or_else(|| temp.path().to_path_buf());
    match args.worker {
        Some(index) => worker(&dir, index, args.mode),
        None => {
            let clean = parent(&args, &dir);
            std::process::exit(if clean { 0 } else { 1 });
        }
    }
}

fn db_path(dir: &Path) -> PathBuf {
    dir.join("chaos.db")
}

fn log_path(dir: &Path) -> PathBuf {
    dir.join("side-effects.log")
}

fn fences_path(dir: &Path) -> PathBuf {
    dir.join("fences.sqlite")
}

/// What the parent did to which worker and when (wall-clock ms), to read beside the events.
fn disturbances_path(dir: &Path) -> PathBuf {
    dir.join("disturbances.log")
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// The side-effect log: one line per tool execution, written when it acts. Every process
/// appends to the one file opened with O_APPEND, one write(2) per line: on a local Linux file
/// system an O_APPEND write is made under the file's lock, so a line (a few hundred bytes,
/// under PIPE_BUF) never interleaves with another process's, and a SIGKILL lands before or
/// after it. One file gives the hook and the checker every process's executions in one read.
#[derive(Clone)]
struct SideEffectLog {
    path: PathBuf,
    file: Arc<File>,
}

impl SideEffectLog {
    fn open(path: PathBuf) -> io::Result<Self> {
        let file = OpenOptions::new().create(true).append(true).open(&path)?;
        Ok(SideEffectLog {
            path,
            file: Arc::new(file),
        })
    }

    /// Appends `execution`'s line and makes it durable.
    fn append(&self, execution: &Execution) -> io::Result<()> {
        let mut line = serde_json::to_string(execution)?;
        line.push('\n');
        let written = (&*self.file).write(line.as_bytes())?;
        if written != line.len() {
            return Err(io::Error::other("a short write to the side-effect log"));
        }
        self.file.sync_data()
    }

    /// Every line, and how many could not be read.
    fn read(path: &Path) -> (Vec<Execution>, usize) {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let mut torn = 0;
        let executions = text
            .lines()
            .filter_map(|line| {
                let parsed = serde_json::from_str(line).ok();
                torn += usize::from(parsed.is_none());
                parsed
            })
            .collect();
        (executions, torn)
    }

    /// Whether an execution with `key` is logged: the truthful reconcile query of a tool
    /// whose effect is the line itself.
    fn has(&self, key: &str) -> bool {
        let quoted = serde_json::to_string(key).expect("a string");
        std::fs::read_to_string(&self.path)
            .unwrap_or_default()
            .lines()
            .filter(|line| line.contains(&quoted))
            .filter_map(|line| serde_json::from_str::<Execution>(line).ok())
            .any(|x| x.key == key)
    }
}

/// The four kinds of tool, one per way an interrupted call is dealt with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Not idempotent; writes through a fenced resource, which its hook asks.
    Fenced,
    /// Not idempotent, unfenced; its hook reads the side-effect log.
    Reconciled,
    /// Idempotent, no hook: run again on an unknown outcome.
    Idempotent,
    /// Not idempotent, no hook: a person approves running it again.
    Unreconciled,
}

const TOOLS: [(&str, Kind); 4] = [
    ("charge", Kind::Fenced),
    ("ticket", Kind::Reconciled),
    ("lookup", Kind::Idempotent),
    ("email", Kind::Unreconciled),
];

fn idempotent(tool: &str) -> bool {
    TOOLS
        .iter()
        .any(|&(name, kind)| name == tool && kind == Kind::Idempotent)
}

struct ChaosTool {
    name: &'static str,
    kind: Kind,
    log: SideEffectLog,
    resource: FencedResource,
}

/// A few milliseconds, so that kills and stops land inside calls.
async fn pause() {
    actix_rt::time::sleep(Duration::from_micros(rand::random_range(1_000..15_000))).await;
}

#[async_trait(?Send)]
impl Tool for ChaosTool {
    fn name(&self) -> &str {
        self.name
    }

    fn idempotent(&self) -> bool {
        self.kind == Kind::Idempotent
    }

    async fn call(&self, ctx: &ToolContext, _: &Value) -> Result<Value, ToolError> {
        // The act comes after an await: a stop can land between `step.tool_started` and it.
        pause().await;
        let mut execution = Execution {
            key: ctx.idempotency_key.clone(),
            run: ctx.run_id.to_string(),
            step: ctx.step,
            call: ctx.call_id.clone(),
            tool: self.name.to_owned(),
            attempt: ctx.attempt,
            token: ctx.fencing_token.get(),
            pid: std::process::id(),
            at_us: Some(now_us()),
            fence: None,
        };
        let io = |err: io::Error| ToolError::new(err.to_string());
        let mut refused = None;
        if self.kind == Kind::Fenced {
            // The write carries the execution itself: an effect whose line a kill prevented
            // is still found in the resource.
            let applied = Execution {
                fence: Some(Fence::Applied),
                ..execution.clone()
            };
            let value = serde_json::to_value(&applied).expect("serialises");
            execution.fence = Some(Fence::Applied);
            if let Admission::Refused { fence } = self
                .resource
                .apply(&ctx.idempotency_key, ctx.fencing_token, value)
                .map_err(io)?
            {
                execution.fence = Some(Fence::Refused);
                refused = Some(fence);
            }
        }
        self.log.append(&execution).map_err(io)?;
        pause().await;
        match refused {
            Some(fence) => Err(ToolError::new(format!(
                "refused: token {} is older than {fence}",
                ctx.fencing_token
            ))),
            None => Ok(json!({ "done": self.name })),
        }
    }

    async fn reconcile(&self, ctx: &ToolContext, _: &Value) -> Option<Reconciliation> {
        let key = &ctx.idempotency_key;
        match self.kind {
            Kind::Fenced => Some(match self.resource.check(key, ctx.fencing_token) {
                Ok(Some(_)) => Reconciliation::Applied(json!({ "done": self.name })),
                Ok(None) => Reconciliation::NotApplied,
                Err(_) => Reconciliation::Unknown,
            }),
            Kind::Reconciled => Some(if self.log.has(key) {
                Reconciliation::Applied(json!({ "done": self.name }))
            } else {
                Reconciliation::NotApplied
            }),
            Kind::Idempotent | Kind::Unreconciled => None,
        }
    }
}

fn agent(dir: &Path) -> Agent {
    let model = ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new("lookup-1", "lookup", json!({}))]),
        ModelResponse::calls(vec![
            ToolCall::new("charge-1", "charge", json!({})),
            ToolCall::new("ticket-1", "ticket", json!({})),
        ]),
        ModelResponse::calls(vec![ToolCall::new("email-1", "email", json!({}))]),
        ModelResponse::answer("done"),
    ]);
    let log = SideEffectLog::open(log_path(dir)).expect("the side-effect log opens");
    let resource = FencedResource::open(fences_path(dir)).expect("the fenced resource opens");
    TOOLS
        .iter()
        .fold(Agent::new(model), |agent, &(name, kind)| {
            agent.tool(ChaosTool {
                name,
                kind,
                log: log.clone(),
                resource: resource.clone(),
            })
        })
        .policy(|_: &RunId, call: &ToolCall| match call.name.as_str() {
            "ticket" => Decision::RequireApproval("tickets need a person".into()),
            _ => Decision::Allow,
        })
}

fn config(owner: &str, mode: Mode) -> Config {
    Config::default()
        .lease_owner(owner)
        .lease_ttl(mode.ttl())
        .start_margin(mode.ttl() / 3)
}

/// Starts or resumes runs forever, several at once, until killed.
fn worker(dir: &Path, index: u8, mode: Mode) {
    let store = Store::open(db_path(dir)).expect("the database opens");
    let agent = agent(dir);
    with_system(|| async move {
        let sup = Supervisor::builder(store.clone())
            .config(config(&format!("worker-{index}"), mode))
            .agent(AGENT, agent)
            .start()
            .expect("starts");
        let lanes: Vec<_> = (0..4)
            .map(|_| {
                let (sup, store) = (sup.clone(), store.clone());
                actix_rt::spawn(async move {
                    loop {
                        let open = {
                            let store = store.clone();
                            actix_rt::task::spawn_blocking(move || {
                                let mut open =
                                    store.runs(Some(RunState::Running)).unwrap_or_default();
                                open.extend(
                                    store
                                        .runs(Some(RunState::WaitingForApproval))
                                        .unwrap_or_default(),
                                );
                                (
                                    open.into_iter().map(|run| run.id).collect::<Vec<_>>(),
                                    store.runs(None).map(|r| r.len()).unwrap_or(0),
                                )
                            })
                            .await
                            .expect("reads")
                        };
                        let (open, total) = open;
                        if open.is_empty() || (total < 400 && rand::random_bool(0.4)) {
                            let _ = drive(&sup, None).await;
                        } else {
                            let run_id = open[rand::random_range(0..open.len())].clone();
                            let _ = drive(&sup, Some(run_id)).await;
                        }
                    }
                })
            })
            .collect();
        for lane in lanes {
            let _ = lane.await;
        }
    });
}

/// Starts a run (`None`) or resumes one, approving what waits, until it finishes or is
/// someone else's.
async fn drive(sup: &actix::Addr<Supervisor>, run_id: Option<RunId>) -> agentrt::Result<()> {
    let mut reply = match &run_id {
        None => sup
            .send(StartRun::new(AGENT, json!({})))
            .await
            .map_err(|_| Error::StoreUnavailable)?,
        Some(run_id) => sup
            .send(agentrt::ResumeRun::new(run_id.clone()))
            .await
            .map_err(|_| Error::StoreUnavailable)?,
    };
    loop {
        let outcome = reply?;
        let Outcome::WaitingForApproval { pending } = outcome.outcome else {
            return Ok(());
        };
        let approval = Approval::approve(outcome.run_id.clone(), pending.call_id, "chaos");
        let _ = sup.send(RecordApproval(approval)).await;
        reply = sup
            .send(agentrt::ResumeRun::new(outcome.run_id))
            .await
            .map_err(|_| Error::StoreUnavailable)?;
    }
}

fn spawn_worker(dir: &Path, index: u8, mode: Mode) -> Child {
    let mode = mode.to_possible_value().expect("a named mode");
    Command::new(std::env::current_exe().expect("this executable"))
        .args([
            "--worker",
            &index.to_string(),
            "--mode",
            mode.get_name(),
            "--dir",
        ])
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("a worker starts")
}

/// Sends `signal` (`STOP`, `CONT`) to a worker: with kill(1), as agentrt has no libc of its own.
fn signal(child: &Child, signal: &str) {
    let status = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(child.id().to_string())
        .status()
        .expect("kill(1) runs");
    assert!(status.success(), "kill -{signal} {} failed", child.id());
}

struct Worker {
    child: Child,
    /// When a stopped worker is continued.
    stopped_until: Option<Instant>,
}

/// Busy-looping threads, until dropped.
struct Spinners {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Spinners {
    fn start(count: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..count)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        Spinners { stop, threads }
    }
}

impl Drop for Spinners {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// Disturbs the workers for the given time, then finishes every run and checks them all.
fn parent(args: &Args, dir: &Path) -> bool {
    drop(Store::open(db_path(dir)).expect("the database is created"));
    let resource = FencedResource::open(fences_path(dir)).expect("the fenced resource opens");
    let mode = args.mode;
    let started = Instant::now();
    let end = started + Duration::from_secs(args.seconds);
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let spinners = (mode == Mode::Starve).then(|| Spinners::start(2 * cores));
    let mut workers: Vec<Worker> = (0..args.workers)
        .map(|i| Worker {
            child: spawn_worker(dir, i, mode),
            stopped_until: None,
        })
        .collect();
    let gap = || Duration::from_millis(rand::random_range(300..2500));
    let (mut kills, mut stops) = (0, 0);
    let mut next = Instant::now() + gap();
    let mut disturbances = File::create(disturbances_path(dir)).expect("the disturbances log");
    let mut note = |what: &str, index: usize, child: &Child| {
        let line = format!(
            "{} {what} worker-{index} pid {}\n",
            now_us() / 1000,
            child.id()
        );
        let _ = disturbances.write_all(line.as_bytes());
    };
    loop {
        let now = Instant::now();
        for (index, worker) in workers.iter_mut().enumerate() {
            if worker.stopped_until.is_some_and(|at| at <= now) {
                note("CONT", index, &worker.child);
                signal(&worker.child, "CONT");
                worker.stopped_until = None;
            }
        }
        if now >= end {
            break;
        }
        if now >= next {
            next = now + gap();
            let running: Vec<usize> = (0..workers.len())
                .filter(|&i| workers[i].stopped_until.is_none())
                .collect();
            if !running.is_empty() {
                let victim = running[rand::random_range(0..running.len())];
                let worker = &mut workers[victim];
                if mode == Mode::Stop && rand::random_bool(0.7) {
                    note("STOP", victim, &worker.child);
                    signal(&worker.child, "STOP");
                    stops += 1;
                    let ttls = rand::random_range(1.0..=6.0);
                    worker.stopped_until = Some(now + mode.ttl().mul_f64(ttls));
                } else {
                    note("KILL", victim, &worker.child);
                    worker.child.kill().expect("SIGKILL"); // Child::kill is SIGKILL on Unix
                    worker.child.wait().expect("reaped");
                    kills += 1;
                    worker.child = spawn_worker(dir, victim as u8, mode);
                }
            }
        }
        let wake = workers
            .iter()
            .filter_map(|w| w.stopped_until)
            .fold(next.min(end), Instant::min);
        std::thread::sleep(wake.saturating_duration_since(Instant::now()));
    }
    // SIGKILL ends a stopped process too.
    for worker in &mut workers {
        let _ = worker.child.kill();
        let _ = worker.child.wait();
    }
    drop(spinners);
    let seconds = started.elapsed().as_secs();

    let store = Store::open(db_path(dir)).expect("the database opens");
    finish_every_run(&store, dir, mode);

    // Every execution: the log's lines, and the fenced writes a kill kept out of it.
    let (mut executions, torn) = SideEffectLog::read(&log_path(dir));
    if torn > 0 {
        eprintln!("{torn} lines of the side-effect log could not be read");
    }
    let applications = resource.applications().expect("the applications");
    let refusals = resource.refusals().expect("the refusals");
    let logged: HashSet<Execution> = executions.iter().cloned().collect();
    let mut unlogged = 0;
    for application in &applications {
        match serde_json::from_value::<Execution>(application.value.clone()) {
            Ok(x) if logged.contains(&x) => {}
            Ok(x) => {
                unlogged += 1;
                executions.push(x);
            }
            Err(err) => eprintln!("an application that is no execution: {err}"),
        }
    }
    for refusal in &refusals {
        let logged = executions.iter().any(|x| {
            x.key == refusal.key
                && x.token == refusal.token.get()
                && x.pid == refusal.pid
                && x.fence == Some(Fence::Refused)
        });
        if !logged {
            unlogged += 1;
            executions.push(unlogged_refusal(&store, refusal));
        }
    }
    if unlogged > 0 {
        eprintln!(
            "{unlogged} fenced writes had no line in the side-effect log (killed in between)"
        );
    }
    let mut by_run: HashMap<String, Vec<Execution>> = HashMap::new();
    for x in executions {
        by_run.entry(x.run.clone()).or_default().push(x);
    }

    let runs = store.runs(None).expect("runs");
    let mut count = Count::default();
    for run in &runs {
        let events = store.events(&run.id).expect("the events");
        count.takeovers += events
            .iter()
            .filter(|e| e.kind == EventKind::LeaseTakenOver)
            .count();
        // The structure of the log: gapless, finished, every started call with an outcome,
        // every interruption reconciled once.
        for violation in check_invariants(&store, &run.id, &[]) {
            if !matches!(violation, agentrt::testkit::Violation::LeftLeased(_)) {
                eprintln!("run {}: {violation}", run.id);
                count.lost_events += 1;
            }
        }
        if store.lease(&run.id).expect("the lease").is_some() {
            eprintln!("run {}: left leased", run.id);
            count.runs_left_leased += 1;
        }
        let found = by_run.remove(run.id.as_str()).unwrap_or_default();
        for (x, class) in found.iter().zip(classify(&events, &found, idempotent)) {
            count.add(x, &class);
        }
    }
    for (run, found) in &by_run {
        eprintln!(
            "run {run}: {} executions of a run the database does not know",
            found.len()
        );
        count.executions += found.len();
        count.unexplained += found.len();
    }
    let mut per_key: HashMap<&str, usize> = HashMap::new();
    for application in &applications {
        *per_key.entry(application.key.as_str()).or_default() += 1;
    }
    for (key, applied) in per_key {
        if applied > 1 {
            eprintln!("{key}: the fenced resource applied {applied} writes");
            count.fenced_applied_twice += applied - 1;
        }
    }

    let Count {
        executions,
        approved_reruns,
        idempotent_retries,
        not_applied_retries,
        zombies_unfenced,
        zombies_fenced_refused,
        zombies_fenced_applied,
        fenced_applied_twice,
        unexplained,
        lost_events,
        runs_left_leased,
        takeovers,
        ..
    } = count;
    let zombies = zombies_unfenced + zombies_fenced_refused + zombies_fenced_applied;
    let mode = mode.to_possible_value().expect("a named mode");
    println!(
        "chaos: mode={} seconds={seconds} workers={} runs={} kills={kills} stops={stops} takeovers={takeovers} executions={executions} approved_reruns={approved_reruns} idempotent_retries={idempotent_retries} not_applied_retries={not_applied_retries} zombies={zombies} zombies_unfenced={zombies_unfenced} zombies_fenced_refused={zombies_fenced_refused} zombies_fenced_applied={zombies_fenced_applied} fenced_applied_twice={fenced_applied_twice} unexplained={unexplained} lost_events={lost_events} runs_left_leased={runs_left_leased}",
        mode.get_name(),
        args.workers,
        runs.len(),
    );
    fenced_applied_twice == 0 && unexplained == 0 && lost_events == 0 && runs_left_leased == 0
}

/// A refused fenced write whose process was killed before its line: its attempt is the one
/// started under its token.
fn unlogged_refusal(store: &Store, refusal: &agentrt::testkit::Refusal) -> Execution {
    let (run, step) = refusal.key.rsplit_once('/').unwrap_or_default();
    let step: u32 = step.parse().unwrap_or_default();
    let started = store
        .events(&RunId::from(run))
        .unwrap_or_default()
        .into_iter()
        .find(|e| {
            e.kind == EventKind::ToolStarted
                && e.step == Some(step)
                && e.payload["fencing_token"].as_u64() == Some(refusal.token.get())
        });
    let field = |name: &str| {
        started
            .as_ref()
            .and_then(|e| e.payload[name].as_str().map(str::to_owned))
            .unwrap_or_default()
    };
    Execution {
        key: refusal.key.clone(),
        run: run.to_owned(),
        step,
        call: field("call_id"),
        tool: field("tool"),
        attempt: started
            .as_ref()
            .and_then(|e| e.payload["attempt"].as_u64())
            .unwrap_or_default() as u32,
        token: refusal.token.get(),
        pid: refusal.pid,
        at_us: None,
        fence: Some(Fence::Refused),
    }
}

/// Drives every unfinished run to its end with one last supervisor, approving what waits.
fn finish_every_run(store: &Store, dir: &Path, mode: Mode) {
    let unfinished: Vec<RunId> = store
        .runs(None)
        .expect("runs")
        .into_iter()
        .filter(|run| !run.state.is_finished())
        .map(|run| run.id)
        .collect();
    let (finisher, agent) = (store.clone(), agent(dir));
    with_system(|| async move {
        let sup = Supervisor::builder(finisher)
            .config(config("finisher", mode))
            .agent(AGENT, agent)
            .start()
            .expect("starts");
        futures_util::stream::iter(unfinished)
            .for_each_concurrent(8, |run_id| {
                let sup = sup.clone();
                async move {
                    // A lost lease or a busy store is tried again; an approval is given.
                    for _ in 0..20 {
                        match resume_when_free(&sup, &run_id, Duration::from_secs(30)).await {
                            Ok(agentrt::RunReply {
                                outcome: Outcome::WaitingForApproval { pending },
                                ..
                            }) => {
                                let approval =
                                    Approval::approve(run_id.clone(), pending.call_id, "chaos");
                                let _ = sup.send(RecordApproval(approval)).await;
                            }
                            Ok(_) => return,
                            Err(err) => eprintln!("run {run_id}: {err}; resuming again"),
                        }
                    }
                }
            })
            .await;
    });
}

/// The summary's counters.
#[derive(Default)]
struct Count {
    executions: usize,
    firsts: usize,
    approved_reruns: usize,
    idempotent_retries: usize,
    not_applied_retries: usize,
    zombies_unfenced: usize,
    zombies_fenced_refused: usize,
    zombies_fenced_applied: usize,
    fenced_applied_twice: usize,
    unexplained: usize,
    lost_events: usize,
    runs_left_leased: usize,
    takeovers: usize,
}

impl Count {
    fn add(&mut self, x: &Execution, class: &Class) {
        self.executions += 1;
        let counter = match class {
            Class::First => &mut self.firsts,
            Class::ApprovedRerun => &mut self.approved_reruns,
            Class::IdempotentRetry => &mut self.idempotent_retries,
            Class::NotAppliedRetry => &mut self.not_applied_retries,
            Class::Zombie => match x.fence {
                None => {
                    // The effects no runtime can take back: shown, not only counted.
                    eprintln!(
                        "zombie: {} {} attempt {} (pid {}, token {}) acted at {} µs",
                        x.key,
                        x.tool,
                        x.attempt,
                        x.pid,
                        x.token,
                        x.at_us.unwrap_or_default()
                    );
                    &mut self.zombies_unfenced
                }
                Some(Fence::Refused) => &mut self.zombies_fenced_refused,
                Some(Fence::Applied) => &mut self.zombies_fenced_applied,
            },
            Class::Unexplained(why) => {
                eprintln!("{} (pid {}, token {}): {why}", x.key, x.pid, x.token);
                &mut self.unexplained
            }
        };
        *counter += 1;
    }
}
