//! The run lease: one live executor per run. TTLs of a few hundred milliseconds; every wait is
//! on a condition (an event, a lease's stored expiry), never on a guessed duration.

use std::{
    sync::mpsc,
    time::{Duration, SystemTime},
};

use actix::Addr;
use agentrt::{
    Agent, Approval, CancelRun, Config, Error, EventKind, Lease, LeaseLostReason, ModelResponse,
    Outcome, RecordApproval, RequireApprovalFor, ResumeRun, RunId, RunReply, RunState, StartRun,
    Store, SubscribeLeaseLost, Supervisor, ToolCall,
    testkit::{
        Behaviour, CountingClock, HeldLeases, LeaseLostLog, ReconcileHook, RecordingTool,
        ScriptedModel, TempStore, assert_no_run_leased, resume_when_free, with_system,
    },
};
use serde_json::json;

use crate::support::{PATIENCE, fast_lease, supervise};

const TTL: Duration = Duration::from_millis(300);

/// The model asks for `first`, then `second`, then answers.
fn two_calls(first: &str, second: &str) -> ScriptedModel {
    ScriptedModel::new(vec![
        ModelResponse::calls(vec![
            ToolCall::new("c1", first, json!({})),
            ToolCall::new("c2", second, json!({})),
        ]),
        ModelResponse::answer("done"),
    ])
}

/// Reads a run's lease through another handle, off the actix thread.
async fn lease_of(location: String, run_id: &str) -> Option<Lease> {
    let run_id = RunId::from(run_id);
    actix_rt::task::spawn_blocking(move || {
        Store::connect(&location).unwrap().lease(&run_id).unwrap()
    })
    .await
    .unwrap()
}

/// Reads a run's events through another handle, off the actix thread.
async fn events_of(location: String, run_id: &str) -> Vec<agentrt::Event> {
    let run_id = RunId::from(run_id);
    actix_rt::task::spawn_blocking(move || {
        Store::connect(&location).unwrap().events(&run_id).unwrap()
    })
    .await
    .unwrap()
}

/// Waits until the stored lease of `run_id` was renewed past its first expiry: proof that the
/// heartbeat runs.
async fn wait_renewed_past_first_expiry(location: String, run_id: &str) -> Lease {
    let first = lease_of(location.clone(), run_id).await.expect("leased");
    let deadline = SystemTime::now() + PATIENCE;
    loop {
        let now = lease_of(location.clone(), run_id)
            .await
            .expect("still leased");
        if SystemTime::now() > first.expires_at && now.expires_at > SystemTime::now() {
            assert_eq!(now.owner, first.owner);
            return now;
        }
        assert!(SystemTime::now() < deadline, "the lease was not renewed");
        actix_rt::time::sleep(TTL / 10).await;
    }
}

/// Starts run `r1` on `sup`, waits until `tool` is executing, then blocks renewals (every write
/// to `db`, as a busy writer elsewhere would) until the supervisor reports the lease lost by
/// expiry. Returns the pending call.
async fn start_and_let_the_lease_lapse(
    sup: &Addr<Supervisor>,
    db: &TempStore,
    tool: &RecordingTool,
) -> (
    tokio::task::JoinHandle<agentrt::Result<RunReply>>,
    LeaseLostLog,
) {
    let log = LeaseLostLog::new();
    sup.send(SubscribeLeaseLost(log.recipient())).await.unwrap();
    let call = sup.send(StartRun::new("a", json!({})).with_id("r1"));
    let call = actix_rt::spawn(async move { call.await.unwrap() });
    tool.wait_executions(1).await;
    let lock = db.block_writes();
    log.wait_for(1).await;
    drop(lock);
    let lost = &log.seen()[0];
    assert_eq!(lost.run_id, RunId::from("r1"));
    assert_eq!(lost.reason, LeaseLostReason::Expired);
    (call, log)
}

