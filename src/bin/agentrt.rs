//! `agentrt`: the operator's tool over an agentrt database file.
//!
//! It works while other processes run the database: every command reads or writes in single
//! short statements or transactions, never holds a lock between them, and writes only where
//! the command is meant to (`cancel`, `approve`, `deny`, `answer`, `signal`, `fork`, `purge`,
//! `vacuum`, `migrate --apply`, `schedule pause|resume`). The others (and `purge --dry-run`)
//! open the database read-only: they create nothing beside it and change no byte of it.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::ExitCode,
    time::{Duration, SystemTime},
};

use agentrt::{
    Approval, FencingToken, Lease, PendingCall, Run, RunId, RunState, RunUsage, Store, Wait, sqlite,
};
use clap::{Parser, Subcommand, ValueEnum};
use comfy_table::{Table, presets};
use serde::Serialize;

#[derive(Parser)]
#[command(
    name = "agentrt",
    version,
    about = "Inspect and operate an agentrt database"
)]
struct Cli {
    /// The database: an SQLite file (never created by this tool), or a PostgreSQL URL
    /// (`postgres://user@host/db`).
    #[arg(long, env = "AGENTRT_DB", global = true)]
    db: Option<PathBuf>,
    /// Print JSON (one document, or one line per event) instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List runs, oldest first, a page at a time (the cursor of the next page goes to stderr,
    /// or into the JSON document).
    Runs {
        /// Only runs in this state.
        #[arg(long, value_enum)]
        state: Option<State>,
        /// Only runs of this agent.
        #[arg(long)]
        agent: Option<String>,
        /// Only runs created within this age (90s, 12h, 30d) or since this RFC 3339 time.
        #[arg(long, value_name = "AGE|TIME")]
        since: Option<String>,
        /// Runs per page, at most 1000.
        #[arg(long, default_value_t = agentrt::DEFAULT_PAGE_LIMIT)]
        limit: usize,
        /// The page after this cursor, as a previous page gave it.
        #[arg(long, value_name = "CURSOR")]
        after: Option<String>,
    },
    /// Show one run: its state, its lease, the calls waiting for an approval, and what it waits
    /// for (an answer, an event, a time, a child run) and since when.
    Show { run: String },
    /// Print a run's events.
    Events {
        run: String,
        /// Only events after this sequence number (at most 2^63 - 1, the largest there can be).
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(..=i64::MAX as u64))]
        after: u64,
        /// Keep printing new events until the run has finished.
        #[arg(long)]
        follow: bool,
    },
    /// Show who holds a run's lease, and until when.
    Lease { run: String },
    /// Cancel a running or waiting run.
    Cancel {
        run: String,
        /// Why (recorded in the run and its run.finished event).
        #[arg(long, value_parser = not_blank)]
        reason: String,
    },
    /// Approve a tool call that waits for an approval.
    Approve(Decide),
    /// Fork a run at a model step into a new run, and print the new run's id.
    ///
    /// The new run has the run's agent and input and copies of its steps before STEP
    /// (completed tool calls are not run again); the model is asked again at STEP. It is
    /// written RUNNING and unleased, and not executed: a supervisor with the run's agent
    /// resumes it (`ResumeRun`). The run forked is only read.
    Fork {
        run: String,
        /// A model step of the run, or the step after its last (to keep every step).
        #[arg(long)]
        at: u32,
        /// The new run's id (a random one otherwise); an existing id is refused, and so is one
        /// that is empty, `.` or `..`, longer than 200 bytes, or holds a control character.
        #[arg(long, value_parser = new_run_id)]
        id: Option<String>,
    },
    /// Deny a tool call that waits for an approval.
    Deny(Decide),
    /// Answer a run's question (its `ask_person` call). An answer off the question's schema is
    /// refused with what is wrong, and nothing is written. A supervisor of the run's agent that
    /// watches the database resumes the run.
    Answer(waits::AnswerArgs),
    /// Send a run an event of NAME: prints `woke` (the run waited for it), `kept` (kept for
    /// the run's first wait on NAME) or `duplicate` (an event of this id came before: nothing
    /// written, so a sender may retry).
    Signal(waits::SignalArgs),
    /// List the runs that wait for an answer, an event, a time or a child run, longest waiting
    /// first: each run's step, call, kind, key (the question, the event's name, the timer's
    /// reason or the child run's id), since when, and a timer's due time.
    Waits(waits::WaitsArgs),
    /// Delete finished runs (SUCCEEDED, FAILED, CANCELLED) with their steps, events and
    /// approvals, in short transactions; a run that has not finished is never touched.
    ///
    /// By age (`--finished-before 30d`: finished more than 30 days ago) or by id (`--run ID`,
    /// repeated: every one must exist and have finished, or nothing is deleted). Prints what it
    /// deleted and the file's size before and after.
    Purge {
        /// Runs that finished before this age (90s, 12h, 30d) or this RFC 3339 time.
        #[arg(long, value_name = "AGE|TIME")]
        finished_before: Option<String>,
        /// This run (repeat for more).
        #[arg(long = "run", value_name = "ID")]
        runs: Vec<String>,
        /// Count what would be deleted, and write nothing.
        #[arg(long)]
        dry_run: bool,
        /// Runs per transaction, at most 1000.
        #[arg(long, default_value_t = agentrt::DEFAULT_PURGE_BATCH)]
        batch: usize,
    },
    /// Rewrite the database compactly, giving its free space back to the disk; a database
    /// created by an agentrt older than `purge` then gives space back after each purge.
    ///
    /// It needs free disk space up to twice the database's size, and blocks every writer
    /// (supervisors included) while it runs: run it while nothing else writes.
    Vacuum,
    /// Report the schema version; apply the pending migrations with --apply.
    Migrate {
        #[arg(long)]
        apply: bool,
    },
    /// Check the database: schema, settings, integrity, stale leases, unleased running runs.
    Doctor,
    /// Serve the HTTP API and the operator console (at /ui) on the database. Decisions and
    /// cancels made there are recorded in the database; the process that executes the run (a
    /// supervisor with `Config::watch`) acts on them.
    Serve {
        /// Where to listen. An address that is not loopback needs --tokens.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: String,
        /// The operators' tokens: a file of `OPERATOR DIGEST` lines, each digest the SHA-256 of
        /// a token in hex (`agentrt token OPERATOR` makes one). With it, every write needs a
        /// token, and a decision is recorded under its operator's name.
        #[arg(long, env = "AGENTRT_TOKENS")]
        tokens: Option<PathBuf>,
        /// Reads need a token too.
        #[arg(long, requires = "tokens")]
        reads_need_token: bool,
    },
    /// List the schedules: each one's agent, cron expression, and next run.
    Schedules,
    /// Pause or resume a schedule.
    #[command(subcommand)]
    Schedule(schedules::ScheduleCommand),
    /// Make a new random token for OPERATOR: prints the token (give it to the operator), then
    /// the line to add to the --tokens file of `serve`, which keeps only its digest.
    Token {
        #[arg(value_parser = not_blank)]
        operator: String,
    },
}

