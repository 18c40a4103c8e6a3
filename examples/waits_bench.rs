//! What waiting costs: the memory of a supervisor holding many waiting runs, how late timers
//! falling due together are woken, how fast delivered events resume their runs, and what a
//! tree of child runs costs against ordinary tool calls.
//!
//! ```text
//! cargo run --release --example waits_bench -- --rounds 5
//! cargo run --release --features postgres --example waits_bench -- --rounds 5 --url postgres://postgres@127.0.0.1:5432/postgres
//! ```
//!
//! Each measurement compares two sides, each side of each round a fresh process of its own (this
//! example again, with `--side`) on a new database, the sides' order swapped every round:
//!
//! - **memory**: the resident memory of a process that opens a database holding `--waiting`
//!   runs waiting for an event and starts a supervisor with their agent, recovery and a watch,
//!   after its first passes; against the same process on a database with none.
//! - **timers**: `--timers` runs sleeping until one same time; the delay from that time to each
//!   run's `run.resumed`, against a single run's.
//! - **events**: `--events` runs waiting for an event, each delivered through
//!   `Store::deliver_event` from another thread while a supervisor watches: runs resumed per
//!   second, against the same runs waiting for approvals recorded through
//!   `Store::record_approval` (the watch's older path).
//! - **events_door**: the same events delivered through the supervisor's `DeliverEvent`, all
//!   sent at once, against `Store::deliver_event` from another thread.
//! - **tree**: one parent whose model asks for `--children` delegating calls in one response
//!   (each a child run that answers at once), from its start to its success; against the same
//!   parent with `--children` ordinary tool calls.
//!
//! Prints one JSON line per side and round (with the load average when it started), then a
//! summary line per measurement: the median, lowest and highest of the rounds' ratios, and each
//! side's medians.

#[path = "support/memory.rs"]
mod memory;