#[test]
fn heartbeat_renews_while_a_call_runs_and_stops_on_return_and_on_panic() {
    let db = TempStore::new();
    let slow = RecordingTool::new("slow").behaviour(Behaviour::BlockIgnoringCancel);
    let boom = RecordingTool::new("boom").behaviour(Behaviour::Panic);
    let model = two_calls("slow", "boom");
    let (store, location, probe) = (db.open(), db.location(), slow.clone());
    let agent = Agent::new(model).tool(slow.clone()).tool(boom);
    let (result, held) = with_system(|| async move {
        let sup = supervise(store, fast_lease(), "a", agent);
        let call = sup.send(StartRun::new("a", json!({})).with_id("r1"));
        let call = actix_rt::spawn(async move { call.await.unwrap() });
        probe.wait_executions(1).await;
        wait_renewed_past_first_expiry(location, "r1").await;
        assert_eq!(sup.send(HeldLeases).await.unwrap(), [RunId::from("r1")]);
        probe.release();
        let result = call.await.unwrap();
        (result, sup.send(HeldLeases).await.unwrap())
    });

    // The second tool panicked: the call returned an error, and the heartbeat stopped with it.
    assert!(
        matches!(result, Err(Error::Panicked { step: 3, .. })),
        "{result:?}"
    );
    assert!(held.is_empty(), "{held:?}");
    let store = db.open();
    assert_eq!(
        store.lease(&RunId::from("r1")).unwrap(),
        None,
        "released on return"
    );
    assert_eq!(
        store.run(&RunId::from("r1")).unwrap().state,
        RunState::Running
    );

    // A call that returns normally releases the lease in its last move.
    let model = ScriptedModel::new(vec![ModelResponse::answer("hi")]);
    let store = db.open();
    let held = with_system(|| async move {
        let sup = supervise(store, fast_lease(), "a", Agent::new(model));
        sup.send(StartRun::new("a", json!({})).with_id("r2"))
            .await
            .unwrap()
            .unwrap();
        sup.send(HeldLeases).await.unwrap()
    });
    assert!(held.is_empty());
    assert_eq!(db.open().lease(&RunId::from("r2")).unwrap(), None);
}

#[test]
fn a_run_resumed_after_an_approval_has_its_lease_renewed() {
    let db = TempStore::new();
    let slow = RecordingTool::new("slow").behaviour(Behaviour::BlockIgnoringCancel);
    let model = ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new("c1", "slow", json!({}))]),
        ModelResponse::answer("done"),
    ]);
    let agent = Agent::new(model)
        .tool(slow.clone())
        .policy(RequireApprovalFor::tools(["slow"]));
    let (store, location, probe) = (db.open(), db.location(), slow.clone());
    let (outcome, held) = with_system(|| async move {
        let sup = supervise(store, fast_lease(), "a", agent);
        let first = sup.send(StartRun::new("a", json!({})).with_id("r1"));
        let first = first.await.unwrap().unwrap();
        assert!(
            matches!(first.outcome, Outcome::WaitingForApproval { .. }),
            "{first:?}"
        );
        let approval = Approval::approve(RunId::from("r1"), "c1", "alice");
        sup.send(RecordApproval(approval)).await.unwrap().unwrap();
        let call = sup.send(ResumeRun::new("r1"));
        let call = actix_rt::spawn(async move { call.await.unwrap() });
        probe.wait_executions(1).await;
        // The tool runs past the expiry the resume stamped: only renewals keep the run.
        wait_renewed_past_first_expiry(location, "r1").await;
        let held = sup.send(HeldLeases).await.unwrap();
        probe.release();
        (call.await.unwrap(), held)
    });

    assert_eq!(held, [RunId::from("r1")]);
    assert_eq!(
        outcome.unwrap().outcome,
        Outcome::Succeeded {
            output: "done".into()
        }
    );
    assert_eq!(slow.executions().len(), 1);
    assert_no_run_leased(&db.open());
}

#[test]
fn a_consumer_holding_the_store_connection_does_not_starve_the_heartbeat() {
    // An SQLite file on either pass: the consumer's connection is the SQLite backend's.
    let db = TempStore::sqlite();
    let slow = RecordingTool::new("slow").behaviour(Behaviour::BlockIgnoringCancel);
    let model = two_calls("slow", "slow");
    let consumer_store = db.open();
    let (store, other, location, probe) = (db.open(), db.open(), db.location(), slow.clone());
    let agent = Agent::new(model).tool(slow.clone());
    let other_agent = Agent::new(two_calls("slow", "slow")).tool(slow.clone());
    let outcome = with_system(|| async move {
        let sup = supervise(store, fast_lease(), "a", agent);
        let call = sup.send(StartRun::new("a", json!({})).with_id("r1"));
        let call = actix_rt::spawn(async move { call.await.unwrap() });
        probe.wait_executions(1).await;

        // The consumer opens a transaction on the store's connection and leaves rows unread.
        let (held_tx, held_rx) = mpsc::channel();
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let consumer = std::thread::spawn(move || {
            let conn = agentrt::sqlite::Sqlite::of(&consumer_store)
                .unwrap()
                .connection()
                .unwrap();
            conn.execute_batch("BEGIN").unwrap();
            let mut stmt = conn.prepare("SELECT seq FROM events").unwrap();
            let mut rows = stmt.query([]).unwrap();
            rows.next().unwrap().expect("a row");
            held_tx.send(()).unwrap();
            done_rx.recv().unwrap();
        });
        actix_rt::task::spawn_blocking(move || held_rx.recv().unwrap())
            .await
            .unwrap();

        // Renewals go on past the first expiry, and another supervisor cannot take the run.
        let lease = wait_renewed_past_first_expiry(location, "r1").await;
        let rival = supervise(other, fast_lease(), "a", other_agent);
        let refused = rival.send(ResumeRun::new("r1")).await.unwrap().unwrap_err();
        assert!(
            matches!(&refused, Error::RunLeased { owner, .. } if *owner == lease.owner),
            "{refused}"
        );

        done_tx.send(()).unwrap();
        consumer.join().unwrap();
        probe.release();
        probe.release();
        call.await.unwrap()
    });
    assert_eq!(
        outcome.unwrap().outcome,
        Outcome::Succeeded {
            output: "done".into()
        }
    );
    assert_eq!(slow.executions().len(), 2, "each call ran once");
}