/// Refuses an id no new run may have, before the file is opened.
fn new_run_id(value: &str) -> Result<String, String> {
    match RunId::from(value).check() {
        Ok(()) => Ok(value.to_owned()),
        Err(agentrt::Error::InvalidInput(why)) => Err(why),
        Err(err) => Err(err.to_string()),
    }
}

/// Refuses an empty or blank value: a decision or a cancel names who and why.
fn not_blank(value: &str) -> Result<String, String> {
    if value.trim().is_empty() {
        Err("it must not be empty".into())
    } else {
        Ok(value.to_owned())
    }
}

#[derive(clap::Args)]
struct Decide {
    run: String,
    /// The call id, as `show RUN` lists it.
    call: String,
    /// Who decides.
    #[arg(long, value_parser = not_blank)]
    by: String,
    /// Why.
    #[arg(long)]
    note: Option<String>,
}

#[derive(Clone, Copy, ValueEnum)]
#[value(rename_all = "SCREAMING_SNAKE_CASE")]
enum State {
    Running,
    WaitingForApproval,
    WaitingForAnswer,
    WaitingForEvent,
    WaitingForTimer,
    WaitingForChild,
    Succeeded,
    Failed,
    Cancelled,
}

impl From<State> for RunState {
    fn from(state: State) -> Self {
        match state {
            State::Running => RunState::Running,
            State::WaitingForApproval => RunState::WaitingForApproval,
            State::WaitingForAnswer => RunState::WaitingForAnswer,
            State::WaitingForEvent => RunState::WaitingForEvent,
            State::WaitingForTimer => RunState::WaitingForTimer,
            State::WaitingForChild => RunState::WaitingForChild,
            State::Succeeded => RunState::Succeeded,
            State::Failed => RunState::Failed,
            State::Cancelled => RunState::Cancelled,
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // A server's operator reads its INFO lines (runs decided, cancelled); a command's, only
    // what RUST_LOG asks for.
    let filter = match (&cli.command, std::env::var_os("RUST_LOG")) {
        (Command::Serve { .. }, None) => tracing_subscriber::EnvFilter::new("info"),
        _ => tracing_subscriber::EnvFilter::from_default_env(),
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    match run(cli) {
        Ok(()) | Err(Failure::BrokenPipe) => ExitCode::SUCCESS,
        Err(Failure::Message(message)) => {
            eprintln!("agentrt: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Why a command stopped early.
enum Failure {
    /// Said in one line on stderr, with a failure exit code.
    Message(String),
    /// The reader of our output went away (`agentrt events RUN | head`): not an error.
    BrokenPipe,
}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Failure::Message(message)
    }
}

impl From<&str> for Failure {
    fn from(message: &str) -> Self {
        Failure::Message(message.to_owned())
    }
}

impl From<std::io::Error> for Failure {
    fn from(err: std::io::Error) -> Self {
        match err.kind() {
            std::io::ErrorKind::BrokenPipe => Failure::BrokenPipe,
            _ => Failure::Message(format!("cannot write the output: {err}")),
        }
    }
}

type Outcome = Result<(), Failure>;

/// `println!` that reports a closed stdout instead of panicking.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($arg)*)?;
    }};
}

// After `out!`, which the waits' commands use; beside this file, in a folder that holds no
// binary of its own.
#[path = "agentrt/schedules.rs"]
mod schedules;
#[path = "agentrt/waits.rs"]
mod waits;

fn run(cli: Cli) -> Outcome {
    // The one command that needs no database.
    if let Command::Token { operator } = &cli.command {
        return token(operator, cli.json);
    }
    let path = cli
        .db
        .ok_or("no database given: pass --db PATH or set AGENTRT_DB")?;
    let json = cli.json;
    match cli.command {
        Command::Token { .. } => unreachable!("answered above"),
        Command::Serve {
            listen,
            tokens,
            reads_need_token,
        } => serve(&path, &listen, tokens.as_deref(), reads_need_token),
        Command::Migrate { apply } => migrate(&path, apply, json),
        Command::Doctor => doctor(&path, json),
        Command::Purge {
            finished_before,
            runs,
            dry_run,
            batch,
        } => purge(&path, finished_before, runs, dry_run, batch, json),
        Command::Vacuum => vacuum(&path, json),
        Command::Answer(args) => waits::answer(&path, args, json),
        Command::Signal(args) => waits::signal(&path, args, json),
        Command::Schedules => schedules::list(&open_reading(&path)?, json),
        Command::Schedule(command) => schedules::write(&path, command, json),
        command @ (Command::Cancel { .. }
        | Command::Approve(_)
        | Command::Deny(_)
        | Command::Fork { .. }) => {
            let store = open_for_writing(&path)?;
            match command {
                Command::Cancel { run, reason } => {
                    let run_id = RunId::from(run);
                    store
                        .cancel(&run_id, &reason)
                        .map_err(|e| write_failed(&path, e))?;
                    done(
                        json,
                        &format!("run {run_id} cancelled"),
                        &Cancelled {
                            run_id: &run_id,
                            state: RunState::Cancelled,
                        },
                    )
                }
                Command::Fork { run, at, id } => {
                    let origin = RunId::from(run);
                    let run_id = store
                        .fork(&origin, at, id.map(RunId::from))
                        .map_err(|e| write_failed(&path, e))?;
                    // The id alone, so that a script can take it: `NEW=$(agentrt fork ...)`.
                    done(
                        json,
                        run_id.as_str(),
                        &Forked {
                            run_id: &run_id,
                            origin: &origin,
                            at,
                        },
                    )
                }
                Command::Approve(decide) => record(&store, &path, decide, true, json),
                Command::Deny(decide) => record(&store, &path, decide, false, json),
                _ => unreachable!("matched above"),
            }
        }
        Command::Runs {
            state,
            agent,
            since,
            limit,
            after,
        } => {
            // The input is checked before the file is opened.
            let mut query = agentrt::RunQuery::new().limit(limit);
            if let Some(state) = state {
                query = query.state(state.into());
            }
            if let Some(agent) = agent {
                query = query.agent(agent);
            }
            if let Some(since) = since {
                query = query.since(age_or_time("--since", &since)?);
            }
            if let Some(after) = after {
                query = query.after(after);
            }
            let store = open_reading(&path)?;
            runs(&store, &query, json)
        }
        command => {
            let store = open_reading(&path)?;
            match command {
                Command::Show { run } => show(&store, &run.into(), json),
                Command::Events { run, after, follow } => {
                    events(&store, &run.into(), after, follow, json)
                }
                Command::Lease { run } => lease(&store, &run.into(), json),
                Command::Waits(args) => waits::waits(&store, args, json),
                _ => unreachable!("matched above"),
            }
        }
    }
}

/// The PostgreSQL URL `path` is, if it is one.
fn url(path: &Path) -> Option<&str> {
    path.to_str().filter(|path| agentrt::postgres::is_url(path))
}

/// Opens the database for a command that only reads: nothing is created, migrated or written.
fn open_reading(path: &Path) -> Result<Store, Failure> {
    let store = match url(path) {
        Some(url) => agentrt::postgres::Options::new().read_only(true).open(url),
        None => Store::open_read_only(path),
    };
    store.map_err(|e| e.to_string().into())
}

/// The schema version of the database, read without writing.
fn schema_status(path: &Path) -> Result<agentrt::SchemaStatus, Failure> {
    let status = match url(path) {
        Some(url) => agentrt::postgres::schema_status(url),
        None => sqlite::schema_status(path),
    };
    status.map_err(|e| e.to_string().into())
}

/// Opens the database for a command that writes, once the checks found nothing that makes
/// writing it impossible or unwise; each refusal names the file and changes nothing. A
/// PostgreSQL database is not migrated by it (`migrate --apply` does that).
fn open_for_writing(path: &Path) -> Result<Store, Failure> {
    if let Some(url) = url(path) {
        return agentrt::postgres::Options::new()
            .migrate(false)
            .open(url)
            .map_err(|e| e.to_string().into());
    }
    // A missing file, a directory, a file that is not a database or was cut short.
    sqlite::schema_status(path).map_err(|e| e.to_string())?;
    refuse_read_only(path)?;
    let found = sqlite::quick_check(path).map_err(|e| e.to_string())?;
    if found != ["ok"] {
        return Err(Failure::Message(format!(
            "{} fails SQLite's quick integrity check ({}); nothing was changed: `agentrt doctor` \
             reports the damage",
            path.display(),
            found.join("; ")
        )));
    }
    Ok(sqlite::Options::existing_only()
        .open(path)
        .map_err(|e| write_failed(path, e))?)
}

/// Refuses a database this process cannot write, as its permissions or its file system say:
/// before SQLite tries, which would fail with an error of its own, or, for root, write a file
/// marked read-only.
fn refuse_read_only(path: &Path) -> Outcome {
    let read_only = |why: String| {
        Failure::Message(
            agentrt::Error::ReadOnly {
                path: path.to_path_buf(),
                why,
            }
            .to_string(),
        )
    };
    let real = std::fs::canonicalize(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let metadata = std::fs::metadata(&real).map_err(|e| format!("{}: {e}", path.display()))?;
    if metadata.permissions().readonly() {
        return Err(read_only(
            "its permissions let nobody write it (`chmod u+w` lets agentrt write it)".into(),
        ));
    }
    // What the permission bits do not say: another owner, a read-only file system. No
    // connection is open yet whose locks closing this descriptor could drop.
    if let Err(err) = std::fs::OpenOptions::new().write(true).open(&real) {
        return Err(read_only(format!(
            "it cannot be opened for writing ({err})"
        )));
    }
    // SQLite writes through a log and its index beside the file, created when missing.
    let beside = |suffix: &str| {
        let mut name = real.clone().into_os_string();
        name.push(suffix);
        PathBuf::from(name).exists()
    };
    if let Some(dir) = real.parent()
        && !(beside("-wal") && beside("-shm"))
        && std::fs::metadata(dir).is_ok_and(|dir| dir.permissions().readonly())
    {
        return Err(read_only(format!(
            "its directory {} lets nobody create the log SQLite writes beside it",
            dir.display()
        )));
    }
    Ok(())
}

/// The message of a write that failed, naming a database SQLite found read-only as such.
fn write_failed(path: &Path, err: agentrt::Error) -> String {
    let read_only = match &err {
        agentrt::Error::Database(db) => std::error::Error::source(db)
            .and_then(|source| source.downcast_ref::<rusqlite::Error>())
            .is_some_and(|err| err.sqlite_error_code() == Some(rusqlite::ErrorCode::ReadOnly)),
        _ => false,
    };
    if read_only {
        return agentrt::Error::ReadOnly {
            path: path.to_path_buf(),
            why: format!("SQLite cannot write it ({err})"),
        }
        .to_string();
    }
    err.to_string()
}

fn time(at: SystemTime) -> String {
    humantime::format_rfc3339_millis(at).to_string()
}

fn table(header: &[&str]) -> Table {
    let mut table = Table::new();
    table
        .load_style(presets::NOTHING)
        .set_header(header.to_vec());
    table
}

fn print_json(value: &impl Serialize) -> Outcome {
    out!(
        "{}",
        serde_json::to_string_pretty(value).map_err(|e| e.to_string())?
    );
    Ok(())
}

fn done(json: bool, text: &str, value: &impl Serialize) -> Outcome {
    if json {
        return print_json(value);
    }
    out!("{text}");
    Ok(())
}

// The `--json` documents: agentrt's own types in their documented JSON shape (times in
// milliseconds since the Unix epoch), with what a command adds beside them.

/// `cancel --json`.
#[derive(Serialize)]
struct Cancelled<'a> {
    run_id: &'a RunId,
    state: RunState,
}

/// `fork --json`.
#[derive(Serialize)]
struct Forked<'a> {
    run_id: &'a RunId,
    origin: &'a RunId,
    at: u32,
}

/// A lease as `show` and `lease` print it: whether it is stale comes with it, so that a
/// script needs no clock of its own.
#[derive(Serialize)]
struct LeaseView<'a> {
    #[serde(flatten)]
    lease: &'a Lease,
    expired: bool,
}