use std::{
    process::Command,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use actix::{Actor, Context, Handler};
use agentrt::{
    Agent, Approval, ChatMessage, Config, DeliverEvent, Delivered, Delivery, EventKind, Model,
    ModelError, ModelRequest, ModelResponse, Outcome, Recovery, RequireApprovalFor, RunId,
    RunSettled, StartRun, Store, SubscribeRuns, Supervisor, Tool, ToolCall, ToolContext, ToolError,
    WaitKind, Watch, async_trait,
    sqlite::{Options, Synchronous},
};
use clap::Parser;
use futures_util::StreamExt;
use memory::status_kib;
use serde_json::{Value, json};

#[derive(Parser, Debug, Clone)]
struct Args {
    /// Rounds; each measures both sides of each measurement once.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Only these measurements (memory, timers, events, events_door, tree); all when empty.
    #[arg(long)]
    only: Vec<String>,
    /// Waiting runs of the memory measurement.
    #[arg(long, default_value_t = 100_000)]
    waiting: usize,
    /// Runs whose timers fall due together.
    #[arg(long, default_value_t = 1000)]
    timers: usize,
    /// Runs woken by delivered events.
    #[arg(long, default_value_t = 1000)]
    events: usize,
    /// Child runs of the tree (delegating calls in the parent's one response).
    #[arg(long, default_value_t = 10)]
    children: usize,
    /// A PostgreSQL server: each side of each round gets a schema of its own there instead of
    /// an SQLite file (with the `postgres` feature).
    #[arg(long)]
    url: Option<String>,
    /// Measures one side in this process, on `--location` (used by the parent process).
    #[arg(long, hide = true)]
    side: Option<String>,
    #[arg(long, hide = true)]
    location: Option<String>,
}

fn main() {
    let args = Args::parse();
    match (&args.side, &args.location) {
        (Some(side), Some(location)) => {
            let load = load_average();
            let mut line = measure(&args, side, location);
            line["side"] = json!(side);
            line["load_at_start"] = json!(load);
            println!("{line}");
        }
        _ => compare(&args),
    }
}

// ---------------------------------------------------------------------------------------------
// The parent: each side a fresh process, sides interleaved, then the summaries.

/// A new database for one side of one round: an SQLite file in a directory of its own, or a
/// PostgreSQL schema; migrated here, so that no side's figures include it; removed when dropped.
enum Place {
    Sqlite(tempfile::TempDir),
    #[cfg(feature = "postgres")]
    Postgres(agentrt::testkit::postgres::Schema),
}

impl Place {
    fn new(args: &Args) -> Place {
        let place = match &args.url {
            None => Place::Sqlite(tempfile::tempdir().expect("a temporary directory")),
            #[cfg(feature = "postgres")]
            Some(url) => Place::Postgres(agentrt::testkit::postgres::Schema::new(url)),
            #[cfg(not(feature = "postgres"))]
            Some(_) => panic!("--url needs the `postgres` feature"),
        };
        drop(open(&place.location()));
        place
    }

    fn location(&self) -> String {
        match self {
            Place::Sqlite(dir) => dir.path().join("waits.db").display().to_string(),
            #[cfg(feature = "postgres")]
            Place::Postgres(schema) => schema.url(),
        }
    }
}

fn open(location: &str) -> Store {
    #[cfg(feature = "postgres")]
    if location.starts_with("postgres://") {
        return agentrt::postgres::Options::new()
            .open(location)
            .expect("the store opens");
    }
    Options::new()
        .synchronous(Synchronous::Full)
        .open(location)
        .expect("the store opens")
}

/// Runs `side` in a fresh process on `location`; its JSON line.
fn run_side(args: &Args, side: &str, location: &str) -> Value {
    let exe = std::env::current_exe().expect("the example's own path");
    let out = Command::new(exe)
        .args(["--side", side, "--location", location])
        .args(["--waiting", &args.waiting.to_string()])
        .args(["--timers", &args.timers.to_string()])
        .args(["--events", &args.events.to_string()])
        .args(["--children", &args.children.to_string()])
        .stderr(std::process::Stdio::inherit())
        .output()
        .expect("the side's process runs");
    assert!(out.status.success(), "side {side} failed");
    let stdout = String::from_utf8_lossy(&out.stdout);
    stdout
        .lines()
        .find_map(|line| serde_json::from_str(line).ok())
        .expect("the side's JSON line")
}

/// A measurement: its two sides, how each side's database is made, the figure compared
/// (`ratio` of side a's over side b's) and the figures whose medians are reported.
struct Comparison {
    name: &'static str,
    sides: [&'static str; 2],
    ratio: fn(&Value, &Value) -> f64,
    figures: &'static [&'static str],
}

const COMPARISONS: [Comparison; 5] = [
    Comparison {
        name: "memory",
        sides: ["memory_waiting", "memory_none"],
        // KiB per waiting run: the growth over the side with none.
        ratio: |a, b| (f(a, "rss_kib") - f(b, "rss_kib")) / f(a, "waiting_runs").max(1.0),
        figures: &[
            "rss_kib",
            "peak_rss_kib",
            "rss_before_open_kib",
            "rss_after_open_kib",
        ],
    },
    Comparison {
        name: "timers",
        sides: ["timers_many", "timers_one"],
        ratio: |a, b| f(a, "p50_ms") / f(b, "p50_ms").max(1.0),
        figures: &[
            "p50_ms",
            "p99_ms",
            "max_ms",
            "all_resumed_ms",
            "all_succeeded_ms",
        ],
    },
    Comparison {
        name: "events",
        sides: ["events", "approvals"],
        ratio: |a, b| f(a, "resumed_per_s") / f(b, "resumed_per_s"),
        figures: &[
            "resumed_per_s",
            "delivered_per_s",
            "p50_ms",
            "p99_ms",
            "all_succeeded_ms",
        ],
    },
    Comparison {
        name: "events_door",
        sides: ["events_message", "events"],
        ratio: |a, b| f(a, "resumed_per_s") / f(b, "resumed_per_s"),
        figures: &[
            "resumed_per_s",
            "delivered_per_s",
            "p50_ms",
            "p99_ms",
            "all_succeeded_ms",
        ],
    },
    Comparison {
        name: "tree",
        sides: ["tree", "calls"],
        ratio: |a, b| f(a, "median_ms") / f(b, "median_ms"),
        figures: &["first_ms", "median_ms"],
    },
];

fn f(line: &Value, field: &str) -> f64 {
    line[field].as_f64().unwrap_or(f64::NAN)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn compare(args: &Args) {
    let wants = |name: &str| args.only.is_empty() || args.only.iter().any(|only| only == name);
    for comparison in COMPARISONS.iter().filter(|c| wants(c.name)) {
        // The memory's databases are made once (100,000 runs take a while), and only read by
        // the sides' processes.
        let shared = (comparison.name == "memory").then(|| {
            let (waiting, none) = (Place::new(args), Place::new(args));
            let made = run_side(args, "prepare_waiting", &waiting.location());
            println!("{made}");
            (waiting, none)
        });
        let mut seen: [Vec<Value>; 2] = [Vec::new(), Vec::new()];
        let mut ratios = Vec::new();
        for round in 0..args.rounds {
            let mut lines: [Option<Value>; 2] = [None, None];
            for i in [round % 2, (round + 1) % 2] {
                let side = comparison.sides[i];
                let place = shared.is_none().then(|| Place::new(args));
                let location = match (&shared, &place) {
                    (Some((waiting, none)), _) => [waiting, none][i].location(),
                    (None, Some(place)) => place.location(),
                    (None, None) => unreachable!(),
                };
                let mut line = run_side(args, side, &location);
                line["round"] = json!(round);
                line["backend"] = json!(if args.url.is_some() {
                    "postgres"
                } else {
                    "sqlite"
                });
                println!("{line}");
                lines[i] = Some(line);
            }
            let [a, b] = lines.map(|line| line.expect("both sides ran"));
            ratios.push((comparison.ratio)(&a, &b));
            seen[0].push(a);
            seen[1].push(b);
        }
        let mut line = json!({
            "summary": comparison.name,
            "backend": if args.url.is_some() { "postgres" } else { "sqlite" },
            "rounds": args.rounds,
            "min_ratio": ratios.iter().cloned().fold(f64::MAX, f64::min),
            "max_ratio": ratios.iter().cloned().fold(f64::MIN, f64::max),
            "median_ratio": median(&mut ratios),
        });
        for (i, side) in comparison.sides.iter().enumerate() {
            let medians: serde_json::Map<String, Value> = comparison
                .figures
                .iter()
                .map(|field| {
                    let mut values: Vec<f64> = seen[i].iter().map(|l| f(l, field)).collect();
                    (field.to_string(), json!(median(&mut values)))
                })
                .collect();
            line[*side] = Value::Object(medians);
        }
        println!("{line}");
    }
}

// ---------------------------------------------------------------------------------------------
// One side, in its own process.

fn measure(args: &Args, side: &str, location: &str) -> Value {
    match side {
        "prepare_waiting" => prepare_waiting(location, args.waiting),
        "memory_waiting" | "memory_none" => memory(location, args.waiting, side),
        "timers_many" => timers(location, args.timers),
        "timers_one" => timers(location, 1),
        "events" => events(location, args.events, Door::Event),
        "approvals" => events(location, args.events, Door::Approval),
        "events_message" => events(location, args.events, Door::Message),
        "tree" => tree(location, args.children, true),
        "calls" => tree(location, args.children, false),
        other => panic!("no side {other}"),
    }
}

/// A supervisor as a service runs one: recovery and a watch, at their defaults, with the
/// agents `agents`.
fn supervisor(store: Store, agents: Vec<(&str, Agent)>) -> actix::Addr<Supervisor> {
    let config = Config::default()
        .recovery(Recovery::default())
        .watch(Watch::default());
    let mut builder = Supervisor::builder(store).config(config);
    for (name, agent) in agents {
        builder = builder.agent(name, agent);
    }
    builder.start().expect("the supervisor starts")
}

/// Answers from a script of tool calls: at its first turn, `calls` (built from the run's
/// input); then a final answer.
struct CallsModel(fn(&Value) -> Vec<ToolCall>);

#[async_trait(?Send)]
impl Model for CallsModel {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        let answered = request
            .messages
            .iter()
            .any(|m| matches!(m, ChatMessage::Assistant(_)));
        Ok(if answered {
            ModelResponse::answer("done")
        } else {
            ModelResponse::calls((self.0)(request.input))
        })
    }
}

/// Waits for an event named `go`.
fn event_waiter() -> Agent {
    Agent::new(CallsModel(|_| {
        vec![ToolCall::new(
            "c1",
            "wait_for_event",
            json!({ "name": "go" }),
        )]
    }))
    .wait_for_event()
}

/// Does nothing: the call's cost is agentrt's.
struct Noop(&'static str);

#[async_trait(?Send)]
impl Tool for Noop {
    fn name(&self) -> &str {
        self.0
    }

    async fn call(&self, _: &ToolContext, _: &Value) -> Result<Value, ToolError> {
        Ok(json!("done"))
    }
}

/// Forwards every settled run to a channel.
struct Forward(tokio::sync::mpsc::UnboundedSender<RunSettled>);

impl Actor for Forward {
    type Context = Context<Self>;
}

impl Handler<RunSettled> for Forward {
    type Result = ();

    fn handle(&mut self, msg: RunSettled, _: &mut Context<Self>) {
        let _ = self.0.send(msg);
    }
}

/// The runs a supervisor settles from now on.
async fn settled(
    sup: &actix::Addr<Supervisor>,
) -> tokio::sync::mpsc::UnboundedReceiver<RunSettled> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    sup.send(SubscribeRuns(Forward(tx).start().recipient()))
        .await
        .expect("the supervisor runs");
    rx
}

/// Waits until `count` runs (`run`, if given) have succeeded; panics after two minutes.
async fn until_succeeded(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<RunSettled>,
    run: Option<&RunId>,
    count: usize,
) {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut succeeded = 0;
    while succeeded < count {
        let left = deadline.saturating_duration_since(Instant::now());
        let settled = actix_rt::time::timeout(left, rx.recv())
            .await
            .unwrap_or_else(|_| panic!("{succeeded} of {count} runs succeeded in time"))
            .expect("the supervisor runs");
        match settled.result {
            _ if run.is_some_and(|run| *run != settled.run_id) => {}
            Ok(Outcome::Succeeded { .. }) => succeeded += 1,
            Ok(_) => {}
            Err(err) => panic!("run {} stopped: {err}", settled.run_id),
        }
    }
}

/// Starts `count` runs of `agent` with `input(i)`, at most 1,000 at once; each must end as
/// `expect` says. The runs' ids.
async fn start_all(
    sup: &actix::Addr<Supervisor>,
    agent: &str,
    count: usize,
    input: impl Fn(usize) -> Value,
    expect: impl Fn(&Outcome) -> bool,
) -> Vec<RunId> {
    let calls = (0..count).map(|i| sup.send(StartRun::new(agent, input(i))));
    let replies: Vec<_> = futures_util::stream::iter(calls)
        .buffer_unordered(1000)
        .collect()
        .await;
    replies
        .into_iter()
        .map(|reply| {
            let reply = reply.expect("the supervisor runs").expect("the run starts");
            assert!(
                expect(&reply.outcome),
                "the run ended as {:?}",
                reply.outcome
            );
            reply.run_id
        })
        .collect()
}

fn waits_for(kind: WaitKind) -> impl Fn(&Outcome) -> bool {
    move |outcome| matches!(outcome, Outcome::Waiting { wait } if wait.kind == kind)
}

fn millis(at: SystemTime) -> f64 {
    at.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
        * 1000.0
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// The time of each run's first event of `kind`, in milliseconds since the epoch.
fn times_of(store: &Store, runs: &[RunId], kind: EventKind) -> Vec<f64> {
    runs.iter()
        .map(|run_id| {
            let events = store.events(run_id).expect("the run's events");
            let event = events
                .iter()
                .find(|e| e.kind == kind)
                .unwrap_or_else(|| panic!("run {run_id} has no {kind}"));
            millis(event.at)
        })
        .collect()
}

/// memory's database: `count` runs waiting for an event, started 1,000 at a time.
fn prepare_waiting(location: &str, count: usize) -> Value {
    let store = open(location);
    actix::System::new().block_on(async move {
        let sup = supervisor(store.clone(), vec![("waiter", event_waiter())]);
        let started = Instant::now();
        let runs = start_all(
            &sup,
            "waiter",
            count,
            |i| json!({ "n": i }),
            waits_for(WaitKind::Event),
        )
        .await;
        let elapsed = started.elapsed().as_secs_f64();
        let listed = store
            .waits(Some(WaitKind::Event), None, 10)
            .expect("the waits");
        assert!(runs.len() == count && listed.len() == count.min(10));
        json!({ "bench": "prepare_waiting", "waiting_runs": count, "seconds": elapsed, "runs_made_waiting_per_s": count as f64 / elapsed })
    })
}

/// memory: a process opens the database and starts a supervisor with the waiting runs' agent,
/// recovery and a watch; its RSS after its first passes.
fn memory(location: &str, waiting: usize, side: &str) -> Value {
    let rss_before_open = status_kib("VmRSS");
    let store = open(location);
    let rss_after_open = status_kib("VmRSS");
    // Recovery's passes every 100 ms and the watch's polls every 50 ms: 2 s is twenty of the
    // one and forty of the other.
    let config = Config::default()
        .recovery(Recovery::default().every(Duration::from_millis(100)))
        .watch(Watch::default());
    actix::System::new().block_on(async move {
        let _sup = Supervisor::builder(store)
            .config(config)
            .agent("waiter", event_waiter())
            .start()
            .expect("the supervisor starts");
        actix_rt::time::sleep(Duration::from_secs(2)).await;
    });
    json!({
        "bench": "memory",
        "waiting_runs": if side == "memory_waiting" { waiting } else { 0 },
        "rss_before_open_kib": rss_before_open,
        "rss_after_open_kib": rss_after_open,
        "rss_kib": status_kib("VmRSS"),
        "peak_rss_kib": status_kib("VmHWM"),
    })
}

/// timers: `count` runs sleeping until one same time, a few seconds ahead; the delay from it
/// to each run's resume.
fn timers(location: &str, count: usize) -> Value {
    let store = open(location);
    let sleeper = Agent::new(CallsModel(|input| {
        vec![ToolCall::new(
            "c1",
            "sleep_until",
            json!({ "until": input["until"], "reason": "bench" }),
        )]
    }))
    .sleep_until();
    let reader = store.clone();
    let (runs, due, made) = actix::System::new().block_on(async move {
        let sup = supervisor(store, vec![("sleeper", sleeper)]);
        let mut settled = settled(&sup).await;
        // Time enough for every run to begin its wait first.
        let due = SystemTime::now() + Duration::from_secs(3) + Duration::from_millis(count as u64);
        let until = rfc3339(due);
        let started = Instant::now();
        let runs = start_all(
            &sup,
            "sleeper",
            count,
            |_| json!({ "until": until }),
            waits_for(WaitKind::Timer),
        )
        .await;
        let made = started.elapsed();
        assert!(
            SystemTime::now() < due,
            "the runs took {made:?} to begin their waits, past the due time"
        );
        until_succeeded(&mut settled, None, count).await;
        (runs, due, made)
    });
    let due = millis(due).floor();
    let mut late: Vec<f64> = times_of(&reader, &runs, EventKind::RunResumed)
        .into_iter()
        .map(|at| at - due)
        .collect();
    let finished = times_of(&reader, &runs, EventKind::RunFinished);
    late.sort_by(f64::total_cmp);
    json!({
        "bench": "timers",
        "runs": count,
        "made_waiting_ms": made.as_secs_f64() * 1000.0,
        "p50_ms": percentile(&late, 0.5),
        "p99_ms": percentile(&late, 0.99),
        "max_ms": late[late.len() - 1],
        "all_resumed_ms": late[late.len() - 1],
        "all_succeeded_ms": finished.iter().cloned().fold(f64::MIN, f64::max) - due,
    })
}

/// How the runs of `events` are woken.
#[derive(Clone, Copy, PartialEq)]
enum Door {
    /// An event delivered through `Store::deliver_event`, from another thread.
    Event,
    /// An approval recorded through `Store::record_approval`, from another thread.
    Approval,
    /// An event delivered through the supervisor's `DeliverEvent`, all sent at once.
    Message,
}

fn delivery(i: usize, run_id: RunId) -> Delivery {
    Delivery {
        run_id,
        name: "go".into(),
        event_id: format!("evt-{i}"),
        payload: json!({ "n": i }),
    }
}

/// events: `count` waiting runs, each woken (from another thread, one after the other,
/// through the store; or through the supervisor) while the supervisor watches; how fast they
/// resume.
fn events(location: &str, count: usize, door: Door) -> Value {
    let store = open(location);
    let agent = match door {
        Door::Event | Door::Message => event_waiter(),
        Door::Approval => Agent::new(CallsModel(|_| vec![ToolCall::new("c1", "noop", json!({}))]))
            .tool(Noop("noop"))
            .policy(RequireApprovalFor::tools(["noop"])),
    };
    let reader = store.clone();
    let (runs, first, delivered) = actix::System::new().block_on(async move {
        let sup = supervisor(store.clone(), vec![("waiter", agent)]);
        let mut settled = settled(&sup).await;
        let expect = move |outcome: &Outcome| match door {
            Door::Event | Door::Message => waits_for(WaitKind::Event)(outcome),
            Door::Approval => matches!(outcome, Outcome::WaitingForApproval { .. }),
        };
        let runs = start_all(&sup, "waiter", count, |i| json!({ "n": i }), expect).await;
        if door == Door::Message {
            let first = SystemTime::now();
            let sends: Vec<_> = (runs.iter().cloned().enumerate())
                .map(|(i, run_id)| actix_rt::spawn(sup.send(DeliverEvent(delivery(i, run_id)))))
                .collect();
            for send in sends {
                let delivered = send.await.unwrap().expect("the supervisor runs");
                assert_eq!(delivered.expect("the event is delivered"), Delivered::Woke);
            }
            let last = SystemTime::now();
            until_succeeded(&mut settled, None, count).await;
            return (runs, first, last);
        }
        let sender = runs.clone();
        let delivering = std::thread::spawn(move || {
            let first = SystemTime::now();
            for (i, run_id) in sender.into_iter().enumerate() {
                if door == Door::Approval {
                    let approval = Approval::approve(run_id, "c1", "bench");
                    store
                        .record_approval(&approval)
                        .expect("the approval is recorded");
                } else {
                    store
                        .deliver_event(&delivery(i, run_id))
                        .expect("the event is delivered");
                }
            }
            (first, SystemTime::now())
        });
        until_succeeded(&mut settled, None, count).await;
        let (first, last) = delivering.join().expect("the deliveries");
        (runs, first, last)
    });
    let first = millis(first);
    let resumed = times_of(&reader, &runs, EventKind::RunResumed);
    let woken = times_of(
        &reader,
        &runs,
        match door {
            Door::Event | Door::Message => EventKind::WaitWoken,
            Door::Approval => EventKind::ApprovalRecorded,
        },
    );
    let finished = times_of(&reader, &runs, EventKind::RunFinished);
    let last_resumed = resumed.iter().cloned().fold(f64::MIN, f64::max);
    let mut late: Vec<f64> = resumed.iter().zip(&woken).map(|(r, w)| r - w).collect();
    late.sort_by(f64::total_cmp);
    json!({
        "bench": "events",
        "door": match door {
            Door::Event => "Store::deliver_event",
            Door::Approval => "Store::record_approval",
            Door::Message => "DeliverEvent",
        },
        "runs": count,
        "resumed_per_s": count as f64 / ((last_resumed - first).max(1.0) / 1000.0),
        "delivered_per_s": count as f64 / ((millis(delivered) - first).max(1.0) / 1000.0),
        "p50_ms": percentile(&late, 0.5),
        "p99_ms": percentile(&late, 0.99),
        "all_succeeded_ms": finished.iter().cloned().fold(f64::MIN, f64::max) - first,
    })
}

/// tree: a parent that asks for `children` calls in one response, each a child run (`delegate`)
/// or an ordinary tool call; from its start to its success, the first run of the process and
/// the median of the next five.
fn tree(location: &str, children: usize, delegate: bool) -> Value {
    let store = open(location);
    // The number of calls goes in the run's input, since the model is a function.
    let model = CallsModel(|input| {
        (0..input["calls"].as_u64().unwrap_or(0))
            .map(|i| ToolCall::new(format!("c{i}"), "research", json!({ "task": i })))
            .collect()
    });
    let parent = if delegate {
        Agent::new(model).delegate("research", "child", "Research a task.")
    } else {
        Agent::new(model).tool(Noop("research"))
    };
    let child = Agent::new(CallsModel(|_| Vec::new()));
    actix::System::new().block_on(async move {
        let sup = supervisor(store, vec![("parent", parent), ("child", child)]);
        let mut settled = settled(&sup).await;
        let mut took = Vec::new();
        for _ in 0..6 {
            let started = Instant::now();
            let reply = sup
                .send(StartRun::new("parent", json!({ "calls": children })))
                .await
                .expect("the supervisor runs")
                .expect("the run starts");
            if !matches!(reply.outcome, Outcome::Succeeded { .. }) {
                until_succeeded(&mut settled, Some(&reply.run_id), 1).await;
            }
            took.push(started.elapsed().as_secs_f64() * 1000.0);
            // Drains what the run settled meanwhile.
            while settled.try_recv().is_ok() {}
        }
        let first = took[0];
        json!({
            "bench": "tree",
            "children": if delegate { children } else { 0 },
            "calls": children,
            "first_ms": first,
            "median_ms": median(&mut took[1..]),
        })
    })
}

/// `at` as an RFC 3339 time in UTC, to the millisecond.
fn rfc3339(at: SystemTime) -> String {
    let ms = at
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as i64;
    let (days, ms) = (ms.div_euclid(86_400_000), ms.rem_euclid(86_400_000));
    // The civil date of a day number: the inverse of the days `sleep_until` counts.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        ms / 3_600_000,
        ms / 60_000 % 60,
        ms / 1000 % 60,
        ms % 1000
    )
}

/// The load averages over 1, 5 and 15 minutes, as `uptime` shows them.
fn load_average() -> Vec<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .filter_map(|v| v.parse().ok())
        .collect()
}
