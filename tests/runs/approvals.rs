//! Policy decisions and approvals: deny, approve and resume, deny and resume, racing resumers.

use std::{
    sync::{Arc, Condvar, Mutex},
    time::Duration,
};

use agentrt::{
    Agent, Approval, ApprovalReason, Config, Decision, Error, EventKind, ModelResponse, Outcome,
    RecordApproval, RequireApprovalFor, ResumeRun, RunId, RunState, StartRun, Supervisor, ToolCall,
    ToolResult,
    testkit::{RecordingTool, ScriptedModel, TempStore, with_system},
};
use serde_json::json;

use crate::support::{
    ask, kinds_of as kinds, last_tool_result, record_then_resume, supervise, transfer_then_answer,
};

#[test]
fn a_call_the_policy_denies_never_runs_and_the_model_is_told() {
    let db = TempStore::new();
    let transfer = RecordingTool::new("transfer");
    let model = transfer_then_answer();
    let agent =
        Agent::new(model.clone())
            .tool(transfer.clone())
            .policy(|_: &RunId, call: &ToolCall| {
                Decision::Deny(format!("{} is not allowed", call.name))
            });
    let start = StartRun::new("a", json!({}));
    let reply = ask(db.open(), Config::default(), "a", agent, start).unwrap();

    assert_eq!(
        reply.outcome,
        Outcome::Succeeded {
            output: "finished".into()
        }
    );
    assert!(transfer.executions().is_empty());
    let ToolResult::Error(error) = last_tool_result(&model) else {
        panic!("the model saw an output")
    };
    assert!(
        error.contains("denied") && error.contains("transfer is not allowed"),
        "{error}"
    );
    let store = db.open();
    let events = store.events(&reply.run_id).unwrap();
    let decided = events
        .iter()
        .find(|e| e.kind == EventKind::PolicyDecided)
        .unwrap();
    assert_eq!(decided.payload["decision"], json!("deny"));
    assert!(!kinds(&store, &reply.run_id).contains(&EventKind::ToolStarted));
}

/// Starts a run that waits for approval of `pay-1`; returns its id.
fn start_waiting(db: &TempStore, agent: Agent) -> RunId {
    let start = StartRun::new("a", json!({}));
    let reply = ask(db.open(), Config::default(), "a", agent, start).unwrap();
    let Outcome::WaitingForApproval { pending } = reply.outcome else {
        panic!("{:?}", reply.outcome)
    };
    assert_eq!(pending.call_id, "pay-1");
    assert_eq!(pending.tool, "transfer");
    assert_eq!(pending.reason, ApprovalReason::Policy);
    assert_eq!(
        db.open().run(&reply.run_id).unwrap().state,
        RunState::WaitingForApproval
    );
    reply.run_id
}

fn approval_agent(model: &ScriptedModel, transfer: &RecordingTool) -> Agent {
    Agent::new(model.clone())
        .tool(transfer.clone())
        .policy(RequireApprovalFor::tools(["transfer"]))
}

#[test]
fn approve_then_resume_runs_the_call_once_and_succeeds() {
    let db = TempStore::new();
    let (model, transfer) = (transfer_then_answer(), RecordingTool::new("transfer"));
    let run_id = start_waiting(&db, approval_agent(&model, &transfer));
    assert!(
        transfer.executions().is_empty(),
        "nothing runs before the approval"
    );

    let approval = Approval::approve(run_id.clone(), "pay-1", "alice").note("within budget");
    let agent = approval_agent(&model, &transfer);
    let reply = record_then_resume(db.open(), Config::default(), "a", agent, approval).unwrap();

    assert_eq!(
        reply.outcome,
        Outcome::Succeeded {
            output: "finished".into()
        }
    );
    assert_eq!(transfer.executions().len(), 1);
    let store = db.open();
    let tail: Vec<EventKind> = kinds(&store, &run_id).into_iter().skip(4).collect();
    assert_eq!(
        tail,
        [
            EventKind::RunWaiting,
            EventKind::ApprovalRecorded,
            EventKind::RunResumed,
            EventKind::PolicyDecided,
            EventKind::ToolStarted,
            EventKind::ToolFinished,
            EventKind::ModelStarted,
            EventKind::ModelFinished,
            EventKind::RunFinished,
        ]
    );
    let events = store.events(&run_id).unwrap();
    let recorded = events
        .iter()
        .find(|e| e.kind == EventKind::ApprovalRecorded)
        .unwrap();
    assert_eq!(recorded.payload["decided_by"], json!("alice"));
    assert_eq!(recorded.payload["note"], json!("within budget"));
}

