//! A supervisor crashes (its actix system goes away, with no further write) while a step is in
//! flight; a fresh supervisor resumes the run and reconciles the step exactly once.

use agentrt::{
    Agent, Approval, ApprovalReason, Config, Event, EventKind, Outcome, Reconciliation,
    RecordApproval, ResumeRun, RunId, RunState, StartRun, Store, ToolResult,
    testkit::{
        Behaviour, ReconcileHook, RecordingTool, ScriptedModel, TempStore, assert_no_run_leased,
        resume_when_free, with_system,
    },
};
use serde_json::json;

use crate::support::{
    PATIENCE, ask, call_then_answer, crash_in_tool, crash_when, fast_lease, supervise,
};

fn charge_then_answer() -> ScriptedModel {
    call_then_answer("charge-1", "charge", json!({"cents": 500}), "charged")
}

/// Runs the agent until the charge tool is in flight, then crashes the supervisor.
fn crash_mid_tool(db: &TempStore, model: &ScriptedModel, charge: &RecordingTool) -> RunId {
    charge.set_behaviour(Behaviour::Block);
    let agent = Agent::new(model.clone()).tool(charge.clone());
    let start = StartRun::new("billing", json!({})).with_id("run-1");
    // The call never answers: the system goes away under it.
    crash_in_tool(db, "billing", agent, start, charge);
    let run_id = RunId::from("run-1");
    let store = db.open();
    let events = store.events(&run_id).unwrap();
    assert_eq!(
        events.last().unwrap().kind,
        EventKind::ToolStarted,
        "crashed mid-tool, no write after"
    );
    assert_eq!(store.run(&run_id).unwrap().state, RunState::Running);
    run_id
}

fn resume(db: &TempStore, agent: Agent, run_id: &RunId, approval: Option<Approval>) -> Outcome {
    let (store, id) = (db.open(), run_id.clone());
    with_system(|| async move {
        let supervisor = supervise(store, fast_lease(), "billing", agent);
        if let Some(approval) = approval {
            supervisor
                .send(RecordApproval(approval))
                .await
                .unwrap()
                .unwrap();
        }
        // The dead supervisor's lease blocks the resume until it expires.
        resume_when_free(&supervisor, &id, PATIENCE).await
    })
    .unwrap()
    .outcome
}

fn of_kind(events: &[Event], kind: EventKind) -> Vec<&Event> {
    events.iter().filter(|e| e.kind == kind).collect()
}

/// One interruption, one reconciliation, saying `outcome` and `action`.
fn assert_reconciled_once(
    store: &Store,
    run_id: &RunId,
    outcome: &str,
    action: &str,
) -> Vec<Event> {
    let events = store.events(run_id).unwrap();
    assert_eq!(of_kind(&events, EventKind::StepInterrupted).len(), 1);
    let reconciled = of_kind(&events, EventKind::StepReconciled);
    assert_eq!(reconciled.len(), 1);
    assert_eq!(reconciled[0].payload["outcome"], json!(outcome));
    assert_eq!(reconciled[0].payload["action"], json!(action));
    assert!(
        events
            .iter()
            .enumerate()
            .all(|(i, e)| e.seq == i as u64 + 1),
        "gapless"
    );
    // The dead supervisor's lease was taken over once, and nothing is left leased.
    assert_eq!(of_kind(&events, EventKind::LeaseTakenOver).len(), 1);
    assert_no_run_leased(store);
    events
}

#[test]
fn interrupted_call_the_hook_says_was_applied_is_recorded_not_run_again() {
    let db = TempStore::new();
    let model = charge_then_answer();
    let charge = RecordingTool::new("charge").reconcile_hook(ReconcileHook::FromLog);
    let run_id = crash_mid_tool(&db, &model, &charge);

    charge.set_behaviour(Behaviour::Succeed);
    let outcome = resume(
        &db,
        Agent::new(model.clone()).tool(charge.clone()),
        &run_id,
        None,
    );

    assert_eq!(
        outcome,
        Outcome::Succeeded {
            output: "charged".into()
        }
    );
    assert_eq!(charge.executions().len(), 1, "the charge ran once");
    assert_eq!(charge.reconciles().len(), 1);
    assert_eq!(
        charge.reconciles()[0].idempotency_key,
        charge.executions()[0].idempotency_key
    );
    let events = assert_reconciled_once(&db.open(), &run_id, "applied", "record_output");
    let finished = of_kind(&events, EventKind::ToolFinished);
    assert_eq!(finished.len(), 1);
    assert_eq!(finished[0].payload["reconciled"], json!(true));
    assert_eq!(of_kind(&events, EventKind::ToolStarted).len(), 1);
}

