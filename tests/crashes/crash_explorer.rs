//! The crash-point explorer over real agents: every move, crashed before it is applied and
//! after it commits, then resumed; every invariant holds.

use agentrt::{
    Agent, ApprovalReason, Decision, ModelResponse, RunId, ToolCall,
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