#[test]
fn a_lapsed_lease_starts_no_side_effect() {
    let db = TempStore::new();
    let first = RecordingTool::new("first").behaviour(Behaviour::Block);
    let second = RecordingTool::new("second");
    let agent = Agent::new(two_calls("first", "second"))
        .tool(first.clone())
        .tool(second.clone());
    let (store, db_ref, probe) = (db.open(), &db, first.clone());
    let result = with_system(|| async move {
        let sup = supervise(store, fast_lease(), "a", agent);
        // Nobody takes the run: the lease only lapses, and the loop stalls past its expiry.
        let (call, _) = start_and_let_the_lease_lapse(&sup, db_ref, &probe).await;
        call.await.unwrap()
    });

    assert!(
        matches!(
            &result,
            Err(Error::LeaseLost {
                reason: LeaseLostReason::Expired,
                ..
            })
        ),
        "{result:?}"
    );
    assert!(
        second.executions().is_empty(),
        "no tool started after the lease lapsed"
    );
    let store = db.open();
    let run_id = RunId::from("r1");
    let events = store.events(&run_id).unwrap();
    assert_eq!(
        events
            .iter()
            .filter(|e| e.kind == EventKind::ToolStarted)
            .count(),
        1
    );
    // The running tool was told (its signal fired) and, nobody having taken the run, its
    // outcome was recorded.
    let finished = events
        .iter()
        .find(|e| e.kind == EventKind::ToolFinished)
        .unwrap();
    assert!(
        finished.payload["error"]
            .as_str()
            .unwrap()
            .contains("cancellation signal")
    );
    assert_eq!(store.run(&run_id).unwrap().state, RunState::Running);
    assert_eq!(
        store.lease(&run_id).unwrap(),
        None,
        "released when the call returned"
    );
}

#[test]
fn no_model_call_after_the_lease_is_lost() {
    let db = TempStore::new();
    let tool = RecordingTool::new("first").behaviour(Behaviour::Block);
    let model = ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new("c1", "first", json!({}))]),
        ModelResponse::answer("done"),
    ]);
    let agent = Agent::new(model.clone()).tool(tool.clone());
    let (store, db_ref, probe) = (db.open(), &db, tool.clone());
    let result = with_system(|| async move {
        let sup = supervise(store, fast_lease(), "a", agent);
        let (call, _) = start_and_let_the_lease_lapse(&sup, db_ref, &probe).await;
        call.await.unwrap()
    });

    assert!(
        matches!(&result, Err(Error::LeaseLost { .. })),
        "{result:?}"
    );
    assert_eq!(
        model.calls(),
        1,
        "the second model call was never dispatched"
    );
    let events = db.open().events(&RunId::from("r1")).unwrap();
    assert_eq!(
        events
            .iter()
            .filter(|e| e.kind == EventKind::ModelStarted)
            .count(),
        1
    );
}

/// What happened when supervisor A's lease lapsed mid-charge and supervisor B took the run
/// over while A's charge still ran.
/// An agent whose model asks for `charge`, then `notify`, then answers.
fn charge_then_notify(charge: &RecordingTool, notify: &RecordingTool) -> Agent {
    Agent::new(two_calls("charge", "notify"))
        .tool(charge.clone())
        .tool(notify.clone())
}

