//! A chaos run with real processes: workers share one database (an SQLite file, or a PostgreSQL
//! database) and start and resume runs in a loop (a quarter of them sleep on a short timer and
//! delegate to a child run, and the workers' watches wake them; half of those also ask a person
//! and wait for an event, which the parent answers and delivers through the store, as an
//! operator or a webhook would), while the parent kills them
//! with SIGKILL, stops them with SIGSTOP, starves them of CPU, runs them on a very short lease,
//! cuts their hosts off the network or shifts their wall clocks. With `--hosts N` every worker is a host
//! of its own: a network namespace that reaches the database server over TCP through a veth
//! link (`support/chaos_hosts.rs`). Afterwards every run is driven to its end, and
//! every tool execution, as the tools logged it when they acted, is sorted into one class: the
//! first for its idempotency key, an approved re-run, an idempotent retry, a retry after "not
//! applied", a zombie (an owner whose lease was taken over, acting anyway), or unexplained.
//! One summary line says how it went; the exit code is non-zero if anything is unexplained, a
//! fenced effect applied twice, an event or a wake-up was lost, a duplicate answer or event was
//! accepted, or a run was left leased.
//!
//! ```text
//! cargo run --release --features testkit --example chaos -- --seconds 60 --workers 4 --mode stop
//! cargo run --release --features testkit,postgres --example chaos -- --seconds 60 --hosts 3 \
//!     --mode partition --db postgres://postgres@127.0.0.1:5432
//! ```

use std::{
    collections::{HashMap, HashSet},
    fs::{File, OpenOptions},
    io::{self, Write},
    net::{Ipv4Addr, SocketAddr, ToSocketAddrs},
    path::{Path, PathBuf},
    process::{Child, Command},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicI64, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use agentrt::{
    Agent, Answer, Approval, Config, Decision, Delivered, Delivery, Drain, Error, EventKind,
    ModelResponse, Outcome, Reconciliation, RecordApproval, Recovery, RunId, RunState, StartRun,
    Store, Supervisor, Tool, ToolCall, ToolContext, ToolError, Wait, WaitKind, Watch, async_trait,
    testkit::{
        Admission, FencedResource, ScriptedModel, check_invariants, resume_when_free, with_system,
    },
};
use clap::{Parser, ValueEnum};
use futures_util::StreamExt;
use serde_json::{Value, json};

#[path = "support/chaos_classes.rs"]
mod chaos_classes;
#[path = "support/chaos_hosts.rs"]
mod chaos_hosts;

use chaos_classes::{Class, Execution, Fence, Waits, classify, late_starts, waits};
use chaos_hosts::Hosts;

const AGENT: &str = "chaos";
/// Runs that sleep on a short timer, delegate to a child run of [`CHILD`], then charge.
const WAITER: &str = "chaos-waiter";
/// The child runs: a ticket, then an answer.
const CHILD: &str = "chaos-child";
/// Runs that wait as [`WAITER`]'s do, and in between ask a person and wait for the event
/// [`EVENT`]: the parent answers and delivers it.
const ASKER: &str = "chaos-asker";
/// The name of the event an [`ASKER`] run waits for, known to the parent in advance.
const EVENT: &str = "payment";
/// The share of the runs a worker starts that wait: [`WAITER`]'s or [`ASKER`]'s.
const WAITER_SHARE: f64 = 0.25;
/// The share of those that are [`ASKER`]'s.
const ASKER_SHARE: f64 = 0.5;

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
    /// Cut a host off the network for 1 to 5 TTLs, then join it again; some kills too
    /// (needs `--hosts`).
    Partition,
    /// Every host's wall clock off by a random amount within 10 TTLs either way, for the whole
    /// run (libfaketime), and the kills.
    Skew,
    /// A rolling deploy: SIGTERM a random worker every 0.3 to 2.5 s, wait for its drain to hand
    /// its runs over and its process to exit, and start it again. No kills.
    Deploy,
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
    /// Runs each of N workers as a host of its own, in a network namespace (needs root and
    /// iproute2); replaces `--workers`.
    #[arg(long, conflicts_with = "workers", value_parser = clap::value_parser!(u8).range(3..=8))]
    hosts: Option<u8>,
    /// The PostgreSQL server to run against, `postgres://USER@HOST:PORT` (trust auth): the
    /// run makes a database of its own there with psql. Without it, an SQLite file in the
    /// directory.
    #[arg(long)]
    db: Option<String>,
    /// What is done to the workers.
    #[arg(long, value_enum, default_value_t = Mode::Kill)]
    mode: Mode,
    /// The directory for the database and the logs (a new temporary one if absent).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Runs a worker (used by the parent process), on the database `--db` names exactly.
    #[arg(long, hide = true)]
    worker: Option<u8>,
    /// How far the worker's wall clock is off, in milliseconds (used by the parent process).
    #[arg(long, hide = true, default_value_t = 0, allow_hyphen_values = true)]
    skew_ms: i64,
    /// Prints the wall clock in microseconds and exits (used by the parent process).
    #[arg(long, hide = true)]
    probe_clock: bool,
}

