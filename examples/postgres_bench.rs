//! The PostgreSQL backend under load: many runs of a few steps each (a scripted model's call,
//! then a tool call with a side effect), all started at once, in one process or in several
//! sharing the database. Four sides, alternating round after round: PostgreSQL with group
//! commit and pipelining (the default writers), PostgreSQL with one commit per move and each
//! statement answered before the next (`group_commit(false)`, `pipeline(false)`), the same
//! with pipelining, and, as a reference, SQLite (a file, `synchronous=FULL`). Figures are moves and runs per
//! second, reported as ratios of sides measured in the same round, and memory per run.
//!
//! ```text
//! cargo run --release --features postgres,testkit --example postgres_bench -- --rounds 5
//! ```
//!
//! Each side of each round gets a new schema (or SQLite file), dropped afterwards, and runs in
//! child processes of its own (this example again, with `--child`), so that its memory figures
//! are its own and several processes can share the database. The children start their runs
//! together, when the parent says so. Prints one JSON line per side and round, then summary
//! lines of medians.

#[path = "support/loop_agent.rs"]
mod loop_agent;
#[path = "support/memory.rs"]
mod memory;

use std::{
    io::{BufRead, BufReader, Write},
    process::{Child, ChildStdout, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use agentrt::{
    Agent, Config, Outcome, StartRun, Store, Supervisor, Tool, ToolContext, ToolError, async_trait,
    postgres,
    sqlite::{self, Synchronous},
    testkit::postgres::Schema,
};
use clap::{Parser, ValueEnum};
use loop_agent::{Commits, LoopModel, median, summary};
use memory::status_kib;
use serde_json::{Value, json};

#[derive(Parser, Debug)]
struct Args {
    /// The server; each side of each round gets a schema of its own in this database.
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432/postgres")]
    url: String,
    /// Rounds; each measures every side once.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Runs started at once, in total over the processes (one measurement each).
    #[arg(long, value_delimiter = ',', default_values_t = [1, 50, 1000])]
    runs: Vec<usize>,
    /// Processes sharing the database (one measurement each); the runs are shared out.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 4])]
    processes: Vec<usize>,
    /// Steps of each run.
    #[arg(long, default_value_t = 3)]
    steps: u32,
    /// Writer connections of each PostgreSQL process.
    #[arg(long, default_value_t = postgres::DEFAULT_WRITERS)]
    writers: usize,
    /// Moves unanswered on a process's first writer connection from which new runs go to the
    /// others (`postgres::Options::spill_at`).
    #[arg(long, default_value_t = postgres::DEFAULT_SPILL_AT)]
    spill_at: usize,
    /// The sides to measure.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Side::Group, Side::Single, Side::Sqlite])]
    sides: Vec<Side>,
    /// Measures this side in this process, on `--location`, `--runs` runs (used by the parent).
    #[arg(long, hide = true)]
    child: Option<Side>,
    #[arg(long, hide = true)]
    location: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Side {
    /// PostgreSQL, group commit on.
    Group,
    /// PostgreSQL, one transaction per move, each statement answered before the next is sent.
    Single,
    /// PostgreSQL, one transaction per move, its writes pipelined.
    Pipelined,
    /// SQLite, a file at `synchronous=FULL`, group commit on.
    Sqlite,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Group => "group",
            Side::Single => "single",
            Side::Pipelined => "pipelined",
            Side::Sqlite => "sqlite",
        }
    }
}

/// A tool whose call is a side effect: it counts, and the count is checked against the steps.
struct Effect(Arc<AtomicUsize>);

#[async_trait(?Send)]
impl Tool for Effect {
    fn name(&self) -> &str {
        "effect"
    }

    async fn call(&self, _: &ToolContext, _: &Value) -> Result<Value, ToolError> {
        Ok(json!(self.0.fetch_add(1, Ordering::SeqCst)))
    }
}

fn main() {
    let args = Args::parse();
    match (args.child, &args.location) {
        (Some(side), Some(location)) => child(&args, side, location),
        _ => compare(&args),
    }
}

/// Where one side of one round runs: a new schema or SQLite file, migrated, removed when
/// dropped.
enum Place {
    Postgres(Schema),
    Sqlite(tempfile::TempDir),
}

impl Place {
    fn new(side: Side, url: &str) -> Place {
        // Migrated here, so that no child's figures include it.
        let place = if side == Side::Sqlite {
            Place::Sqlite(tempfile::tempdir().expect("a temporary directory"))
        } else {
            Place::Postgres(Schema::new(url))
        };
        drop(open(side, &place.location(), 1, postgres::DEFAULT_SPILL_AT));
        place
    }

    fn location(&self) -> String {
        match self {
            Place::Postgres(schema) => schema.url(),
            Place::Sqlite(dir) => dir.path().join("bench.db").display().to_string(),
        }
    }
}

fn open(side: Side, location: &str, writers: usize, spill_at: usize) -> Store {
    match side {
        Side::Group => postgres::Options::new()
            .writers(writers)
            .spill_at(spill_at)
            .open(location),
        Side::Single => postgres::Options::new()
            .writers(writers)
            .spill_at(spill_at)
            .group_commit(false)
            .pipeline(false)
            .open(location),
        Side::Pipelined => postgres::Options::new()
            .writers(writers)
            .spill_at(spill_at)
            .group_commit(false)
            .open(location),
        Side::Sqlite => sqlite::Options::new()
            .synchronous(Synchronous::Full)
            .open(location),
    }
    .expect("the store opens")
}

/// Every measurement, its sides alternating round after round; one line per side and round,
/// then the summary lines.
fn compare(args: &Args) {
    for &processes in &args.processes {
        for &runs in &args.runs {
            if runs < processes {
                // One run lives in one process: nothing to share out.
                continue;
            }
            let mut seen: Vec<(Side, Vec<Value>)> =
                args.sides.iter().map(|&side| (side, Vec::new())).collect();
            for round in 0..args.rounds {
                for turn in 0..seen.len() {
                    let (side, lines) = &mut seen[(turn + round) % args.sides.len()];
                    let mut line = measure(args, *side, runs, processes);
                    line["round"] = json!(round);
                    println!("{line}");
                    lines.push(line);
                }
            }
            summarize(args, runs, processes, &seen);
        }
    }
}

/// The summary lines of one measurement: each side's medians, and group commit's moves per
/// second over the other sides', round by round.
fn summarize(args: &Args, runs: usize, processes: usize, seen: &[(Side, Vec<Value>)]) {
    let lines = |side: Side| seen.iter().find(|(s, _)| *s == side).map(|(_, l)| l);
    let medians = |lines: &Vec<Value>| {
        let of = |field: &str| {
            let mut values: Vec<f64> = lines.iter().map(|l| l[field].as_f64().unwrap()).collect();
            median(&mut values)
        };
        json!({
            "moves_per_s": of("moves_per_s"), "runs_per_s": of("runs_per_s"),
            "moves_per_commit": of("moves_per_commit"), "p50_ms": of("p50_ms"),
            "p99_ms": of("p99_ms"), "kib_per_run": of("kib_per_run"),
            "failed_runs": lines.iter().map(|l| l["failed_runs"].as_f64().unwrap()).sum::<f64>(),
        })
    };
    let shape = json!({ "runs": runs, "processes": processes, "steps": args.steps, "writers": args.writers, "spill_at": args.spill_at });
    let Some(group) = lines(Side::Group) else {
        return;
    };
    for other in [Side::Single, Side::Pipelined, Side::Sqlite] {
        let Some(others) = lines(other) else {
            continue;
        };
        let mut ratios: Vec<f64> = group
            .iter()
            .zip(others)
            .map(|(g, o)| g["moves_per_s"].as_f64().unwrap() / o["moves_per_s"].as_f64().unwrap())
            .collect();
        let mut extra = shape.clone();
        extra["group"] = medians(group);
        extra[other.name()] = medians(others);
        summary(
            &format!("postgres_group_vs_{}", other.name()),
            extra,
            &mut ratios,
        );
    }
}

/// One side, once: `processes` children on a new schema (or file), started together; the
/// moves and runs per second over the span from the first start to the last end.
fn measure(args: &Args, side: Side, runs: usize, processes: usize) -> Value {
    let place = Place::new(side, &args.url);
    let location = place.location();
    let mut children: Vec<(Child, BufReader<ChildStdout>)> = (0..processes)
        .map(|index| {
            // The first processes take the remainder.
            let share = runs / processes + usize::from(index < runs % processes);
            let mut child = Command::new(std::env::current_exe().expect("the example's path"))
                .args(["--child", side.name(), "--location", &location])
                .args(["--runs", &share.to_string()])
                .args(["--steps", &args.steps.to_string()])
                .args(["--writers", &args.writers.to_string()])
                .args(["--spill-at", &args.spill_at.to_string()])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .expect("the child starts");
            let stdout = BufReader::new(child.stdout.take().expect("its output"));
            (child, stdout)
        })
        .collect();
    let mut line = String::new();
    for (_, stdout) in &mut children {
        line.clear();
        stdout.read_line(&mut line).expect("the child's output");
        assert_eq!(
            line.trim(),
            "ready",
            "the {} child did not start",
            side.name()
        );
    }
    for (child, _) in &mut children {
        writeln!(child.stdin.as_mut().expect("its input"), "go").expect("the child reads");
    }
    let results: Vec<Value> = children
        .into_iter()
        .map(|(mut child, mut stdout)| {
            line.clear();
            stdout.read_line(&mut line).expect("the child's output");
            assert!(
                child.wait().expect("the child ends").success(),
                "the {} child failed",
                side.name()
            );
            serde_json::from_str(&line).expect("the child's line")
        })
        .collect();
    drop(place);
    let field = |name: &'static str| results.iter().map(move |r| r[name].as_f64().unwrap());
    let sum = |name| field(name).sum::<f64>();
    let most = |name| field(name).fold(f64::MIN, f64::max);
    let span = most("done_s") - field("go_s").fold(f64::MAX, f64::min);
    let (steps, failed) = (sum("steps"), sum("failed"));
    if failed == 0.0 {
        assert_eq!(sum("effects"), steps, "one effect per step");
    }
    let total = |per_step| {
        field("steps")
            .zip(field(per_step))
            .map(|(s, p)| s * p)
            .sum::<f64>()
    };
    let (commits, moves) = (total("commits_per_step"), total("moves_per_step"));
    json!({
        "bench": "postgres", "side": side.name(), "runs": runs, "processes": processes,
        "steps": args.steps, "span_s": span, "failed_runs": failed,
        "runs_per_s": runs as f64 / span, "moves_per_s": moves / span,
        "moves_per_commit": moves / commits, "commits_per_step": commits / steps,
        // The worst process's step latency.
        "p50_ms": most("p50_ms"), "p99_ms": most("p99_ms"),
        "kib_per_run": sum("rss_growth_kib") / runs as f64,
    })
}

/// One child: opens the store, starts a supervisor, says it is ready, and on the parent's word
/// starts its runs at once and waits for them all; prints its figures as one JSON line.
fn child(args: &Args, side: Side, location: &str) {
    let runs = args.runs[0];
    let store = open(side, location, args.writers, args.spill_at);
    let commits = Commits::default();
    let effects = Arc::new(AtomicUsize::new(0));
    let model = LoopModel::new(args.steps, "effect");
    let agent = Agent::new(model.clone())
        .tool(Effect(effects.clone()))
        .max_steps(2 * args.steps + 2);
    let config = Config::default()
        .observer(commits.clone())
        .max_concurrent_runs(runs);
    let (go, done, base_kib, failed) = actix::System::new().block_on(async move {
        let sup = Supervisor::builder(store)
            .config(config)
            .agent("bench", agent)
            .start()
            .expect("the supervisor starts");
        let base_kib = status_kib("VmRSS");
        println!("ready");
        std::io::stdout().flush().unwrap();
        let mut word = String::new();
        std::io::stdin().read_line(&mut word).unwrap();
        let go = SystemTime::now();
        // Spawned, so that every call is in flight at once.
        let calls: Vec<_> = (0..runs)
            .map(|_| actix_rt::spawn(sup.send(StartRun::new("bench", json!({})))))
            .collect();
        // A run that fails is counted and said, not a panic: what failed is a finding too.
        let mut failed = 0;
        for call in calls {
            match call.await.unwrap().unwrap() {
                Ok(reply) if matches!(reply.outcome, Outcome::Succeeded { .. }) => {}
                other => {
                    failed += 1;
                    eprintln!("a {} run did not succeed: {other:?}", side.name());
                }
            }
        }
        (go, SystemTime::now(), base_kib, failed)
    });
    let (p50, p99) = model.take_p50_p99();
    let steps = runs * args.steps as usize;
    let (commits_per_step, moves_per_step) = commits.per_step(steps);
    let seconds = |at: SystemTime| {
        at.duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO)
            .as_secs_f64()
    };
    println!(
        "{}",
        json!({
            "go_s": seconds(go), "done_s": seconds(done),
            "steps": steps, "commits_per_step": commits_per_step, "moves_per_step": moves_per_step,
            "effects": effects.load(Ordering::SeqCst), "failed": failed,
            "p50_ms": p50, "p99_ms": p99,
            "rss_growth_kib": status_kib("VmHWM").saturating_sub(base_kib),
        })
    );
}