impl<'a> LeaseView<'a> {
    fn of(lease: &'a Option<Lease>) -> Option<Self> {
        lease.as_ref().map(|lease| LeaseView {
            lease,
            expired: lease.expires_at <= SystemTime::now(),
        })
    }
}

/// `show --json`: the run, its lease, the calls waiting for an approval and its other wait.
#[derive(Serialize)]
struct Shown<'a> {
    #[serde(flatten)]
    run: &'a Run,
    lease: Option<LeaseView<'a>>,
    pending_calls: &'a [PendingCall],
    /// What it waits for other than an approval; `null` when nothing.
    wait: Option<&'a Wait>,
    /// `null` when the run's log cannot be read (written by a newer version, say).
    usage: Option<&'a RunUsage>,
}

/// `lease --json`.
#[derive(Serialize)]
struct LeaseReport<'a> {
    run_id: &'a RunId,
    lease: Option<LeaseView<'a>>,
}

/// `migrate --json`.
#[derive(Serialize)]
struct MigrateReport {
    found: u32,
    supported: u32,
    applied: bool,
    now: u32,
}

/// `doctor --json`.
#[derive(Serialize)]
struct DoctorReport<'a> {
    schema: Schema,
    settings: BTreeMap<&'a str, String>,
    defensive: bool,
    integrity: &'a [String],
    stale_leases: Vec<StaleLease<'a>>,
    running_without_lease: &'a [RunId],
    ok: bool,
}

