//! Recovery built into a supervisor: the runs a dead process left `RUNNING` are taken over by
//! a supervisor configured with `Config::recovery`, once their lease has expired, without a
//! `ResumeRun` from the application; runs of agents it does not know are left alone; two
//! recovering supervisors execute each run once; runs never executed fill the free slots while
//! takeovers wait for their turn.

use std::time::Duration;

use agentrt::{
    Agent, Config, EventKind, ModelResponse, Outcome, Reconciliation, Recovery, RunId, RunSettled,
    RunState, SpawnRun, Store, SubscribeRuns, Supervisor,
    testkit::{Behaviour, ReconcileHook, RecordingTool, ScriptedModel, TempStore, with_system},
};
use serde_json::json;

use settled::subscriber;

use crate::support::{idempotency_keys, pay_then_answer, settled, supervise};

/// Recovery passes that come often; leases that a loaded machine renews on time.
fn config() -> Config {
    Config::default()
        .lease_ttl(Duration::from_secs(2))
        .recovery(
            Recovery::default()
                .every(Duration::from_millis(100))
                .jitter(Duration::from_millis(20)),
        )
}

/// Spawns `runs` runs of each agent and tears the system down once every `pay` is in flight:
/// the runs are left RUNNING under a lease nobody renews.
fn leave_runs_in_flight(db: &TempStore, agents: &[(&str, usize)]) -> Vec<RunId> {
    let blocked = RecordingTool::new("pay").behaviour(Behaviour::Block);
    let store = db.open();
    let mut builder =
        Supervisor::builder(store).config(Config::default().lease_ttl(Duration::from_millis(600)));
    for (name, _) in agents {
        builder = builder.agent(*name, Agent::new(pay_then_answer()).tool(blocked.clone()));
    }
    let agents: Vec<(String, usize)> = agents.iter().map(|(n, k)| (n.to_string(), *k)).collect();
    with_system(|| async move {
        let supervisor = builder.start().unwrap();
        let mut ids = Vec::new();
        for (name, runs) in &agents {
            for _ in 0..*runs {
                let id = supervisor
                    .send(SpawnRun::new(name.clone(), json!({})))
                    .await
                    .unwrap()
                    .unwrap();
                ids.push(id);
            }
        }
        blocked.wait_executions(ids.len()).await;
        ids
    })
}

/// A tool that took effect before the crash: its hook says so.
fn applied_pay() -> RecordingTool {
    RecordingTool::new("pay").reconcile_hook(ReconcileHook::Answer(Reconciliation::Applied(
        json!({"charged": true}),
    )))
}

/// Runs recovering supervisors, one per entry of `supervisors` (the agents it registers),
/// until `done` holds of the settlements they heard together.
fn recover_until(
    db: &TempStore,
    supervisors: Vec<Vec<&'static str>>,
    pay: &RecordingTool,
    done: impl Fn(&[RunSettled]) -> bool + 'static,
) -> Vec<RunSettled> {
    let stores: Vec<Store> = supervisors.iter().map(|_| db.open()).collect();
    let pay = pay.clone();
    with_system(|| async move {
        let (inbox, mut rx) = subscriber();
        let mut running = Vec::new();
        for (store, names) in stores.into_iter().zip(supervisors) {
            let mut builder = Supervisor::builder(store).config(config());
            for name in names {
                builder = builder.agent(name, Agent::new(pay_then_answer()).tool(pay.clone()));
            }
            let supervisor = builder.start().unwrap();
            supervisor
                .send(SubscribeRuns(inbox.clone().recipient()))
                .await
                .unwrap();
            running.push(supervisor);
        }
        // Looked at on each settlement, and every 50 ms for a condition on the time too; a
        // recovery that never comes fails the test, rather than hang it.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let seen = rx.borrow_and_update().clone();
            if done(&seen) {
                return seen;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the runs were not recovered in time: {seen:?}"
            );
            let _ = actix_rt::time::timeout(Duration::from_millis(50), rx.changed()).await;
        }
    })
}

#[test]
fn a_recovering_supervisor_takes_over_the_runs_a_dead_process_left() {
    let db = TempStore::new();
    let ids = leave_runs_in_flight(&db, &[("billing", 3)]);
    let pay = applied_pay();

    let settled = recover_until(&db, vec![vec!["billing"]], &pay, |seen| seen.len() >= 3);

    assert_eq!(settled.len(), 3, "{settled:?}");
    for s in &settled {
        assert_eq!(
            s.result,
            Ok(Outcome::Succeeded {
                output: "paid".into()
            })
        );
    }
    assert!(
        pay.executions().is_empty(),
        "reconciled as applied, never run again"
    );
    let store = db.open();
    for id in &ids {
        assert_eq!(store.run(id).unwrap().state, RunState::Succeeded);
    }
    agentrt::testkit::assert_no_run_leased(&store);
}

#[test]
fn recovery_leaves_the_runs_of_agents_it_does_not_know() {
    let db = TempStore::new();
    let ids = leave_runs_in_flight(&db, &[("billing", 1), ("shipping", 1)]);
    let pay = applied_pay();

    let store = db.open();
    let shipping = &ids[1];
    let expiry = store.lease(shipping).unwrap().unwrap().expires_at;
    // The billing run's end proves that passes ran after the leases expired; a few more
    // passes (every 100 ms) run past the shipping lease's expiry before it is looked at.
    let settled = recover_until(&db, vec![vec!["billing"]], &pay, move |seen| {
        !seen.is_empty() && std::time::SystemTime::now() > expiry + Duration::from_millis(400)
    });

    assert_eq!(settled.len(), 1);
    assert_eq!(settled[0].run_id, ids[0]);
    assert_eq!(store.run(shipping).unwrap().state, RunState::Running);
    let kinds: Vec<EventKind> = store
        .events(shipping)
        .unwrap()
        .iter()
        .map(|e| e.kind)
        .collect();
    assert!(
        !kinds.contains(&EventKind::RunResumed),
        "nobody took the shipping run over: {kinds:?}"
    );
}

