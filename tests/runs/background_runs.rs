//! Runs started without waiting: `SpawnRun` answers with the run's id once the run is durable,
//! the supervisor drives it, and every call's end reaches the `SubscribeRuns` subscribers;
//! `DecideAndResume` records a decision and resumes in one message.

use std::time::Duration;

use agentrt::{
    Agent, Approval, Config, DecideAndResume, Error, Outcome, RequireApprovalFor, RunId,
    RunSettled, RunState, SpawnRun, StartRun,
    testkit::{Behaviour, RecordingTool, TempStore, resume_when_free, with_system},
};
use serde_json::json;

use settled::{Heard, heard, subscribed};

use crate::support::{pay_then_answer, settled, supervise};

#[test]
fn a_spawned_run_answers_with_its_id_once_durable_and_its_end_reaches_the_subscribers() {
    let db = TempStore::new();
    let pay = RecordingTool::new("pay").behaviour(Behaviour::Block);
    let agent = Agent::new(pay_then_answer()).tool(pay.clone());
    let (store, reader) = (db.open(), db.open());

    let (at_answer, settled) = with_system(|| async move {
        let supervisor = supervise(store, Config::default(), "billing", agent);
        let (_recipient, mut rx) = subscribed(&supervisor).await;
        let run_id = supervisor
            .send(SpawnRun::new("billing", json!({"order": 7})).with_id("run-1"))
            .await
            .unwrap()
            .unwrap();
        // Answered before the run ended: its tool waits for a release.
        let at_answer = reader.run(&run_id).unwrap().state;
        pay.wait_executions(1).await;
        pay.release();
        (at_answer, heard(&mut rx, 1).await)
    });

    assert_eq!(
        at_answer,
        RunState::Running,
        "the run is in the store when answered"
    );
    assert_eq!(
        settled,
        [RunSettled {
            run_id: RunId::from("run-1"),
            result: Ok(Outcome::Succeeded {
                output: "paid".into()
            }),
        }]
    );
    assert_eq!(
        db.open().run(&RunId::from("run-1")).unwrap().state,
        RunState::Succeeded
    );
}

#[test]
fn a_spawn_that_cannot_start_answers_why_and_nothing_settles() {
    let db = TempStore::new();
    let agent = Agent::new(pay_then_answer()).tool(RecordingTool::new("pay"));
    let store = db.open();

    let (unknown, taken, settled) = with_system(|| async move {
        let supervisor = supervise(store, Config::default(), "billing", agent);
        let (recipient, _) = subscribed(&supervisor).await;
        let unknown = supervisor
            .send(SpawnRun::new("nobody", json!({})))
            .await
            .unwrap();
        supervisor
            .send(StartRun::new("billing", json!({})).with_id("run-1"))
            .await
            .unwrap()
            .unwrap();
        let taken = supervisor
            .send(SpawnRun::new("billing", json!({})).with_id("run-1"))
            .await
            .unwrap();
        // Any settlement of these calls was sent before they answered.
        let settled = recipient.send(Heard).await.unwrap();
        (unknown, taken, settled)
    });

    assert!(matches!(unknown, Err(Error::UnknownAgent(name)) if name == "nobody"));
    assert!(matches!(taken, Err(Error::RunExists(id)) if id == RunId::from("run-1")));
    assert_eq!(settled.len(), 1, "{settled:?}");
    assert!(matches!(settled[0].result, Ok(Outcome::Succeeded { .. })));
}

#[test]
fn decide_and_resume_records_the_decision_and_resumes_in_one_message() {
    let db = TempStore::new();
    let pay = RecordingTool::new("pay");
    let agent = Agent::new(pay_then_answer())
        .tool(pay.clone())
        .policy(RequireApprovalFor::tools(["pay"]));
    let store = db.open();

    let (resumed, settled) = with_system(|| async move {
        let supervisor = supervise(store, Config::default(), "billing", agent);
        let (_recipient, mut rx) = subscribed(&supervisor).await;
        let run_id = supervisor
            .send(SpawnRun::new("billing", json!({})))
            .await
            .unwrap()
            .unwrap();
        let waiting = heard(&mut rx, 1).await;
        assert!(matches!(
            waiting[0].result,
            Ok(Outcome::WaitingForApproval { .. })
        ));
        let approval = Approval::approve(run_id, "pay-1", "alice").note("checked");
        let resumed = supervisor
            .send(DecideAndResume(approval))
            .await
            .unwrap()
            .unwrap();
        (resumed, heard(&mut rx, 2).await)
    });

    assert_eq!(
        resumed.outcome,
        Outcome::Succeeded {
            output: "paid".into()
        }
    );
    assert_eq!(pay.executions().len(), 1);
    assert_eq!(settled[1].result, Ok(resumed.outcome.clone()));
    let events = db.open().events(&resumed.run_id).unwrap();
    let decided = events
        .iter()
        .find(|e| e.kind == agentrt::EventKind::ApprovalRecorded)
        .unwrap();
    assert_eq!(decided.payload["decided_by"], json!("alice"));
}

#[test]
fn a_decision_refused_by_decide_and_resume_resumes_nothing() {
    let db = TempStore::new();
    let agent = Agent::new(pay_then_answer()).tool(RecordingTool::new("pay"));
    let store = db.open();

    let refused = with_system(|| async move {
        let supervisor = supervise(store, Config::default(), "billing", agent);
        supervisor
            .send(StartRun::new("billing", json!({})).with_id("run-1"))
            .await
            .unwrap()
            .unwrap();
        supervisor
            .send(DecideAndResume(Approval::approve(
                "run-1", "pay-1", "alice",
            )))
            .await
            .unwrap()
    });

    // The run finished: nothing waits for a decision.
    let err = refused.unwrap_err();
    assert!(err.is_run_state(), "{err}");
}

#[test]
fn a_spawned_run_survives_a_crash_of_its_supervisor() {
    let db = TempStore::new();
    let pay = RecordingTool::new("pay").behaviour(Behaviour::Block);
    let (store, agent, config, blocked) = (
        db.open(),
        Agent::new(pay_then_answer()).tool(pay.clone()),
        Config::default().lease_ttl(Duration::from_millis(600)),
        pay.clone(),
    );
    let run_id = with_system(|| async move {
        let supervisor = supervise(store, config, "billing", agent);
        let run_id = supervisor
            .send(SpawnRun::new("billing", json!({})))
            .await
            .unwrap()
            .unwrap();
        // The system goes away with the tool in flight.
        blocked.wait_executions(1).await;
        run_id
    });

    let done = RecordingTool::new("pay").reconcile_hook(agentrt::testkit::ReconcileHook::Answer(
        agentrt::Reconciliation::Applied(json!({"charged": true})),
    ));
    let (store, agent, id) = (
        db.open(),
        Agent::new(pay_then_answer()).tool(done.clone()),
        run_id.clone(),
    );
    // The crashed system's short lease is what the takeover waits for; the run's new owner
    // holds a long one, so that a loaded machine's late renewal cannot end its lease.
    let long = Config::default().lease_ttl(Duration::from_secs(30));
    let reply = with_system(|| async move {
        let supervisor = supervise(store, long, "billing", agent);
        resume_when_free(&supervisor, &id, Duration::from_secs(10)).await
    })
    .unwrap();

    assert_eq!(
        reply.outcome,
        Outcome::Succeeded {
            output: "paid".into()
        }
    );
    assert!(
        done.executions().is_empty(),
        "reconciled as applied, not run again"
    );
}