#[derive(Serialize)]
struct Schema {
    found: u32,
    supported: u32,
}

#[derive(Serialize)]
struct StaleLease<'a> {
    run_id: &'a RunId,
    #[serde(flatten)]
    lease: &'a Lease,
}

fn runs(store: &Store, query: &agentrt::RunQuery, json: bool) -> Outcome {
    let page = store.list_runs(query).map_err(|e| e.to_string())?;
    if json {
        return print_json(&page);
    }
    let mut table = table(&["RUN", "AGENT", "STATE", "UPDATED"]);
    for run in &page.runs {
        table.add_row(vec![
            run.id.to_string(),
            run.agent.clone(),
            run.state.to_string(),
            time(run.updated_at),
        ]);
    }
    out!("{}", table.trim_fmt());
    // On stderr: the table on stdout stays the runs alone.
    if let Some(next) = &page.next {
        eprintln!("agentrt: more runs follow: the next page is `--after {next}`");
    }
    Ok(())
}

/// A time given as an age before now (`90s`, `12h`, `30d`) or as an RFC 3339 time.
fn age_or_time(flag: &str, value: &str) -> Result<SystemTime, Failure> {
    if let Ok(age) = humantime::parse_duration(value) {
        return SystemTime::now().checked_sub(age).ok_or_else(|| {
            format!("{flag} {value}: that age reaches before the Unix epoch").into()
        });
    }
    humantime::parse_rfc3339_weak(value).map_err(|_| {
        Failure::Message(format!(
            "{flag} {value:?} is neither an age (90s, 12h, 30d) nor an RFC 3339 time \
             (2025-01-31T00:00:00Z); nothing was done"
        ))
    })
}

