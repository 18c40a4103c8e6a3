//! The helpers of the behaviour tests, in one place: each test binary (`tests/<area>/main.rs`)
//! includes this module tree once, as `crate::support`. Each binary uses its own part.

#![allow(dead_code)]

pub mod child;
pub mod cli;
#[cfg(any(feature = "openai", feature = "anthropic"))]
pub mod fake_llm;
#[cfg(feature = "web")]
pub mod metrics;
pub mod migrations;
pub mod settled;
#[cfg(feature = "web")]
pub mod web;

// The examples' own helpers that tests check too; the examples include them from there.
#[path = "../../examples/support/chaos_classes.rs"]
pub mod chaos_classes;
#[path = "../../examples/support/chaos_hosts.rs"]
pub mod chaos_hosts;
#[path = "../../examples/support/quickstart_agent.rs"]
pub mod quickstart_agent;

use std::{collections::BTreeMap, future::Future, path::Path, time::Duration};

use actix::{Addr, Handler};
use agentrt::{
    Agent, Approval, ChatMessage, Config, Event, EventKind, ModelResponse, Outcome, RecordApproval,
    RequireApprovalFor, ResumeRun, RunId, RunReply, SpawnRun, StartRun, Store, Supervisor,
    ToolCall, ToolResult,
    testkit::{RecordingTool, ScriptedModel, TempStore, resume_when_free, with_system},
};
use serde_json::{Value, json};

/// How long a resume waits for a dead supervisor's lease at most.
pub const PATIENCE: Duration = Duration::from_secs(10);

/// A short TTL: a crashed supervisor's runs are free again quickly.
pub fn fast_lease() -> Config {
    Config::default().lease_ttl(Duration::from_millis(300))
}

/// A model that asks for one call `id` of `tool` with `args`, then answers `answer`.
pub fn call_then_answer(id: &str, tool: &str, args: Value, answer: &str) -> ScriptedModel {
    ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new(id, tool, args)]),
        ModelResponse::answer(answer),
    ])
}

/// A model that asks for `pay` to pay 100 cents (call `pay-1`), then answers "paid".
pub fn pay_then_answer() -> ScriptedModel {
    call_then_answer("pay-1", "pay", json!({"cents": 100}), "paid")
}

/// The model of the approval tests: it asks for `transfer` (call `pay-1`), then answers.
pub fn transfer_then_answer() -> ScriptedModel {
    call_then_answer("pay-1", "transfer", json!({"amount": 100}), "finished")
}

/// An agent whose model asks for `tool` to provision an `xl` (call `c1`), then answers: the
/// run the child-process tests leave behind.
pub fn provisioning(tool: &RecordingTool) -> Agent {
    let model = call_then_answer("c1", "provision", json!({"size": "xl"}), "provisioned");
    Agent::new(model).tool(tool.clone())
}

/// A supervisor over `store` with `config`, executing `agent` as `name`, started in the
/// current actix system.
pub fn supervise(store: Store, config: Config, name: &str, agent: Agent) -> Addr<Supervisor> {
    Supervisor::builder(store)
        .config(config)
        .agent(name, agent)
        .start()
        .unwrap()
}

/// Sends `msg` to a new supervisor ([`supervise`]) in an actix system of its own, and answers
/// its reply.
pub fn ask<M>(store: Store, config: Config, name: &str, agent: Agent, msg: M) -> M::Result
where
    M: actix::Message + Send + 'static,
    M::Result: Send,
    Supervisor: Handler<M>,
{
    with_system(|| async move {
        let supervisor = supervise(store, config, name, agent);
        supervisor.send(msg).await.unwrap()
    })
}

/// Runs `run-1` of `agent` (as `a`) on `input` on a new supervisor over `db`, until it ends or
/// waits; answers how the call ended.
pub fn outcome_of(db: &TempStore, agent: Agent, input: Value) -> Outcome {
    let start = StartRun::new("a", input).with_id("run-1");
    ask(db.open(), Config::default(), "a", agent, start)
        .unwrap()
        .outcome
}

/// Starts run `id` of `agent` on `supervisor` in the background (`SpawnRun`), once it is
/// durable.
pub async fn spawn(supervisor: &Addr<Supervisor>, agent: &str, id: impl Into<RunId>) {
    supervisor
        .send(SpawnRun::new(agent, json!({})).with_id(id))
        .await
        .unwrap()
        .unwrap();
}

/// Sends `msg` to a new supervisor ([`supervise`]) and crashes it once `until` completes: its
/// actix system goes away with no further write, and the call never answers.
pub fn crash_when<M>(
    store: Store,
    config: Config,
    name: &str,
    agent: Agent,
    msg: M,
    until: impl Future<Output = ()>,
) where
    M: actix::Message + Send + 'static,
    M::Result: Send,
    Supervisor: Handler<M>,
{
    with_system(|| async move {
        let supervisor = supervise(store, config, name, agent);
        actix_rt::spawn(supervisor.send(msg));
        until.await;
    })
}

/// Sends `msg` to a new supervisor of `agent` as `name` over `db`, under a [`fast_lease`], and
/// crashes it once `tool` is executing ([`crash_when`]).
pub fn crash_in_tool<M>(db: &TempStore, name: &str, agent: Agent, msg: M, tool: &RecordingTool)
where
    M: actix::Message + Send + 'static,
    M::Result: Send,
    Supervisor: Handler<M>,
{
    crash_when(
        db.open(),
        fast_lease(),
        name,
        agent,
        msg,
        tool.wait_executions(1),
    );
}

