//! A chaos run with real processes: workers share one database file, start and resume runs in
//! a loop, and are killed with SIGKILL at random moments. Afterwards every run is driven to its
//! end and the invariants are checked across all runs from a side-effect log the tools write
//! (append, then fsync). One summary line says how it went; the exit code is non-zero if any
//! side effect ran twice outside a reconciled retry, or anything was lost.
//!
//! ```text
//! cargo run --release --features testkit --example chaos -- --seconds 60 --workers 3
//! ```

use std::{
    collections::HashMap,
    fs::OpenOptions,
    io::Write,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use agentrt::{
    Agent, Approval, Config, Decision, Error, EventKind, ModelResponse, Outcome, Reconciliation,
    RecordApproval, RunId, RunState, StartRun, Store, Supervisor, Tool, ToolCall, ToolContext,
    ToolError, async_trait,
    testkit::{ScriptedModel, check_invariants, resume_when_free, with_system},
};
use clap::Parser;
use serde_json::{Value, json};

const TTL: Duration = Duration::from_millis(500);
const AGENT: &str = "chaos";

#[derive(Parser, Debug)]
#[command(about = "Kill agentrt processes at random and check that no side effect ran twice")]
struct Args {
    /// How long to keep killing workers.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// How many worker processes share the database (2 to 4).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u8).range(2..=4))]
    workers: u8,
    /// The directory for the database and the side-effect log (a new temporary one if absent).
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
        Some(index) => worker(&dir, index),
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

/// A tool whose side effect is a line in a shared file, appended and fsynced; its reconcile
/// hook reads the file.
struct LoggedTool {
    name: &'static str,
    idempotent: bool,
    log: PathBuf,
}

impl LoggedTool {
    fn applied(&self, key: &str) -> bool {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .any(|line| line.split(' ').next() == Some(key))
    }
}

#[async_trait(?Send)]
impl Tool for LoggedTool {
    fn name(&self) -> &str {
        self.name
    }

    fn idempotent(&self) -> bool {
        self.idempotent
    }

    async fn call(&self, ctx: &ToolContext, _: &Value) -> Result<Value, ToolError> {
        // Widen the window in which a kill lands mid-call.
        actix_rt::time::sleep(Duration::from_millis(rand::random_range(0..40))).await;
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| ToolError::new(e.to_string()))?;
        // One write(2) per line: appends of other processes cannot interleave within it.
        let line = format!(
            "{} {} {}\n",
            ctx.idempotency_key,
            ctx.attempt,
            std::process::id()
        );
        file.write_all(line.as_bytes())
            .map_err(|e| ToolError::new(e.to_string()))?;
        file.sync_data()
            .map_err(|e| ToolError::new(e.to_string()))?;
        actix_rt::time::sleep(Duration::from_millis(rand::random_range(0..40))).await;
        Ok(json!({ "done": self.name }))
    }

    async fn reconcile(&self, ctx: &ToolContext, _: &Value) -> Option<Reconciliation> {
        // The email service cannot be asked; the others can.
        if self.name == "email" {
            return None;
        }
        Some(if self.applied(&ctx.idempotency_key) {
            Reconciliation::Applied(json!({ "done": self.name }))
        } else {
            Reconciliation::NotApplied
        })
    }
}

fn agent(dir: &Path) -> Agent {
    let model = ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new("charge-1", "charge", json!({}))]),
        ModelResponse::calls(vec![
            ToolCall::new("email-1", "email", json!({})),
            ToolCall::new("ticket-1", "ticket", json!({})),
        ]),
        ModelResponse::answer("done"),
    ]);
    let tool = |name, idempotent| LoggedTool {
        name,
        idempotent,
        log: log_path(dir),
    };
    Agent::new(model)
        .tool(tool("charge", false))
        .tool(tool("email", false))
        .tool(tool("ticket", true))
        .policy(|_: &RunId, call: &ToolCall| match call.name.as_str() {
            "ticket" => Decision::RequireApproval("tickets need a person".into()),
            _ => Decision::Allow,
        })
}