/// The size of a file, 0 when it is missing (and for a PostgreSQL URL, which names no file).
fn file_size(path: &Path) -> u64 {
    if url(path).is_some() {
        return 0;
    }
    std::fs::metadata(path).map_or(0, |metadata| metadata.len())
}

fn bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// `purge --json`: the library's report, with the file's size around it.
#[derive(Serialize)]
struct PurgeOutput<'a> {
    #[serde(flatten)]
    report: &'a agentrt::PurgeReport,
    file_bytes_before: u64,
    file_bytes_after: u64,
}

fn purge(
    path: &Path,
    finished_before: Option<String>,
    runs: Vec<String>,
    dry_run: bool,
    batch: usize,
    json: bool,
) -> Outcome {
    // Every refusal of the input comes before the file is opened.
    let selection = match (finished_before, runs.is_empty()) {
        (None, true) => {
            return Err(
                "say which runs to purge: --finished-before AGE (90s, 12h, 30d) or \
                 TIME, or --run ID; nothing was done"
                    .into(),
            );
        }
        (Some(_), false) => {
            return Err("give --finished-before or --run, not both; nothing was done".into());
        }
        (Some(before), true) => {
            agentrt::Purge::finished_before(age_or_time("--finished-before", &before)?)
        }
        (None, false) => agentrt::Purge::runs(runs),
    };
    let purge = selection.dry_run(dry_run).batch(batch);
    let before = file_size(path);
    let store = if dry_run {
        // A dry run reads as the read commands do: nothing created, no byte changed.
        open_reading(path)?
    } else {
        open_for_writing(path)?
    };
    let report = store.purge(&purge).map_err(|e| write_failed(path, e))?;
    // Closed first: the last connection to close copies the log into the file, which is when
    // the file shrinks.
    drop(store);
    let after = file_size(path);
    if json {
        return print_json(&PurgeOutput {
            report: &report,
            file_bytes_before: before,
            file_bytes_after: after,
        });
    }
    let plural = |n: u64, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
    out!(
        "{} {} ({}, {}, {}) in {}",
        if dry_run { "would purge" } else { "purged" },
        plural(report.runs, "run"),
        plural(report.steps, "step"),
        plural(report.events, "event"),
        plural(report.approvals, "approval"),
        plural(report.batches, if dry_run { "read" } else { "transaction" }),
    );
    for run_id in &report.run_ids {
        out!("  {run_id}");
    }
    if report.runs > report.run_ids.len() as u64 {
        out!(
            "  ... and {} more",
            report.runs - report.run_ids.len() as u64
        );
    }
    if dry_run {
        out!("file {} (a dry run changes nothing)", bytes(before));
        return Ok(());
    }
    out!("file {} -> {}", bytes(before), bytes(after));
    if let Some(space) = &report.space
        && !space.returns_space
        && space.free_bytes > 0
    {
        out!(
            "the file keeps {} free for later writes and cannot shrink by itself (it was created \
             by an older agentrt): `agentrt vacuum` gives the space back and makes later purges \
             shrink the file; it needs free disk space up to twice the database's size and \
             blocks every writer while it runs",
            bytes(space.free_bytes)
        );
    } else if let Some(space) = &report.space
        && space.bytes_after < after
    {
        out!(
            "the file shrinks once the process that holds the database open copies its log \
             into it (its next checkpoint)"
        );
    }
    Ok(())
}