struct Takeover {
    first: agentrt::Result<RunReply>,
    second: agentrt::Result<RunReply>,
    owner_a: String,
    /// What the first supervisor's subscriber was told.
    told: Vec<agentrt::LeaseLost>,
    charge: RecordingTool,
    notify: RecordingTool,
    db: TempStore,
}

fn lapse_then_take_over() -> Takeover {
    let db = TempStore::new();
    // The charge cannot be recalled once begun; its hook asks the (shared) side-effect log.
    let charge = RecordingTool::new("charge")
        .behaviour(Behaviour::BlockIgnoringCancel)
        .reconcile_hook(ReconcileHook::FromLog);
    let notify = RecordingTool::new("notify");
    let (store_a, store_b, db_ref, probe) = (db.open(), db.open(), &db, charge.clone());
    let (agent_a, agent_b) = (
        charge_then_notify(&charge, &notify),
        charge_then_notify(&charge, &notify),
    );
    let (first, second, owner_a) = with_system(|| async move {
        let a = supervise(store_a, fast_lease(), "a", agent_a);
        let (call_a, log) = start_and_let_the_lease_lapse(&a, db_ref, &probe).await;
        let owner_a = lease_of(db_ref.location(), "r1")
            .await
            .expect("stale, not released")
            .owner;

        // Another supervisor takes the run over while the first one's charge still runs.
        let b = supervise(store_b, fast_lease(), "a", agent_b);
        let second = resume_when_free(&b, &RunId::from("r1"), PATIENCE).await;

        // The first loop's charge returns only now.
        probe.release();
        (call_a.await.unwrap(), second, (owner_a, log.seen()))
    });
    let (owner_a, told) = owner_a;
    Takeover {
        first,
        second,
        owner_a,
        told,
        charge,
        notify,
        db,
    }
}

#[test]
fn a_loop_that_loses_its_lease_stops_before_its_next_tool_call() {
    let Takeover {
        first,
        second,
        notify,
        told,
        ..
    } = lapse_then_take_over();
    assert!(
        matches!(&first, Err(Error::LeaseLost { .. })),
        "the first call lost its lease: {first:?}"
    );
    // The subscriber and the call are told the same reason, once.
    assert_eq!(told.len(), 1, "{told:?}");
    assert!(
        matches!(&first, Err(Error::LeaseLost { reason, .. }) if *reason == told[0].reason),
        "{first:?} against {told:?}"
    );
    assert_eq!(
        second.unwrap().outcome,
        Outcome::Succeeded {
            output: "done".into()
        }
    );
    let executions = notify.executions();
    assert_eq!(executions.len(), 1, "notify ran once, under the new owner");
}

#[test]
fn an_expired_lease_is_taken_over_and_reconciled_once() {
    let Takeover {
        owner_a,
        charge,
        db,
        ..
    } = lapse_then_take_over();
    assert_eq!(charge.executions().len(), 1, "the charge ran once");
    let store = db.open();
    let events = store.events(&RunId::from("r1")).unwrap();
    let of = |kind: EventKind, step: u32| {
        events
            .iter()
            .filter(|e| e.kind == kind && e.step == Some(step))
            .count()
    };
    assert_eq!(of(EventKind::ToolStarted, 2), 1);
    assert_eq!(of(EventKind::StepInterrupted, 2), 1);
    assert_eq!(of(EventKind::StepReconciled, 2), 1);
    let finished: Vec<_> = events
        .iter()
        .filter(|e| e.kind == EventKind::ToolFinished && e.step == Some(2))
        .collect();
    assert_eq!(
        finished.len(),
        1,
        "the first owner's late outcome was not written"
    );
    assert_eq!(finished[0].payload["reconciled"], json!(true));
    let taken = events
        .iter()
        .find(|e| e.kind == EventKind::LeaseTakenOver)
        .unwrap();
    assert_eq!(taken.payload["previous_owner"], json!(owner_a));
    assert_ne!(taken.payload["new_owner"], json!(owner_a));
    assert_no_run_leased(&store);
}