#[test]
fn interrupted_call_the_hook_says_was_not_applied_runs_again_with_the_same_key() {
    let db = TempStore::new();
    let model = charge_then_answer();
    let charge = RecordingTool::new("charge")
        .reconcile_hook(ReconcileHook::Answer(Reconciliation::NotApplied));
    let run_id = crash_mid_tool(&db, &model, &charge);

    charge.set_behaviour(Behaviour::Succeed);
    let outcome = resume(
        &db,
        Agent::new(model.clone()).tool(charge.clone()),
        &run_id,
        None,
    );

    assert_eq!(
        outcome,
        Outcome::Succeeded {
            output: "charged".into()
        }
    );
    let executions = charge.executions();
    assert_eq!(
        executions.len(),
        2,
        "the reconciliation chose to run it again"
    );
    assert_eq!((executions[0].attempt, executions[1].attempt), (1, 2));
    assert_eq!(executions[0].idempotency_key, executions[1].idempotency_key);
    assert_reconciled_once(&db.open(), &run_id, "not_applied", "run_again");
}

#[test]
fn interrupted_idempotent_call_with_unknown_outcome_runs_again() {
    let db = TempStore::new();
    let model = charge_then_answer();
    let charge = RecordingTool::new("charge")
        .idempotent(true)
        .reconcile_hook(ReconcileHook::Answer(Reconciliation::Unknown));
    let run_id = crash_mid_tool(&db, &model, &charge);

    charge.set_behaviour(Behaviour::Succeed);
    let outcome = resume(
        &db,
        Agent::new(model.clone()).tool(charge.clone()),
        &run_id,
        None,
    );

    assert_eq!(
        outcome,
        Outcome::Succeeded {
            output: "charged".into()
        }
    );
    assert_eq!(charge.executions().len(), 2);
    assert_reconciled_once(&db.open(), &run_id, "unknown", "run_again");
}

#[test]
fn interrupted_idempotent_call_without_a_hook_runs_again() {
    let db = TempStore::new();
    let model = charge_then_answer();
    let charge = RecordingTool::new("charge").idempotent(true);
    let run_id = crash_mid_tool(&db, &model, &charge);

    charge.set_behaviour(Behaviour::Succeed);
    let outcome = resume(
        &db,
        Agent::new(model.clone()).tool(charge.clone()),
        &run_id,
        None,
    );

    assert_eq!(
        outcome,
        Outcome::Succeeded {
            output: "charged".into()
        }
    );
    assert_eq!(charge.executions().len(), 2);
    assert_reconciled_once(&db.open(), &run_id, "no_hook", "run_again");
}

/// Crashes mid-call of a non-idempotent tool whose outcome is unknown, resumes: the run waits
/// for a person. Returns the run id.
fn crash_into_reconcile_approval(
    db: &TempStore,
    model: &ScriptedModel,
    charge: &RecordingTool,
) -> RunId {
    let run_id = crash_mid_tool(db, model, charge);
    charge.set_behaviour(Behaviour::Succeed);
    let outcome = resume(
        db,
        Agent::new(model.clone()).tool(charge.clone()),
        &run_id,
        None,
    );
    let Outcome::WaitingForApproval { pending } = outcome else {
        panic!("{outcome:?}")
    };
    assert_eq!(pending.reason, ApprovalReason::Reconcile);
    assert_eq!(pending.call_id, "charge-1");
    assert_eq!(
        charge.executions().len(),
        1,
        "nothing ran again before a person decided"
    );
    assert_eq!(
        db.open().run(&run_id).unwrap().state,
        RunState::WaitingForApproval
    );
    run_id
}

#[test]
fn interrupted_call_with_unknown_outcome_waits_for_a_person_who_approves_a_second_attempt() {
    let db = TempStore::new();
    let model = charge_then_answer();
    let charge =
        RecordingTool::new("charge").reconcile_hook(ReconcileHook::Answer(Reconciliation::Unknown));
    let run_id = crash_into_reconcile_approval(&db, &model, &charge);

    let approval =
        Approval::approve(run_id.clone(), "charge-1", "ops").note("checked: not charged");
    let outcome = resume(
        &db,
        Agent::new(model.clone()).tool(charge.clone()),
        &run_id,
        Some(approval),
    );

    assert_eq!(
        outcome,
        Outcome::Succeeded {
            output: "charged".into()
        }
    );
    let executions = charge.executions();
    assert_eq!(executions.len(), 2);
    assert_eq!(executions[1].attempt, 2);
    let events = assert_reconciled_once(&db.open(), &run_id, "unknown", "await_approval");
    let decided = of_kind(&events, EventKind::PolicyDecided);
    assert_eq!(decided.last().unwrap().payload["source"], json!("approval"));
}

