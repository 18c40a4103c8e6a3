//! A drain within one process: two supervisors over one store, the first told to drain. What
//! it refuses, what it hands over, what its deadline cancels, and the model call it abandons.

use std::time::Duration;

use agentrt::{
    Agent, Config, Drain, Error, EventKind, ModelResponse, Outcome, Recovery, RunId, RunState,
    SpawnRun, StartRun, Supervisor,
    testkit::{Behaviour, RecordingTool, ScriptedModel, TempStore, with_system},
};
use serde_json::json;

use crate::support::{
    kinds_of, provisioning,
    settled::{self, subscribed},
    spawn,
};

/// A supervisor that recovers, with a period far past the test: only the feed makes it prompt.
fn heir(store: agentrt::Store, agent: Agent) -> actix::Addr<Supervisor> {
    let config = Config::default()
        .lease_owner("heir")
        .lease_ttl(Duration::from_secs(60))
        .recovery(Recovery::default().every(Duration::from_secs(3600)));
    Supervisor::builder(store)
        .config(config)
        .agent("provision", agent)
        .start()
        .unwrap()
}

fn draining(store: agentrt::Store, agent: Agent) -> actix::Addr<Supervisor> {
    let config = Config::default()
        .lease_owner("old")
        .lease_ttl(Duration::from_secs(60));
    Supervisor::builder(store)
        .config(config)
        .agent("provision", agent)
        .start()
        .unwrap()
}

#[test]
fn past_the_deadline_a_tool_is_cancelled_its_outcome_recorded_and_the_run_handed_over() {
    let db = TempStore::new();
    // Blocks until its cancellation fires, then fails: a tool that honours the signal.
    let tool = RecordingTool::new("provision").behaviour(Behaviour::Block);
    let (old_store, heir_store) = (db.open(), db.open());
    let (old_agent, heir_agent) = (provisioning(&tool), provisioning(&tool));
    let probe = tool.clone();
    let (report, settled) = with_system(|| async move {
        let heir = heir(heir_store, heir_agent);
        let (_inbox, mut rx) = subscribed(&heir).await;
        let old = draining(old_store, old_agent);
        spawn(&old, "provision", "r1").await;
        probe.wait_executions(1).await;
        let drain = Drain::within(Duration::from_millis(100)).grace(Duration::from_secs(30));
        let report = old.send(drain).await.unwrap();
        (report, settled::heard(&mut rx, 1).await)
    });
    assert_eq!(report.handed_over, [RunId::from("r1")]);
    assert!(report.is_clean(), "{report:?}");
    assert!(matches!(settled[0].result, Ok(Outcome::Succeeded { .. })));
    let store = db.open();
    let kinds = kinds_of(&store, &RunId::from("r1"));
    for absent in [EventKind::StepInterrupted, EventKind::StepReconciled] {
        assert!(!kinds.contains(&absent), "{kinds:?}");
    }
    assert!(kinds.contains(&EventKind::RunHandedOver), "{kinds:?}");
    // The cancelled call's outcome is what the tool returned, and the model saw it.
    let events = store.events(&RunId::from("r1")).unwrap();
    let finished: Vec<_> = events
        .iter()
        .filter(|e| e.kind == EventKind::ToolFinished)
        .collect();
    assert_eq!(finished.len(), 1);
    assert!(
        finished[0].payload["error"].is_string(),
        "{}",
        finished[0].payload
    );
    assert_eq!(tool.executions().len(), 1, "the call was not made again");
}

#[test]
fn a_draining_supervisor_refuses_starts_and_resumes_and_writes_nothing() {
    let db = TempStore::new();
    let store = db.open();
    let tool = RecordingTool::new("provision");
    let agent = provisioning(&tool);
    let (report, start, spawned, resume) = with_system(|| async move {
        let old = draining(store, agent);
        let report = old.send(Drain::default()).await.unwrap();
        let start = old
            .send(StartRun::new("provision", json!({})).with_id("s"))
            .await
            .unwrap();
        let spawned = old
            .send(SpawnRun::new("provision", json!({})).with_id("p"))
            .await
            .unwrap();
        let resume = old.send(agentrt::ResumeRun::new("s")).await.unwrap();
        (report, start, spawned, resume)
    });
    assert_eq!(report, agentrt::DrainReport::default(), "nothing ran");
    assert!(matches!(start, Err(Error::Draining)), "{start:?}");
    assert!(matches!(spawned, Err(Error::Draining)), "{spawned:?}");
    assert!(matches!(resume, Err(Error::Draining)), "{resume:?}");
    assert!(db.open().runs(None).unwrap().is_empty());
}

#[test]
fn a_model_call_in_flight_is_abandoned_and_asked_again_by_the_next_owner() {
    let db = TempStore::new();
    // The old owner's model never answers; the heir's answers at once.
    let blocked = ScriptedModel::new(vec![ModelResponse::answer("never")]).block_at_turn(0);
    let slow = Agent::new(blocked.clone());
    let quick = Agent::new(ScriptedModel::new(vec![ModelResponse::answer("done")]));
    let (old_store, heir_store) = (db.open(), db.open());
    let (report, settled) = with_system(|| async move {
        let heir = heir(heir_store, quick);
        let (_inbox, mut rx) = subscribed(&heir).await;
        let old = draining(old_store, slow);
        spawn(&old, "provision", "m1").await;
        blocked.wait_calls(1).await;
        let report = old.send(Drain::default()).await.unwrap();
        (report, settled::heard(&mut rx, 1).await)
    });
    assert_eq!(report.handed_over, [RunId::from("m1")]);
    assert!(matches!(&settled[0].result, Ok(Outcome::Succeeded { output }) if output == "done"));
    let store = db.open();
    assert_eq!(
        store.run(&RunId::from("m1")).unwrap().state,
        RunState::Succeeded
    );
    let events = store.events(&RunId::from("m1")).unwrap();
    let released = events
        .iter()
        .find(|e| e.kind == EventKind::RunReleased)
        .unwrap();
    assert_eq!(
        released.payload["abandoned"],
        json!({"step": 1, "attempt": 1})
    );
    let attempts: Vec<_> = events
        .iter()
        .filter(|e| e.kind == EventKind::ModelStarted)
        .map(|e| e.payload["attempt"].clone())
        .collect();
    // The abandoned attempt is not counted: the next owner makes it again.
    assert_eq!(attempts, [json!(1), json!(1)]);
    let kinds = kinds_of(&store, &RunId::from("m1"));
    assert!(!kinds.contains(&EventKind::StepInterrupted), "{kinds:?}");
}
