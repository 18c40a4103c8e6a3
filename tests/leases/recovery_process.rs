//! Two real processes: a child leaves runs behind when it is killed with SIGKILL (one mid-tool
//! under its lease, one whose `SpawnRun` was answered a moment before the kill, and one that
//! nobody holds); the parent starts a supervisor with recovery, which takes every one of them
//! over by itself and finishes it. Likewise for runs that waited their turn behind a
//! concurrency limit: answered, inserted with no lease, and recovered after the kill.

use std::time::Duration;

use agentrt::{
    Agent, Config, ModelResponse, Outcome, Recovery, RunId, RunState, StartRun, Supervisor,
    testkit::{RecordingTool, ScriptedModel, TempStore, with_system},
};
use serde_json::json;

use crate::support::{
    child, provisioning,
    settled::{self, subscribed},
    spawn, supervise,
};

const DB_VAR: &str = "AGENTRT_TEST_RECOVERY_CHILD_DB";
const TTL: Duration = Duration::from_millis(500);

fn quick() -> Agent {
    Agent::new(ScriptedModel::new(vec![ModelResponse::answer("ok")]))
}

/// The child's side. Only meaningful as a child process of the test below, hence ignored.
#[test]
#[ignore = "the child process of runs_a_killed_process_left_are_recovered_without_a_resume"]
fn child_process_leaves_runs_and_is_killed() {
    let (store, probe) = child::store_and_stuck_tool(DB_VAR);
    with_system(|| async move {
        let config = Config::default().lease_owner("child").lease_ttl(TTL);
        let sup = Supervisor::builder(store.clone())
            .config(config)
            .agent("provision", provisioning(&probe))
            .agent("quick", quick())
            .start()
            .unwrap();
        // A finished run, and a fork of it that nobody has executed: RUNNING, unleased.
        sup.send(StartRun::new("quick", json!({})).with_id("done"))
            .await
            .unwrap()
            .unwrap();
        store
            .fork(&RunId::from("done"), 1, Some(RunId::from("forked")))
            .unwrap();
        // A run mid-tool, under this process's lease.
        spawn(&sup, "provision", "mid-tool").await;
        probe.wait_executions(1).await;
        // A run whose start was answered: the kill comes right after.
        spawn(&sup, "provision", "just-started").await;
        println!("READY");
        std::future::pending::<()>().await;
    });
}

#[test]
fn runs_a_killed_process_left_are_recovered_without_a_resume() {
    let db = TempStore::new();
    drop(db.open());
    child::killed_after(
        module_path!(),
        "child_process_leaves_runs_and_is_killed",
        DB_VAR,
        &db.location(),
        "READY",
    );

    let store = db.open();
    for id in ["forked", "mid-tool", "just-started"] {
        assert_eq!(
            store.run(&RunId::from(id)).unwrap().state,
            RunState::Running,
            "{id} is in the store, left RUNNING"
        );
    }

    // The interrupted provisioning is idempotent: it runs again, once.
    let tool = RecordingTool::new("provision").idempotent(true);
    let (store, agent) = (db.open(), provisioning(&tool));
    let settled = with_system(|| async move {
        let config = Config::default()
            .lease_owner("parent")
            .lease_ttl(Duration::from_secs(2))
            .recovery(Recovery::default().every(Duration::from_millis(100)));
        let sup = Supervisor::builder(store)
            .config(config)
            .agent("provision", agent)
            .agent("quick", quick())
            .start()
            .unwrap();
        let (_inbox, mut rx) = subscribed(&sup).await;
        rx.wait_for(|seen| seen.len() >= 3).await.unwrap().clone()
    });

    let mut ids: Vec<&str> = settled.iter().map(|s| s.run_id.as_str()).collect();
    ids.sort();
    assert_eq!(ids, ["forked", "just-started", "mid-tool"]);
    for s in &settled {
        assert!(
            matches!(s.result, Ok(Outcome::Succeeded { .. })),
            "{}: {:?}",
            s.run_id,
            s.result
        );
    }
    let keys: Vec<String> = tool
        .executions()
        .iter()
        .map(|e| e.idempotency_key.clone())
        .collect();
    assert!(
        keys.iter().filter(|k| k.starts_with("mid-tool/")).count() == 1,
        "the interrupted call ran again once: {keys:?}"
    );
    agentrt::testkit::assert_no_run_leased(&db.open());
}

const QUEUE_DB_VAR: &str = "AGENTRT_TEST_QUEUE_CHILD_DB";
const QUEUED: usize = 30;

/// The child's side of the test below: two slots, both taken by runs blocked mid-tool, and
/// the other runs answered and waiting their turn when it is killed.
#[test]
#[ignore = "the child process of runs_waiting_their_turn_survive_a_kill_and_are_recovered"]
fn child_process_queues_runs_and_is_killed() {
    let (store, probe) = child::store_and_stuck_tool(QUEUE_DB_VAR);
    with_system(|| async move {
        let config = Config::default()
            .lease_owner("child")
            .lease_ttl(TTL)
            .max_concurrent_runs(2);
        let sup = supervise(store, config, "provision", provisioning(&probe));
        for n in 0..QUEUED {
            spawn(&sup, "provision", format!("q{n:02}")).await;
        }
        probe.wait_executions(2).await;
        println!("READY");
        std::future::pending::<()>().await;
    });
}

#[test]
fn runs_waiting_their_turn_survive_a_kill_and_are_recovered() {
    let db = TempStore::new();
    drop(db.open());
    child::killed_after(
        module_path!(),
        "child_process_queues_runs_and_is_killed",
        QUEUE_DB_VAR,
        &db.location(),
        "READY",
    );

    let store = db.open();
    let left = store.runs(Some(RunState::Running)).unwrap();
    assert_eq!(left.len(), QUEUED, "every answered run is in the store");
    let unleased = left
        .iter()
        .filter(|run| store.lease(&run.id).unwrap().is_none())
        .count();
    assert_eq!(
        unleased,
        QUEUED - 2,
        "the runs that waited their turn are held by nobody"
    );

    let tool = RecordingTool::new("provision").idempotent(true);
    let (store, agent) = (db.open(), provisioning(&tool));
    let settled = with_system(|| async move {
        let config = Config::default()
            .lease_owner("parent")
            .lease_ttl(Duration::from_secs(2))
            .max_concurrent_runs(4)
            // No second pass from the timer: the first finds a page of 4, and each recovered
            // run's end starts the next pass, until the backlog is drained.
            .recovery(Recovery::default().every(Duration::from_secs(3600)));
        let sup = supervise(store, config, "provision", agent);
        let (_inbox, mut rx) = subscribed(&sup).await;
        settled::heard(&mut rx, QUEUED).await
    });
    for s in &settled {
        assert!(
            matches!(s.result, Ok(Outcome::Succeeded { .. })),
            "{}: {:?}",
            s.run_id,
            s.result
        );
    }
    let mut runs: Vec<String> = tool.executions().iter().map(|e| e.run_id.clone()).collect();
    runs.sort();
    runs.dedup();
    assert_eq!(runs.len(), QUEUED, "every run's call ran");
    assert_eq!(tool.executions().len(), QUEUED, "each once in the parent");
    agentrt::testkit::assert_no_run_leased(&db.open());
}
