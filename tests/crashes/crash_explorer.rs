//! The crash-point explorer over real agents: every move, crashed before it is applied and
//! after it commits, then resumed; every invariant holds.

use std::collections::BTreeMap;

use agentrt::{
    Agent, ApprovalReason, Decision, ModelResponse, MoveKind, RequireApprovalFor, RunId, RunState,
    ToolCall,
    testkit::{Behaviour, CrashPoint, Explorer, ReconcileHook, RecordingTool, ScriptedModel},
};
use serde_json::json;

use crate::support::quickstart_agent;

#[test]
fn every_crash_point_of_the_quickstart_agent_keeps_the_invariants() {
    let exploration = Explorer::new(quickstart_agent::agent)
        .input(json!({"customer": "ada"}))
        .explore();
    exploration.assert_holds();
    assert!(exploration.moves >= 10, "{}", exploration.moves);
    assert_eq!(exploration.cases.len(), 2 * exploration.moves);
    assert!(exploration.cases.iter().all(|case| case.crashed));
}

#[test]
fn every_crash_point_of_three_concurrent_runs_keeps_the_invariants_including_deferred_syncs() {
    // Three quickstart runs at once: their moves share group commits, and the crash points
    // include groups committed without their sync, stopped on the log-sync thread before their
    // callers heard of them.
    let exploration = Explorer::new(quickstart_agent::agent)
        .input(json!({"customer": "ada"}))
        .concurrent_runs(3)
        .explore();
    exploration.assert_holds();
    assert!(exploration.moves >= 30, "{}", exploration.moves);
    // Deferred syncs are the SQLite backend's: a PostgreSQL store's writer threads answer a
    // group once its commit returned, durable.
    if agentrt::testkit::on_postgres() {
        return;
    }
    let on_sync_thread = exploration
        .cases
        .iter()
        .filter(|case| case.crash_thread.as_deref() == Some("agentrt-log-sync"))
        .count();
    assert!(
        on_sync_thread > 0,
        "no crash point fell in a deferred group: {:?}",
        exploration
            .cases
            .iter()
            .map(|case| &case.crash_thread)
            .collect::<Vec<_>>()
    );
}

/// Ten steps and more: five turns of two calls each, across tools of every kind, with
/// approvals.
fn long_agent() -> Agent {
    let turn = |t: usize| {
        ModelResponse::calls(vec![
            ToolCall::new(format!("fetch-{t}"), "fetch", json!({"page": t})),
            ToolCall::new(
                format!("act-{t}"),
                ["charge", "email", "ticket"][t % 3],
                json!({"turn": t}),
            ),
        ])
    };
    let mut script: Vec<ModelResponse> = (0..5).map(turn).collect();
    script.push(ModelResponse::answer("all done"));
    let policy = |_: &RunId, call: &ToolCall| match call.name.as_str() {
        "charge" => Decision::RequireApproval("money moves".into()),
        "ticket" if call.args["turn"] == json!(4) => Decision::Deny("no more tickets".into()),
        _ => Decision::Allow,
    };
    Agent::new(ScriptedModel::new(script))
        // Idempotent, no hook: an interrupted fetch simply runs again.
        .tool(RecordingTool::new("fetch").idempotent(true))
        // Not idempotent, with a hook that asks its own log.
        .tool(RecordingTool::new("charge").reconcile_hook(ReconcileHook::FromLog))
        // Not idempotent, no hook: an interrupted email waits for a person.
        .tool(RecordingTool::new("email"))
        // A tool whose calls fail: the model sees the error.
        .tool(RecordingTool::new("ticket").behaviour(Behaviour::Fail("tracker down".into())))
        .policy(policy)
}

#[test]
fn every_crash_point_of_a_long_agent_with_approvals_keeps_the_invariants() {
    // The person denies emails that were interrupted, approves everything else.
    let exploration = Explorer::new(long_agent)
        .approve_with(|pending| {
            !(pending.tool == "email" && pending.reason == ApprovalReason::Reconcile)
        })
        .explore();
    exploration.assert_holds();
    assert!(exploration.moves >= 30, "{}", exploration.moves);
    let steps_run = exploration
        .cases
        .iter()
        .map(|case| case.executions)
        .max()
        .unwrap();
    assert!(steps_run >= 10, "{steps_run}");
}