fn vacuum(path: &Path, json: bool) -> Outcome {
    let store = open_for_writing(path)?;
    let before = file_size(path);
    let space = store.vacuum().map_err(|e| write_failed(path, e))?;
    drop(store);
    let after = file_size(path);
    if json {
        return print_json(&PurgeSpace {
            space: &space,
            file_bytes_before: before,
            file_bytes_after: after,
        });
    }
    out!(
        "file {} -> {}; purges now give the space they free back to the disk",
        bytes(before),
        bytes(after)
    );
    Ok(())
}

/// `vacuum --json`.
#[derive(Serialize)]
struct PurgeSpace<'a> {
    #[serde(flatten)]
    space: &'a agentrt::Space,
    file_bytes_before: u64,
    file_bytes_after: u64,
}

fn show(store: &Store, run_id: &RunId, json: bool) -> Outcome {
    let run = store.run(run_id).map_err(|e| e.to_string())?;
    let lease = store.lease(run_id).map_err(|e| e.to_string())?;
    let pending = store.pending_calls(run_id).map_err(|e| e.to_string())?;
    let wait = store.wait(run_id).map_err(|e| e.to_string())?;
    // The totals come from the log: a log this build cannot read leaves them unknown, not
    // the rest of the run.
    let usage = store.usage(run_id);
    if json {
        return print_json(&Shown {
            run: &run,
            lease: LeaseView::of(&lease),
            pending_calls: &pending,
            wait: wait.as_ref(),
            usage: usage.as_ref().ok(),
        });
    }
    out!("run       {}", run.id);
    out!("agent     {}", run.agent);
    out!("state     {}", run.state);
    out!("input     {}", run.input);
    if let Some(output) = &run.output {
        out!("output    {output}");
    }
    if let Some(error) = &run.error {
        out!("error     {error}");
    }
    out!("created   {}", time(run.created_at));
    out!("updated   {}", time(run.updated_at));
    out!("lease     {}", describe_lease(&lease));
    for (label, text) in wait.iter().flat_map(waits::describe) {
        out!("{label:<9} {text}");
    }
    match &usage {
        Ok(usage) => out!("model     {}", describe_usage(usage)),
        Err(err) => out!("model     unknown: {err}"),
    }
    if !pending.is_empty() {
        let mut table = table(&["CALL", "STEP", "TOOL", "ARGS", "WAITS FOR"]);
        for call in &pending {
            table.add_row(vec![
                call.call_id.clone(),
                call.step.to_string(),
                call.tool.clone(),
                call.args.to_string(),
                call.reason.as_str().to_owned(),
            ]);
        }
        out!("\n{}", table.trim_fmt());
    }
    Ok(())
}

fn describe_usage(usage: &RunUsage) -> String {
    let plural = |n: u32, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
    let mut line = format!(
        "{} in, {} out; {}, {}",
        usage.tokens.input_tokens,
        usage.tokens.output_tokens,
        plural(usage.answers, "answer"),
        plural(usage.attempts, "attempt"),
    );
    if !usage.models.is_empty() {
        line.push_str(&format!(" ({})", usage.models.join(", ")));
    }
    format!("tokens {line}")
}

fn describe_lease(lease: &Option<Lease>) -> String {
    match lease {
        None => "none".into(),
        Some(lease) if lease.expires_at <= SystemTime::now() => {
            format!(
                "{} (expired at {}: stale, a resume takes it over; fencing token {})",
                lease.owner,
                time(lease.expires_at),
                lease.fencing_token
            )
        }
        Some(lease) => format!(
            "{} until {} (fencing token {})",
            lease.owner,
            time(lease.expires_at),
            lease.fencing_token
        ),
    }
}