#[test]
fn a_call_that_returns_with_an_error_releases_its_lease() {
    let db = TempStore::new();
    let boom = RecordingTool::new("boom").behaviour(Behaviour::Panic);
    let agent = || {
        let model = ScriptedModel::new(vec![ModelResponse::calls(vec![ToolCall::new(
            "c1",
            "boom",
            json!({}),
        )])]);
        Agent::new(model).tool(boom.clone())
    };
    let (store, other, location) = (db.open(), db.open(), db.location());
    let (agent_a, agent_b) = (agent(), agent());
    // The default TTL (30 s): had the lease not been released, the resume below would be
    // refused with RunLeased for that long.
    let (failed, lease_after, resumed) = with_system(|| async move {
        let a = supervise(store, Config::default(), "a", agent_a);
        let failed = a
            .send(StartRun::new("a", json!({})).with_id("r1"))
            .await
            .unwrap();
        let lease_after = lease_of(location, "r1").await;
        let b = supervise(other, Config::default(), "a", agent_b);
        (
            failed,
            lease_after,
            b.send(ResumeRun::new("r1")).await.unwrap(),
        )
    });
    assert!(matches!(failed, Err(Error::Panicked { .. })), "{failed:?}");
    assert_eq!(lease_after, None);
    // Taken over at once; the panicked call is reconciled (no hook, not idempotent: a person
    // decides).
    let resumed = resumed.unwrap();
    assert!(
        matches!(resumed.outcome, Outcome::WaitingForApproval { .. }),
        "{resumed:?}"
    );
}

#[test]
fn a_resume_of_a_run_this_supervisor_executes_is_refused_naming_its_own_owner_and_a_start_as_existing()
 {
    let db = TempStore::new();
    let slow = RecordingTool::new("slow").behaviour(Behaviour::BlockIgnoringCancel);
    let agent = Agent::new(two_calls("slow", "slow")).tool(slow.clone());
    let (store, location, probe) = (db.open(), db.location(), slow.clone());
    let (resumed, started, lease, events_during, events_after) = with_system(|| async move {
        let sup = supervise(store, fast_lease(), "a", agent);
        let call = sup.send(StartRun::new("a", json!({})).with_id("r1"));
        let call = actix_rt::spawn(async move { call.await.unwrap() });
        probe.wait_executions(1).await;
        let lease = lease_of(location.clone(), "r1").await.unwrap();
        let events_during = events_of(location.clone(), "r1").await.len();
        let resumed = sup.send(ResumeRun::new("r1")).await.unwrap();
        let started = sup
            .send(StartRun::new("a", json!({})).with_id("r1"))
            .await
            .unwrap();
        let events_after = events_of(location.clone(), "r1").await.len();
        probe.release();
        probe.release();
        call.await.unwrap().unwrap();
        (resumed, started, lease, events_during, events_after)
    });
    let err = resumed.unwrap_err();
    assert!(err.is_run_state(), "{err}");
    assert!(
        matches!(&err, Error::RunLeased { owner, .. } if *owner == lease.owner),
        "{err}"
    );
    // A start is told the run exists: a retry cannot change that.
    let err = started.unwrap_err();
    assert!(err.is_run_state(), "{err}");
    assert!(
        matches!(&err, Error::RunExists(id) if id.as_str() == "r1"),
        "{err}"
    );
    assert_eq!(events_during, events_after, "nothing was written");
    assert_eq!(slow.executions().len(), 2);
}

#[test]
fn a_live_lease_of_another_supervisor_is_refused_without_reading_the_clock_or_writing() {
    let db = TempStore::new();
    let slow = RecordingTool::new("slow").behaviour(Behaviour::BlockIgnoringCancel);
    let agent = || Agent::new(two_calls("slow", "slow")).tool(slow.clone());
    let (store_a, store_b, location, probe) = (db.open(), db.open(), db.location(), slow.clone());
    let (agent_a, agent_b) = (agent(), agent());
    let clock = CountingClock::default();
    let clock_b = clock.clone();
    let (refused, owner, before, after) = with_system(|| async move {
        let a = supervise(store_a, fast_lease().lease_owner("replica-a"), "a", agent_a);
        let call = a.send(StartRun::new("a", json!({})).with_id("r1"));
        let call = actix_rt::spawn(async move { call.await.unwrap() });
        probe.wait_executions(1).await;
        let owner = lease_of(location.clone(), "r1").await.unwrap().owner;
        let before = events_of(location.clone(), "r1").await;
        let b = supervise(store_b, fast_lease().clock(clock_b), "a", agent_b);
        let refused = b.send(ResumeRun::new("r1")).await.unwrap();
        let after = events_of(location.clone(), "r1").await;
        probe.release();
        probe.release();
        call.await.unwrap().unwrap();
        (refused, owner, before, after)
    });
    let err = refused.unwrap_err();
    let Error::RunLeased {
        owner: leased_by,
        expires_at,
        ..
    } = &err
    else {
        panic!("{err}")
    };
    assert_eq!(*leased_by, owner);
    assert!(
        owner.starts_with("replica-a/") && owner.len() == "replica-a/".len() + 12,
        "{owner}"
    );
    assert!(*expires_at > SystemTime::now() - PATIENCE);
    assert!(err.is_run_state());
    assert_eq!(clock.reads(), 0, "a refused resume reads no time");
    assert_eq!(before, after, "and writes nothing");
}

