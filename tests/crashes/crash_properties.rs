//! A property test: random scripted agents (steps, tool mix, policy decisions, approvals,
//! idempotent or not, with or without a reconcile hook) crossed with random crash points; the
//! explorer's invariants hold in every case.

use std::time::Duration;

use agentrt::{
    Agent, Decision, ModelResponse, Reconciliation, RunId, ToolCall,
    testkit::{Behaviour, CrashPoint, Explorer, ReconcileHook, RecordingTool, ScriptedModel},
};
use proptest::prelude::*;
use serde_json::json;

#[derive(Debug, Clone)]
enum Hook {
    None,
    FromLog,
    Unknown,
    NotApplied,
}

#[derive(Debug, Clone)]
enum Rule {
    Allow,
    Deny,
    RequireApproval,
}

#[derive(Debug, Clone)]
struct ToolSpec {
    idempotent: bool,
    hook: Hook,
    fails: bool,
    rule: Rule,
}

#[derive(Debug, Clone)]
struct Case {
    tools: Vec<ToolSpec>,
    /// Per model turn, the tools it calls (indexes into `tools`, or past the end: a tool the
    /// agent does not have).
    turns: Vec<Vec<usize>>,
    /// The person approves (true) or denies every call that waits.
    approves: bool,
    /// Where to crash, as a fraction of the run's moves.
    at: f64,
    after_commit: bool,
}

fn tool_spec() -> impl Strategy<Value = ToolSpec> {
    (
        any::<bool>(),
        prop_oneof![Just(Hook::None), Just(Hook::FromLog), Just(Hook::Unknown), Just(Hook::NotApplied)],
        prop::bool::weighted(0.2),
        prop_oneof![3 => Just(Rule::Allow), 1 => Just(Rule::Deny), 2 => Just(Rule::RequireApproval)],
    )
        .prop_map(|(idempotent, hook, fails, rule)| ToolSpec { idempotent, hook, fails, rule })
}

fn case() -> impl Strategy<Value = Case> {
    prop::collection::vec(tool_spec(), 1..=4).prop_flat_map(|tools| {
        let n = tools.len();
        (
            Just(tools),
            // Now and then a call of a tool the agent lacks (index n).
            prop::collection::vec(prop::collection::vec(0..=n, 1..=3), 1..=4),
            any::<bool>(),
            0.0..1.0f64,
            any::<bool>(),
        )
            .prop_map(|(tools, turns, approves, at, after_commit)| Case {
                tools,
                turns,
                approves,
                at,
                after_commit,
            })
    })
}

fn build(case: &Case) -> Agent {
    let mut script: Vec<ModelResponse> = case
        .turns
        .iter()
        .enumerate()
        .map(|(t, calls)| {
            ModelResponse::calls(
                calls
                    .iter()
                    .enumerate()
                    .map(|(i, tool)| {
                        ToolCall::new(format!("c{t}-{i}"), format!("t{tool}"), json!({"i": i}))
                    })
                    .collect(),
            )
        })
        .collect();
    script.push(ModelResponse::answer("end"));
    let rules: Vec<Rule> = case.tools.iter().map(|tool| tool.rule.clone()).collect();
    let policy = move |_: &RunId, call: &ToolCall| {
        let index: usize = call.name[1..].parse().unwrap();
        match rules.get(index) {
            Some(Rule::Deny) => Decision::Deny("not this one".into()),
            Some(Rule::RequireApproval) => Decision::RequireApproval("a person decides".into()),
            _ => Decision::Allow,
        }
    };
    let mut agent = Agent::new(ScriptedModel::new(script)).policy(policy);
    for (index, spec) in case.tools.iter().enumerate() {
        let hook = match spec.hook {
            Hook::None => ReconcileHook::None,
            Hook::FromLog => ReconcileHook::FromLog,
            Hook::Unknown => ReconcileHook::Answer(Reconciliation::Unknown),
            Hook::NotApplied => ReconcileHook::Answer(Reconciliation::NotApplied),
        };
        let behaviour = if spec.fails {
            Behaviour::Fail("boom".into())
        } else {
            Behaviour::Succeed
        };
        agent = agent.tool(
            RecordingTool::new(format!("t{index}"))
                .idempotent(spec.idempotent)
                .reconcile_hook(hook)
                .behaviour(behaviour),
        );
    }
    agent
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn random_agents_crashed_at_random_moves_keep_the_invariants(case in case()) {
        let approves = case.approves;
        let spec = case.clone();
        let explorer = Explorer::new(move || build(&spec))
            .approve_with(move |_| approves)
            .lease_ttl(Duration::from_millis(60));
        let moves = explorer.count_moves();
        let k = 1 + ((case.at * moves as f64) as usize).min(moves - 1);
        let crash = if case.after_commit { CrashPoint::AfterCommit(k) } else { CrashPoint::BeforeApply(k) };
        let report = explorer.run_case(crash);
        prop_assert!(report.violations.is_empty(), "{:?} with {:?}", report, case);
        // The uncrashed run's count of moves includes any a loaded machine added (a lease
        // lost to a late renewal, then taken over): a case whose run took fewer moves never
        // reaches its crash point, and proves nothing about crashes.
        prop_assume!(report.crashed);
    }
}
