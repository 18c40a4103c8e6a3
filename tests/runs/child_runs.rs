//! Child runs under a fork and a cancel: a fork of a parent delegates anew from its fork point
//! and keeps the answers of the delegations it copies, leaving the origin's children alone; a
//! cancel of the parent reaches down the whole tree of children.

use agentrt::{
    Agent, ChatMessage, Config, Delivery, Error, EventKind, ForkRun, ModelResponse, Outcome,
    ResumeRun, RunId, RunState, StartRun, Store, Supervisor, ToolCall, ToolResult, WaitKind,
    testkit::{Behaviour, RecordingTool, ScriptedModel, TempStore, with_system},
};
use serde_json::json;

use crate::{
    support::{call_then_answer, until_state},
    waits::{until, waiting, waking},
};

/// A supervisor over `store` executing each of `agents` under its name.
fn supervise_all(
    store: Store,
    config: Config,
    agents: Vec<(&str, Agent)>,
) -> actix::Addr<Supervisor> {
    agents
        .into_iter()
        .fold(
            Supervisor::builder(store).config(config),
            |builder, (name, agent)| builder.agent(name, agent),
        )
        .start()
        .unwrap()
}

/// The runs `tool` ran for, in the order it ran.
fn runs_of(tool: &RecordingTool) -> Vec<String> {
    tool.executions().into_iter().map(|e| e.run_id).collect()
}

/// The children whose ends woke `run_id`, as its log says.
fn woken_by(store: &Store, run_id: &str) -> Vec<String> {
    store
        .events(&RunId::from(run_id))
        .unwrap()
        .iter()
        .filter(|e| e.kind == EventKind::WaitWoken)
        .map(|e| e.payload["child"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn a_fork_delegates_anew_from_its_fork_point_keeps_copied_delegations_and_leaves_the_origins_child_alone()
 {
    let db = TempStore::new();
    // The parent hands a task to `research` at step 2 and answers at step 3; the child runs
    // `search`, which counts its executions and blocks until released, then answers.
    let task = json!({"task": "find the paper"});
    let parent = call_then_answer("c1", "research", task, "reported");
    let child = call_then_answer("c1", "search", json!({"q": "paper"}), "found it");
    let search = RecordingTool::new("search").behaviour(Behaviour::Block);
    let agents = || {
        vec![
            (
                "a",
                Agent::new(parent.clone()).delegate("research", "researcher", "Research."),
            ),
            ("researcher", Agent::new(child.clone()).tool(search.clone())),
        ]
    };
    let (store, family) = (db.open(), agents());
    let search2 = search.clone();
    with_system(|| async move {
        let supervisor = supervise_all(store.clone(), waking(), family);
        let reply = supervisor
            .send(StartRun::new("a", json!("go")).with_id("p"))
            .await
            .unwrap()
            .unwrap();
        let wait = waiting(reply.outcome, WaitKind::Child);
        assert_eq!(wait.key, "p/2");
        until(|| search2.executions().len() == 1).await;

        // Forked at step 1, before its delegation, while the origin waits for its child: the
        // fork asks the model again, and delegates to a child of its own.
        let reply = supervisor
            .send(ForkRun::new("p", 1).with_id("before"))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(waiting(reply.outcome, WaitKind::Child).key, "before/2");
        until(|| search2.executions().len() == 2).await;
        // The origin still waits for its own child, which still runs.
        let p = RunId::from("p");
        assert_eq!(store.run(&p).unwrap().state, RunState::WaitingForChild);
        assert_eq!(store.wait(&p).unwrap(), Some(wait));
        assert_eq!(
            store.run(&RunId::from("p/2")).unwrap().state,
            RunState::Running
        );

        search2.release();
        search2.release();
        until_state(&store, &p, RunState::Succeeded).await;
        until_state(&store, &RunId::from("before"), RunState::Succeeded).await;
    });
    let store = db.open();
    assert_eq!(
        runs_of(&search),
        ["p/2", "before/2"],
        "one search per child"
    );
    let new_child = store.run(&RunId::from("before/2")).unwrap();
    assert_eq!(
        (new_child.state, new_child.agent.as_str(), &new_child.input),
        (RunState::Succeeded, "researcher", &json!("find the paper"))
    );
    let started = &store.events(&RunId::from("before/2")).unwrap()[0];
    assert_eq!(started.payload["parent"]["run_id"], "before");
    // Each parent was woken by its own child only.
    assert_eq!(woken_by(&store, "p"), ["p/2"]);
    assert_eq!(woken_by(&store, "before"), ["before/2"]);

    // Forked at step 3, after the delegation: its call is copied with the child's answer, and
    // no child runs again.
    let origin = ["p", "p/2"].map(|id| db.rows_of(id));
    let (store, family) = (db.open(), agents());
    with_system(|| async move {
        let supervisor = supervise_all(store, waking(), family);
        let reply = supervisor
            .send(ForkRun::new("p", 3).with_id("after"))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            reply.outcome,
            Outcome::Succeeded {
                output: "reported".into()
            }
        );
    });
    let store = db.open();
    let seen = parent.seen().pop().unwrap();
    let copied_answer = |m: &ChatMessage| {
        matches!(m, ChatMessage::Tool { call_id, result, .. }
            if call_id == "c1" && *result == ToolResult::Ok(json!("found it")))
    };
    assert!(
        seen.iter().any(copied_answer),
        "the fork's model is given the copied call's answer: {seen:?}"
    );
    assert!(matches!(
        store.run(&RunId::from("after/2")),
        Err(Error::RunNotFound(_))
    ));
    assert_eq!(runs_of(&search), ["p/2", "before/2"], "no search ran again");
    assert_eq!(["p", "p/2"].map(|id| db.rows_of(id)), origin);
    let mut ids: Vec<String> = store
        .runs(None)
        .unwrap()
        .into_iter()
        .map(|run| run.id.to_string())
        .collect();
    ids.sort();
    assert_eq!(
        ids,
        ["after", "before", "before/2", "p", "p/2"],
        "no other run"
    );
}

/// A model that asks for `first` (call `c1`), then for `note` (call `c2`), then answers.
fn then_note(first: &str, args: serde_json::Value) -> ScriptedModel {
    ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new("c1", first, args)]),
        ModelResponse::calls(vec![ToolCall::new("c2", "note", json!({}))]),
        ModelResponse::answer("done"),
    ])
}

