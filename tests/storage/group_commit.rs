//! Group commit: moves of different runs that arrive together share one transaction, and
//! every run's log is exactly what it would be with one commit per move.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use agentrt::{
    Agent, Config, EventKind, ModelResponse, MoveInfo, MoveKind, MoveObserver, Outcome, RunId,
    StartRun, Tool, ToolCall, ToolContext, ToolError, async_trait, sqlite,
    testkit::{RecordingTool, ScriptedModel, TempStore, with_system},
};
use serde_json::{Value, json};

use crate::support::supervise;

const RUNS: usize = 40;

fn agent() -> Agent {
    agent_with(RecordingTool::new("t"))
}

fn agent_with(tool: impl Tool) -> Agent {
    let model = ScriptedModel::new(vec![
        ModelResponse::calls(vec![
            ToolCall::new("a", "t", json!({})),
            ToolCall::new("b", "t", json!({})),
        ]),
        ModelResponse::calls(vec![ToolCall::new("c", "t", json!({}))]),
        ModelResponse::answer("done"),
    ]);
    Agent::new(model).tool(tool)
}

/// Runs `RUNS` runs at once; returns each run's event kinds and steps.
fn logs(group_commit: bool) -> Vec<Vec<(EventKind, Option<u32>, u64)>> {
    logs_on(group_commit, Config::default(), agent())
}

fn logs_of(config: Config, agent: Agent) -> Vec<Vec<(EventKind, Option<u32>, u64)>> {
    logs_on(true, config, agent)
}

fn logs_on(
    group_commit: bool,
    config: Config,
    agent: Agent,
) -> Vec<Vec<(EventKind, Option<u32>, u64)>> {
    // An SQLite file on either pass: these are the SQLite backend's group commits.
    let db = TempStore::sqlite();
    let store = sqlite::Options::new()
        .group_commit(group_commit)
        .open(db.path())
        .unwrap();
    with_system(|| async move {
        let sup = supervise(store, config, "a", agent);
        let calls: Vec<_> = (0..RUNS)
            .map(|i| {
                actix_rt::spawn(sup.send(StartRun::new("a", json!({})).with_id(format!("r{i}"))))
            })
            .collect();
        for call in calls {
            let reply = call.await.unwrap().unwrap().unwrap();
            assert_eq!(
                reply.outcome,
                Outcome::Succeeded {
                    output: "done".into()
                }
            );
        }
    });
    let store = db.open();
    (0..RUNS)
        .map(|i| {
            store
                .events(&RunId::from(format!("r{i}").as_str()))
                .unwrap()
                .into_iter()
                .map(|e| (e.kind, e.step, e.seq))
                .collect()
        })
        .collect()
}

#[test]
fn concurrent_runs_log_the_same_events_in_the_same_order_with_and_without_group_commit() {
    let grouped = logs(true);
    let single = logs(false);
    assert_eq!(grouped, single);
    // And that is the ordinary sequence: gapless, every step started and finished.
    for log in &grouped {
        assert_eq!(log.len(), 1 + 3 * 2 + 3 * 3 + 1);
        assert!(
            log.iter()
                .enumerate()
                .all(|(i, (_, _, seq))| *seq == i as u64 + 1)
        );
        assert_eq!(log.last().unwrap().0, EventKind::RunFinished);
    }
}

/// Per run, the tool decisions (each starts its call) reported durable, and whether a report
/// came from the log-sync thread.
#[derive(Clone, Default)]
struct Durable {
    decisions: Arc<Mutex<HashMap<RunId, u32>>>,
    by_sync_thread: Arc<Mutex<bool>>,
}

impl MoveObserver for Durable {
    fn committed(&self, moves: &[&MoveInfo]) {
        if std::thread::current().name() == Some("agentrt-log-sync") {
            *self.by_sync_thread.lock().unwrap() = true;
        }
        let mut decisions = self.decisions.lock().unwrap();
        for info in moves
            .iter()
            .filter(|info| info.kind == MoveKind::DecideTool)
        {
            *decisions.entry(info.run_id.clone()).or_default() += 1;
        }
    }
}

/// Notes each call that began before the decision that started it was reported durable.
struct StartsOnlyWhenDurable {
    durable: Durable,
    calls: Mutex<HashMap<RunId, u32>>,
    early: Arc<Mutex<Vec<String>>>,
}