/// Resumes `run_id` on a new supervisor ([`supervise`]) once the lease a dead one left has
/// expired ([`resume_when_free`], for `patience` at most).
pub fn resume_when_free_on(
    store: Store,
    config: Config,
    name: &str,
    agent: Agent,
    run_id: &RunId,
    patience: Duration,
) -> agentrt::Result<RunReply> {
    let run_id = run_id.clone();
    with_system(|| async move {
        let supervisor = supervise(store, config, name, agent);
        resume_when_free(&supervisor, &run_id, patience).await
    })
}

/// Records `approval` on `supervisor`, then resumes the run it decides.
pub async fn decide_then_resume(
    supervisor: &Addr<Supervisor>,
    approval: Approval,
) -> agentrt::Result<RunReply> {
    let run_id = approval.run_id.clone();
    supervisor
        .send(RecordApproval(approval))
        .await
        .unwrap()
        .unwrap();
    supervisor.send(ResumeRun::new(run_id)).await.unwrap()
}

/// Records `approval` on a new supervisor ([`supervise`]) in an actix system of its own, then
/// resumes the run it decides.
pub fn record_then_resume(
    store: Store,
    config: Config,
    name: &str,
    agent: Agent,
    approval: Approval,
) -> agentrt::Result<RunReply> {
    with_system(|| async move {
        let supervisor = supervise(store, config, name, agent);
        decide_then_resume(&supervisor, approval).await
    })
}

/// Starts a run with `start` on a new supervisor ([`supervise`]) in an actix system of its
/// own, checks that it waits for a decision, records `decision` and resumes the run. Answers
/// the resumed run's outcome.
pub fn start_then_decide(
    store: Store,
    config: Config,
    name: &str,
    agent: Agent,
    start: StartRun,
    decision: Approval,
) -> Outcome {
    with_system(|| async move {
        let supervisor = supervise(store, config, name, agent);
        let started = supervisor.send(start).await.unwrap().unwrap();
        assert!(matches!(
            started.outcome,
            Outcome::WaitingForApproval { .. }
        ));
        let resumed = decide_then_resume(&supervisor, decision).await;
        resumed.unwrap().outcome
    })
}

/// Runs `run_id` of agent `support`, whose model asks to send an email (call `c1`) that waits
/// for an approval ([`start_then_decide`]), carol approving it. Answers the resumed run's
/// outcome.
pub fn email_approved_by_carol(store: Store, run_id: &str) -> Outcome {
    let model = call_then_answer("c1", "email", json!({}), "sent");
    let agent = Agent::new(model)
        .tool(RecordingTool::new("email"))
        .policy(RequireApprovalFor::tools(["email"]));
    let start = StartRun::new("support", json!({})).with_id(run_id);
    let approval = Approval::approve(run_id, "c1", "carol");
    start_then_decide(store, Config::default(), "support", agent, start, approval)
}

/// The kinds of `events`, in order.
pub fn kinds(events: &[Event]) -> Vec<EventKind> {
    events.iter().map(|e| e.kind).collect()
}

/// The kinds of the events of `run_id`, in order.
pub fn kinds_of(store: &Store, run_id: &RunId) -> Vec<EventKind> {
    kinds(&store.events(run_id).unwrap())
}

/// The tool results the model saw on its last turn.
pub fn results_seen(model: &ScriptedModel) -> Vec<ToolResult> {
    model
        .seen()
        .pop()
        .unwrap()
        .into_iter()
        .filter_map(|m| match m {
            ChatMessage::Tool { result, .. } => Some(result),
            _ => None,
        })
        .collect()
}

/// The tool result the model saw for its call, on its last turn.
pub fn last_tool_result(model: &ScriptedModel) -> ToolResult {
    model
        .seen()
        .last()
        .unwrap()
        .iter()
        .rev()
        .find_map(|m| match m {
            ChatMessage::Tool { result, .. } => Some(result.clone()),
            _ => None,
        })
        .unwrap()
}

/// The idempotency keys of `tool`'s executions, in the order they ran.
pub fn idempotency_keys(tool: &RecordingTool) -> Vec<String> {
    tool.executions()
        .iter()
        .map(|e| e.idempotency_key.clone())
        .collect()
}

/// Every file of `dir`, by name, with its bytes.
pub fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| {
            let entry = entry.unwrap();
            (
                entry.file_name().to_string_lossy().into_owned(),
                std::fs::read(entry.path()).unwrap(),
            )
        })
        .collect()
}

/// The entries of `dir`, by name, with their kind and length, found without opening any (a
/// named pipe would hang a read).
pub fn entries(dir: &Path) -> BTreeMap<String, (String, u64)> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| {
            let entry = entry.unwrap();
            let metadata = std::fs::symlink_metadata(entry.path()).unwrap();
            let kind = format!("{:?}", metadata.file_type());
            (
                entry.file_name().to_string_lossy().into_owned(),
                (kind, metadata.len()),
            )
        })
        .collect()
}

/// Waits, polling the store, until run `run_id` is in `state`; panics after a minute (a
/// bound for a loaded machine, not a guess at how long it takes).
pub async fn until_state(store: &Store, run_id: &RunId, state: agentrt::RunState) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let now = store.run(run_id).unwrap().state;
        if now == state {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "run {run_id} stayed {now}, never {state}"
        );
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
}