#[test]
fn cancelling_a_parent_cancels_its_child_and_its_grandchild_and_none_of_them_goes_on() {
    let db = TempStore::new();
    // Three generations: the parent delegates to a child, which delegates to a grandchild,
    // which waits for an event nobody sends. Each would call `note` if it went on.
    let note = RecordingTool::new("note");
    let models = [
        then_note("research", json!({"task": "dig"})),
        then_note("read", json!({"task": "read"})),
        then_note("wait_for_event", json!({"name": "go-ahead"})),
    ];
    let agents = vec![
        (
            "a",
            Agent::new(models[0].clone()).tool(note.clone()).delegate(
                "research",
                "researcher",
                "Research.",
            ),
        ),
        (
            "researcher",
            Agent::new(models[1].clone())
                .tool(note.clone())
                .delegate("read", "reader", "Read."),
        ),
        (
            "reader",
            Agent::new(models[2].clone())
                .tool(note.clone())
                .wait_for_event(),
        ),
    ];
    let ids = ["p", "p/2", "p/2/2"].map(RunId::from);
    let (store, ids2) = (db.open(), ids.clone());
    with_system(|| async move {
        let supervisor = supervise_all(store.clone(), waking(), agents);
        let reply = supervisor
            .send(StartRun::new("a", json!("go")).with_id("p"))
            .await
            .unwrap()
            .unwrap();
        waiting(reply.outcome, WaitKind::Child);
        let [p, child, grandchild] = &ids2;
        until(|| {
            store
                .run(grandchild)
                .is_ok_and(|run| run.state == RunState::WaitingForEvent)
        })
        .await;
        assert_eq!(store.run(child).unwrap().state, RunState::WaitingForChild);

        // One transaction cancels the three: each is CANCELLED once the cancel returns.
        store.cancel(p, "not needed").unwrap();
        for id in &ids2 {
            let run = store.run(id).unwrap();
            assert_eq!(run.state, RunState::Cancelled, "{id}");
            assert!(run.error.unwrap().contains("not needed"), "{id}");
            assert_eq!(store.wait(id).unwrap(), None, "{id}");
        }
        assert_eq!(store.waits(None, None, 10).unwrap(), vec![]);

        // Nothing wakes them again: a resume is refused, and so is the event.
        for id in &ids2 {
            let err = supervisor
                .send(ResumeRun::new(id.clone()))
                .await
                .unwrap()
                .unwrap_err();
            assert!(err.is_run_state(), "{id}: {err}");
        }
        let delivery = Delivery {
            run_id: grandchild.clone(),
            name: "go-ahead".into(),
            event_id: "evt-1".into(),
            payload: json!({}),
        };
        let err = store.deliver_event(&delivery).unwrap_err();
        assert!(err.is_run_state(), "{err}");
    });
    let store = db.open();
    for (id, model) in ids.iter().zip(&models) {
        if id.as_str() != "p" {
            let error = store.run(id).unwrap().error.unwrap();
            assert!(
                error.contains("its parent run was cancelled"),
                "{id}: {error}"
            );
        }
        let events = store.events(id).unwrap();
        let last = events.last().unwrap();
        assert_eq!(
            (last.kind, &last.payload["state"]),
            (EventKind::RunFinished, &json!("CANCELLED")),
            "{id}: nothing after its cancel"
        );
        assert_eq!(model.calls(), 1, "{id}: its model was asked once");
    }
    assert!(note.executions().is_empty(), "no run went on to `note`");
}