#[test]
fn deny_then_resume_tells_the_model_and_runs_nothing() {
    let db = TempStore::new();
    let (model, transfer) = (transfer_then_answer(), RecordingTool::new("transfer"));
    let run_id = start_waiting(&db, approval_agent(&model, &transfer));

    let denial = Approval::deny(run_id.clone(), "pay-1", "bob");
    let agent = approval_agent(&model, &transfer);
    let reply = record_then_resume(db.open(), Config::default(), "a", agent, denial).unwrap();

    assert_eq!(
        reply.outcome,
        Outcome::Succeeded {
            output: "finished".into()
        }
    );
    assert!(transfer.executions().is_empty());
    let ToolResult::Error(error) = last_tool_result(&model) else {
        panic!("the model saw an output")
    };
    assert!(error.contains("denied by bob"), "{error}");
    assert!(!kinds(&db.open(), &run_id).contains(&EventKind::ToolStarted));
}

#[test]
fn resume_without_a_decision_still_waits_and_changes_nothing() {
    let db = TempStore::new();
    let (model, transfer) = (transfer_then_answer(), RecordingTool::new("transfer"));
    let run_id = start_waiting(&db, approval_agent(&model, &transfer));
    let before = db.open().events(&run_id).unwrap();
    let updated = db.open().run(&run_id).unwrap().updated_at;

    let agent = approval_agent(&model, &transfer);
    let resume = ResumeRun::new(run_id.clone());
    let reply = ask(db.open(), Config::default(), "a", agent, resume).unwrap();

    let Outcome::WaitingForApproval { pending } = reply.outcome else {
        panic!("{:?}", reply.outcome)
    };
    assert_eq!(pending.call_id, "pay-1");
    assert_eq!(db.open().events(&run_id).unwrap(), before);
    assert_eq!(db.open().run(&run_id).unwrap().updated_at, updated);
    assert_eq!(db.open().pending_calls(&run_id).unwrap().len(), 1);
}

#[test]
fn an_approval_for_a_call_that_is_not_pending_is_refused() {
    let db = TempStore::new();
    let (model, transfer) = (transfer_then_answer(), RecordingTool::new("transfer"));
    let run_id = start_waiting(&db, approval_agent(&model, &transfer));

    let (store, id) = (db.open(), run_id.clone());
    let (unknown_call, twice, unknown_run) = with_system(|| async move {
        let supervisor = Supervisor::builder(store).start().unwrap();
        let unknown_call = supervisor
            .send(RecordApproval(Approval::approve(
                id.clone(),
                "nope",
                "alice",
            )))
            .await
            .unwrap();
        supervisor
            .send(RecordApproval(Approval::approve(
                id.clone(),
                "pay-1",
                "alice",
            )))
            .await
            .unwrap()
            .unwrap();
        let twice = supervisor
            .send(RecordApproval(Approval::deny(
                id.clone(),
                "pay-1",
                "mallory",
            )))
            .await
            .unwrap();
        let unknown_run = supervisor
            .send(RecordApproval(Approval::approve(
                "no-such-run",
                "pay-1",
                "alice",
            )))
            .await
            .unwrap();
        (unknown_call, twice, unknown_run)
    });

    assert!(
        matches!(unknown_call, Err(Error::CallNotFound { .. })),
        "{unknown_call:?}"
    );
    let twice = twice.unwrap_err();
    assert!(twice.is_run_state(), "{twice}");
    assert!(twice.to_string().contains("already decided"), "{twice}");
    assert!(
        matches!(unknown_run, Err(Error::RunNotFound(_))),
        "{unknown_run:?}"
    );
    let approvals = kinds(&db.open(), &run_id)
        .iter()
        .filter(|k| **k == EventKind::ApprovalRecorded)
        .count();
    assert_eq!(approvals, 1, "the refused approvals wrote nothing");

    // Once the run has moved on, its call is no longer pending.
    let (store, agent, id) = (db.open(), approval_agent(&model, &transfer), run_id.clone());
    let late = with_system(|| async move {
        let supervisor = supervise(store, Config::default(), "a", agent);
        supervisor
            .send(ResumeRun::new(id.clone()))
            .await
            .unwrap()
            .unwrap();
        supervisor
            .send(RecordApproval(Approval::approve(id, "pay-1", "alice")))
            .await
            .unwrap()
    });
    let late = late.unwrap_err();
    assert!(late.is_run_state(), "{late}");
}