#[async_trait(?Send)]
impl Tool for StartsOnlyWhenDurable {
    fn name(&self) -> &str {
        "t"
    }

    async fn call(&self, ctx: &ToolContext, _: &Value) -> Result<Value, ToolError> {
        let mut calls = self.calls.lock().unwrap();
        let call = calls.entry(ctx.run_id.clone()).or_default();
        *call += 1;
        let durable = self.durable.decisions.lock().unwrap();
        if durable.get(&ctx.run_id).copied().unwrap_or(0) < *call {
            let early = format!(
                "{}: call {call} began before its start was durable",
                ctx.run_id
            );
            self.early.lock().unwrap().push(early);
        }
        Ok(json!({}))
    }
}

#[test]
fn a_grouped_tool_call_begins_only_after_its_start_is_durable() {
    let durable = Durable::default();
    let early = Arc::default();
    let tool = StartsOnlyWhenDurable {
        durable: durable.clone(),
        calls: Mutex::default(),
        early: Arc::clone(&early),
    };
    let config = Config::default().observer(durable.clone());
    let grouped = logs_of(config, agent_with(tool));
    assert_eq!(*early.lock().unwrap(), Vec::<String>::new());
    assert_eq!(grouped, logs(false));
    // With many runs in flight, groups were synced off the store actor's thread (while it
    // applied the next group), and still no call began before its group's sync.
    assert!(*durable.by_sync_thread.lock().unwrap());
}

/// Panics once, when told of a group on the log-sync thread.
#[derive(Clone, Default)]
struct PanicsOnceWhenSynced(Arc<Mutex<bool>>);

impl MoveObserver for PanicsOnceWhenSynced {
    fn committed(&self, _: &[&MoveInfo]) {
        if std::thread::current().name() == Some("agentrt-log-sync") {
            let mut panicked = self.0.lock().unwrap();
            if !*panicked {
                *panicked = true;
                drop(panicked);
                panic!("an observer panicked on the log-sync thread");
            }
        }
    }
}

#[test]
fn an_observer_that_panics_on_the_log_sync_thread_fails_its_groups_runs_and_hangs_nothing() {
    // An SQLite file on either pass: its log-sync thread is the SQLite backend's.
    let db = TempStore::sqlite();
    let store = db.open();
    let observer = PanicsOnceWhenSynced::default();
    let panicked = observer.0.clone();
    // A bound on liveness, not a timing: before the fix, this hung for good.
    let bound = std::time::Duration::from_secs(60);
    let (failed, later) = with_system(|| async move {
        actix_rt::time::timeout(bound, every_call_answers(store, observer))
            .await
            .expect("the supervisor hung")
    });
    assert!(
        *panicked.lock().unwrap(),
        "no group was synced by the log-sync thread"
    );
    assert!(
        failed > 0,
        "the group whose observer panicked was not answered"
    );
    // Runs started afterwards share groups again; with the log-sync thread gone, each group
    // syncs in the store actor's thread, and they all succeed.
    assert_eq!(later, LATER);
}

/// Runs started at once after the log-sync thread died.
const LATER: usize = 5;

/// Starts `RUNS` runs at once, resumes one, then starts `LATER` more at once: the starts of
/// the first that failed, and the later that succeeded.
async fn every_call_answers(
    store: agentrt::Store,
    observer: PanicsOnceWhenSynced,
) -> (usize, usize) {
    let sup = supervise(store, Config::default().observer(observer), "a", agent());
    let start_all = |prefix: &'static str, runs: usize| {
        let calls: Vec<_> = (0..runs)
            .map(|i| {
                let start = StartRun::new("a", json!({})).with_id(format!("{prefix}{i}"));
                actix_rt::spawn(sup.send(start))
            })
            .collect();
        async move {
            let mut succeeded = 0;
            for call in calls {
                if let Ok(reply) = call.await.unwrap().unwrap()
                    && matches!(reply.outcome, Outcome::Succeeded { .. })
                {
                    succeeded += 1;
                }
            }
            succeeded
        }
    };
    let failed = RUNS - start_all("r", RUNS).await;
    // The store actor still answers: its reads wait for every group's sync to be counted, the
    // panicked one's included. (A resume reads the run first, whatever it then finds.)
    let _ = sup
        .send(agentrt::ResumeRun::new(RunId::from("r0")))
        .await
        .unwrap();
    (failed, start_all("later", LATER).await)
}
