//! Two supervisor processes whose wall clocks disagree by many TTLs (libfaketime shifts each
//! child's clock; the monotonic clock is left alone) each execute a run and try to take the
//! other's. On PostgreSQL, leases are stamped and judged by the server's clock: neither takes
//! the other's live run. On SQLite, where lease expiry compares wall clocks, the process whose
//! clock runs ahead takes the other's live run over: the contrast `docs/postgres.md` shows.

#![cfg(feature = "postgres")]

use std::{
    collections::HashMap,
    io::{BufRead, BufReader},
    path::Path,
    process::{Child, Stdio},
    sync::mpsc,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use agentrt::{
    Agent, Config, Error, ModelResponse, ResumeRun, RunId, StartRun, Store, ToolCall,
    testkit::{
        Behaviour, RecordingTool, ScriptedModel, TempStore,
        postgres::{Schema, server},
        with_system,
    },
};
use serde_json::json;

use crate::support::{child, supervise};

const TTL: Duration = Duration::from_millis(400);
/// How far each child's wall clock is moved: ten TTLs, one back and one forward.
const SKEW_SECONDS: i64 = 4;
const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

const DB: &str = "AGENTRT_SKEW_DB";
const NAME: &str = "AGENTRT_SKEW_NAME";
const OTHER: &str = "AGENTRT_SKEW_OTHER";
const GO: &str = "AGENTRT_SKEW_GO";

fn agent(tool: &RecordingTool) -> Agent {
    let model = ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new("c1", "deploy", json!({}))]),
        ModelResponse::answer("deployed"),
    ]);
    Agent::new(model).tool(tool.clone())
}

/// The child's side: reports its wall clock, executes its own run until the tool is in flight
/// (the tool never returns), then, once the parent says go, asks for the other child's run
/// every quarter TTL for six TTLs, and reports what became of each ask.
#[test]
#[ignore = "the child process of the clock-skew tests"]
fn child_executes_its_run_and_reaches_for_the_other() {
    let location = std::env::var(DB).expect("run by the parent test");
    let name = std::env::var(NAME).unwrap();
    let other = RunId::from(std::env::var(OTHER).unwrap());
    let go = std::env::var(GO).unwrap();
    let wall = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    println!("CLOCK {}", wall.as_millis());
    let tool = RecordingTool::new("deploy").behaviour(Behaviour::BlockIgnoringCancel);
    let store = Store::connect(&location).unwrap();
    with_system(|| async move {
        let config = Config::default().lease_owner(name.as_str()).lease_ttl(TTL);
        let sup = supervise(store, config, "a", agent(&tool));
        actix_rt::spawn(sup.send(StartRun::new("a", json!({})).with_id(format!("run-{name}"))));
        tool.wait_executions(1).await;
        println!("HOLDING");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !Path::new(&go).exists() {
            assert!(Instant::now() < deadline, "the parent never said go");
            actix_rt::time::sleep(Duration::from_millis(5)).await;
        }
        let (mut refused, mut other_outcomes) = (0, Vec::new());
        let until = Instant::now() + TTL * 6;
        // Six TTLs, and at least three asks however slowly a loaded machine answers them.
        while Instant::now() < until || refused + other_outcomes.len() < 3 {
            let asked = sup.send(ResumeRun::new(other.clone()));
            // However long an ask takes on a loaded machine, it answers, unless it took the
            // other run over and runs its tool here (which never returns): told by the tool.
            let took_and_runs = tool.wait_executions(2);
            match futures_util::future::select(std::pin::pin!(asked), std::pin::pin!(took_and_runs))
                .await
            {
                futures_util::future::Either::Left((Ok(Err(Error::RunLeased { .. })), _)) => {
                    refused += 1
                }
                futures_util::future::Either::Left((outcome, _)) => {
                    other_outcomes.push(format!("{outcome:?}"))
                }
                futures_util::future::Either::Right(_) => {
                    other_outcomes.push("took".to_owned());
                    break;
                }
            }
            actix_rt::time::sleep(TTL / 4).await;
        }
        println!(
            "ASKED refused={refused} executions={} other={other_outcomes:?}",
            tool.executions().len()
        );
        std::future::pending::<()>().await;
    });
}

/// A child under libfaketime, its wall clock moved by `offset` seconds.
fn spawn(location: &str, name: &str, other: &str, go: &Path, offset: i64) -> Child {
    child::test(
        module_path!(),
        "child_executes_its_run_and_reaches_for_the_other",
    )
    .env(DB, location)
    .env(NAME, name)
    .env(OTHER, format!("run-{other}"))
    .env(GO, go)
    .env("LD_PRELOAD", LIBFAKETIME)
    .env("FAKETIME", format!("{offset:+}"))
    .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
    .stdout(Stdio::piped())
    .stderr(Stdio::null())
    .spawn()
    .unwrap()
}