#[test]
fn an_operators_cancel_releases_the_lease_and_the_loop_stops_at_its_next_write() {
    let db = TempStore::new();
    let first = RecordingTool::new("first").behaviour(Behaviour::BlockIgnoringCancel);
    let second = RecordingTool::new("second");
    let agent = Agent::new(two_calls("first", "second"))
        .tool(first.clone())
        .tool(second.clone());
    let (store, operator_store, location, probe) =
        (db.open(), db.open(), db.location(), first.clone());
    let (outcome, lease_after_cancel, lost) = with_system(|| async move {
        let sup = supervise(store, fast_lease(), "a", agent);
        let log = LeaseLostLog::new();
        sup.send(SubscribeLeaseLost(log.recipient())).await.unwrap();
        let call = sup.send(StartRun::new("a", json!({})).with_id("r1"));
        let call = actix_rt::spawn(async move { call.await.unwrap() });
        probe.wait_executions(1).await;
        // The operator works through another supervisor that executes nothing: no lease needed.
        let operator = Supervisor::builder(operator_store).start().unwrap();
        operator
            .send(CancelRun::new("r1", "wrong customer"))
            .await
            .unwrap()
            .unwrap();
        let lease_after_cancel = lease_of(location.clone(), "r1").await;
        // The executing supervisor learns it at its next renewal.
        log.wait_for(1).await;
        probe.release();
        (call.await.unwrap(), lease_after_cancel, log.seen())
    });

    assert_eq!(lease_after_cancel, None);
    assert_eq!(lost[0].reason, LeaseLostReason::ReleasedOrCancelled);
    assert_eq!(
        outcome.unwrap().outcome,
        Outcome::Cancelled {
            reason: "wrong customer".into()
        }
    );
    assert!(second.executions().is_empty());
    let events = db.open().events(&RunId::from("r1")).unwrap();
    let last = events.last().unwrap();
    assert_eq!(
        (last.kind, last.payload["late"].clone()),
        (EventKind::ToolFinished, json!(true))
    );
    assert_no_run_leased(&db.open());
}

#[test]
fn on_a_memory_store_renewals_go_through_its_one_connection() {
    let slow = RecordingTool::new("slow").behaviour(Behaviour::BlockIgnoringCancel);
    let store = Store::in_memory().unwrap();
    let agent = Agent::new(two_calls("slow", "slow")).tool(slow.clone());
    let probe = slow.clone();
    let (outcome, renewed) = with_system(|| async move {
        let sup = supervise(store.clone(), fast_lease(), "a", agent);
        let call = sup.send(StartRun::new("a", json!({})).with_id("r1"));
        let call = actix_rt::spawn(async move { call.await.unwrap() });
        probe.wait_executions(1).await;
        let read = |store: Store| async move {
            actix_rt::task::spawn_blocking(move || {
                store.lease(&RunId::from("r1")).unwrap().unwrap()
            })
            .await
            .unwrap()
        };
        let first = read(store.clone()).await;
        // Held past its first expiry: renewed, though the database has a single connection.
        let deadline = SystemTime::now() + PATIENCE;
        let renewed = loop {
            let now = read(store.clone()).await;
            if SystemTime::now() > first.expires_at && now.expires_at > SystemTime::now() {
                break now.expires_at > first.expires_at;
            }
            assert!(SystemTime::now() < deadline, "not renewed");
            actix_rt::time::sleep(TTL / 10).await;
        };
        probe.release();
        probe.release();
        (call.await.unwrap(), renewed)
    });
    assert!(renewed);
    assert_eq!(
        outcome.unwrap().outcome,
        Outcome::Succeeded {
            output: "done".into()
        }
    );
}

