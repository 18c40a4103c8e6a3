//! Two real processes: a child executes a run on a file database and is killed with SIGKILL in
//! the middle of a tool call; the parent resumes the run.

use std::time::Duration;

use agentrt::{
    Config, Error, EventKind, Outcome, ResumeRun, RunId, StartRun,
    testkit::{RecordingTool, TempStore, assert_no_run_leased, resume_when_free, with_system},
};
use serde_json::json;

use crate::support::{child, provisioning, supervise};

const DB_VAR: &str = "AGENTRT_TEST_CHILD_DB";
const TTL: Duration = Duration::from_millis(500);

/// The child's side: runs `r1` until its tool is in flight, says so, and waits to be killed.
/// Only meaningful as a child process of the test below, hence ignored.
#[test]
#[ignore = "the child process of killed_process_lease_is_taken_over_after_its_ttl"]
fn child_process_runs_until_killed() {
    let (store, probe) = child::store_and_stuck_tool(DB_VAR);
    with_system(|| async move {
        let config = Config::default().lease_owner("child").lease_ttl(TTL);
        let sup = supervise(store.clone(), config, "a", provisioning(&probe));
        actix_rt::spawn(sup.send(StartRun::new("a", json!({})).with_id("r1")));
        probe.wait_executions(1).await;
        let lease =
            actix_rt::task::spawn_blocking(move || store.lease(&RunId::from("r1")).unwrap())
                .await
                .unwrap()
                .expect("leased");
        println!("READY {}", lease.owner);
        // Keep renewing until the parent kills this process.
        std::future::pending::<()>().await;
    });
}

#[test]
fn killed_process_lease_is_taken_over_after_its_ttl() {
    let db = TempStore::new();
    drop(db.open());
    let child_owner = child::killed_after(
        module_path!(),
        "child_process_runs_until_killed",
        DB_VAR,
        &db.location(),
        "READY ",
    );

    let tool = RecordingTool::new("provision").idempotent(true);
    let (store, parent_agent) = (db.open(), provisioning(&tool));
    let (refused, resumed) = with_system(|| async move {
        let config = Config::default().lease_owner("parent").lease_ttl(TTL);
        let sup = supervise(store, config, "a", parent_agent);
        let run_id = RunId::from("r1");
        let refused = sup.send(ResumeRun::new(run_id.clone())).await.unwrap();
        (
            refused,
            resume_when_free(&sup, &run_id, Duration::from_secs(10)).await,
        )
    });

    // The dead child's lease blocked the resume until its TTL passed.
    let err = refused.unwrap_err();
    assert!(
        matches!(&err, Error::RunLeased { owner, .. } if *owner == child_owner),
        "{err}"
    );
    assert_eq!(
        resumed.unwrap().outcome,
        Outcome::Succeeded {
            output: "provisioned".into()
        }
    );
    let store = db.open();
    let events = store.events(&RunId::from("r1")).unwrap();
    let taken = events
        .iter()
        .find(|e| e.kind == EventKind::LeaseTakenOver)
        .unwrap();
    assert_eq!(taken.payload["previous_owner"], json!(child_owner));
    assert!(child_owner.starts_with("child/"));
    let count = |kind| events.iter().filter(|e| e.kind == kind).count();
    assert_eq!(count(EventKind::StepInterrupted), 1);
    assert_eq!(count(EventKind::StepReconciled), 1);
    // The provisioning is idempotent and its outcome unknown: it ran again, with the same key.
    let executions = tool.executions();
    assert_eq!(executions.len(), 1);
    assert_eq!(
        (
            executions[0].attempt,
            executions[0].idempotency_key.as_str()
        ),
        (2, "r1/2")
    );
    assert_no_run_leased(&store);
}
