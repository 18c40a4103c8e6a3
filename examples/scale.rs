//! Scale on one host: many runs started without waiting, each step a model call and a tool
//! call that take time without using the CPU (timers), all executing at once. Measures the
//! throughput against the ideal (every step taking only its model's and tool's time), the
//! latency each step adds to them, and the memory per run; the same workload on a database in
//! memory (no durability at all) is measured in the same run, side by side, as a baseline.
//!
//! ```text
//! cargo run --release --example scale -- --runs 10000 --rounds 3
//! ```
//!
//! Each side of each round runs in a child process of its own, so that its memory figures are
//! its own. Prints one JSON line per side and round, then a summary line of medians.

#[path = "support/memory.rs"]
mod memory;

use std::{
    collections::HashMap,
    process::Command,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use actix::{Actor, Context, Handler};
use agentrt::{
    Agent, ChatMessage, Config, Model, ModelError, ModelRequest, ModelResponse, RunSettled,
    SpawnRun, SubscribeRuns, Supervisor, Tool, ToolCall, ToolContext, ToolError, async_trait,
};
use clap::Parser;
use memory::status_kib;
use serde_json::{Value, json};

// Thousands of runs allocate and free on several threads at once (a run's thread, the store's):
// glibc's allocator contends on its arenas there, which is the application's choice to make,
// not the runtime's. The figures in docs/performance.md say which allocator they were
// measured with.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser, Debug, Clone)]
struct Args {
    /// Runs started at once (and the supervisor's concurrency limit).
    #[arg(long, default_value_t = 10_000)]
    runs: usize,
    /// Steps of each run: a model call that asks for a tool, then the tool call; the run ends
    /// with one more model call, which answers.
    #[arg(long, default_value_t = 8)]
    steps: u32,
    /// How long a model call takes.
    #[arg(long, default_value_t = 200)]
    model_ms: u64,
    /// How long a tool call takes.
    #[arg(long, default_value_t = 50)]
    tool_ms: u64,
    /// Rounds; each measures both sides once.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// The most moves one group commit holds (`sqlite::Options::max_group`).
    #[arg(long, default_value_t = agentrt::sqlite::DEFAULT_MAX_GROUP)]
    max_group: usize,
    /// Measures one side in this process: `durable` (a SQLite file) or `memory` (used by the
    /// parent process).
    #[arg(long, hide = true)]
    side: Option<String>,
}

fn main() {
    let args = Args::parse();
    match args.side.clone() {
        Some(side) => println!("{}", measure(&args, &side)),
        None => compare(&args),
    }
}

/// Runs both sides in child processes, interleaved round after round, and prints the medians.
fn compare(args: &Args) {
    let exe = std::env::current_exe().expect("the example's own path");
    let mut seen: HashMap<&str, Vec<Value>> = HashMap::new();
    for round in 0..args.rounds {
        for side in ["durable", "memory"] {
            let out = Command::new(&exe)
                .args([
                    "--side",
                    side,
                    "--runs",
                    &args.runs.to_string(),
                    "--steps",
                    &args.steps.to_string(),
                    "--model-ms",
                    &args.model_ms.to_string(),
                    "--tool-ms",
                    &args.tool_ms.to_string(),
                    "--max-group",
                    &args.max_group.to_string(),
                ])
                .output()
                .expect("the child process runs");
            assert!(
                out.status.success(),
                "the {side} side failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let line = String::from_utf8_lossy(&out.stdout);
            let mut result: Value = serde_json::from_str(line.trim()).expect("one JSON line");
            result["round"] = json!(round);
            println!("{result}");
            seen.entry(side).or_default().push(result);
        }
    }
    let median = |side: &str, field: &str| {
        let mut values: Vec<f64> = seen[side]
            .iter()
            .map(|v| v[field].as_f64().unwrap())
            .collect();
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    let mut summary = json!({
        "summary": "scale",
        "runs": args.runs,
        "steps": args.steps,
        "model_ms": args.model_ms,
        "tool_ms": args.tool_ms,
        "rounds": args.rounds,
        "ideal_steps_per_s": ideal_steps_per_s(args),
    });
    for side in ["durable", "memory"] {
        summary[side] = json!({
            "steps_per_s": median(side, "steps_per_s"),
            "of_ideal": median(side, "of_ideal"),
            "added_p50_ms": median(side, "added_p50_ms"),
            "added_p99_ms": median(side, "added_p99_ms"),
            "kib_per_run": median(side, "kib_per_run"),
        });
    }
    summary["durable_over_memory_p99"] =
        json!(median("durable", "added_p99_ms") - median("memory", "added_p99_ms"));
    println!("{summary}");
}

/// The throughput if every step took only its model's and tool's time: all runs' steps over
/// the time one run takes (its steps and its answering call).
fn ideal_steps_per_s(args: &Args) -> f64 {
    let step = Duration::from_millis(args.model_ms + args.tool_ms);
    let run = step * args.steps + Duration::from_millis(args.model_ms);
    (args.runs as f64 * f64::from(args.steps)) / run.as_secs_f64()
}

/// When each run's model was last called, and the gaps between its calls less the model's
/// and the tool's own time: the latency a step adds.
#[derive(Default)]
struct Gaps {
    last: HashMap<String, Instant>,
    added: Vec<Duration>,
}

/// A model that takes `took` and asks for `steps` tool calls before it answers.
struct TimedModel {
    took: Duration,
    /// The model's and the tool's time, which a gap between two calls includes.
    step: Duration,
    steps: usize,
    gaps: Arc<Mutex<Gaps>>,
}

#[async_trait(?Send)]
impl Model for TimedModel {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        let now = Instant::now();
        {
            let mut gaps = self.gaps.lock().unwrap();
            let run = request.run_id.to_string();
            if let Some(last) = gaps.last.insert(run, now) {
                let added = now.duration_since(last).saturating_sub(self.step);
                gaps.added.push(added);
            }
        }
        actix_rt::time::sleep(self.took).await;
        let turn = request
            .messages
            .iter()
            .filter(|m| matches!(m, ChatMessage::Assistant(_)))
            .count();
        if turn < self.steps {
            let id = format!("c{turn}");
            Ok(ModelResponse::calls(vec![ToolCall::new(
                id,
                "wait",
                json!({}),
            )]))
        } else {
            Ok(ModelResponse::answer("done"))
        }
    }
}

/// A tool that takes `took`.
struct TimedTool {
    took: Duration,
}

#[async_trait(?Send)]
impl Tool for TimedTool {
    fn name(&self) -> &str {
        "wait"
    }

    async fn call(&self, _: &ToolContext, _: &Value) -> Result<Value, ToolError> {
        actix_rt::time::sleep(self.took).await;
        Ok(json!("ok"))
    }
}

/// Counts settled runs and says when all have.
struct Countdown {
    left: usize,
    failed: usize,
    done: Option<tokio::sync::oneshot::Sender<usize>>,
}

impl Actor for Countdown {
    type Context = Context<Self>;
}

impl Handler<RunSettled> for Countdown {
    type Result = ();

    fn handle(&mut self, msg: RunSettled, _: &mut Context<Self>) {
        if !matches!(msg.result, Ok(agentrt::Outcome::Succeeded { .. })) {
            self.failed += 1;
            eprintln!("{}: {:?}", msg.run_id, msg.result);
        }
        self.left -= 1;
        if self.left == 0
            && let Some(done) = self.done.take()
        {
            let _ = done.send(self.failed);
        }
    }
}

/// One side, in this process: its figures as a JSON line.
fn measure(args: &Args, side: &str) -> Value {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let options = agentrt::sqlite::Options::new().max_group(args.max_group);
    let store = match side {
        "durable" => options.open(dir.path().join("scale.db")),
        "memory" => options.open(":memory:"),
        other => panic!("no side {other:?}"),
    }
    .expect("the store opens");
    let base_kib = status_kib("VmRSS");
    let gaps = Arc::new(Mutex::new(Gaps::default()));
    let (runs, steps) = (args.runs, args.steps);
    let (model, tool) = (
        Duration::from_millis(args.model_ms),
        Duration::from_millis(args.tool_ms),
    );
    let probe = gaps.clone();
    let (elapsed, busiest) = actix::System::new().block_on(async move {
        let agent = Agent::new(TimedModel {
            took: model,
            step: model + tool,
            steps: steps as usize,
            gaps: probe,
        })
        .tool(TimedTool { took: tool })
        .max_steps(2 * steps + 2);
        let sup = Supervisor::builder(store)
            .config(Config::default().max_concurrent_runs(runs))
            .agent("scale", agent)
            .start()
            .expect("the supervisor starts");
        let (done, all_done) = tokio::sync::oneshot::channel();
        let countdown = Countdown {
            left: runs,
            failed: 0,
            done: Some(done),
        }
        .start();
        sup.send(SubscribeRuns(countdown.recipient()))
            .await
            .unwrap();
        let started = Instant::now();
        let spawns = (0..runs).map(|_| sup.send(SpawnRun::new("scale", json!({}))));
        for answer in futures_util::future::join_all(spawns).await {
            answer
                .expect("the supervisor runs")
                .expect("the run starts");
        }
        let failed = all_done.await.expect("every run settles");
        assert_eq!(failed, 0, "every run succeeds");
        // Before the system stops: its threads are gone after.
        (started.elapsed(), busiest_threads_cpu_s())
    });
    let mut added = std::mem::take(&mut gaps.lock().unwrap().added);
    added.sort();
    let quantile = |q: f64| added[((added.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e3;
    let steps_per_s = (runs as f64 * f64::from(steps)) / elapsed.as_secs_f64();
    let peak_kib = status_kib("VmHWM");
    let per_step_us = |cpu_s: f64| cpu_s * 1e6 / (runs as f64 * f64::from(steps));
    json!({
        "side": side,
        "runs": runs,
        "steps": steps,
        "elapsed_s": elapsed.as_secs_f64(),
        "steps_per_s": steps_per_s,
        "of_ideal": steps_per_s / ideal_steps_per_s(args),
        "added_p50_ms": quantile(0.5),
        "added_p99_ms": quantile(0.99),
        "peak_rss_kib": peak_kib,
        "kib_per_run": (peak_kib.saturating_sub(base_kib)) as f64 / runs as f64,
        // The store's writing thread is the busiest, the runs' thread the next: the CPU each
        // spends on a step says which one holds the throughput.
        "busiest_thread_us_per_step": busiest.first().copied().map(per_step_us),
        "second_thread_us_per_step": busiest.get(1).copied().map(per_step_us),
    })
}

/// The CPU time (user and system) of this process's threads since each started, in seconds,
/// busiest first; empty where the system has no /proc. The runs' thread counts the store's
/// opening and the starts too: its figure per step is an upper bound.
fn busiest_threads_cpu_s() -> Vec<f64> {
    // SAFETY: sysconf reads a constant of the system; it has no precondition.
    let ticks_per_s = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let mut times: Vec<f64> = std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("stat")).ok())
        .filter_map(|stat| {
            // The fields after the name, which is in parentheses and may hold spaces.
            let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
            let ticks = |n: usize| fields.get(n)?.parse::<f64>().ok();
            Some((ticks(11)? + ticks(12)?) / ticks_per_s)
        })
        .collect();
    times.sort_by(|a, b| b.total_cmp(a));
    times
}