/// Lets `parties` callers through together, so that both resumers have read the waiting run
/// before either moves it.
#[derive(Clone)]
struct Rendezvous(Arc<(Mutex<usize>, Condvar)>, usize);

impl Rendezvous {
    fn new(parties: usize) -> Self {
        Rendezvous(Arc::new((Mutex::new(0), Condvar::new())), parties)
    }

    fn arrive(&self) {
        let (count, all_here) = &*self.0;
        let mut count = count.lock().unwrap();
        *count += 1;
        all_here.notify_all();
        // Bounded: a resumer that never arrives fails the test instead of hanging it.
        let (_count, timeout) = all_here
            .wait_timeout_while(count, Duration::from_secs(20), |c| *c < self.1)
            .unwrap();
        assert!(!timeout.timed_out(), "the other resumer never arrived");
    }
}

#[test]
fn two_concurrent_resumers_of_a_waiting_run_one_wins_and_the_tool_runs_once() {
    let db = TempStore::new();
    let (model, transfer) = (transfer_then_answer(), RecordingTool::new("transfer"));
    let run_id = start_waiting(&db, approval_agent(&model, &transfer));
    with_system(|| {
        let (store, id) = (db.open(), run_id.clone());
        async move {
            let supervisor = Supervisor::builder(store).start().unwrap();
            supervisor
                .send(RecordApproval(Approval::approve(id, "pay-1", "alice")))
                .await
                .unwrap()
                .unwrap();
        }
    });

    // Two "processes": each its own actix system, thread and connections to the file.
    let rendezvous = Rendezvous::new(2);
    let resumers: Vec<_> = (0..2)
        .map(|_| {
            let (store, id) = (db.open(), run_id.clone());
            let (model, transfer, rendezvous) =
                (model.clone(), transfer.clone(), rendezvous.clone());
            std::thread::spawn(move || {
                // The resume-time policy decision is taken after the run was read and before
                // the move: both meet there, so both race on the compare-and-set.
                let policy = move |_: &RunId, _: &ToolCall| {
                    rendezvous.arrive();
                    Decision::RequireApproval("transfer requires an approval".into())
                };
                let agent = Agent::new(model).tool(transfer).policy(policy);
                ask(store, Config::default(), "a", agent, ResumeRun::new(id))
            })
        })
        .collect();
    let results: Vec<_> = resumers.into_iter().map(|r| r.join().unwrap()).collect();

    let winners = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(winners, 1, "{results:?}");
    let loser = results.iter().find_map(|r| r.as_ref().err()).unwrap();
    assert!(loser.is_run_state(), "{loser}");
    assert_eq!(transfer.executions().len(), 1);
    let store = db.open();
    assert_eq!(store.run(&run_id).unwrap().state, RunState::Succeeded);
    let resumed = kinds(&store, &run_id)
        .iter()
        .filter(|k| **k == EventKind::RunResumed)
        .count();
    assert_eq!(resumed, 1);
}

/// The database no longer checks the ids of calls that do not wait (migration 7): the loop
/// must keep them unique across a resume, from the ids it reads back.
#[test]
fn a_call_id_used_before_a_resume_is_made_unique_after_it() {
    let db = TempStore::new();
    let pay = || ModelResponse::calls(vec![ToolCall::new("pay-1", "transfer", json!({}))]);
    let model = ScriptedModel::new(vec![pay(), pay(), ModelResponse::answer("finished")]);
    let transfer = RecordingTool::new("transfer");
    let run_id = start_waiting(&db, approval_agent(&model, &transfer));

    // Each resume runs in a supervisor of its own, whose loop knows the run only from the
    // database.
    let approve_and_resume = |call_id: &'static str| {
        let approval = Approval::approve(run_id.clone(), call_id, "alice");
        let agent = approval_agent(&model, &transfer);
        record_then_resume(db.open(), Config::default(), "a", agent, approval).unwrap()
    };
    let reply = approve_and_resume("pay-1");
    let Outcome::WaitingForApproval { pending } = reply.outcome else {
        panic!("{:?}", reply.outcome)
    };
    assert_eq!((pending.step, pending.call_id.as_str()), (4, "call-4"));
    let reply = approve_and_resume("call-4");
    assert!(matches!(reply.outcome, Outcome::Succeeded { .. }));
    let ids: Vec<String> = transfer
        .executions()
        .into_iter()
        .map(|e| e.call_id)
        .collect();
    assert_eq!(ids, ["pay-1", "call-4"]);
}