/// Reads a child's report lines on a thread, keyed by their first word.
fn lines(child: &mut Child) -> mpsc::Receiver<(String, String)> {
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let (send, receive) = mpsc::channel();
    std::thread::spawn(move || {
        for line in stdout.lines().map_while(Result::ok) {
            for word in ["CLOCK", "HOLDING", "ASKED"] {
                if let Some((_, rest)) = line.split_once(word) {
                    let _ = send.send((word.to_owned(), rest.trim().to_owned()));
                }
            }
        }
    });
    receive
}

fn next(reports: &mpsc::Receiver<(String, String)>, word: &str) -> String {
    let (got, rest) = reports
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("a child did not report {word}"));
    assert_eq!(got, word, "{rest}");
    rest
}

/// What each child said of its asks, after both executed their own runs with their clocks
/// `2 × SKEW_SECONDS` apart.
fn race(location: &str) -> HashMap<&'static str, String> {
    if !Path::new(LIBFAKETIME).exists() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI is set and libfaketime is missing: install Debian's faketime"
        );
        eprintln!("skipped: libfaketime is missing (install Debian's faketime)");
        return HashMap::new();
    }
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    drop(Store::connect(location).unwrap());
    let mut children = [
        (
            "behind",
            spawn(location, "behind", "ahead", &go, -SKEW_SECONDS),
        ),
        (
            "ahead",
            spawn(location, "ahead", "behind", &go, SKEW_SECONDS),
        ),
    ];
    let reports: Vec<_> = children.iter_mut().map(|(_, child)| lines(child)).collect();
    let clocks: Vec<i64> = reports
        .iter()
        .map(|r| next(r, "CLOCK").parse().unwrap())
        .collect();
    // The clocks really disagree, by many TTLs.
    let apart = Duration::from_millis((clocks[1] - clocks[0]).unsigned_abs());
    assert!(
        apart > TTL * 10,
        "the children's clocks are {apart:?} apart"
    );
    reports.iter().for_each(|r| drop(next(r, "HOLDING")));
    std::fs::write(&go, b"").unwrap();
    let asked = children
        .iter()
        .zip(&reports)
        .map(|((name, _), r)| (*name, next(r, "ASKED")))
        .collect();
    for (_, child) in &mut children {
        child.kill().unwrap();
        child.wait().unwrap();
    }
    asked
}

#[test]
fn on_postgres_supervisors_whose_clocks_disagree_by_many_ttls_take_no_live_run_from_each_other() {
    let Some(server) = server() else { return };
    let schema = Schema::new(&server);
    let asked = race(&schema.url());
    if asked.is_empty() {
        return;
    }
    for (name, said) in &asked {
        // Every ask was refused for the other's live lease; each tool ran once, in its own run.
        assert!(said.contains("executions=1 other=[]"), "{name}: {said}");
        let refused: u32 = said
            .split_once("refused=")
            .and_then(|(_, rest)| rest.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap();
        assert!(refused >= 3, "{name}: {said}");
    }
    let store = Store::connect(&schema.url()).unwrap();
    for name in ["behind", "ahead"] {
        let run_id = RunId::from(format!("run-{name}"));
        let events = store.events(&run_id).unwrap();
        assert!(
            !events
                .iter()
                .any(|event| event.kind == agentrt::EventKind::LeaseTakenOver),
            "{name}'s run was taken over: {events:?}"
        );
    }
}

#[test]
fn on_sqlite_a_supervisor_whose_clock_runs_ahead_takes_a_live_run_over() {
    let temp = TempStore::new();
    let asked = race(&temp.path().display().to_string());
    if asked.is_empty() {
        return;
    }
    // Its clock many TTLs ahead, the one ahead sees the other's live lease long expired and
    // takes the run over (interrupting the tool still running in the other process, which it
    // leaves to a person to reconcile); the one behind sees a lease with seconds left.
    assert!(!asked["ahead"].contains("other=[]"), "{asked:?}");
    assert!(asked["behind"].contains("other=[]"), "{asked:?}");
    let events = Store::open(temp.path())
        .unwrap()
        .events(&RunId::from("run-behind"))
        .unwrap();
    assert!(
        events
            .iter()
            .any(|event| event.kind == agentrt::EventKind::LeaseTakenOver),
        "{events:?}"
    );
}