#[test]
fn two_supervisors_with_the_same_lease_owner_sweeping_racing_resumes_never_run_a_step_twice() {
    const RUNS: usize = 12;
    let db = TempStore::new();
    let charge = RecordingTool::new("charge")
        .behaviour(Behaviour::Block)
        .reconcile_hook(ReconcileHook::FromLog);
    let notify = RecordingTool::new("notify").reconcile_hook(ReconcileHook::FromLog);
    let agent = || {
        Agent::new(two_calls("charge", "notify"))
            .tool(charge.clone())
            .tool(notify.clone())
    };

    // A first process starts every run and dies with each one's charge in flight.
    let (store, a, probe) = (db.open(), agent(), charge.clone());
    with_system(|| async move {
        let sup = supervise(store, fast_lease().lease_owner("replica"), "a", a);
        for i in 0..RUNS {
            actix_rt::spawn(sup.send(StartRun::new("a", json!({})).with_id(format!("r{i}"))));
        }
        probe.wait_executions(RUNS).await;
    });
    charge.set_behaviour(Behaviour::Sleep(Duration::from_millis(2)));

    // Two replicas under the same name sweep all runs, racing on each.
    let sweepers: Vec<_> = (0..2)
        .map(|replica| {
            let (store, agent) = (db.open(), agent());
            std::thread::spawn(move || {
                with_system(|| async move {
                    let sup = supervise(store, fast_lease().lease_owner("replica"), "a", agent);
                    let deadline = SystemTime::now() + PATIENCE * 3;
                    let mut pending: Vec<usize> = (0..RUNS).collect();
                    if replica == 1 {
                        pending.reverse();
                    }
                    let mut leased = 0;
                    while !pending.is_empty() {
                        assert!(SystemTime::now() < deadline, "runs left: {pending:?}");
                        let mut still = Vec::new();
                        for i in pending {
                            match sup.send(ResumeRun::new(format!("r{i}"))).await.unwrap() {
                                Ok(_) => {}
                                // Finished by the other replica meanwhile.
                                Err(Error::RunState { state, .. }) if state.is_finished() => {}
                                Err(Error::RunLeased { .. }) => {
                                    leased += 1;
                                    still.push(i);
                                }
                                Err(err) => panic!("r{i}: {err}"),
                            }
                        }
                        pending = still;
                        if !pending.is_empty() {
                            actix_rt::time::sleep(TTL / 3).await;
                        }
                    }
                    leased
                })
            })
        })
        .collect();
    let leased: usize = sweepers.into_iter().map(|s| s.join().unwrap()).sum();
    println!("resumes refused with RunLeased: {leased}");

    let store = db.open();
    for i in 0..RUNS {
        let run_id = RunId::from(format!("r{i}").as_str());
        assert_eq!(
            store.run(&run_id).unwrap().state,
            RunState::Succeeded,
            "r{i}"
        );
        let events = store.events(&run_id).unwrap();
        let count = |kind| events.iter().filter(|e| e.kind == kind).count();
        assert_eq!(count(EventKind::StepInterrupted), 1, "r{i}");
        assert_eq!(count(EventKind::StepReconciled), 1, "r{i}");
        assert_eq!(count(EventKind::LeaseTakenOver), 1, "r{i}");
    }
    // Every side effect ran exactly once: the interrupted charges were found applied.
    for tool in [&charge, &notify] {
        let mut keys: Vec<String> = tool
            .executions()
            .into_iter()
            .map(|e| e.idempotency_key)
            .collect();
        let total = keys.len();
        keys.sort();
        keys.dedup();
        assert_eq!((keys.len(), total), (RUNS, RUNS));
    }
    assert_no_run_leased(&store);
}

/// Holds the store thread before the first `take_over` is applied, until told to go on.
struct HoldTakeover {
    reached: std::sync::Mutex<Option<mpsc::Sender<()>>>,
    go_on: std::sync::Mutex<Option<mpsc::Receiver<()>>>,
}

impl agentrt::MoveObserver for HoldTakeover {
    fn before_apply(&self, info: &agentrt::MoveInfo) {
        if info.kind != agentrt::MoveKind::TakeOver {
            return;
        }
        if let Some(reached) = self.reached.lock().unwrap().take() {
            reached.send(()).unwrap();
            let go_on = self.go_on.lock().unwrap().take().unwrap();
            go_on.recv().unwrap();
        }
    }
}