#[test]
fn the_explorer_catches_a_side_effect_that_runs_twice() {
    // A tool that claims to be idempotent but is not, and a hook that lies: the explorer must
    // still flag nothing for the runtime (each re-run is recorded as a reconciliation), while a
    // forged extra execution is flagged.
    let explorer = Explorer::new(|| {
        let model = ScriptedModel::new(vec![
            ModelResponse::calls(vec![ToolCall::new("c1", "pay", json!({}))]),
            ModelResponse::answer("paid"),
        ]);
        Agent::new(model).tool(RecordingTool::new("pay").idempotent(true))
    });
    let moves = explorer.count_moves();
    let case = explorer.run_case(CrashPoint::BeforeApply(moves - 2));
    assert!(case.crashed);
    assert!(case.violations.is_empty(), "{:?}", case.violations);

    let db = agentrt::testkit::TempStore::new();
    let store = db.open();
    let run_id = RunId::from("r");
    let reply = agentrt::testkit::with_system(|| {
        let store = store.clone();
        async move {
            let model = ScriptedModel::new(vec![
                ModelResponse::calls(vec![ToolCall::new("c1", "pay", json!({}))]),
                ModelResponse::answer("paid"),
            ]);
            let sup = agentrt::Supervisor::builder(store)
                .agent("a", Agent::new(model).tool(RecordingTool::new("pay")))
                .start()
                .unwrap();
            sup.send(agentrt::StartRun::new("a", json!({})).with_id("r"))
                .await
                .unwrap()
        }
    });
    assert!(reply.is_ok());
    let forged = vec![("r/2".to_owned(), 1), ("r/2".to_owned(), 1)];
    let violations = agentrt::testkit::check_invariants(&store, &run_id, &forged);
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert!(violations[0].is_duplicate(), "{violations:?}");
    assert!(
        violations[0].to_string().contains("ran 2 times"),
        "{violations:?}"
    );
}

/// A parent that asks a person, sleeps on a timer, delegates to a `researcher` child (which
/// calls `lookup` and waits for an event), and calls `notify`, once a person approves, with
/// the child's answer.
fn waiting_parent() -> Agent {
    let turn =
        |id: &str, tool: &str, args| ModelResponse::calls(vec![ToolCall::new(id, tool, args)]);
    let model = ScriptedModel::new(vec![
        turn("ask", "ask_person", json!({"question": "Which account?"})),
        turn(
            "nap",
            "sleep_until",
            json!({"seconds": 5, "reason": "let the payment settle"}),
        ),
        turn("hand", "research", json!({"task": "find the invoice"})),
        turn("tell", "notify", json!({"to": "ada"})),
        ModelResponse::answer("told ada"),
    ]);
    Agent::new(model)
        .ask_person()
        .sleep_until()
        .delegate(
            "research",
            "researcher",
            "Hands a task to the research agent.",
        )
        .tool(RecordingTool::new("notify").reconcile_hook(ReconcileHook::FromLog))
        .policy(RequireApprovalFor::tools(["notify"]))
}

fn researcher() -> Agent {
    let model = ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new("look", "lookup", json!({}))]),
        ModelResponse::calls(vec![ToolCall::new(
            "paid",
            "wait_for_event",
            json!({"name": "invoice.paid"}),
        )]),
        ModelResponse::answer("invoice 42"),
    ]);
    Agent::new(model)
        .tool(RecordingTool::new("lookup").reconcile_hook(ReconcileHook::FromLog))
        .wait_for_event()
}

#[test]
fn every_crash_point_of_a_parent_that_waits_and_its_child_wakes_both_and_runs_each_tool_once() {
    let exploration = Explorer::new(waiting_parent)
        .agent("researcher", researcher)
        .answer_with(|wait| {
            assert_eq!(wait.detail["question"], json!("Which account?"));
            json!("savings")
        })
        .waits()
        .explore();
    println!(
        "{} moves, {} crash points explored",
        exploration.moves,
        exploration.cases.len()
    );
    exploration.assert_holds();
    // Every write of either run is a crash point: the parent's three waits begun, woken and
    // resumed, the person's answer and approval, and the child's moves, its event's delivery
    // included.
    let (parent, child) = (RunId::from("explored"), RunId::from("explored/6"));
    let kinds = |run: &RunId| -> Vec<MoveKind> {
        let moves = exploration.committed.iter().filter(|m| m.run_id == *run);
        moves.map(|m| m.kind).collect()
    };
    let (of_parent, of_child) = (kinds(&parent), kinds(&child));
    let count = |kinds: &[MoveKind], kind| kinds.iter().filter(|k| **k == kind).count();
    assert_eq!(count(&of_parent, MoveKind::BeginWait), 3, "{of_parent:?}");
    assert_eq!(count(&of_parent, MoveKind::ResumeWait), 3, "{of_parent:?}");
    assert_eq!(
        count(&of_parent, MoveKind::AnswerQuestion),
        1,
        "{of_parent:?}"
    );
    assert_eq!(
        count(&of_parent, MoveKind::RecordApproval),
        1,
        "{of_parent:?}"
    );
    assert_eq!(count(&of_child, MoveKind::DeliverEvent), 1, "{of_child:?}");
    assert_eq!(count(&of_child, MoveKind::ResumeWait), 1, "{of_child:?}");
    assert_eq!(of_parent.len() + of_child.len(), exploration.moves);
    for case in &exploration.cases {
        assert!(case.crashed, "{case:?}");
        // A crash before the child's insert leaves the parent alone until it is woken.
        assert_eq!(
            case.runs.get(&parent),
            Some(&RunState::Succeeded),
            "{case:?}"
        );
        assert_eq!(
            case.runs.get(&child),
            Some(&RunState::Succeeded),
            "{case:?}"
        );
        assert_eq!(case.runs.len(), 2, "{case:?}");
        let once: BTreeMap<String, usize> =
            [("explored/6/2".to_owned(), 1), ("explored/8".to_owned(), 1)].into();
        assert_eq!(case.executed, once, "{case:?}");
    }
}