fn events(store: &Store, run_id: &RunId, after: u64, follow: bool, json: bool) -> Outcome {
    let mut last = after;
    let mut printed_table = false;
    let mut holder = Holder::Unknown;
    // Once following, a database that went away (or any failure) ends the watch with a word on
    // what stopped it.
    let stopped = |err: agentrt::Error| {
        if follow {
            format!("stopped following run {run_id}: {err}")
        } else {
            err.to_string()
        }
    };
    loop {
        let events = store.events_after(run_id, last).map_err(stopped)?;
        if json {
            for event in &events {
                out!(
                    "{}",
                    serde_json::to_string(event).map_err(|e| e.to_string())?
                );
            }
        } else if !events.is_empty() {
            let mut table = if printed_table {
                Table::new()
            } else {
                table(&["SEQ", "AT", "KIND", "STEP", "PAYLOAD"])
            };
            table.load_style(presets::NOTHING);
            for event in &events {
                let step = event.step.map(|s| s.to_string()).unwrap_or_default();
                table.add_row(vec![
                    event.seq.to_string(),
                    time(event.at),
                    event.kind.to_string(),
                    step,
                    event.payload.to_string(),
                ]);
            }
            out!("{}", table.trim_fmt());
            printed_table = true;
        }
        last = events.last().map_or(last, |event| event.seq);
        if !follow {
            return Ok(());
        }
        let run = store.run(run_id).map_err(stopped)?;
        // Stop once the run has finished and a poll after that found nothing new (a cancelled
        // run's late tool outcome comes within its lease period at most).
        if events.is_empty() && run.state.is_finished() {
            return Ok(());
        }
        holder = holder.next(store, &run).map_err(stopped)?;
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Who executes a followed run, as `events --follow` last told it: it says when nobody does
/// any more, and who took the run over, once each.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Holder {
    /// Not running (waiting for an approval needs no executor), or not looked at yet.
    Unknown,
    /// Leased by this owner under this fencing token, the lease live.
    Held(String, FencingToken),
    /// Running, and nobody holds it: its lease expired, or it was left unleased.
    Abandoned,
}

impl Holder {
    /// Looks at the run's lease, and tells on stderr what changed since the last look.
    fn next(self, store: &Store, run: &Run) -> Result<Holder, agentrt::Error> {
        if run.state != RunState::Running {
            return Ok(Holder::Unknown);
        }
        let lease = store.lease(&run.id)?;
        let now = match &lease {
            Some(lease) if lease.expires_at > SystemTime::now() => {
                Holder::Held(lease.owner.clone(), lease.fencing_token)
            }
            _ => Holder::Abandoned,
        };
        match (&self, &now, &lease) {
            (Holder::Abandoned, Holder::Abandoned, _) => {}
            (_, Holder::Abandoned, Some(lease)) => eprintln!(
                "agentrt: run {}: nobody holds its lease any more: {}'s expired at {} and \
                 nobody took it over (its executor is gone); a resume takes it over",
                run.id,
                lease.owner,
                time(lease.expires_at)
            ),
            (_, Holder::Abandoned, None) => eprintln!(
                "agentrt: run {}: nobody holds it: it is RUNNING and unleased (the call \
                 executing it returned, or it was never executed: a fork, or a run that waits \
                 for a free slot); a supervisor with recovery, or a resume, takes it over",
                run.id
            ),
            // A new token is a new acquisition, whatever the owner's name.
            (Holder::Abandoned, Holder::Held(owner, token), _) => {
                eprintln!(
                    "agentrt: run {}: taken over by {owner} (fencing token {token})",
                    run.id
                )
            }
            (Holder::Held(_, before), Holder::Held(owner, token), _) if before != token => {
                eprintln!(
                    "agentrt: run {}: taken over by {owner} (fencing token {token})",
                    run.id
                )
            }
            _ => {}
        }
        Ok(now)
    }
}

fn lease(store: &Store, run_id: &RunId, json: bool) -> Outcome {
    let lease = store.lease(run_id).map_err(|e| e.to_string())?;
    if json {
        return print_json(&LeaseReport {
            run_id,
            lease: LeaseView::of(&lease),
        });
    }
    out!("{}", describe_lease(&lease));
    Ok(())
}

fn record(store: &Store, path: &Path, decide: Decide, approved: bool, json: bool) -> Outcome {
    let run_id = RunId::from(decide.run);
    let mut approval = if approved {
        Approval::approve(run_id.clone(), decide.call.clone(), decide.by)
    } else {
        Approval::deny(run_id.clone(), decide.call.clone(), decide.by)
    };
    approval.note = decide.note;
    store
        .record_approval(&approval)
        .map_err(|e| write_failed(path, e))?;
    let verb = if approved { "approved" } else { "denied" };
    done(
        json,
        &format!(
            "call {} of run {run_id} {verb}; resume the run to continue",
            decide.call
        ),
        &approval,
    )
}

fn migrate(path: &Path, apply: bool, json: bool) -> Outcome {
    let before = schema_status(path)?;
    if before.found > before.supported {
        return Err(Failure::Message(format!(
            "{} has schema version {}, newer than the {} this agentrt knows; it was left unchanged",
            path.display(),
            before.found,
            before.supported
        )));
    }
    if apply && before.pending() > 0 {
        match url(path) {
            Some(url) => drop(agentrt::postgres::Options::new().open(url)),
            None => drop(sqlite::Options::new().create(false).open(path)),
        }
    }
    let after = schema_status(path)?;
    // An empty PostgreSQL schema goes to the first version PostgreSQL had in one migration.
    let pending = match url(path) {
        Some(_) => agentrt::postgres::migrations_pending(before.found),
        None => before.pending(),
    };
    let text = match (pending, apply) {
        (0, _) => format!("schema version {}: up to date", after.found),
        (n, false) => format!(
            "schema version {}, this agentrt writes {}: {n} migration(s) pending; run `agentrt migrate --apply`",
            before.found, before.supported
        ),
        (n, true) => format!(
            "applied {n} migration(s): schema version {} -> {}",
            before.found, after.found
        ),
    };
    done(
        json,
        &text,
        &MigrateReport {
            found: before.found,
            supported: before.supported,
            applied: apply && before.pending() > 0,
            now: after.found,
        },
    )
}

fn doctor(path: &Path, json: bool) -> Outcome {
    let status = schema_status(path)?;
    if status.found != status.supported {
        return migrate(path, false, json)
            .and_then(|()| Err("the schema is not current; nothing else was checked".into()));
    }
    let store = open_reading(path)?;
    let health = store.health().map_err(|e| e.to_string())?;
    if json {
        print_json(&DoctorReport {
            schema: Schema {
                found: health.schema.found,
                supported: health.schema.supported,
            },
            settings: health
                .settings
                .iter()
                .filter(|(name, _)| name != "defensive")
                .map(|(name, value)| (name.as_str(), value.clone()))
                .collect(),
            defensive: health.setting("defensive") == Some("1"),
            integrity: &health.integrity,
            stale_leases: health
                .stale_leases
                .iter()
                .map(|(run_id, lease)| StaleLease { run_id, lease })
                .collect(),
            running_without_lease: &health.running_without_lease,
            ok: health.is_ok(),
        })?;
    } else {
        out!("schema version  {} (current)", health.schema.found);
        for (name, value) in health
            .settings
            .iter()
            .filter(|(name, _)| name != "defensive")
        {
            out!("{name:<15} {value}");
        }
        // SQLite's defensive mode, which a PostgreSQL store has no such thing as.
        if let Some(defensive) = health.setting("defensive") {
            out!(
                "defensive       {}",
                if defensive == "1" { "on" } else { "off" }
            );
        }
        if health.setting("auto_vacuum") == Some("none")
            && health
                .setting("freelist_count")
                .is_some_and(|free| free != "0")
        {
            out!(
                "                (the file keeps its free pages: `agentrt vacuum` gives them back)"
            );
        }
        out!("integrity       {}", health.integrity.join("; "));
        out!("stale leases    {}", health.stale_leases.len());
        for (run_id, lease) in &health.stale_leases {
            out!(
                "  {run_id}: {} expired at {}",
                lease.owner,
                time(lease.expires_at)
            );
        }
        out!("unleased runs   {}", health.running_without_lease.len());
        for run_id in &health.running_without_lease {
            out!("  {run_id}");
        }
    }
    if health.integrity != ["ok"] {
        return Err("the integrity check found problems".into());
    }
    Ok(())
}

/// `agentrt token OPERATOR`.
fn token(operator: &str, json: bool) -> Outcome {
    if operator.chars().any(char::is_whitespace) {
        return Err("an operator's name has no spaces: it is the first word of its line".into());
    }
    let mut bytes = [0u8; 32];
    rand::fill(&mut bytes);
    let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let digest = agentrt::web::token_digest(&token);
    if json {
        out!(
            "{}",
            serde_json::json!({ "operator": operator, "token": token, "digest": digest })
        );
    } else {
        out!("{token}");
        out!("{operator} {digest}");
    }
    Ok(())
}

/// Reads a tokens file: `OPERATOR DIGEST` per line, blank lines and `#` comments skipped.
fn read_tokens(api: agentrt::web::Api, file: &Path) -> Result<agentrt::web::Api, Failure> {
    let text = std::fs::read_to_string(file)
        .map_err(|e| format!("cannot read the tokens file {}: {e}", file.display()))?;
    let mut api = api;
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut words = line.split_whitespace();
        let (Some(operator), Some(digest), None) = (words.next(), words.next(), words.next())
        else {
            return Err(Failure::Message(format!(
                "{} line {}: expected `OPERATOR DIGEST` (`agentrt token OPERATOR` makes one)",
                file.display(),
                n + 1
            )));
        };
        api = api
            .token_digest(operator, digest)
            .map_err(|e| format!("{} line {}: {e}", file.display(), n + 1))?;
    }
    if !api.has_tokens() {
        return Err(Failure::Message(format!(
            "the tokens file {} names no operator",
            file.display()
        )));
    }
    Ok(api)
}

/// `agentrt serve`: the API and the console until SIGTERM or SIGINT (it executes no runs: it
/// stops gracefully).
fn serve(path: &Path, listen: &str, tokens: Option<&Path>, reads_need_token: bool) -> Outcome {
    let store = open_for_writing(path)?;
    let mut api = agentrt::web::Api::new(store);
    if let Some(file) = tokens {
        api = read_tokens(api, file)?.tokens_for_reads(reads_need_token);
    }
    let system = actix_rt::System::new();
    system
        .block_on(agentrt::web::serve(api, listen))
        .map_err(|e| Failure::Message(format!("cannot serve on {listen}: {e}")))
}