fn main() {
    let args = Args::parse();
    if args.probe_clock {
        println!("{}", now_us());
        return;
    }
    let temp = tempfile::tempdir().expect("a temporary directory");
    let dir = args
        .dir
        .clone()
        .unwrap_or_else(|| temp.path().to_path_buf());
    match args.worker {
        Some(index) => {
            let location = args.db.clone().unwrap_or_else(|| sqlite_location(&dir));
            worker(&dir, &location, index, args.mode, args.skew_ms)
        }
        None => {
            let code = match parent(&args, &dir) {
                Ok(true) => 0,
                Ok(false) => 1,
                Err(err) => {
                    eprintln!("chaos: {err}");
                    2
                }
            };
            drop(temp);
            std::process::exit(code);
        }
    }
}

fn sqlite_location(dir: &Path) -> String {
    dir.join("chaos.db").display().to_string()
}

/// Opens the store at `location`: an SQLite path, or a PostgreSQL URL (with the `postgres`
/// feature).
fn open_store(location: &str) -> Store {
    Store::connect(location).unwrap_or_else(|err| panic!("{location}: {err}"))
}

/// Where the runs are stored.
enum Db {
    /// An SQLite file every worker opens (namespaces do not change file access).
    Sqlite(String),
    /// A database made for this run on a PostgreSQL server.
    Postgres {
        user: String,
        host: String,
        port: u16,
        name: String,
    },
}