#[test]
fn interrupted_call_without_a_hook_waits_for_a_person_who_denies_it() {
    let db = TempStore::new();
    let model = charge_then_answer();
    let charge = RecordingTool::new("charge");
    let run_id = crash_into_reconcile_approval(&db, &model, &charge);

    let denial = Approval::deny(run_id.clone(), "charge-1", "ops").note("it went through");
    let outcome = resume(
        &db,
        Agent::new(model.clone()).tool(charge.clone()),
        &run_id,
        Some(denial),
    );

    assert_eq!(
        outcome,
        Outcome::Succeeded {
            output: "charged".into()
        }
    );
    assert_eq!(charge.executions().len(), 1, "denied: not run again");
    let events = assert_reconciled_once(&db.open(), &run_id, "no_hook", "await_approval");
    let finished = of_kind(&events, EventKind::ToolFinished);
    assert_eq!(finished.len(), 1);
    assert_eq!(finished[0].payload["denied"], json!(true));
    let conversation = model.seen().pop().unwrap();
    let told = conversation.iter().any(|m| {
        matches!(m, agentrt::ChatMessage::Tool { result: ToolResult::Error(e), .. } if e.contains("denied by ops"))
    });
    assert!(told, "the model is told the call failed: {conversation:?}");
}

#[test]
fn interrupted_model_call_is_dispatched_again() {
    let db = TempStore::new();
    let model = charge_then_answer().block_at_turn(0);
    let charge = RecordingTool::new("charge");
    let agent = Agent::new(model.clone()).tool(charge.clone());
    let start = StartRun::new("billing", json!({})).with_id("run-1");
    crash_when(
        db.open(),
        fast_lease(),
        "billing",
        agent,
        start,
        model.wait_calls(1),
    );
    let run_id = RunId::from("run-1");
    let before = db.open().events(&run_id).unwrap();
    assert_eq!(before.last().unwrap().kind, EventKind::ModelStarted);

    model.release(); // the script's turn 0 answers at once from now on
    let outcome = resume(
        &db,
        Agent::new(model.clone()).tool(charge.clone()),
        &run_id,
        None,
    );

    assert_eq!(
        outcome,
        Outcome::Succeeded {
            output: "charged".into()
        }
    );
    assert_eq!(
        model.calls(),
        3,
        "turn 0 twice (dispatched again), then turn 1"
    );
    let events = assert_reconciled_once(&db.open(), &run_id, "model_call", "dispatch_again");
    let started = of_kind(&events, EventKind::ModelStarted);
    assert_eq!(started[1].step, Some(1));
    assert_eq!(started[1].payload["attempt"], json!(2));
    assert_eq!(charge.executions().len(), 1);
}

#[test]
fn a_recovered_run_once_finished_cannot_be_resumed_again() {
    let db = TempStore::new();
    let model = charge_then_answer();
    let charge = RecordingTool::new("charge");
    let run_id = crash_mid_tool(&db, &model, &charge);
    charge.set_behaviour(Behaviour::Succeed);
    // The first resume reconciles (no hook, not idempotent) and waits; a denial closes it.
    let denial = Approval::deny(run_id.clone(), "charge-1", "ops");
    resume(
        &db,
        Agent::new(model.clone()).tool(charge.clone()),
        &run_id,
        None,
    );
    let outcome = resume(
        &db,
        Agent::new(model.clone()).tool(charge.clone()),
        &run_id,
        Some(denial),
    );
    assert!(matches!(outcome, Outcome::Succeeded { .. }));
    // Resuming a finished run is refused and changes nothing.
    let before = db.open().events(&run_id).unwrap();
    let agent = Agent::new(model.clone()).tool(charge.clone());
    let resume = ResumeRun::new(run_id.clone());
    let err = ask(db.open(), Config::default(), "billing", agent, resume).unwrap_err();
    assert!(err.is_run_state(), "{err}");
    assert_eq!(db.open().events(&run_id).unwrap(), before);
}
