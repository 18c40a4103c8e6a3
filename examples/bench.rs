//! Benchmarks: what a step costs against SQLite's own limit, and what the lease costs.
//! Prints one JSON line per measurement, then one summary line per comparison. Each comparison
//! runs its two sides interleaved, round after round, in this one process, so that a noisy
//! machine affects both alike; figures are reported as ratios with their spread.
//!
//! ```text
//! cargo run --release --example bench -- --rounds 5
//! ```

#[path = "support/loop_agent.rs"]
mod loop_agent;
#[path = "support/memory.rs"]
mod memory;

use std::{
    collections::HashMap,
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use agentrt::{
    Agent, Config, Outcome, RequireApprovalFor, StartRun, Store, Supervisor, Tool, ToolContext,
    ToolError, async_trait,
    sqlite::{Options, Synchronous},
};
use clap::Parser;
use loop_agent::{Commits, LoopModel, median, summary};
use memory::status_kib;
use serde_json::{Value, json};

#[derive(Parser, Debug)]
struct Args {
    /// Rounds of each A/B comparison.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Steps of the single run (workload a).
    #[arg(long, default_value_t = 1000)]
    steps: u32,
    /// Concurrent runs of workload b.
    #[arg(long, default_value_t = 1000)]
    runs: usize,
    /// Steps of each run of workload b.
    #[arg(long, default_value_t = 20)]
    run_steps: u32,
    /// Workload b compares group commit with and without an index like the one migration 7
    /// dropped (`UNIQUE (run_id, call_id)` on steps), created again on one side.
    #[arg(long, hide = true)]
    call_id_index_ab: bool,
    /// Only these workloads (a, b, c, e, f; and disk and growth, which run only when named); a
    /// to f when empty.
    #[arg(long)]
    only: Vec<String>,
    /// Only this durability setting for workloads a and b (full, normal); both when absent.
    #[arg(long)]
    sync: Option<String>,
    /// Runs only agentrt's side of workload a, for a profiler.
    #[arg(long, hide = true)]
    profile_a: bool,
    /// Runs only one side of workload b (group commit on or off), for a profiler.
    #[arg(long, hide = true)]
    profile_b: Option<bool>,
    /// Runs the child of workload f on this database (used by the parent process).
    #[arg(long, hide = true)]
    child: Option<std::path::PathBuf>,
    /// Fresh-process mode: N processes for each of workloads a and b (or those `--only`
    /// names), each started anew on a new database: its first run, then warm runs.
    #[arg(long, num_args = 0..=1, default_missing_value = "7")]
    fresh: Option<usize>,
    /// Steps of the single run of the fresh mode's workload a.
    #[arg(long, default_value_t = 500)]
    fresh_steps: u32,
    /// Concurrent runs of the fresh mode's workload b (of `--run-steps` steps each).
    #[arg(long, default_value_t = 50)]
    fresh_runs: usize,
    /// Warm measurements after the first in each fresh process (their median is reported).
    #[arg(long, default_value_t = 3)]
    warm: usize,
    /// One process of the fresh mode, measuring this workload (used by the parent process).
    #[arg(long, hide = true)]
    fresh_child: Option<String>,
}

/// Does nothing: the step's cost is agentrt's.
struct Noop;

#[async_trait(?Send)]
impl Tool for Noop {
    fn name(&self) -> &str {
        "noop"
    }

    async fn call(&self, _: &ToolContext, _: &Value) -> Result<Value, ToolError> {
        Ok(Value::Null)
    }
}

/// Holds every call until the benchmark ends (workload e's running runs).
struct Hold(Arc<tokio::sync::Notify>, Arc<AtomicUsize>);

#[async_trait(?Send)]
impl Tool for Hold {
    fn name(&self) -> &str {
        "noop"
    }

    async fn call(&self, _: &ToolContext, _: &Value) -> Result<Value, ToolError> {
        self.1.fetch_add(1, Ordering::SeqCst);
        self.0.notified().await;
        Ok(Value::Null)
    }
}

/// A supervisor running `agent` as `"bench"`.
fn bench_supervisor(store: Store, config: Config, agent: Agent) -> actix::Addr<Supervisor> {
    Supervisor::builder(store)
        .config(config)
        .agent("bench", agent)
        .start()
        .unwrap()
}

fn options(sync: Synchronous) -> Options {
    Options::new().synchronous(sync)
}

/// Workload a, agentrt's side: one run of `steps` steps; (steps/s, commits per step).
fn agentrt_run(dir: &Path, sync: Synchronous, steps: u32, ttl: Duration) -> (f64, (f64, f64)) {
    let path = dir.join(format!("agentrt-{}.db", rand::random::<u32>()));
    let store = options(sync).open(&path).unwrap();
    let commits = Commits::default();
    let config = Config::default().lease_ttl(ttl).observer(commits.clone());
    let agent = Agent::new(LoopModel::new(steps, "noop"))
        .tool(Noop)
        .max_steps(u32::MAX);
    let elapsed = actix::System::new().block_on(async move {
        let sup = bench_supervisor(store, config, agent);
        let started = Instant::now();
        let reply = sup
            .send(StartRun::new("bench", json!({})))
            .await
            .unwrap()
            .unwrap();
        assert!(matches!(reply.outcome, Outcome::Succeeded { .. }));
        started.elapsed()
    });
    let _ = std::fs::remove_file(&path);
    (
        steps as f64 / elapsed.as_secs_f64(),
        commits.per_step(steps as usize),
    )
}

/// Appends one event in the baseline.
type EventFn<'a> = dyn FnMut(&rusqlite::Connection, &str, Option<u32>, &str) + 'a;

/// How the baseline of workload a commits a step.
#[derive(Clone, Copy, PartialEq)]
enum BaselineCommits {
    /// agentrt's: the model's answer with the tool's decision and start, synced; the tool's
    /// outcome with the next model reservation, written but not synced (the next commit's
    /// sync covers it).
    Same,
    /// The design before 0.5.1: both synced.
    BothSynced,
    /// Everything from one tool start to the next in one transaction: the fewest commits any
    /// design that makes each tool start durable before the call can make.
    One,
}

/// Workload a, the baseline: plain rusqlite doing the commits `commits` says with agentrt's
/// rows and statements (its schema and pragmas), with nothing around them.
fn baseline_run(dir: &Path, sync: Synchronous, steps: u32, commits: BaselineCommits) -> f64 {
    let path = dir.join(format!("baseline-{}.db", rand::random::<u32>()));
    drop(options(sync).open(&path).unwrap()); // the schema
    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.execute_batch(&format!(
        "PRAGMA journal_mode = WAL; PRAGMA synchronous = {}; PRAGMA foreign_keys = ON;
         PRAGMA wal_autocheckpoint = 0; PRAGMA temp_store = MEMORY;",
        sync.as_str()
    ))
    .unwrap();
    let ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64
    };
    // agentrt's checkpoint schedule: between transactions, once per 100 ms of commits, or
    // less often when a copy takes more than a twentieth of that.
    let mut last_checkpoint = Instant::now();
    let mut took = Duration::ZERO;
    let mut checkpoint_if_due = |conn: &rusqlite::Connection| {
        let period = (took * 19).clamp(Duration::from_millis(100), Duration::from_secs(2));
        if last_checkpoint.elapsed() >= period {
            let started = Instant::now();
            conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
                .unwrap();
            last_checkpoint = Instant::now();
            took = last_checkpoint - started;
        }
    };
    let started = Instant::now();
    let run = "baseline";
    let mut seq = 0i64;
    // The run's key, looked up once, as agentrt's writer keeps it.
    let mut key = None;
    let mut event = |tx: &rusqlite::Connection, kind: &str, step: Option<u32>, payload: &str| {
        seq += 1;
        let run_key: i64 = *key.get_or_insert_with(|| {
            tx.query_row("SELECT key FROM runs WHERE id = ?1", [run], |row| {
                row.get(0)
            })
            .unwrap()
        });
        tx.prepare_cached("INSERT INTO events (run_key, seq, kind, at, step, payload) VALUES (?1, ?2, ?3, ?4, ?5, ?6)")
            .unwrap()
            .execute(rusqlite::params![run_key, seq, kind, ms(), step, payload])
            .unwrap();
    };
    let touch = |tx: &rusqlite::Connection| {
        tx.prepare_cached("UPDATE runs SET updated_at = ?2 WHERE id = ?1 AND state = 'RUNNING' AND lease_owner = 'owner'")
            .unwrap()
            .execute(rusqlite::params![run, ms()])
            .unwrap();
    };
    // A reservation paired with the outcome before it shares that move's touch of the run.
    let begin_model = |tx: &rusqlite::Connection, event: &mut EventFn<'_>, step: u32| {
        tx.prepare_cached("INSERT INTO steps (run_id, step, kind, state, attempt) VALUES (?1, ?2, 'model', 'in_flight', 1)").unwrap().execute(rusqlite::params![run, step]).unwrap();
        event(tx, "step.model_started", Some(step), r#"{"attempt":1}"#);
    };
    let begin = |conn: &rusqlite::Connection| {
        conn.prepare_cached("BEGIN IMMEDIATE")
            .unwrap()
            .execute([])
            .unwrap();
    };
    let commit = |conn: &rusqlite::Connection| {
        conn.prepare_cached("COMMIT").unwrap().execute([]).unwrap();
    };
    // A commit written, not synced, at FULL, as agentrt's store makes it: the setting is
    // lowered for that transaction.
    let synchronous = |conn: &rusqlite::Connection, sync: &str| {
        conn.prepare_cached(&format!("PRAGMA synchronous = {sync}"))
            .unwrap()
            .execute([])
            .unwrap();
    };
    let tx = &conn;
    begin(tx);
    tx.execute(
        "INSERT INTO runs (id, agent, input, state, created_at, updated_at, lease_owner, lease_expires_at) VALUES (?1, 'bench', '{}', 'RUNNING', ?2, ?2, 'owner', ?2)",
        rusqlite::params![run, ms()],
    )
    .unwrap();
    event(tx, "run.started", None, "{}");
    touch(tx);
    begin_model(tx, &mut event, 1);
    commit(tx);
    let mut open = false;
    for i in 0..steps {
        let (model_step, tool_step) = (2 * i + 1, 2 * i + 2);
        if !open {
            begin(tx);
        }
        // The answer and the decision with its start share one touch of the run, and the
        // call's step is inserted started.
        touch(tx);
        let response = format!(r#"{{"tool_calls":[{{"id":"c{i}","name":"noop","args":{{}}}}]}}"#);
        tx.prepare_cached("INSERT INTO steps (run_id, step, kind, state, attempt, call_id, tool, args) VALUES (?1, ?2, 'tool', 'in_flight', 1, ?3, 'noop', '{}')").unwrap().execute(rusqlite::params![run, tool_step, format!("c{i}")]).unwrap();
        tx.prepare_cached(
            "UPDATE steps SET state = 'finished', result = ?3 WHERE run_id = ?1 AND step = ?2",
        )
        .unwrap()
        .execute(rusqlite::params![run, model_step, response])
        .unwrap();
        event(tx, "step.model_finished", Some(model_step), &response);
        event(
            tx,
            "policy.decided",
            Some(tool_step),
            r#"{"decision":"allow"}"#,
        );
        event(tx, "step.tool_started", Some(tool_step), r#"{"attempt":1}"#);
        // The tool's start is durable before its call.
        commit(tx);
        checkpoint_if_due(tx);

        if commits == BaselineCommits::Same {
            synchronous(tx, "NORMAL");
        }
        begin(tx);
        touch(tx);
        tx.prepare_cached("UPDATE steps SET state = 'finished', result = '{\"ok\":null}' WHERE run_id = ?1 AND step = ?2").unwrap().execute(rusqlite::params![run, tool_step]).unwrap();
        event(
            tx,
            "step.tool_finished",
            Some(tool_step),
            r#"{"output":null}"#,
        );
        begin_model(tx, &mut event, tool_step + 1);
        match commits {
            BaselineCommits::One => open = true,
            BaselineCommits::Same => {
                commit(tx);
                synchronous(tx, sync.as_str());
            }
            BaselineCommits::BothSynced => commit(tx),
        }
        if !open {
            checkpoint_if_due(tx);
        }
    }
    // The final answer.
    if !open {
        begin(tx);
    }
    touch(tx);
    let last = 2 * steps + 1;
    tx.prepare_cached(
        "UPDATE steps SET state = 'finished', result = ?3 WHERE run_id = ?1 AND step = ?2",
    )
    .unwrap()
    .execute(rusqlite::params![run, last, r#"{"text":"done"}"#])
    .unwrap();
    event(tx, "step.model_finished", Some(last), r#"{"text":"done"}"#);
    tx.execute(
        "UPDATE runs SET state = 'SUCCEEDED', output = 'done', lease_owner = NULL, lease_expires_at = NULL WHERE id = ?1",
        [run],
    )
    .unwrap();
    event(tx, "run.finished", None, r#"{"state":"SUCCEEDED"}"#);
    commit(tx);
    let elapsed = started.elapsed();
    drop(conn);
    let _ = std::fs::remove_file(&path);
    steps as f64 / elapsed.as_secs_f64()
}

/// The durability settings a and b measure.
fn syncs(args: &Args) -> Vec<Synchronous> {
    [Synchronous::Full, Synchronous::Normal]
        .into_iter()
        .filter(|sync| {
            args.sync
                .as_deref()
                .is_none_or(|only| only.eq_ignore_ascii_case(sync.as_str()))
        })
        .collect()
}

/// a: one run against the baseline, at FULL then NORMAL.
fn workload_a(args: &Args, dir: &Path) {
    if args.profile_a {
        for sync in syncs(args) {
            let (steps_per_s, (commits, moves)) =
                agentrt_run(dir, sync, args.steps, Duration::from_secs(30));
            println!(
                "{}",
                json!({ "bench": "a_one_side", "sync": sync.as_str(), "steps": args.steps, "steps_per_s": steps_per_s, "commits_per_step": commits, "moves_per_step": moves })
            );
        }
        return;
    }
    for sync in syncs(args) {
        let (mut ratios, mut ratios_both, mut ratios_one) = (Vec::new(), Vec::new(), Vec::new());
        let mut commits = 0.0;
        for round in 0..args.rounds {
            // Rotate which side goes first.
            let (mut ours, mut base, mut both, mut one) = (None, None, None, None);
            for side in (0..4).map(|i| (i + round) % 4) {
                match side {
                    0 => ours = Some(agentrt_run(dir, sync, args.steps, Duration::from_secs(30))),
                    1 => base = Some(baseline_run(dir, sync, args.steps, BaselineCommits::Same)),
                    2 => {
                        both = Some(baseline_run(
                            dir,
                            sync,
                            args.steps,
                            BaselineCommits::BothSynced,
                        ))
                    }
                    _ => one = Some(baseline_run(dir, sync, args.steps, BaselineCommits::One)),
                }
            }
            let (ours, base) = (ours.unwrap(), base.unwrap());
            let (both, one) = (both.unwrap(), one.unwrap());
            commits = ours.1.0;
            ratios.push(ours.0 / base);
            ratios_both.push(ours.0 / both);
            ratios_one.push(ours.0 / one);
            println!(
                "{}",
                json!({ "bench": "a_one_run", "sync": format!("{sync:?}"), "steps": args.steps, "round": round, "agentrt_steps_per_s": ours.0, "baseline_steps_per_s": base, "ratio": ours.0 / base, "both_synced_steps_per_s": both, "ratio_both_synced": ours.0 / both, "one_commit_steps_per_s": one, "ratio_one_commit": ours.0 / one, "commits_per_step": ours.1.0, "moves_per_step": ours.1.1 })
            );
        }
        summary(
            "a_one_run_vs_baseline",
            json!({ "sync": format!("{sync:?}"), "commits_per_step": commits }),
            &mut ratios,
        );
        summary(
            "a_one_run_vs_both_synced",
            json!({ "sync": format!("{sync:?}") }),
            &mut ratios_both,
        );
        summary(
            "a_one_run_vs_one_commit",
            json!({ "sync": format!("{sync:?}") }),
            &mut ratios_one,
        );
    }
}

/// c: the lease's cost per step: a 300 ms TTL (a renewal every 100 ms) against 30 s.
fn workload_c(args: &Args, dir: &Path) {
    let mut ratios = Vec::new();
    let run = |ttl| agentrt_run(dir, Synchronous::Full, args.steps, ttl).0;
    for round in 0..args.rounds {
        // Alternate which side goes first.
        let (short, long) = if round % 2 == 0 {
            let short = run(Duration::from_millis(300));
            (short, run(Duration::from_secs(30)))
        } else {
            let long = run(Duration::from_secs(30));
            (run(Duration::from_millis(300)), long)
        };
        ratios.push(short / long);
        println!(
            "{}",
            json!({ "bench": "c_lease_ttl", "round": round, "ttl_300ms_steps_per_s": short, "ttl_30s_steps_per_s": long, "ratio": short / long })
        );
    }
    summary("c_ttl_300ms_vs_30s", json!({}), &mut ratios);

    // The guard itself: the move's stamp with its lease condition against the same statement
    // without it, at synchronous=OFF so that the statement, not the disk, is measured.
    let path = dir.join("guard.db");
    drop(Store::open(&path).unwrap());
    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.execute_batch("PRAGMA synchronous = OFF;").unwrap();
    conn.execute("INSERT INTO runs (id, agent, input, state, created_at, updated_at, lease_owner, lease_expires_at) VALUES ('g', 'a', '{}', 'RUNNING', 0, 0, 'me', 9223372036854775807)", []).unwrap();
    let time = |sql: &str| {
        let started = Instant::now();
        for i in 0..20_000i64 {
            conn.execute_batch("BEGIN IMMEDIATE").unwrap();
            assert_eq!(
                conn.prepare_cached(sql)
                    .unwrap()
                    .execute(rusqlite::params![i, 1_700_000_000_000i64])
                    .unwrap(),
                1
            );
            conn.execute_batch("COMMIT").unwrap();
        }
        started.elapsed().as_secs_f64()
    };
    let guarded = "UPDATE runs SET updated_at = ?1 WHERE id = 'g' AND state = 'RUNNING' AND lease_owner = 'me' AND (?2 IS NULL OR lease_expires_at > ?2)";
    let plain = "UPDATE runs SET updated_at = ?1 WHERE id = 'g' AND state = 'RUNNING' AND ?2 = ?2";
    let mut ratios = Vec::new();
    for round in 0..args.rounds {
        let (with, without) = if round % 2 == 0 {
            let w = time(guarded);
            (w, time(plain))
        } else {
            let p = time(plain);
            (time(guarded), p)
        };
        ratios.push(with / without);
        println!(
            "{}",
            json!({ "bench": "c_guarded_move", "round": round, "guarded_s": with, "unguarded_s": without, "ratio": with / without })
        );
    }
    summary(
        "c_guarded_vs_unguarded_move_time",
        json!({ "moves": 20_000 }),
        &mut ratios,
    );
}

fn peak_rss_kib() -> u64 {
    status_kib("VmHWM")
}

fn rss_kib() -> u64 {
    status_kib("VmRSS")
}

/// One side of workload b: `runs` concurrent runs of `steps` steps; (steps/s, p50 ms, p99 ms).
/// `call_id_index` creates the index migration 7 dropped again first.
fn concurrent(
    dir: &Path,
    sync: Synchronous,
    (runs, steps): (usize, u32),
    group_commit: bool,
    call_id_index: bool,
) -> (f64, f64, f64) {
    let path = dir.join(format!("concurrent-{}.db", rand::random::<u32>()));
    if call_id_index {
        drop(options(sync).open(&path).unwrap());
        rusqlite::Connection::open(&path)
            .unwrap()
            .execute("CREATE UNIQUE INDEX call_id ON steps (run_id, call_id)", [])
            .unwrap();
    }
    let store = options(sync)
        .group_commit(group_commit)
        .open(&path)
        .unwrap();
    let model = LoopModel::new(steps, "noop");
    let agent = Agent::new(model.clone())
        .tool(Noop)
        .max_steps(2 * steps + 2);
    let config = Config::default();
    let elapsed = actix::System::new().block_on(async move {
        let sup = bench_supervisor(store, config, agent);
        let started = Instant::now();
        // Spawned, so that every call is in flight at once (a `send` not polled waits outside
        // a full mailbox).
        let calls: Vec<_> = (0..runs)
            .map(|_| actix_rt::spawn(sup.send(StartRun::new("bench", json!({})))))
            .collect();
        for call in calls {
            call.await.unwrap().unwrap().unwrap();
        }
        started.elapsed()
    });
    let _ = std::fs::remove_file(&path);
    let (p50, p99) = model.take_p50_p99();
    (runs as f64 * steps as f64 / elapsed.as_secs_f64(), p50, p99)
}

/// b: many concurrent runs of 20 steps on one supervisor, group commit on against off.
fn workload_b(args: &Args, dir: &Path) {
    if let Some(on) = args.profile_b {
        // One side only, for a profiler: no comparison.
        for sync in syncs(args) {
            let (steps_per_s, p50, p99) =
                concurrent(dir, sync, (args.runs, args.run_steps), on, false);
            println!(
                "{}",
                json!({ "bench": "b_one_side", "group_commit": on, "sync": sync.as_str(), "runs": args.runs, "steps_per_s": steps_per_s, "p50_ms": p50, "p99_ms": p99 })
            );
        }
        return;
    }
    let shape = (args.runs, args.run_steps);
    if args.call_id_index_ab {
        return call_id_index_ab(args, dir);
    }
    for sync in syncs(args) {
        let mut ratios = Vec::new();
        for round in 0..args.rounds.min(3) {
            let (on, off) = if round % 2 == 0 {
                let on = concurrent(dir, sync, shape, true, false);
                (on, concurrent(dir, sync, shape, false, false))
            } else {
                let off = concurrent(dir, sync, shape, false, false);
                (concurrent(dir, sync, shape, true, false), off)
            };
            ratios.push(on.0 / off.0);
            println!(
                "{}",
                json!({ "bench": "b_concurrent", "sync": format!("{sync:?}"), "runs": args.runs, "steps_per_run": args.run_steps, "round": round,
                        "group_commit_steps_per_s": on.0, "group_commit_p50_ms": on.1, "group_commit_p99_ms": on.2,
                        "single_commit_steps_per_s": off.0, "single_commit_p50_ms": off.1, "single_commit_p99_ms": off.2,
                        "ratio": on.0 / off.0, "peak_rss_kib": peak_rss_kib() })
            );
        }
        summary(
            "b_group_commit_vs_off",
            json!({ "sync": format!("{sync:?}"), "runs": args.runs, "steps_per_run": args.run_steps }),
            &mut ratios,
        );
    }
}

/// b with `--call-id-index-ab`: group commit on both sides, without and with the call-id index
/// that migration 7 dropped.
fn call_id_index_ab(args: &Args, dir: &Path) {
    let shape = (args.runs, args.run_steps);
    for sync in syncs(args) {
        let mut ratios = Vec::new();
        for round in 0..args.rounds {
            let (without, with) = if round % 2 == 0 {
                let without = concurrent(dir, sync, shape, true, false);
                (without, concurrent(dir, sync, shape, true, true))
            } else {
                let with = concurrent(dir, sync, shape, true, true);
                (concurrent(dir, sync, shape, true, false), with)
            };
            ratios.push(without.0 / with.0);
            println!(
                "{}",
                json!({ "bench": "b_call_id_index", "sync": format!("{sync:?}"), "runs": args.runs, "steps_per_run": args.run_steps, "round": round,
                        "without_steps_per_s": without.0, "with_steps_per_s": with.0, "ratio": without.0 / with.0 })
            );
        }
        summary(
            "b_without_vs_with_call_id_index",
            json!({ "sync": format!("{sync:?}"), "runs": args.runs, "steps_per_run": args.run_steps }),
            &mut ratios,
        );
    }
}

/// e: memory per run: 10,000 runs waiting for approval, then 1,000 running at once.
fn workload_e(dir: &Path) {
    let path = dir.join("memory.db");
    let store = Store::open(&path).unwrap();
    let release = Arc::new(tokio::sync::Notify::new());
    let entered = Arc::new(AtomicUsize::new(0));
    let waiting_agent = Agent::new(LoopModel::new(1, "noop"))
        .tool(Noop)
        .policy(RequireApprovalFor::tools(["noop"]));
    let running_agent =
        Agent::new(LoopModel::new(1, "noop")).tool(Hold(release.clone(), entered.clone()));
    actix::System::new().block_on(async move {
        let sup = Supervisor::builder(store).agent("waits", waiting_agent).agent("runs", running_agent).start().unwrap();
        let before = rss_kib();
        for chunk in 0..10 {
            let calls: Vec<_> =
                (0..1000).map(|i| actix_rt::spawn(sup.send(StartRun::new("waits", json!({ "n": chunk * 1000 + i }))))).collect();
            for call in calls {
                call.await.unwrap().unwrap().unwrap();
            }
        }
        let after_waiting = rss_kib();
        let calls: Vec<_> = (0..1000).map(|_| actix_rt::spawn(sup.send(StartRun::new("runs", json!({}))))).collect();
        while entered.load(Ordering::SeqCst) < 1000 {
            actix_rt::time::sleep(Duration::from_millis(20)).await;
        }
        let after_running = rss_kib();
        release.notify_waiters();
        for call in calls {
            call.await.unwrap().unwrap().unwrap();
        }
        println!(
            "{}",
            json!({ "bench": "e_memory", "waiting_runs": 10000, "kib_per_waiting_run": (after_waiting.saturating_sub(before)) as f64 / 10000.0, "running_runs": 1000, "kib_per_running_run": (after_running.saturating_sub(after_waiting)) as f64 / 1000.0 })
        );
    });
    let _ = std::fs::remove_file(&path);
}

/// f's child: runs one run until its tool is in flight, says so, and waits to be killed.
fn takeover_child(path: &Path) {
    let store = Store::open(path).unwrap();
    let release = Arc::new(tokio::sync::Notify::new());
    let entered = Arc::new(AtomicUsize::new(0));
    let agent = Agent::new(LoopModel::new(2, "noop")).tool(Hold(release, entered.clone()));
    actix::System::new().block_on(async move {
        let config = Config::default().lease_ttl(TAKEOVER_TTL);
        let sup = bench_supervisor(store, config, agent);
        actix_rt::spawn(sup.send(StartRun::new("bench", json!({})).with_id("victim")));
        while entered.load(Ordering::SeqCst) == 0 {
            actix_rt::time::sleep(Duration::from_millis(5)).await;
        }
        println!("READY");
        std::future::pending::<()>().await;
    });
}

const TAKEOVER_TTL: Duration = Duration::from_secs(1);

/// f: takeover latency after SIGKILL, from the dead owner's lease expiry to the new owner's
/// first step (the reconciliation of the interrupted call).
fn workload_f(args: &Args, dir: &Path) {
    use std::io::BufRead;
    let mut latencies = Vec::new();
    for round in 0..args.rounds {
        let path = dir.join(format!("takeover-{round}.db"));
        drop(Store::open(&path).unwrap());
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .arg("--child")
            .arg(&path)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        assert!(
            stdout
                .lines()
                .map_while(Result::ok)
                .any(|line| line == "READY"),
            "the child reports"
        );
        child.kill().unwrap();
        child.wait().unwrap();
        let store = Store::open(&path).unwrap();
        let run_id = agentrt::RunId::from("victim");
        let expires_at = store
            .lease(&run_id)
            .unwrap()
            .expect("the dead child's lease")
            .expires_at;
        let agent = Agent::new(LoopModel::new(2, "noop")).tool(Noop);
        let reader = store.clone();
        actix::System::new().block_on(async move {
            let config = Config::default().lease_ttl(TAKEOVER_TTL);
            let sup = bench_supervisor(store, config, agent);
            // A consumer's recovery loop: resume, and on RunLeased retry after its expiry.
            agentrt_resume_when_free(&sup, &run_id).await;
        });
        let events = reader.events(&agentrt::RunId::from("victim")).unwrap();
        let first_step = events
            .iter()
            .skip_while(|e| e.kind != agentrt::EventKind::LeaseTakenOver)
            .find(|e| e.kind == agentrt::EventKind::StepReconciled)
            .expect("the new owner reconciled the interrupted call");
        let latency = first_step
            .at
            .duration_since(expires_at)
            .unwrap_or_default()
            .as_secs_f64()
            * 1000.0;
        latencies.push(latency);
        println!(
            "{}",
            json!({ "bench": "f_takeover", "round": round, "ttl_ms": TAKEOVER_TTL.as_millis() as u64, "expiry_to_first_step_ms": latency })
        );
        let _ = std::fs::remove_file(&path);
    }
    let median = median(&mut latencies);
    println!(
        "{}",
        json!({ "summary": "f_takeover_latency_ms", "median": median, "min": latencies.first(), "max": latencies.last(), "renewal_period_ms": TAKEOVER_TTL.as_millis() as u64 / 3 })
    );
}

/// Resumes until the run is free (the dead child's lease expired), as a consumer would.
async fn agentrt_resume_when_free(sup: &actix::Addr<Supervisor>, run_id: &agentrt::RunId) {
    loop {
        match sup
            .send(agentrt::ResumeRun::new(run_id.clone()))
            .await
            .unwrap()
        {
            Err(agentrt::Error::RunLeased { expires_at, .. }) => {
                let wait = expires_at
                    .duration_since(std::time::SystemTime::now())
                    .unwrap_or_default();
                actix_rt::time::sleep(wait + Duration::from_millis(1)).await;
            }
            other => {
                other.unwrap();
                return;
            }
        }
    }
}

fn main() {
    let args = Args::parse();
    if let Some(path) = &args.child {
        takeover_child(path);
        return;
    }
    if let Some(workload) = &args.fresh_child {
        fresh_child(&args, workload);
        return;
    }
    if let Some(processes) = args.fresh {
        fresh(&args, processes);
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let wants = |name: &str| args.only.is_empty() || args.only.iter().any(|only| only == name);
    if wants("a") {
        workload_a(&args, dir.path());
    }
    if wants("c") {
        workload_c(&args, dir.path());
    }
    if wants("b") {
        workload_b(&args, dir.path());
    }
    if wants("e") {
        workload_e(dir.path());
    }
    if wants("f") {
        workload_f(&args, dir.path());
    }
    if args.only.iter().any(|only| only == "disk") {
        workload_disk(dir.path());
    }
    if args.only.iter().any(|only| only == "growth") {
        workload_growth(&args, dir.path());
    }
}

/// growth (only when asked for): `--rounds` rounds in a row of `--runs` concurrent runs of
/// `--run-steps` steps, at FULL with group commit, on one database and one supervisor: whether
/// a store slows down as it grows. One line per round (steps/s, step latency p50 and p99, the
/// sizes of the database and its log after it), then the last round's steps/s over the first's.
fn workload_growth(args: &Args, dir: &Path) {
    let path = dir.join("growth.db");
    let store = options(Synchronous::Full).open(&path).unwrap();
    let model = LoopModel::new(args.run_steps, "noop");
    let agent = Agent::new(model.clone())
        .tool(Noop)
        .max_steps(2 * args.run_steps + 2);
    let (runs, steps, rounds) = (args.runs, args.run_steps, args.rounds);
    let size = |suffix: &str| {
        let mut name = path.clone().into_os_string();
        name.push(suffix);
        std::fs::metadata(name).map(|m| m.len()).unwrap_or(0)
    };
    let figures = actix::System::new().block_on(async move {
        let sup = bench_supervisor(store, Config::default(), agent);
        let mut figures = Vec::new();
        for round in 0..rounds {
            let started = Instant::now();
            let calls: Vec<_> = (0..runs)
                .map(|_| actix_rt::spawn(sup.send(StartRun::new("bench", json!({})))))
                .collect();
            for call in calls {
                call.await.unwrap().unwrap().unwrap();
            }
            let steps_per_s = runs as f64 * steps as f64 / started.elapsed().as_secs_f64();
            let (p50, p99) = model.take_p50_p99();
            println!(
                "{}",
                json!({ "bench": "growth", "round": round, "runs": runs, "steps_per_run": steps,
                        "steps_per_s": steps_per_s, "p50_ms": p50, "p99_ms": p99,
                        "db_bytes": size(""), "wal_bytes": size("-wal") })
            );
            figures.push(steps_per_s);
        }
        figures
    });
    if let (Some(first), Some(last)) = (figures.first(), figures.last()) {
        println!(
            "{}",
            json!({ "summary": "growth_last_vs_first", "rounds": rounds, "ratio": last / first })
        );
    }
}

/// disk (only when asked for): the floor under every durable commit on this disk, with no
/// SQLite at all: `pages` 4 KiB writes rewriting a preallocated file in place, then one
/// `fdatasync`, as a commit to a log that has started over does. Median and deciles.
fn workload_disk(dir: &Path) {
    let mut disk = Disk::new(dir, 64 << 20);
    for pages in [1u64, 6, 12, 24] {
        let mut micros = disk.write_sync_us(pages, 1500);
        micros.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let at = |q: f64| micros[((micros.len() - 1) as f64 * q) as usize];
        println!(
            "{}",
            json!({ "bench": "disk_write_sync", "pages": pages, "p10_us": at(0.1), "p50_us": at(0.5), "p90_us": at(0.9) })
        );
    }
}

/// A file for timing writes and their `fdatasync`, with no SQLite; removed when dropped.
struct Disk {
    path: std::path::PathBuf,
    file: std::fs::File,
    span: u64,
    offset: u64,
}

impl Disk {
    /// A file of `span` bytes, allocated and on disk first, so that every sync rewrites
    /// blocks in place.
    fn new(dir: &Path, span: u64) -> Self {
        use std::os::unix::fs::FileExt;
        let path = dir.join(format!("disk-{}.bin", rand::random::<u32>()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        for offset in (0..span).step_by(1 << 20) {
            file.write_all_at(&vec![0u8; (span - offset).min(1 << 20) as usize], offset)
                .unwrap();
        }
        file.sync_all().unwrap();
        Disk {
            path,
            file,
            span,
            offset: 0,
        }
    }

    /// `count` times: `pages` 4 KiB pages written in place, then one `fdatasync`; each time's
    /// microseconds.
    fn write_sync_us(&mut self, pages: u64, count: usize) -> Vec<f64> {
        self.write_then_us(pages, count, std::fs::File::sync_data)
    }

    /// The same with `fsync`, which SQLite calls (as built by `libsqlite3-sys`, without
    /// `HAVE_FDATASYNC`): it also writes the file's changed times, an inode update each time.
    fn write_fsync_us(&mut self, pages: u64, count: usize) -> Vec<f64> {
        self.write_then_us(pages, count, std::fs::File::sync_all)
    }

    fn write_then_us(
        &mut self,
        pages: u64,
        count: usize,
        sync: fn(&std::fs::File) -> std::io::Result<()>,
    ) -> Vec<f64> {
        use std::os::unix::fs::FileExt;
        let page = [0x5au8; 4096];
        (0..count)
            .map(|_| {
                let started = Instant::now();
                for _ in 0..pages {
                    self.file.write_all_at(&page, self.offset).unwrap();
                    self.offset = (self.offset + 4096) % self.span;
                }
                sync(&self.file).unwrap();
                started.elapsed().as_secs_f64() * 1e6
            })
            .collect()
    }
}

impl Drop for Disk {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// `count` times: `pages` 4 KiB pages appended to a new file, then one `fdatasync`, as a
/// commit to a log that is still growing does (each sync also writes the file's new size);
/// each time's microseconds.
fn append_sync_us(dir: &Path, pages: u64, count: usize) -> Vec<f64> {
    use std::io::Write;
    let path = dir.join(format!("append-{}.bin", rand::random::<u32>()));
    let mut file = std::fs::File::create(&path).unwrap();
    let chunk = vec![0x5au8; 4096 * pages as usize];
    let micros = (0..count)
        .map(|_| {
            let started = Instant::now();
            file.write_all(&chunk).unwrap();
            file.sync_data().unwrap();
            started.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    drop(file);
    let _ = std::fs::remove_file(&path);
    micros
}

/// The pages one step of workload a writes to the log at FULL, all in the step's one sync:
/// the two commits' frames (the outcome and reservation, then the answer, decision and
/// start), counted from the log's writes under `strace` (see docs/performance.md).
const STEP_PAGES: u64 = 10;

/// The fresh mode: `processes` processes for each workload, each this binary started again
/// on a new database in a new directory; prints each process's line, then the medians and
/// ranges over the processes.
fn fresh(args: &Args, processes: usize) {
    let workloads: Vec<&str> = ["a", "b"]
        .into_iter()
        .filter(|w| args.only.is_empty() || args.only.iter().any(|only| only == w))
        .collect();
    let mut lines: HashMap<&str, Vec<Value>> = HashMap::new();
    for process in 0..processes {
        for &workload in &workloads {
            let output = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--fresh-child", workload])
                .args(["--fresh-steps", &args.fresh_steps.to_string()])
                .args(["--fresh-runs", &args.fresh_runs.to_string()])
                .args(["--run-steps", &args.run_steps.to_string()])
                .args(["--warm", &args.warm.to_string()])
                .stderr(std::process::Stdio::inherit())
                .output()
                .unwrap();
            assert!(output.status.success(), "the fresh child failed");
            let mut line: Value = String::from_utf8(output.stdout)
                .unwrap()
                .lines()
                .find_map(|line| serde_json::from_str(line).ok())
                .expect("the fresh child's line");
            line["process"] = json!(process);
            println!("{line}");
            lines.entry(workload).or_default().push(line);
        }
    }
    for workload in workloads {
        let lines = &lines[workload];
        let spread = |field: &str| {
            let mut values: Vec<f64> = lines.iter().filter_map(|l| l[field].as_f64()).collect();
            let (min, max) = (
                values.iter().cloned().fold(f64::MAX, f64::min),
                values.iter().cloned().fold(f64::MIN, f64::max),
            );
            json!({ "median": median(&mut values), "min": min, "max": max })
        };
        let figures = json!({
            "processes": lines.len(),
            "runs": lines[0]["runs"], "steps_per_run": lines[0]["steps_per_run"],
            "first_steps_per_s": spread("first_steps_per_s"),
            "warm_steps_per_s": spread("warm_steps_per_s"),
            "sync_p50_us": spread("sync_p50_us"),
            "fsync_p50_us": spread("fsync_p50_us"),
            "fsync_mean_us": spread("fsync_mean_us"),
            "ratio_first_to_mean_fsync_limit": spread("ratio_first_to_mean_fsync_limit"),
            "append_sync_p50_us": spread("append_sync_p50_us"),
            "ratio_first_to_fsync_limit": spread("ratio_first_to_fsync_limit"),
            "limit_steps_per_s": spread("limit_steps_per_s"),
            "ratio_first_to_limit": spread("ratio_first_to_limit"),
            "ratio_warm_to_limit": spread("ratio_warm_to_limit"),
            "ratio_first_to_warm": spread("ratio_first_to_warm"),
            "open_ms": spread("open_ms"),
            "peak_rss_kib": spread("peak_rss_kib"),
        });
        let mut line = json!({ "summary": format!("fresh_{workload}") });
        line.as_object_mut()
            .unwrap()
            .extend(figures.as_object().unwrap().clone());
        println!("{line}");
    }
}

/// The size of a file, 0 when it does not exist.
fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

/// One process of the fresh mode, on a new database in a new directory: the disk's
/// write-and-sync time for a step's pages, then the workload (a: one run; b: concurrent runs
/// with group commit) at FULL as this process's first run, then `--warm` times again on the
/// same database and supervisor. Prints one JSON line.
fn fresh_child(args: &Args, workload: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (runs, steps) = match workload {
        "a" => (1, args.fresh_steps),
        "b" => (args.fresh_runs, args.run_steps),
        other => panic!("no fresh workload {other}"),
    };
    // The disk first, in a small file (a large one would leave writeback behind it).
    let mut disk = Disk::new(dir.path(), 8 << 20);
    let mut sync_us = disk.write_sync_us(STEP_PAGES, 500);
    let mut fsync_us = disk.write_fsync_us(STEP_PAGES, 500);
    drop(disk);
    let mut append_us = append_sync_us(dir.path(), STEP_PAGES, 500);
    // The mean too: a run's steps a second are its mean step's, and the disk's slow syncs
    // weigh in it as they do in the mean sync, not in the median.
    let mean = |us: &[f64]| us.iter().sum::<f64>() / us.len() as f64;
    let (sync_mean, fsync_mean) = (mean(&sync_us), mean(&fsync_us));
    let (sync_p50, fsync_p50, append_p50) = (
        median(&mut sync_us),
        median(&mut fsync_us),
        median(&mut append_us),
    );

    let path = dir.path().join("fresh.db");
    let wal = dir.path().join("fresh.db-wal");
    let opened = Instant::now();
    let store = options(Synchronous::Full).open(&path).unwrap();
    let open_ms = opened.elapsed().as_secs_f64() * 1000.0;
    let commits = Commits::default();
    let config = Config::default().observer(commits.clone());
    let model = LoopModel::new(steps, "noop");
    let agent = Agent::new(model.clone()).tool(Noop).max_steps(u32::MAX);
    let rounds: Vec<Value> = actix::System::new().block_on(async move {
        let started = Instant::now();
        let sup = bench_supervisor(store, config, agent);
        let supervisor_ms = started.elapsed().as_secs_f64() * 1000.0;
        let mut rounds = Vec::new();
        for round in 0..=args.warm {
            // A marker for syscall traces (scripts/fresh-trace.sh): nothing else calls getppid.
            let _ = (round, std::os::unix::process::parent_id());
            commits.transactions.store(0, Ordering::SeqCst);
            model.latencies.lock().unwrap().clear();
            let wal_before = file_len(&wal);
            let started = Instant::now();
            let calls: Vec<_> = (0..runs)
                .map(|_| actix_rt::spawn(sup.send(StartRun::new("bench", json!({})))))
                .collect();
            for call in calls {
                let reply = call.await.unwrap().unwrap().unwrap();
                assert!(matches!(reply.outcome, Outcome::Succeeded { .. }));
            }
            let elapsed = started.elapsed();
            let mut latencies: Vec<f64> = model
                .latencies
                .lock()
                .unwrap()
                .iter()
                .map(|d| d.as_secs_f64() * 1e6)
                .collect();
            let first_steps_us: Vec<f64> = latencies.iter().take(5).cloned().collect();
            rounds.push(json!({
                "steps_per_s": (runs * steps as usize) as f64 / elapsed.as_secs_f64(),
                "commits_per_step": commits.per_step(runs * steps as usize).0,
                "wal_bytes_before": wal_before, "wal_bytes_after": file_len(&wal),
                "step_p50_us": median(&mut latencies), "first_steps_us": first_steps_us,
                "supervisor_ms": supervisor_ms,
            }));
        }
        rounds
    });
    let first = &rounds[0];
    let first_steps_per_s = first["steps_per_s"].as_f64().unwrap();
    let mut warm: Vec<f64> = rounds[1..]
        .iter()
        .map(|r| r["steps_per_s"].as_f64().unwrap())
        .collect();
    let warm_steps_per_s = if warm.is_empty() {
        f64::NAN
    } else {
        median(&mut warm)
    };
    let limit = 1e6 / sync_p50;
    println!(
        "{}",
        json!({ "bench": format!("fresh_{workload}"), "sync": "Full", "runs": runs, "steps_per_run": steps,
                "first_steps_per_s": first_steps_per_s, "warm_steps_per_s": warm_steps_per_s, "warm_rounds": args.warm,
                "sync_pages": STEP_PAGES, "sync_p50_us": sync_p50, "fsync_p50_us": fsync_p50, "append_sync_p50_us": append_p50,
                "fsync_limit_steps_per_s": 1e6 / fsync_p50, "ratio_first_to_fsync_limit": first_steps_per_s * fsync_p50 / 1e6,
                "sync_mean_us": sync_mean, "fsync_mean_us": fsync_mean,
                "ratio_first_to_mean_fsync_limit": first_steps_per_s * fsync_mean / 1e6,
                "limit_steps_per_s": limit, "ratio_first_to_limit": first_steps_per_s / limit,
                "ratio_warm_to_limit": warm_steps_per_s / limit, "ratio_first_to_warm": first_steps_per_s / warm_steps_per_s,
                "open_ms": open_ms, "supervisor_ms": first["supervisor_ms"],
                "first_commits_per_step": first["commits_per_step"], "first_step_p50_us": first["step_p50_us"],
                "first_run_first_steps_us": first["first_steps_us"],
                "first_wal_bytes": [first["wal_bytes_before"], first["wal_bytes_after"]],
                "warm_step_p50_us": rounds.get(1).map(|r| r["step_p50_us"].clone()),
                "warm_wal_bytes": rounds[1..].iter().map(|r| json!([r["wal_bytes_before"], r["wal_bytes_after"]])).collect::<Vec<_>>(),
                "peak_rss_kib": peak_rss_kib() })
    );
}