#[test]
fn two_recovering_supervisors_execute_each_run_once() {
    let db = TempStore::new();
    let ids = leave_runs_in_flight(&db, &[("billing", 6)]);
    // Not applied: each interrupted call is run again, once, by whichever supervisor won it.
    let pay =
        RecordingTool::new("pay").reconcile_hook(ReconcileHook::Answer(Reconciliation::NotApplied));

    let settled = recover_until(&db, vec![vec!["billing"], vec!["billing"]], &pay, |seen| {
        seen.len() >= 6
    });

    assert_eq!(settled.len(), 6, "each run settled once: {settled:?}");
    let mut keys = idempotency_keys(&pay);
    keys.sort();
    let before = keys.len();
    keys.dedup();
    assert_eq!(before, keys.len(), "a call ran twice: {keys:?}");
    assert_eq!(keys.len(), 6);
    let store = db.open();
    for id in &ids {
        assert_eq!(store.run(id).unwrap().state, RunState::Succeeded);
        let takeovers = store
            .events(id)
            .unwrap()
            .iter()
            .filter(|e| e.kind == EventKind::LeaseTakenOver)
            .count();
        assert_eq!(takeovers, 1, "run {id} was taken over once");
    }
}

#[test]
fn a_supervisor_nobody_holds_stops_and_recovers_nothing() {
    let db = TempStore::new();
    let ids = leave_runs_in_flight(&db, &[("billing", 1)]);
    let store = db.open();
    let expiry = store.lease(&ids[0]).unwrap().unwrap().expires_at;
    let pay = applied_pay();

    let (store_b, agent) = (db.open(), Agent::new(pay_then_answer()).tool(pay.clone()));
    with_system(|| async move {
        let supervisor = supervise(store_b, config(), "billing", agent);
        drop(supervisor);
        // Passes every 100 ms would have taken the run over by then.
        let after = expiry + Duration::from_millis(500);
        let wait = after
            .duration_since(std::time::SystemTime::now())
            .unwrap_or_default();
        actix_rt::time::sleep(wait).await;
    });

    assert_eq!(store.run(&ids[0]).unwrap().state, RunState::Running);
    let resumed = store
        .events(&ids[0])
        .unwrap()
        .iter()
        .any(|e| e.kind == EventKind::RunResumed);
    assert!(!resumed, "a dropped supervisor took the run over");
}

#[test]
fn runs_never_executed_are_recovered_while_takeovers_wait_for_their_turn() {
    let db = TempStore::new();
    // Three runs left mid-tool by a dead process: takeovers, one at a time, each of which
    // blocks in its tool again.
    let orphans = leave_runs_in_flight(&db, &[("pay", 3)]);
    // Their leases lapse first, so that the first pass finds them oldest of all.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while orphans.iter().any(|id| {
        db.open()
            .lease(id)
            .unwrap()
            .is_some_and(|lease| lease.expires_at > std::time::SystemTime::now())
    }) {
        assert!(
            std::time::Instant::now() < deadline,
            "the leases never lapsed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Five forks nobody executed, newer than the takeovers: they need only a slot.
    let store = db.open();
    let quick = || Agent::new(ScriptedModel::new(vec![ModelResponse::answer("ok")]));
    let origin = store.clone();
    with_system(|| async move {
        let supervisor = supervise(origin, Config::default(), "quick", quick());
        supervisor
            .send(agentrt::StartRun::new("quick", json!({})).with_id("origin"))
            .await
            .unwrap()
            .unwrap();
    });
    let forks: Vec<RunId> = (0..5)
        .map(|n| {
            store
                .fork(
                    &RunId::from("origin"),
                    1,
                    Some(RunId::from(format!("fork-{n}"))),
                )
                .unwrap()
        })
        .collect();

    let pay = RecordingTool::new("pay")
        .idempotent(true)
        .behaviour(Behaviour::Block);
    let (store, probe) = (db.open(), pay.clone());
    let settled = with_system(|| async move {
        let (inbox, mut rx) = subscriber();
        // Three slots, one takeover at a time, and no second pass from the timer: the
        // forks get the other slots at once, then each slot their ends free.
        let config = Config::default()
            .lease_ttl(Duration::from_secs(2))
            .max_concurrent_runs(3)
            .recovery(
                Recovery::default()
                    .every(Duration::from_secs(3600))
                    .concurrency(1)
                    .jitter(Duration::ZERO),
            );
        let supervisor = Supervisor::builder(store)
            .config(config)
            .agent("pay", Agent::new(pay_then_answer()).tool(probe))
            .agent("quick", quick())
            .start()
            .unwrap();
        supervisor
            .send(SubscribeRuns(inbox.recipient()))
            .await
            .unwrap();
        settled::heard(&mut rx, 5).await
    });
    let mut done: Vec<&str> = settled
        .iter()
        .filter(|s| matches!(s.result, Ok(Outcome::Succeeded { .. })))
        .map(|s| s.run_id.as_str())
        .collect();
    done.sort();
    let expected: Vec<&str> = forks.iter().map(RunId::as_str).collect();
    assert_eq!(done, expected, "{settled:?}");
    assert!(pay.executions().len() <= 1, "one takeover at a time");
}