/// Starts or resumes runs forever, several at once, until killed.
fn worker(dir: &Path, index: u8) {
    let store = Store::open(db_path(dir)).expect("the database opens");
    let agent = agent(dir);
    with_system(|| async move {
        let config = Config::default()
            .lease_owner(format!("worker-{index}"))
            .lease_ttl(TTL);
        let sup = Supervisor::builder(store.clone())
            .config(config)
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

fn spawn_worker(dir: &Path, index: u8) -> Child {
    Command::new(std::env::current_exe().expect("this executable"))
        .args(["--worker", &index.to_string(), "--dir"])
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("a worker starts")
}

/// Kills workers at random for the given time, then finishes every run and checks them all.
fn parent(args: &Args, dir: &Path) -> bool {
    drop(Store::open(db_path(dir)).expect("the database is created"));
    let started = Instant::now();
    let mut workers: Vec<Child> = (0..args.workers).map(|i| spawn_worker(dir, i)).collect();
    let mut kills = 0;
    while started.elapsed() < Duration::from_secs(args.seconds) {
        std::thread::sleep(Duration::from_millis(rand::random_range(300..2500)));
        let victim = rand::random_range(0..workers.len());
        workers[victim].kill().expect("SIGKILL"); // Child::kill is SIGKILL on Unix
        workers[victim].wait().expect("reaped");
        kills += 1;
        workers[victim] = spawn_worker(dir, victim as u8);
    }
    for worker in &mut workers {
        let _ = worker.kill();
        let _ = worker.wait();
    }

    // Every run to its end, by one last supervisor.
    let store = Store::open(db_path(dir)).expect("the database opens");
    let unfinished: Vec<RunId> = store
        .runs(None)
        .expect("runs")
        .into_iter()
        .filter(|run| !run.state.is_finished())
        .map(|run| run.id)
        .collect();
    let (finisher, agent) = (store.clone(), agent(dir));
    with_system(|| async move {
        let config = Config::default().lease_owner("finisher").lease_ttl(TTL);
        let sup = Supervisor::builder(finisher)
            .config(config)
            .agent(AGENT, agent)
            .start()
            .expect("starts");
        for run_id in unfinished {
            let mut reply = resume_when_free(&sup, &run_id, Duration::from_secs(30)).await;
            while let Ok(agentrt::RunReply {
                outcome: Outcome::WaitingForApproval { pending },
                ..
            }) = &reply
            {
                let approval = Approval::approve(run_id.clone(), pending.call_id.clone(), "chaos");
                let _ = sup.send(RecordApproval(approval)).await;
                reply = resume_when_free(&sup, &run_id, Duration::from_secs(30)).await;
            }
        }
    });

    // The side-effect log, by run.
    let mut executions: HashMap<String, Vec<(String, u32)>> = HashMap::new();
    for line in std::fs::read_to_string(log_path(dir))
        .unwrap_or_default()
        .lines()
    {
        let mut fields = line.split(' ');
        let (Some(key), Some(attempt)) = (fields.next(), fields.next()) else {
            continue;
        };
        let run = key
            .rsplit_once('/')
            .map(|(run, _)| run.to_owned())
            .unwrap_or_default();
        executions
            .entry(run)
            .or_default()
            .push((key.to_owned(), attempt.parse().unwrap_or(0)));
    }
    let runs = store.runs(None).expect("runs");
    let (mut duplicates, mut lost, mut takeovers) = (0, 0, 0);
    for run in &runs {
        let found = executions.remove(run.id.as_str()).unwrap_or_default();
        for violation in check_invariants(&store, &run.id, &found) {
            eprintln!("run {}: {violation}", run.id);
            duplicates += usize::from(violation.is_duplicate());
            lost += usize::from(!violation.is_duplicate());
        }
        takeovers += store
            .events(&run.id)
            .map(|events| {
                events
                    .iter()
                    .filter(|e| e.kind == EventKind::LeaseTakenOver)
                    .count()
            })
            .unwrap_or(0);
    }
    // Side effects of runs the database does not know.
    for (run, found) in &executions {
        eprintln!(
            "run {run}: {} side effects of a run the database does not know",
            found.len()
        );
        duplicates += found.len();
    }
    println!(
        "chaos: runs={} kills={kills} takeovers={takeovers} duplicate_executions={duplicates} lost_events={lost} seconds={} workers={}",
        runs.len(),
        started.elapsed().as_secs(),
        args.workers
    );
    duplicates == 0 && lost == 0
}