impl Db {
    /// The run's database: a new one, `chaos_<pid>`, on the server `--db` names, or the
    /// SQLite file in `dir`.
    fn create(url: Option<&str>, dir: &Path) -> Result<Db, String> {
        let Some(url) = url else {
            return Ok(Db::Sqlite(sqlite_location(dir)));
        };
        let rest = url
            .strip_prefix("postgres://")
            .or_else(|| url.strip_prefix("postgresql://"))
            .ok_or_else(|| format!("--db {url}: not a postgres:// URL"))?;
        let authority = rest.split(['/', '?']).next().unwrap_or_default();
        let (user, address) = authority
            .rsplit_once('@')
            .unwrap_or(("postgres", authority));
        let user = user.split(':').next().unwrap_or(user);
        let (host, port) = match address.rsplit_once(':') {
            Some((host, port)) => (
                host,
                port.parse()
                    .map_err(|_| format!("--db {url}: a bad port"))?,
            ),
            None => (address, 5432),
        };
        let db = Db::Postgres {
            user: user.to_owned(),
            host: host.to_owned(),
            port,
            name: format!("chaos_{}", std::process::id()),
        };
        db.psql(&format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            db.name()
        ))?;
        db.psql(&format!("CREATE DATABASE {}", db.name()))?;
        Ok(db)
    }

    fn name(&self) -> &str {
        match self {
            Db::Sqlite(path) => path,
            Db::Postgres { name, .. } => name,
        }
    }

    /// Runs one statement with psql on the server's `postgres` database.
    fn psql(&self, sql: &str) -> Result<(), String> {
        let Db::Postgres {
            user, host, port, ..
        } = self
        else {
            return Ok(());
        };
        let output = Command::new("psql")
            .args([
                "-X",
                "-q",
                "-v",
                "ON_ERROR_STOP=1",
                "-d",
                "postgres",
                "-h",
                host,
                "-U",
                user,
            ])
            .args(["-p", &port.to_string(), "-c", sql])
            .output()
            .map_err(|err| format!("psql: {err} (is the PostgreSQL client installed?)"))?;
        if output.status.success() {
            Ok(())
        } else {
            Err(format!(
                "psql -c {sql:?}: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            ))
        }
    }

    /// Drops a PostgreSQL database unless it is to be kept (beside the files, when they are).
    fn discard(&self, keep: bool) {
        if !keep && let Err(err) = self.psql(&format!("DROP DATABASE {} WITH (FORCE)", self.name()))
        {
            eprintln!("{err}");
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Db::Sqlite(_) => "sqlite",
            Db::Postgres { .. } => "postgres",
        }
    }

    /// The server, for the forwarders.
    fn server(&self) -> Result<Option<SocketAddr>, String> {
        let Db::Postgres { host, port, .. } = self else {
            return Ok(None);
        };
        let mut addresses = (host.as_str(), *port)
            .to_socket_addrs()
            .map_err(|err| format!("{host}:{port}: {err}"))?;
        match addresses.find(|a| a.ip().is_loopback()) {
            Some(address) => Ok(Some(address)),
            None => Err(format!(
                "{host}:{port}: a multi-host run forwards to loopback only"
            )),
        }
    }

    /// The database as the parent reaches it.
    fn location(&self) -> String {
        match self {
            Db::Sqlite(path) => path.clone(),
            Db::Postgres {
                user,
                host,
                port,
                name,
            } => format!("postgres://{user}@{host}:{port}/{name}"),
        }
    }

    /// The database as a host reaches it: through the forwarder at `gateway`.
    fn location_via(&self, gateway: Ipv4Addr) -> String {
        match self {
            Db::Sqlite(path) => path.clone(),
            Db::Postgres {
                user, port, name, ..
            } => format!("postgres://{user}@{gateway}:{port}/{name}"),
        }
    }
}

fn log_path(dir: &Path) -> PathBuf {
    dir.join("side-effects.log")
}

fn fences_path(dir: &Path) -> PathBuf {
    dir.join("fences.sqlite")
}

/// What the parent did to which worker and when (wall-clock ms), to read beside the events.
/// Marks a deploy's worker whose SIGTERM handler is installed.
fn ready_path(dir: &Path, pid: u32) -> PathBuf {
    dir.join(format!("ready-{pid}"))
}

fn disturbances_path(dir: &Path) -> PathBuf {
    dir.join("disturbances.log")
}

/// How far this process's wall clock is off (libfaketime), in milliseconds: 0 but in a
/// skewed worker.
static SKEW_MS: AtomicI64 = AtomicI64::new(0);

/// The true time: this process's wall clock, less its skew. What the side-effect log and the
/// events are stamped with, so that the executions of every host and the acquisitions of every
/// lease share one timeline; lease times are read from the skewed clock all the same.
fn true_now() -> SystemTime {
    let skew = SKEW_MS.load(Ordering::Relaxed);
    let magnitude = Duration::from_millis(skew.unsigned_abs());
    if skew >= 0 {
        SystemTime::now() - magnitude
    } else {
        SystemTime::now() + magnitude
    }
}

fn now_us() -> u64 {
    true_now()
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

/// Every agent a process registers, by name: [`AGENT`], [`WAITER`], [`ASKER`] and [`CHILD`].
fn agents(dir: &Path) -> Vec<(&'static str, Agent)> {
    let log = SideEffectLog::open(log_path(dir)).expect("the side-effect log opens");
    let resource = FencedResource::open(fences_path(dir)).expect("the fenced resource opens");
    // `model` with the tools named in `tools`.
    let agent = |model: ScriptedModel, tools: &[&str]| {
        TOOLS.iter().filter(|(name, _)| tools.contains(name)).fold(
            Agent::new(model),
            |agent, &(name, kind)| {
                agent.tool(ChaosTool {
                    name,
                    kind,
                    log: log.clone(),
                    resource: resource.clone(),
                })
            },
        )
    };
    let call =
        |id: &str, tool: &str, args| ModelResponse::calls(vec![ToolCall::new(id, tool, args)]);
    let chaos = ScriptedModel::new(vec![
        call("lookup-1", "lookup", json!({})),
        ModelResponse::calls(vec![
            ToolCall::new("charge-1", "charge", json!({})),
            ToolCall::new("ticket-1", "ticket", json!({})),
        ]),
        call("email-1", "email", json!({})),
        ModelResponse::answer("done"),
    ]);
    let chaos = agent(chaos, &["charge", "ticket", "lookup", "email"]).policy(
        |_: &RunId, call: &ToolCall| match call.name.as_str() {
            "ticket" => Decision::RequireApproval("tickets need a person".into()),
            _ => Decision::Allow,
        },
    );
    // A timer shorter than a TTL, so that it falls due within the kills and stops.
    let waiter = ScriptedModel::new(vec![
        call(
            "nap-1",
            "sleep_until",
            json!({"seconds": 0.2, "reason": "settle"}),
        ),
        call("hand-1", "research", json!({"task": "open a ticket"})),
        call("charge-1", "charge", json!({})),
        ModelResponse::answer("done"),
    ]);
    let waiter = agent(waiter, &["charge"]).sleep_until().delegate(
        "research",
        CHILD,
        "Hands a task to a child run.",
    );
    // The waiter's moves with a question and an event between the timer and the child.
    let asker = ScriptedModel::new(vec![
        call(
            "nap-1",
            "sleep_until",
            json!({"seconds": 0.2, "reason": "settle"}),
        ),
        call("ask-1", "ask_person", json!({"question": "Go ahead?"})),
        call("event-1", "wait_for_event", json!({ "name": EVENT })),
        call("hand-1", "research", json!({"task": "open a ticket"})),
        call("charge-1", "charge", json!({})),
        ModelResponse::answer("done"),
    ]);
    let asker = agent(asker, &["charge"])
        .sleep_until()
        .ask_person()
        .wait_for_event()
        .delegate("research", CHILD, "Hands a task to a child run.");
    let child = ScriptedModel::new(vec![
        call("ticket-1", "ticket", json!({})),
        ModelResponse::answer("ticket opened"),
    ]);
    let child = agent(child, &["ticket"]);
    vec![
        (AGENT, chaos),
        (WAITER, waiter),
        (ASKER, asker),
        (CHILD, child),
    ]
}

/// A supervisor over `store` for `owner`, with every agent.
fn supervisor(store: Store, dir: &Path, owner: &str, mode: Mode) -> actix::Addr<Supervisor> {
    agents(dir)
        .into_iter()
        .fold(
            Supervisor::builder(store).config(config(owner, mode)),
            |builder, (name, agent)| builder.agent(name, agent),
        )
        .start()
        .expect("starts")
}

fn config(owner: &str, mode: Mode) -> Config {
    // The watch wakes the runs that wait: a child's end, and timers, whichever worker set them.
    let config = Config::default()
        .clock(true_now)
        .lease_owner(owner)
        .lease_ttl(mode.ttl())
        .start_margin(mode.ttl() / 3)
        .watch(Watch::default());
    match mode {
        // The released runs reach the others through the feed: the period is only a backstop.
        Mode::Deploy => config.recovery(Recovery::default().every(Duration::from_secs(5))),
        _ => config,
    }
}

/// How long a deploy's worker drains: far longer than its tools take.
const DEPLOY_DRAIN: Duration = Duration::from_secs(5);

/// Starts or resumes runs forever, several at once, until killed.
fn worker(dir: &Path, location: &str, index: u8, mode: Mode, skew_ms: i64) {
    SKEW_MS.store(skew_ms, Ordering::Relaxed);
    let wall = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros());
    println!(
        "worker-{index} pid {} starts: wall clock {wall} µs, skew {skew_ms} ms, {location}",
        std::process::id()
    );
    // A worker outlives no parent, even one killed with SIGKILL: it is then adopted.
    let parent = std::os::unix::process::parent_id();
    std::thread::spawn(move || {
        while std::os::unix::process::parent_id() == parent {
            std::thread::sleep(Duration::from_millis(200));
        }
        std::process::exit(0);
    });
    let store = open_store(location);
    with_system(|| async move {
        let sup = supervisor(store.clone(), dir, &format!("worker-{index}"), mode);
        if mode == Mode::Deploy {
            // As a service does: SIGTERM drains, then the process exits. Until its handler is
            // installed a SIGTERM ends the process as a crash, so the parent waits for the mark.
            let drained = agentrt::drain_on_signal(sup.clone(), Drain::within(DEPLOY_DRAIN));
            std::fs::write(ready_path(dir, std::process::id()), b"").expect("the ready mark");
            actix_rt::spawn(async move {
                let report = drained.await;
                println!(
                    "worker-{index} pid {} DRAINED handed_over={} settled={} left_running={} \
                     left_queued={}",
                    std::process::id(),
                    report.handed_over.len(),
                    report.settled.len(),
                    report.left_running.len(),
                    report.left_queued
                );
                std::process::exit(if report.is_clean() { 0 } else { 4 });
            });
        }
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
                        let driven = if open.is_empty() || (total < 400 && rand::random_bool(0.4)) {
                            let agent = if rand::random_bool(WAITER_SHARE) {
                                if rand::random_bool(ASKER_SHARE) {
                                    ASKER
                                } else {
                                    WAITER
                                }
                            } else {
                                AGENT
                            };
                            drive(&sup, Some(agent), None).await
                        } else {
                            let run_id = open[rand::random_range(0..open.len())].clone();
                            drive(&sup, None, Some(run_id)).await
                        };
                        // A draining worker starts nothing: its process exits soon.
                        if let Err(Error::Draining | Error::HandedOver { .. }) = driven {
                            actix_rt::time::sleep(Duration::from_millis(50)).await;
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

/// Starts a run of `agent` (with no `run_id`) or resumes one, approving what waits, until it
/// finishes, is someone else's, or waits for a time, a child, an answer or an event (the
/// supervisors wake it once it came).
async fn drive(
    sup: &actix::Addr<Supervisor>,
    agent: Option<&str>,
    run_id: Option<RunId>,
) -> agentrt::Result<()> {
    let mut reply = match &run_id {
        None => sup
            .send(StartRun::new(agent.unwrap_or(AGENT), json!({})))
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

/// How the parent starts its workers.
struct Launcher<'a> {
    dir: &'a Path,
    mode: Mode,
    db: &'a Db,
    hosts: Option<&'a Hosts>,
    /// Each worker's skew, in milliseconds.
    skews: Vec<i64>,
}

impl Launcher<'_> {
    /// Worker `index`'s command: in its host's namespace, with its clock skewed, if so.
    fn command(&self, index: u8) -> Command {
        let exe = std::env::current_exe().expect("this executable");
        let mut command = match self.hosts {
            Some(hosts) => hosts.command(index, &exe),
            None => Command::new(exe),
        };
        let skew = self.skews[usize::from(index)];
        if skew != 0 {
            command.envs(chaos_hosts::skew_env(skew));
        }
        command
    }

    fn spawn(&self, index: u8) -> Child {
        let location = match self.hosts {
            Some(_) => self.db.location_via(chaos_hosts::gateway(index)),
            None => self.db.location(),
        };
        let mode = self.mode.to_possible_value().expect("a named mode");
        let output = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("workers.log"))
            .expect("the workers' log");
        self.command(index)
            .args(["--worker", &index.to_string(), "--mode", mode.get_name()])
            .args(["--skew-ms", &self.skews[usize::from(index)].to_string()])
            .args(["--db", &location, "--dir"])
            .arg(self.dir)
            .stdout(output.try_clone().expect("the workers' log"))
            .stderr(output)
            .spawn()
            .expect("a worker starts")
    }

    /// Checks that worker `index` would start where it should and read the wall clock it
    /// should: a process started as it is prints its clock.
    fn probe(&self, index: u8) -> Result<(), String> {
        let before = now_us();
        let output = self
            .command(index)
            .arg("--probe-clock")
            .output()
            .map_err(|err| format!("a probe of worker-{index}: {err}"))?;
        let after = now_us();
        let text = String::from_utf8_lossy(&output.stdout);
        let Ok(wall) = text.trim().parse::<i64>() else {
            return Err(format!(
                "a probe of worker-{index} failed: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            ));
        };
        let offset_ms = (wall - ((before + after) / 2) as i64) / 1000;
        let skew = self.skews[usize::from(index)];
        // The probe's start takes a few milliseconds; a clock libfaketime missed is off by
        // the whole skew.
        if (offset_ms - skew).abs() > 250 {
            return Err(format!(
                "worker-{index}'s wall clock is off by {offset_ms} ms, not {skew} ms: is \
                 libfaketime ({}) installed (apt-get install faketime)?",
                chaos_hosts::LIBFAKETIME
            ));
        }
        Ok(())
    }
}

/// Waits for a worker sent SIGTERM to drain and exit cleanly: false if it exits with a
/// failure, or is still running well past its drain's deadline and grace.
fn drained(child: &mut Child) -> bool {
    let limit = Instant::now() + DEPLOY_DRAIN + Duration::from_secs(5);
    while Instant::now() < limit {
        match child.try_wait().expect("the worker's status") {
            Some(status) => return status.success(),
            None => std::thread::sleep(Duration::from_millis(5)),
        }
    }
    false
}

/// Sends `signal` (`STOP`, `CONT`, `TERM`) to a worker: with kill(1), as agentrt has no libc of its own.
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
    /// When a host cut off the network is joined again.
    cut_until: Option<Instant>,
}

/// A worker is killed when dropped, on a panic too: a stopped one as well.
impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
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

/// How long the drive to the end and the check may take before the run counts as hung.
const CHECK_LIMIT: Duration = Duration::from_secs(600);

/// Disturbs the workers for the given time, then finishes every run and checks them all;
/// whether all is well.
fn parent(args: &Args, dir: &Path) -> Result<bool, String> {
    let mode = args.mode;
    if mode == Mode::Partition && args.hosts.is_none() {
        return Err("--mode partition needs --hosts".into());
    }
    let db = Db::create(args.db.as_deref(), dir)?;
    let location = db.location();
    drop(open_store(&location));
    let resource = FencedResource::open(fences_path(dir)).expect("the fenced resource opens");
    let workers_count = args.hosts.unwrap_or(args.workers);
    let skews: Vec<i64> = (0..workers_count)
        .map(|_| match mode {
            Mode::Skew => {
                let ttls = mode.ttl().as_millis() as i64 * 10;
                rand::random_range(-ttls..=ttls)
            }
            _ => 0,
        })
        .collect();
    if mode == Mode::Skew {
        eprintln!("skews (ms): {skews:?}");
    }
    chaos_hosts::catch_interrupts();
    let hosts = match args.hosts {
        Some(count) => Some(Hosts::create(count, db.server()?).map_err(|err| {
            format!("{err}\nthe hosts are network namespaces: run as root, with iproute2")
        })?),
        None => None,
    };
    let launcher = Launcher {
        dir,
        mode,
        db: &db,
        hosts: hosts.as_ref(),
        skews: skews.clone(),
    };
    for index in 0..workers_count {
        launcher.probe(index)?;
    }
    let started = Instant::now();
    let end = started + Duration::from_secs(args.seconds);
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let spinners = (mode == Mode::Starve).then(|| Spinners::start(2 * cores));
    let mut workers: Vec<Worker> = (0..workers_count)
        .map(|i| Worker {
            child: launcher.spawn(i),
            stopped_until: None,
            cut_until: None,
        })
        .collect();
    // The person and the webhook: from the start until every run has finished.
    let stop_delivering = Arc::new(AtomicBool::new(false));
    let delivering = deliverer(location.clone(), stop_delivering.clone());
    let gap = || Duration::from_millis(rand::random_range(300..2500));
    let (mut kills, mut stops, mut cuts) = (0, 0, 0);
    // Drains: SIGTERMs whose worker exited cleanly, and those that did not in time (then
    // killed).
    let (mut drains, mut unclean_drains) = (0, 0);
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
    let hosts_ref = hosts.as_ref();
    let link = |index: usize, up: bool| {
        let hosts = hosts_ref.expect("a partition needs hosts");
        let index = index as u8;
        let done = if up {
            hosts.restore(index)
        } else {
            hosts.cut(index)
        };
        done.expect("the link changes");
    };
    while !chaos_hosts::interrupted() {
        let now = Instant::now();
        for (index, worker) in workers.iter_mut().enumerate() {
            if worker.stopped_until.is_some_and(|at| at <= now) {
                note("CONT", index, &worker.child);
                signal(&worker.child, "CONT");
                worker.stopped_until = None;
            }
            if worker.cut_until.is_some_and(|at| at <= now) {
                note("RESTORE", index, &worker.child);
                link(index, true);
                worker.cut_until = None;
            }
        }
        if now >= end {
            break;
        }
        if now >= next {
            next = now + gap();
            // A host cut off the network may still be killed: a host that dies in a partition.
            // A deploy's worker is not sent SIGTERM before its handler is installed.
            let candidates: Vec<usize> = (0..workers.len())
                .filter(|&i| workers[i].stopped_until.is_none())
                .filter(|&i| {
                    mode != Mode::Deploy || ready_path(dir, workers[i].child.id()).exists()
                })
                .collect();
            if !candidates.is_empty() {
                let victim = candidates[rand::random_range(0..candidates.len())];
                let worker = &mut workers[victim];
                let connected = worker.cut_until.is_none();
                if mode == Mode::Stop && rand::random_bool(0.7) {
                    note("STOP", victim, &worker.child);
                    signal(&worker.child, "STOP");
                    stops += 1;
                    let ttls = rand::random_range(1.0..=6.0);
                    worker.stopped_until = Some(now + mode.ttl().mul_f64(ttls));
                } else if mode == Mode::Partition && connected && rand::random_bool(0.7) {
                    note("CUT", victim, &worker.child);
                    link(victim, false);
                    cuts += 1;
                    let ttls = rand::random_range(1.0..=5.0);
                    worker.cut_until = Some(now + mode.ttl().mul_f64(ttls));
                } else if mode == Mode::Deploy {
                    note("TERM", victim, &worker.child);
                    signal(&worker.child, "TERM");
                    if drained(&mut worker.child) {
                        drains += 1;
                    } else {
                        note("KILL-AFTER-TERM", victim, &worker.child);
                        worker.child.kill().expect("SIGKILL");
                        worker.child.wait().expect("reaped");
                        unclean_drains += 1;
                    }
                    worker.child = launcher.spawn(victim as u8);
                } else {
                    note("KILL", victim, &worker.child);
                    worker.child.kill().expect("SIGKILL"); // Child::kill is SIGKILL on Unix
                    worker.child.wait().expect("reaped");
                    kills += 1;
                    worker.child = launcher.spawn(victim as u8);
                }
            }
        }
        let wake = workers
            .iter()
            .flat_map(|w| [w.stopped_until, w.cut_until])
            .flatten()
            .fold(next.min(end), Instant::min);
        // Short sleeps, so that an interrupt is seen soon.
        let sleep = wake.saturating_duration_since(Instant::now());
        std::thread::sleep(sleep.min(Duration::from_millis(100)));
    }
    // A deploy ends as it went: each worker drains and exits, and is not started again.
    if mode == Mode::Deploy {
        for (index, worker) in workers.iter_mut().enumerate() {
            let limit = Instant::now() + Duration::from_secs(30);
            while !ready_path(dir, worker.child.id()).exists() && Instant::now() < limit {
                std::thread::sleep(Duration::from_millis(10));
            }
            note("TERM", index, &worker.child);
            signal(&worker.child, "TERM");
            if drained(&mut worker.child) {
                drains += 1;
            } else {
                unclean_drains += 1;
            }
        }
    }
    // Every worker is killed before its host goes away.
    drop(workers);
    drop(hosts);
    drop(spinners);
    if chaos_hosts::interrupted() {
        stop_delivering.store(true, Ordering::Relaxed);
        let _ = delivering.join();
        db.discard(args.dir.is_some());
        return Err("interrupted: the workers are killed and the hosts removed".into());
    }
    chaos_hosts::release_interrupts();
    let seconds = started.elapsed().as_secs();
    // A hang is a finding: bounded, and said so.
    std::thread::spawn(|| {
        std::thread::sleep(CHECK_LIMIT);
        eprintln!("chaos: the drive to the end and the check took over {CHECK_LIMIT:?}: a hang");
        std::process::exit(3);
    });

    let store = open_store(&location);
    let left_waiting = finish_every_run(&store, dir, mode);
    for (run_id, state) in &left_waiting {
        eprintln!("run {run_id}: left {state}: its wake-up was lost");
    }
    stop_delivering.store(true, Ordering::Relaxed);
    let deliveries = delivering.join().expect("the deliverer");

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
    let mut count = Count {
        lost_wakeups: left_waiting.len(),
        ..Count::default()
    };
    // On SQLite under skew, each host writes lease expiries by its own shifted clock: they
    // cannot be compared with the events' true stamps.
    let one_clock = !(mode == Mode::Skew && matches!(db, Db::Sqlite(_)));
    for run in &runs {
        let events = store.events(&run.id).expect("the events");
        let of = |kind: EventKind| events.iter().filter(|e| e.kind == kind).count();
        count.takeovers += of(EventKind::LeaseTakenOver);
        count.released += of(EventKind::RunReleased);
        count.handed_over += of(EventKind::RunHandedOver);
        count.interruptions += of(EventKind::StepInterrupted);
        count.reconciliations += of(EventKind::StepReconciled);
        let run_waits = waits(&events);
        count.waits.add(&run_waits);
        count.child_runs += usize::from(run_waits.child_run);
        count.waiter_runs += usize::from(run.agent == WAITER);
        count.asker_runs += usize::from(run.agent == ASKER);
        // Every answer and event a wait began for came once, and an asker's run received its
        // event once (waited for, or kept before it waited), however often it was sent.
        let asker = run.agent == ASKER;
        let once = usize::from(asker);
        if run.state.is_finished()
            && (run_waits.answers != once
                || run_waits.answer_wakes != once
                || run_waits.event_wakes != run_waits.events
                || run_waits.events + run_waits.events_kept != once
                || run_waits.events_received != once)
        {
            eprintln!("run {}: of its answer and event, {run_waits:?}", run.id);
            count.lost_wakeups += 1;
        }
        // Every wait a finished run began was resumed, once.
        if run.state.is_finished() && run_waits.begun() != run_waits.resumed {
            eprintln!(
                "run {}: {} waits begun, {} resumed",
                run.id,
                run_waits.begun(),
                run_waits.resumed
            );
            count.lost_wakeups += 1;
        }
        for (start, expired) in late_starts(&events).into_iter().filter(|_| one_clock) {
            eprintln!(
                "run {}: {} of step {} at {} ms, after its lease expired at {expired} ms",
                run.id,
                start.kind,
                start.step.unwrap_or_default(),
                start
                    .at
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis())
            );
            count.late_starts += 1;
        }
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
        late_starts,
        released,
        handed_over,
        interruptions,
        reconciliations,
        waits,
        waiter_runs,
        asker_runs,
        child_runs,
        lost_wakeups,
        ..
    } = count;
    let Deliveries {
        duplicate_answers_refused,
        duplicate_events_refused,
        duplicates_accepted,
    } = deliveries;
    let late = if one_clock {
        late_starts.to_string()
    } else {
        "n/a".to_owned()
    };
    let zombies = zombies_unfenced + zombies_fenced_refused + zombies_fenced_applied;
    let mode_name = mode.to_possible_value().expect("a named mode");
    let skews = match mode {
        Mode::Skew => {
            let skews: Vec<String> = skews.iter().map(|s| format!("{s:+}")).collect();
            format!(" skews_ms={}", skews.join(","))
        }
        _ => String::new(),
    };
    println!(
        "chaos: mode={} db={} hosts={} seconds={seconds} workers={workers_count} runs={} kills={kills} stops={stops} partitions={cuts} drains={drains} unclean_drains={unclean_drains} released={released} handed_over={handed_over} interruptions={interruptions} reconciliations={reconciliations} ttl_waits={takeovers} takeovers={takeovers} executions={executions} approved_reruns={approved_reruns} idempotent_retries={idempotent_retries} not_applied_retries={not_applied_retries} zombies={zombies} zombies_unfenced={zombies_unfenced} zombies_fenced_refused={zombies_fenced_refused} zombies_fenced_applied={zombies_fenced_applied} fenced_applied_twice={fenced_applied_twice} unexplained={unexplained} lost_events={lost_events} runs_left_leased={runs_left_leased} late_starts={late} waiter_runs={waiter_runs} asker_runs={asker_runs} child_runs={child_runs} timer_waits={} child_waits={} answer_waits={} event_waits={} events_kept={} wakes={} wait_resumes={} duplicate_answers_refused={duplicate_answers_refused} duplicate_events_refused={duplicate_events_refused} duplicates_accepted={duplicates_accepted} lost_wakeups={lost_wakeups}{skews}",
        mode_name.get_name(),
        db.kind(),
        args.hosts.unwrap_or(0),
        runs.len(),
        waits.timers,
        waits.children,
        waits.answers,
        waits.events,
        waits.events_kept,
        waits.woken,
        waits.resumed,
    );
    drop(store);
    db.discard(args.dir.is_some());
    // A deploy whose tools finish within the drain's deadline is no crash: nothing waits out
    // a TTL, nothing is interrupted or reconciled.
    let deployed_cleanly = mode != Mode::Deploy
        || (unclean_drains == 0 && takeovers == 0 && interruptions == 0 && reconciliations == 0);
    Ok(fenced_applied_twice == 0
        && unexplained == 0
        && lost_events == 0
        && runs_left_leased == 0
        && late_starts == 0
        && lost_wakeups == 0
        && duplicates_accepted == 0
        && deployed_cleanly)
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

/// How long the last supervisor gives the runs that wait for a time or a child to be woken,
/// once no other run is left: far beyond their timers and the watch's period.
const WAKE_LIMIT: Duration = Duration::from_secs(60);

/// Drives every unfinished run to its end with one last supervisor, approving what waits. It
/// resumes no run that waits for a time or a child: its own wake-ups must. Returns the runs
/// that stayed waiting for [`WAKE_LIMIT`] once no other run was left: wake-ups lost.
fn finish_every_run(store: &Store, dir: &Path, mode: Mode) -> Vec<(RunId, RunState)> {
    let finisher = store.clone();
    with_system(|| async move {
        let sup = supervisor(finisher.clone(), dir, "finisher", mode);
        let mut deadline = Instant::now() + WAKE_LIMIT;
        loop {
            let unfinished: Vec<(RunId, RunState)> = finisher
                .runs(None)
                .expect("runs")
                .into_iter()
                .filter(|run| !run.state.is_finished())
                .map(|run| (run.id, run.state))
                .collect();
            let (waiting, others): (Vec<_>, Vec<_>) = unfinished
                .into_iter()
                .partition(|(_, state)| state.waits_for().is_some());
            if waiting.is_empty() && others.is_empty() {
                return Vec::new();
            }
            if others.is_empty() {
                if Instant::now() >= deadline {
                    return waiting;
                }
                actix_rt::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            deadline = Instant::now() + WAKE_LIMIT;
            futures_util::stream::iter(others)
                .for_each_concurrent(8, |(run_id, _)| {
                    let (sup, store) = (sup.clone(), finisher.clone());
                    async move {
                        // A lost lease or a busy store is tried again; an approval is given.
                        for _ in 0..20 {
                            // Finished, or waiting for its wake-up: nothing to resume.
                            let state = store.run(&run_id).expect("the run").state;
                            if state.is_finished() || state.waits_for().is_some() {
                                return;
                            }
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
                                // Moved on meanwhile (its child, say, which this supervisor
                                // executes already): read again.
                                Err(err) if err.is_run_state() => {}
                                Err(err) => eprintln!("run {run_id}: {err}; resuming again"),
                            }
                        }
                    }
                })
                .await;
        }
    })
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
    /// Starts of a side effect after the expiry of their lease (`late_starts`).
    late_starts: usize,
    /// `run.released`: runs a draining worker let go.
    released: usize,
    /// `run.handed_over`: released runs another worker took up.
    handed_over: usize,
    /// `step.interrupted`.
    interruptions: usize,
    /// `step.reconciled`.
    reconciliations: usize,
    /// The waits (for a time, a child) the runs began, were woken from and resumed from.
    waits: Waits,
    /// Runs of [`WAITER`].
    waiter_runs: usize,
    /// Runs of [`ASKER`].
    asker_runs: usize,
    /// Runs a parent's delegating call started.
    child_runs: usize,
    /// Runs left waiting by the last supervisor, and finished runs with a wait never resumed.
    lost_wakeups: usize,
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

/// What the parent did as the person who answers and the sender of the events.
#[derive(Debug, Default, Clone, Copy)]
struct Deliveries {
    /// Second answers to a question already answered, refused as they should be.
    duplicate_answers_refused: usize,
    /// Second deliveries of an event (same id) that wrote nothing (`duplicate`).
    duplicate_events_refused: usize,
    /// Second answers or deliveries that were accepted: must be 0.
    duplicates_accepted: usize,
}

/// Where the parent is with one [`ASKER`] run.
#[derive(Debug, Default)]
struct Asked {
    /// Its event is delivered before its run waits for it (while it waits for its answer).
    early: bool,
    /// Its question, once answered.
    answered: Option<Answer>,
    answered_twice: bool,
    /// What the first delivery of its event came to.
    delivered: Option<Delivered>,
    /// A first delivery failed: the next may find it committed all the same.
    delivery_failed: bool,
    delivered_twice: bool,
}

/// The event for `run_id`: its id is the run's own, so that a second delivery is a duplicate.
fn delivery(run_id: &RunId) -> Delivery {
    Delivery {
        run_id: run_id.clone(),
        name: EVENT.to_owned(),
        event_id: format!("{run_id}/{EVENT}"),
        payload: json!({"paid": true}),
    }
}

impl Asked {
    /// Delivers `run_id`'s event, then again with the same id, unless done; false if the
    /// store did not take the first (busy, a stopped worker holding its lock): tried again.
    fn deliver(&mut self, store: &Store, run_id: &RunId, counts: &mut Deliveries) -> bool {
        if self.delivered.is_none() {
            match store.deliver_event(&delivery(run_id)) {
                Ok(delivered) => {
                    if delivered == Delivered::Duplicate && !self.delivery_failed {
                        eprintln!("run {run_id}: its first event was a duplicate");
                        counts.duplicates_accepted += 1;
                    }
                    self.delivered = Some(delivered);
                }
                Err(err) => {
                    eprintln!("run {run_id}: delivering its event: {err}; again later");
                    self.delivery_failed = true;
                    return false;
                }
            }
        }
        if !self.delivered_twice {
            match store.deliver_event(&delivery(run_id)) {
                Ok(Delivered::Duplicate) => counts.duplicate_events_refused += 1,
                Ok(delivered) => {
                    eprintln!("run {run_id}: a second delivery of its event came to {delivered:?}");
                    counts.duplicates_accepted += 1;
                }
                // Finished meanwhile: refused, though not as a duplicate.
                Err(err) if err.is_run_state() => {}
                Err(_) => return true,
            }
            self.delivered_twice = true;
        }
        true
    }

    /// Answers `wait`'s question, then again, unless done.
    fn answer(&mut self, store: &Store, wait: &Wait, counts: &mut Deliveries) {
        let answer = Answer {
            run_id: wait.run_id.clone(),
            call_id: wait.call_id.clone(),
            answer: json!("yes"),
            by: "chaos".into(),
        };
        if self.answered.is_none() {
            match store.answer(&answer) {
                Ok(()) => {}
                // Only the parent answers: an earlier answer whose reply was an error.
                Err(err) if err.is_run_state() => {
                    eprintln!("run {}: answering: {err}", wait.run_id);
                }
                Err(err) => {
                    eprintln!("run {}: answering: {err}; again later", wait.run_id);
                    return;
                }
            }
            self.answered = Some(answer);
        }
        self.answer_again(store, counts);
    }

    /// Answers the question it answered once again, unless done: the store must refuse it.
    fn answer_again(&mut self, store: &Store, counts: &mut Deliveries) {
        let Some(answer) = self.answered.as_ref().filter(|_| !self.answered_twice) else {
            return;
        };
        match store.answer(answer) {
            Err(err) if err.is_run_state() => counts.duplicate_answers_refused += 1,
            Ok(()) => {
                eprintln!("run {}: a second answer was accepted", answer.run_id);
                counts.duplicates_accepted += 1;
            }
            Err(_) => return,
        }
        self.answered_twice = true;
    }
}

/// Every wait of `kind`, oldest first.
fn all_waits(store: &Store, kind: WaitKind) -> Vec<Wait> {
    let mut all: Vec<Wait> = Vec::new();
    loop {
        let Ok(page) = store.waits(Some(kind), all.last(), 100) else {
            return all;
        };
        let more = page.len() == 100;
        all.extend(page);
        if !more {
            return all;
        }
    }
}

/// The person and the webhook, from outside the workers, until `stop`: polls the store for
/// runs that wait for an answer or an event, answers the questions and delivers the events,
/// each twice. Half of the [`ASKER`] runs, picked when first seen waiting for their answer,
/// get their event then, before they wait for it: it is kept.
fn deliverer(location: String, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<Deliveries> {
    std::thread::spawn(move || {
        let store = open_store(&location);
        let mut counts = Deliveries::default();
        let mut asked: HashMap<RunId, Asked> = HashMap::new();
        while !stop.load(Ordering::Relaxed) {
            for wait in all_waits(&store, WaitKind::Answer) {
                let run = asked.entry(wait.run_id.clone()).or_insert_with(|| Asked {
                    early: rand::random_bool(0.5),
                    ..Asked::default()
                });
                if run.early && !run.deliver(&store, &wait.run_id, &mut counts) {
                    continue;
                }
                run.answer(&store, &wait, &mut counts);
            }
            for wait in all_waits(&store, WaitKind::Event) {
                let run = asked.entry(wait.run_id.clone()).or_default();
                run.deliver(&store, &wait.run_id, &mut counts);
            }
            // A second answer or delivery the store did not take at once.
            for (run_id, run) in &mut asked {
                run.answer_again(&store, &mut counts);
                if run.delivered.is_some() && !run.delivered_twice {
                    run.deliver(&store, run_id, &mut counts);
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        counts
    })
}