#[test]
fn an_outcome_written_between_a_resumes_read_and_its_takeover_is_not_executed_again() {
    let db = TempStore::new();
    let charge = RecordingTool::new("charge").behaviour(Behaviour::BlockIgnoringCancel);
    let notify = RecordingTool::new("notify");
    let (store_a, store_b, db_ref, probe) = (db.open(), db.open(), &db, charge.clone());
    let (agent_a, agent_b) = (
        charge_then_notify(&charge, &notify),
        charge_then_notify(&charge, &notify),
    );
    let (reached_tx, reached) = mpsc::channel::<()>();
    let (go_on, go_on_rx) = mpsc::channel();
    let hold = HoldTakeover {
        reached: std::sync::Mutex::new(Some(reached_tx)),
        go_on: std::sync::Mutex::new(Some(go_on_rx)),
    };
    let (first, second) = with_system(|| async move {
        let a = supervise(store_a, fast_lease(), "a", agent_a);
        let (call_a, _) = start_and_let_the_lease_lapse(&a, db_ref, &probe).await;

        // B reads the run (the charge in flight), then stops right before its takeover.
        let b = supervise(store_b, fast_lease().observer(hold), "a", agent_b);
        let resume =
            actix_rt::spawn(
                async move { resume_when_free(&b, &RunId::from("r1"), PATIENCE).await },
            );
        let reached = actix_rt::task::spawn_blocking(move || reached.recv_timeout(PATIENCE))
            .await
            .unwrap();
        if reached.is_err() {
            panic!("B never reached its takeover: {:?}", resume.await);
        }

        // Meanwhile A, whose lease lapsed but which nobody has taken over yet, records the
        // charge's outcome and stops.
        probe.release();
        let first = call_a.await.unwrap();
        go_on.send(()).unwrap();
        // Were the charge started again, it would block (its gate was opened once): give up
        // after the patience rather than hang.
        let second = actix_rt::time::timeout(PATIENCE, resume)
            .await
            .unwrap_or_else(|_| panic!("B is stuck in a second charge: {:?}", probe.executions()));
        (first, second.unwrap())
    });
    assert!(matches!(&first, Err(Error::LeaseLost { .. })), "{first:?}");
    assert_eq!(
        second.unwrap().outcome,
        Outcome::Succeeded {
            output: "done".into()
        }
    );
    assert_eq!(charge.executions().len(), 1, "the charge ran once");
    assert_eq!(notify.executions().len(), 1);
    let events = db.open().events(&RunId::from("r1")).unwrap();
    assert_eq!(
        events
            .iter()
            .filter(|e| e.kind == EventKind::StepInterrupted)
            .count(),
        0,
        "nothing was in flight when B took over"
    );
}

#[test]
fn on_a_memory_store_a_consumer_holding_the_connection_holds_up_no_run() {
    let slow = RecordingTool::new("slow").behaviour(Behaviour::BlockIgnoringCancel);
    let store = Store::in_memory().unwrap();
    let agent = Agent::new(two_calls("slow", "slow")).tool(slow.clone());
    let probe = slow.clone();
    let outcome = with_system(|| async move {
        let sup = supervise(store.clone(), fast_lease(), "a", agent);
        let call = sup.send(StartRun::new("a", json!({})).with_id("r1"));
        let call = actix_rt::spawn(async move { call.await.unwrap() });
        probe.wait_executions(1).await;
        let first = store.lease(&RunId::from("r1")).unwrap().unwrap();
        // The consumer holds its connection, mid-query, for three lease periods and more.
        let (held, holding) = std::sync::mpsc::channel();
        let (done, finish) = std::sync::mpsc::channel::<()>();
        let consumer_store = store.clone();
        let consumer = std::thread::spawn(move || {
            let conn = agentrt::sqlite::Sqlite::of(&consumer_store)
                .unwrap()
                .connection()
                .unwrap();
            conn.execute_batch("BEGIN").unwrap();
            let state: String = conn
                .query_row("SELECT state FROM runs WHERE id = 'r1'", [], |row| {
                    row.get(0)
                })
                .unwrap();
            held.send(state).unwrap();
            finish.recv().unwrap();
        });
        let seen = actix_rt::task::spawn_blocking(move || holding.recv().unwrap())
            .await
            .unwrap();
        assert_eq!(seen, "RUNNING", "the consumer reads the database as it was");
        // Meanwhile the lease is renewed past its first expiry, and the run goes on.
        let deadline = SystemTime::now() + PATIENCE;
        loop {
            let now = store.lease(&RunId::from("r1")).unwrap().unwrap();
            if SystemTime::now() > first.expires_at + TTL && now.expires_at > SystemTime::now() {
                break;
            }
            assert!(
                SystemTime::now() < deadline,
                "not renewed while the consumer held on"
            );
            actix_rt::time::sleep(TTL / 10).await;
        }
        probe.release();
        probe.wait_executions(2).await;
        probe.release();
        let outcome = call.await.unwrap();
        done.send(()).unwrap();
        consumer.join().unwrap();
        outcome
    });
    assert_eq!(
        outcome.unwrap().outcome,
        Outcome::Succeeded {
            output: "done".into()
        }
    );
}
