//! Runs that wait for a person's answer, an event, a time or a child run: each holds no lease
//! while it waits, survives a restart, and goes on with what came.

use std::{
    sync::{
        Arc, Condvar, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use agentrt::{
    Agent, Answer, Config, Delivered, Delivery, Error, EventKind, ModelResponse, Outcome, Recovery,
    ResumeRun, RunId, RunState, SpawnRun, StartRun, ToolCall, ToolResult, WaitKind, Watch,
    testkit::{ManualClock, RecordingTool, ScriptedModel, TempStore, with_system},
};
use serde_json::json;

use crate::support::{ask, kinds_of, last_tool_result, supervise, until_state};

/// A supervisor that hears of woken waits and due timers quickly.
pub(crate) fn waking() -> Config {
    Config::default()
        .watch(Watch::default().every(Duration::from_millis(10)))
        .recovery(Recovery::default().every(Duration::from_millis(50)))
        .lease_ttl(Duration::from_millis(500))
}

fn one_call(tool: &str, args: serde_json::Value, answer: &str) -> ScriptedModel {
    ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new("c1", tool, args)]),
        ModelResponse::answer(answer),
    ])
}

/// Starts run `id` of `agent` (as `a`); answers how the call ended.
fn start(db: &TempStore, agent: Agent, id: &str) -> Outcome {
    let start = StartRun::new("a", json!("go")).with_id(id);
    ask(db.open(), Config::default(), "a", agent, start)
        .unwrap()
        .outcome
}

/// The wait `outcome` says the run is in, which must be of `kind`.
pub(crate) fn waiting(outcome: Outcome, kind: WaitKind) -> agentrt::Wait {
    match outcome {
        Outcome::Waiting { wait } if wait.kind == kind => wait,
        other => panic!("expected a wait for {kind}, got {other:?}"),
    }
}

#[test]
fn a_question_waits_with_no_lease_refuses_an_answer_off_its_schema_and_resumes_with_the_answer_after_a_restart()
 {
    let db = TempStore::new();
    let schema = json!({
        "type": "object",
        "properties": {"account": {"type": "string"}},
        "required": ["account"]
    });
    let model = one_call(
        "ask_person",
        json!({"question": "Which account?", "schema": schema}),
        "done",
    );
    let agent = || Agent::new(model.clone()).ask_person();
    let wait = waiting(start(&db, agent(), "q1"), WaitKind::Answer);
    assert_eq!(wait.call_id, "c1");
    assert_eq!(wait.detail["question"], json!("Which account?"));

    let store = db.open();
    let run_id = RunId::from("q1");
    assert_eq!(
        store.run(&run_id).unwrap().state,
        RunState::WaitingForAnswer
    );
    assert!(
        store.lease(&run_id).unwrap().is_none(),
        "a waiting run holds no lease"
    );
    assert_eq!(store.wait(&run_id).unwrap(), Some(wait.clone()));
    assert_eq!(
        store.waits(Some(WaitKind::Answer), None, 10).unwrap(),
        vec![wait]
    );

    let events = store.events(&run_id).unwrap().len();
    let off_schema = Answer {
        run_id: run_id.clone(),
        call_id: "c1".into(),
        answer: json!({"acct": 7}),
        by: "alice".into(),
    };
    let err = store.answer(&off_schema).unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err}");
    assert!(err.to_string().contains("account"), "{err}");
    assert_eq!(
        store.events(&run_id).unwrap().len(),
        events,
        "a refusal writes nothing"
    );
    let unknown = Answer {
        call_id: "c9".into(),
        ..off_schema.clone()
    };
    assert!(matches!(
        store.answer(&unknown),
        Err(Error::CallNotFound { .. })
    ));

    let answer = Answer {
        answer: json!({"account": "savings"}),
        ..off_schema
    };
    store.answer(&answer).unwrap();
    let again = store.answer(&answer).unwrap_err();
    assert!(again.is_run_state(), "{again}");

    // A new process (a new system) resumes it.
    let reply = ask(
        db.open(),
        Config::default(),
        "a",
        agent(),
        ResumeRun::new("q1"),
    )
    .unwrap();
    assert_eq!(
        reply.outcome,
        Outcome::Succeeded {
            output: "done".into()
        }
    );
    assert_eq!(
        last_tool_result(&model),
        ToolResult::Ok(json!({"account": "savings"}))
    );
    assert_eq!(db.open().wait(&run_id).unwrap(), None);
    let kinds = kinds_of(&db.open(), &run_id);
    assert!(kinds.contains(&EventKind::WaitWoken), "{kinds:?}");
}

#[test]
fn an_answer_recorded_elsewhere_wakes_the_run_through_a_watching_supervisor() {
    let db = TempStore::new();
    let model = one_call("ask_person", json!({"question": "Go ahead?"}), "went");
    let agent = Agent::new(model.clone()).ask_person();
    let store = db.open();
    with_system(|| async move {
        let supervisor = supervise(store.clone(), waking(), "a", agent);
        supervisor
            .send(SpawnRun::new("a", json!("go")).with_id("q2"))
            .await
            .unwrap()
            .unwrap();
        let run_id = RunId::from("q2");
        until_state(&store, &run_id, RunState::WaitingForAnswer).await;
        let answer = Answer {
            run_id: run_id.clone(),
            call_id: "c1".into(),
            answer: json!("yes"),
            by: "bob".into(),
        };
        store.answer(&answer).unwrap();
        until_state(&store, &run_id, RunState::Succeeded).await;
    });
    assert_eq!(last_tool_result(&model), ToolResult::Ok(json!("yes")));
}

#[test]
fn an_event_delivered_before_its_wait_is_kept_and_a_repeated_delivery_is_kept_once() {
    let db = TempStore::new();
    let store = db.open();
    let model = ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new("c1", "pay", json!({}))]),
        ModelResponse::calls(vec![ToolCall::new(
            "c2",
            "wait_for_event",
            json!({"name": "payment"}),
        )]),
        ModelResponse::calls(vec![ToolCall::new(
            "c3",
            "wait_for_event",
            json!({"name": "payment"}),
        )]),
        ModelResponse::answer("paid twice"),
    ]);
    // The first call blocks until released: the event arrives while the run is RUNNING.
    let pay = RecordingTool::new("pay").behaviour(agentrt::testkit::Behaviour::Block);
    let agent = Agent::new(model.clone()).tool(pay.clone()).wait_for_event();
    let delivery = |id: &str, amount: u32| Delivery {
        run_id: RunId::from("e1"),
        name: "payment".into(),
        event_id: id.into(),
        payload: json!({ "amount": amount }),
    };
    let (store2, pay2) = (store.clone(), pay.clone());
    with_system(|| async move {
        let supervisor = supervise(store2.clone(), Config::default(), "a", agent);
        let run = supervisor.send(StartRun::new("a", json!("go")).with_id("e1"));
        let started = actix_rt::spawn(run);
        let run_id = RunId::from("e1");
        while pay2.executions().is_empty() {
            actix_rt::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(
            store2.deliver_event(&delivery("evt-1", 10)).unwrap(),
            Delivered::Kept
        );
        assert_eq!(
            store2.deliver_event(&delivery("evt-1", 99)).unwrap(),
            Delivered::Duplicate
        );
        pay2.release();
        let reply = started.await.unwrap().unwrap().unwrap();
        // The kept event was taken at once; the second wait waits.
        let wait = waiting(reply.outcome, WaitKind::Event);
        assert_eq!(wait.step, 6);
        assert_eq!(
            store2.run(&run_id).unwrap().state,
            RunState::WaitingForEvent
        );
    });
    // The process is gone when the event comes: it is recorded, and the next process to
    // start with the run's agent resumes the run from it.
    let run_id = RunId::from("e1");
    assert_eq!(
        store.deliver_event(&delivery("evt-2", 20)).unwrap(),
        Delivered::Woke
    );
    assert_eq!(
        store.deliver_event(&delivery("evt-2", 20)).unwrap(),
        Delivered::Duplicate
    );
    let (store3, agent) = (
        store.clone(),
        Agent::new(model.clone()).tool(pay).wait_for_event(),
    );
    with_system(|| async move {
        let _supervisor = supervise(store3.clone(), waking(), "a", agent);
        until_state(&store3, &run_id, RunState::Succeeded).await;
    });
    assert_eq!(
        store.run(&RunId::from("e1")).unwrap().output.as_deref(),
        Some("paid twice")
    );
    let results = crate::support::results_seen(&model);
    assert_eq!(
        results[1..],
        [
            ToolResult::Ok(json!({"amount": 10})),
            ToolResult::Ok(json!({"amount": 20}))
        ]
    );
    assert!(matches!(
        store.deliver_event(&Delivery {
            run_id: RunId::from("nobody"),
            ..delivery("evt-3", 1)
        }),
        Err(Error::RunNotFound(_))
    ));
    let finished = store.deliver_event(&delivery("evt-3", 1)).unwrap_err();
    assert!(finished.is_run_state(), "{finished}");
}

#[test]
fn a_timer_fires_after_downtime_when_a_recovering_supervisor_starts() {
    let db = TempStore::new();
    let clock = ManualClock::new();
    let model = one_call(
        "sleep_until",
        json!({"seconds": 3600, "reason": "check tomorrow"}),
        "woke",
    );
    let agent = || Agent::new(model.clone()).sleep_until();
    let config = Config::default().clock(clock.clone());
    let start = StartRun::new("a", json!("go")).with_id("t1");
    let reply = ask(db.open(), config.clone(), "a", agent(), start).unwrap();
    let wait = waiting(reply.outcome, WaitKind::Timer);
    assert_eq!(wait.key, "check tomorrow");
    assert!(wait.due_at.is_some());
    // Not due: a resume changes nothing.
    let reply = ask(
        db.open(),
        config.clone(),
        "a",
        agent(),
        ResumeRun::new("t1"),
    )
    .unwrap();
    assert!(matches!(reply.outcome, Outcome::Waiting { .. }));

    // Downtime: no process runs while the time passes.
    clock.advance(Duration::from_secs(3601));
    let store = db.open();
    let config = waking().clock(clock.clone());
    with_system(|| async move {
        let _supervisor = supervise(store.clone(), config, "a", agent());
        until_state(&store, &RunId::from("t1"), RunState::Succeeded).await;
    });
    let ToolResult::Ok(woke) = last_tool_result(&model) else {
        panic!("the timer's call failed")
    };
    assert_eq!(woke["reason"], json!("check tomorrow"));
}

#[test]
fn a_tool_that_asks_to_be_called_again_later_is_called_again_once_its_time_comes() {
    let db = TempStore::new();
    let clock = ManualClock::new();
    let model = one_call("report", json!({}), "ready");
    let (store, tool_clock) = (db.open(), clock.clone());
    let agent = Agent::new(model.clone()).tool(Report(tool_clock));
    let config = waking().clock(clock.clone());
    let clock2 = clock.clone();
    with_system(|| async move {
        let supervisor = supervise(store.clone(), config, "a", agent);
        let reply = supervisor
            .send(StartRun::new("a", json!("go")).with_id("t2"))
            .await
            .unwrap()
            .unwrap();
        let wait = waiting(reply.outcome, WaitKind::Timer);
        assert_eq!(wait.detail["retry"], json!(true));
        clock2.advance(Duration::from_secs(601));
        until_state(&store, &RunId::from("t2"), RunState::Succeeded).await;
    });
    assert_eq!(
        last_tool_result(&model),
        ToolResult::Ok(json!({"attempt": 2}))
    );
}

/// A report that is not ready at the first attempt: it asks to be called again in ten minutes.
struct Report(ManualClock);

#[agentrt::async_trait(?Send)]
impl agentrt::Tool for Report {
    fn name(&self) -> &str {
        "report"
    }

    async fn call(
        &self,
        ctx: &agentrt::ToolContext,
        _: &serde_json::Value,
    ) -> Result<serde_json::Value, agentrt::ToolError> {
        if ctx.attempt == 1 {
            let later = agentrt::Clock::now(&self.0) + Duration::from_secs(600);
            return Err(ctx.call_again_at(later, "not ready"));
        }
        Ok(json!({"attempt": ctx.attempt}))
    }
}

/// A parent that delegates to `research`, and the child agent.
fn family(parent: &ScriptedModel, child: &ScriptedModel) -> (Agent, Agent) {
    let parent = Agent::new(parent.clone()).delegate(
        "research",
        "researcher",
        "Hand a research task to the research agent.",
    );
    (parent, Agent::new(child.clone()))
}

fn supervise_family(
    store: agentrt::Store,
    config: Config,
    parent: Agent,
    child: Agent,
) -> actix::Addr<agentrt::Supervisor> {
    agentrt::Supervisor::builder(store)
        .config(config)
        .agent("a", parent)
        .agent("researcher", child)
        .start()
        .unwrap()
}

#[test]
fn a_child_run_answers_its_parent_and_its_failure_is_the_parents_tool_error() {
    for (child_script, expected) in [
        (
            ScriptedModel::new(vec![ModelResponse::answer("found it")]),
            ToolResult::Ok(json!("found it")),
        ),
        (
            ScriptedModel::with_results(vec![Err(agentrt::ModelError::fatal("no such paper"))]),
            ToolResult::Error(String::new()),
        ),
    ] {
        let db = TempStore::new();
        let parent = one_call("research", json!({"task": "find the paper"}), "reported");
        let (parent_agent, child_agent) = family(&parent, &child_script);
        let store = db.open();
        with_system(|| async move {
            let supervisor = supervise_family(store.clone(), waking(), parent_agent, child_agent);
            let reply = supervisor
                .send(StartRun::new("a", json!("go")).with_id("p1"))
                .await
                .unwrap()
                .unwrap();
            let wait = waiting(reply.outcome, WaitKind::Child);
            assert_eq!(wait.key, "p1/2");
            assert_eq!(
                store.run(&RunId::from("p1")).unwrap().state,
                RunState::WaitingForChild
            );
            until_state(&store, &RunId::from("p1"), RunState::Succeeded).await;
        });
        let child = db.open().run(&RunId::from("p1/2")).unwrap();
        assert_eq!(child.input, json!("find the paper"));
        match (last_tool_result(&parent), expected) {
            (ToolResult::Ok(seen), ToolResult::Ok(want)) => assert_eq!(seen, want),
            (ToolResult::Error(seen), ToolResult::Error(_)) => {
                assert_eq!(child.state, RunState::Failed);
                assert!(
                    seen.contains("p1/2") && seen.contains("no such paper"),
                    "{seen}"
                );
            }
            (seen, want) => panic!("saw {seen:?}, wanted {want:?}"),
        }
        let started = &db.open().events(&RunId::from("p1/2")).unwrap()[0];
        assert_eq!(started.payload["parent"]["run_id"], json!("p1"));
    }
}

#[test]
fn cancelling_a_parent_cancels_the_child_it_waits_for() {
    let db = TempStore::new();
    let parent = one_call("research", json!({"task": "slow task"}), "never");
    let child = ScriptedModel::new(vec![ModelResponse::answer("late")]).block_at_turn(0);
    let (parent_agent, child_agent) = family(&parent, &child);
    let store = db.open();
    let child2 = child.clone();
    with_system(|| async move {
        let supervisor = supervise_family(store.clone(), waking(), parent_agent, child_agent);
        let reply = supervisor
            .send(StartRun::new("a", json!("go")).with_id("p2"))
            .await
            .unwrap()
            .unwrap();
        waiting(reply.outcome, WaitKind::Child);
        store.cancel(&RunId::from("p2"), "not needed").unwrap();
        until_state(&store, &RunId::from("p2/2"), RunState::Cancelled).await;
        child2.release();
    });
    let store = db.open();
    assert_eq!(
        store.run(&RunId::from("p2")).unwrap().state,
        RunState::Cancelled
    );
    let child = store.run(&RunId::from("p2/2")).unwrap();
    assert_eq!(child.state, RunState::Cancelled);
    assert!(child.error.unwrap().contains("parent"));
    assert_eq!(store.wait(&RunId::from("p2")).unwrap(), None);
}

#[test]
fn a_child_left_by_its_parents_process_is_run_elsewhere_and_wakes_the_parent_after_a_restart() {
    let db = TempStore::new();
    let parent = one_call("research", json!({"task": "dig"}), "reported");
    let child = ScriptedModel::new(vec![ModelResponse::answer("dug")]);
    let (parent_agent, child_agent) = family(&parent, &child);
    // The parent's process has no research agent: the child waits for one.
    let start = StartRun::new("a", json!("go")).with_id("p3");
    let reply = ask(
        db.open(),
        Config::default(),
        "a",
        parent_agent.clone(),
        start,
    )
    .unwrap();
    waiting(reply.outcome, WaitKind::Child);
    // A process with only the research agent takes the child up and finishes it.
    let store = db.open();
    with_system(|| async move {
        let _supervisor = supervise(store.clone(), waking(), "researcher", child_agent);
        until_state(&store, &RunId::from("p3/2"), RunState::Succeeded).await;
    });
    // The parent's wake-up was recorded while no process ran its agent.
    let store = db.open();
    assert_eq!(
        store.run(&RunId::from("p3")).unwrap().state,
        RunState::WaitingForChild
    );
    with_system(|| async move {
        let _supervisor = supervise(store.clone(), waking(), "a", parent_agent);
        until_state(&store, &RunId::from("p3"), RunState::Succeeded).await;
    });
    assert_eq!(last_tool_result(&parent), ToolResult::Ok(json!("dug")));
}

#[test]
fn a_question_whose_schema_cannot_check_an_answer_is_refused_to_the_model_instead_of_waiting() {
    let db = TempStore::new();
    let model = one_call(
        "ask_person",
        json!({"question": "Which account?", "schema": {"type": "no-such-type"}}),
        "asked badly",
    );
    let outcome = start(&db, Agent::new(model.clone()).ask_person(), "q9");
    assert_eq!(
        outcome,
        Outcome::Succeeded {
            output: "asked badly".into()
        }
    );
    let ToolResult::Error(error) = last_tool_result(&model) else {
        panic!("the call did not fail")
    };
    assert!(error.contains("schema"), "{error}");
}

/// Holds the store actor's thread after the first commit of a move of `kind`, until released:
/// the call that made the move does not hear of it meanwhile.
#[derive(Clone)]
struct HoldAfter {
    kind: agentrt::MoveKind,
    /// Whether it holds, and whether it was released.
    state: Arc<(Mutex<(bool, bool)>, Condvar)>,
}

impl HoldAfter {
    fn new(kind: agentrt::MoveKind) -> Self {
        HoldAfter {
            kind,
            state: Arc::default(),
        }
    }

    fn holding(&self) -> bool {
        self.state.0.lock().unwrap().0
    }

    fn release(&self) {
        self.state.0.lock().unwrap().1 = true;
        self.state.1.notify_all();
    }
}

impl agentrt::MoveObserver for HoldAfter {
    fn after_commit(&self, info: &agentrt::MoveInfo) {
        let (state, released) = &*self.state;
        let mut state = state.lock().unwrap();
        if info.kind != self.kind || state.0 {
            return;
        }
        state.0 = true;
        while !state.1 {
            state = released.wait(state).unwrap();
        }
    }
}

/// A tool that waits for its cancellation signal, and says when it is running and when the
/// signal fired.
#[derive(Clone, Default)]
struct Listen {
    running: Arc<AtomicBool>,
    told: Arc<AtomicBool>,
}

#[agentrt::async_trait(?Send)]
impl agentrt::Tool for Listen {
    fn name(&self) -> &str {
        "listen"
    }

    async fn call(
        &self,
        ctx: &agentrt::ToolContext,
        _: &serde_json::Value,
    ) -> Result<serde_json::Value, agentrt::ToolError> {
        self.running.store(true, Ordering::SeqCst);
        ctx.cancellation.cancelled().await;
        self.told.store(true, Ordering::SeqCst);
        Err(agentrt::ToolError::new("cancelled"))
    }
}

/// Waits, polling, until `condition` holds; panics after a minute.
pub(crate) async fn until(condition: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !condition() {
        assert!(std::time::Instant::now() < deadline, "never happened");
        actix_rt::time::sleep(Duration::from_millis(5)).await;
    }
}

#[test]
fn an_answer_the_watch_hears_while_the_execution_that_asked_returns_resumes_the_run() {
    let db = TempStore::new();
    // The execution that asks does not hear its wait's commit until released.
    let hold = HoldAfter::new(agentrt::MoveKind::BeginWait);
    // A watch and no recovery: only the watch hears of the answer.
    let config = Config::default()
        .watch(Watch::default().every(Duration::from_millis(5)))
        .observer(hold.clone());
    let asker = one_call("ask_person", json!({"question": "Go?"}), "went");
    let listen = Listen::default();
    let listener = Agent::new(one_call("listen", json!({}), "stopped")).tool(listen.clone());
    let (store, hold2, asker2) = (db.open(), hold.clone(), asker.clone());
    with_system(|| async move {
        let supervisor = agentrt::Supervisor::builder(store.clone())
            .config(config)
            .agent("a", Agent::new(asker2).ask_person())
            .agent("b", listener)
            .start()
            .unwrap();
        // Run b listens for a cancel: its signal fires when the watch hears of one.
        supervisor
            .send(SpawnRun::new("b", json!("go")).with_id("b1"))
            .await
            .unwrap()
            .unwrap();
        until(|| listen.running.load(Ordering::SeqCst)).await;
        // Run a asks, and its execution is held right after its wait commits.
        actix_rt::spawn(supervisor.send(SpawnRun::new("a", json!("go")).with_id("a1")));
        until(|| hold2.holding()).await;
        // Elsewhere: the question is answered, then b is cancelled.
        let elsewhere = db.open();
        let answer = Answer {
            run_id: RunId::from("a1"),
            call_id: "c1".into(),
            answer: json!("yes"),
            by: "carol".into(),
        };
        elsewhere.answer(&answer).unwrap();
        elsewhere.cancel(&RunId::from("b1"), "enough").unwrap();
        // The watch heard the cancel, so the answer before it, while a's execution ran.
        until(|| listen.told.load(Ordering::SeqCst)).await;
        hold2.release();
        until_state(&store, &RunId::from("a1"), RunState::Succeeded).await;
    });
    assert_eq!(last_tool_result(&asker), ToolResult::Ok(json!("yes")));
}

#[test]
fn a_timer_another_supervisor_set_before_it_went_away_fires_on_a_supervisor_that_only_watches() {
    let db = TempStore::new();
    let clock = ManualClock::new();
    let model = one_call(
        "sleep_until",
        json!({"seconds": 3600, "reason": "check tomorrow"}),
        "woke",
    );
    let agent = || Agent::new(model.clone()).sleep_until();
    let set_timer = |id: &str| {
        let start = StartRun::new("a", json!("go")).with_id(id);
        let config = Config::default().clock(clock.clone());
        let reply = ask(db.open(), config, "a", agent(), start).unwrap();
        waiting(reply.outcome, WaitKind::Timer);
    };
    // A timer due when the watching supervisor starts: its first pass resumes it, so that
    // pass is over before the next timer is set.
    set_timer("t0");
    clock.advance(Duration::from_secs(3601));
    let (store, watcher_clock) = (db.open(), clock.clone());
    let config = Config::default()
        .watch(Watch::default().every(Duration::from_millis(10)))
        .clock(clock.clone());
    let (set, timer_set) = std::sync::mpsc::channel::<()>();
    let watching_agent = agent();
    let watcher = std::thread::spawn(move || {
        with_system(|| async move {
            let _supervisor = supervise(store.clone(), config, "a", watching_agent);
            until_state(&store, &RunId::from("t0"), RunState::Succeeded).await;
            set.send(()).unwrap();
            // Another supervisor, gone since, sets this one's timer: nothing tells of it.
            let t1 = RunId::from("t1");
            until(|| store.run(&t1).is_ok()).await;
            until_state(&store, &t1, RunState::Succeeded).await;
        })
    });
    timer_set.recv().unwrap();
    set_timer("t1");
    watcher_clock.advance(Duration::from_secs(3601));
    watcher.join().unwrap();
}

#[test]
fn a_supervisor_nobody_holds_stops_though_it_knows_of_a_timer() {
    let db = TempStore::new();
    let model = one_call("sleep_until", json!({"seconds": 3600}), "woke");
    let store = db.open();
    with_system(|| async move {
        let supervisor = supervise(store, waking(), "a", Agent::new(model).sleep_until());
        let reply = supervisor
            .send(StartRun::new("a", json!("go")).with_id("t3"))
            .await
            .unwrap()
            .unwrap();
        waiting(reply.outcome, WaitKind::Timer);
        let weak = supervisor.downgrade();
        drop(supervisor);
        until(|| {
            !weak
                .upgrade()
                .is_some_and(|supervisor| supervisor.connected())
        })
        .await;
    });
}

#[test]
fn a_parent_goes_on_as_soon_as_its_child_ends_on_the_same_supervisor() {
    let db = TempStore::new();
    let parent = ScriptedModel::new(vec![
        ModelResponse::calls(vec![
            ToolCall::new("c1", "research", json!({"task": "first"})),
            ToolCall::new("c2", "research", json!({"task": "second"})),
        ]),
        ModelResponse::answer("both found"),
    ]);
    let child = ScriptedModel::new(vec![ModelResponse::answer("found")]);
    let (parent_agent, child_agent) = family(&parent, &child);
    let store = db.open();
    with_system(|| async move {
        // No watch and no recovery: nothing reads the change feed, so only the child's end,
        // seen by the supervisor that executed it, can resume the parent.
        let supervisor =
            supervise_family(store.clone(), Config::default(), parent_agent, child_agent);
        let reply = supervisor
            .send(StartRun::new("a", json!("go")).with_id("p3"))
            .await
            .unwrap()
            .unwrap();
        waiting(reply.outcome, WaitKind::Child);
        until_state(&store, &RunId::from("p3"), RunState::Succeeded).await;
    });
    let store = db.open();
    for child in ["p3/2", "p3/3"] {
        let run = store.run(&RunId::from(child)).unwrap();
        assert_eq!(run.state, RunState::Succeeded, "{child}");
    }
    assert_eq!(last_tool_result(&parent), ToolResult::Ok(json!("found")));
}

/// Delivers run `e2`'s event as soon as its wait begins, before the loop that began it hears
/// so, then holds the loop's answer long enough for a watch polling every few milliseconds to
/// hear of the wake-up while the execution is still under way.
struct DeliverOnWait(agentrt::Store);

impl agentrt::MoveObserver for DeliverOnWait {
    fn after_commit(&self, info: &agentrt::MoveInfo) {
        if info.kind != agentrt::MoveKind::BeginWait || info.run_id.as_str() != "e2" {
            return;
        }
        let delivery = Delivery {
            run_id: info.run_id.clone(),
            name: "payment".into(),
            event_id: "evt-1".into(),
            payload: json!({"amount": 5}),
        };
        assert_eq!(self.0.deliver_event(&delivery).unwrap(), Delivered::Woke);
        // The window the race needs, not a wait for a result: the run must succeed however
        // long the watch takes.
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_wait_woken_while_the_execution_that_began_it_ends_is_resumed() {
    let db = TempStore::new();
    let model = one_call("wait_for_event", json!({"name": "payment"}), "paid");
    let agent = Agent::new(model.clone()).wait_for_event();
    let store = db.open();
    // A watch and no recovery: no later pass over the ready waits would find the run.
    let config = Config::default()
        .watch(Watch::default().every(Duration::from_millis(5)))
        .observer(DeliverOnWait(db.open()));
    with_system(|| async move {
        let supervisor = supervise(store.clone(), config, "a", agent);
        let reply = supervisor
            .send(StartRun::new("a", json!("go")).with_id("e2"))
            .await
            .unwrap()
            .unwrap();
        waiting(reply.outcome, WaitKind::Event);
        until_state(&store, &RunId::from("e2"), RunState::Succeeded).await;
    });
    assert_eq!(
        last_tool_result(&model),
        ToolResult::Ok(json!({"amount": 5}))
    );
}

#[test]
fn more_timers_falling_due_together_than_one_pass_reads_are_all_woken() {
    // A pass reads 256 ready waits; the next reads on after them.
    const RUNS: usize = 300;
    let db = TempStore::new();
    let clock = ManualClock::new();
    let model = one_call("sleep_until", json!({"seconds": 3600}), "woke");
    let agent = Agent::new(model.clone()).sleep_until();
    let store = db.open();
    let config = Config::default()
        .watch(Watch::default().every(Duration::from_millis(10)))
        .clock(clock.clone());
    with_system(|| async move {
        let supervisor = supervise(store.clone(), config, "a", agent);
        let starts: Vec<_> = (0..RUNS)
            .map(|_| actix_rt::spawn(supervisor.send(StartRun::new("a", json!("go")))))
            .collect();
        for start in starts {
            let reply = start.await.unwrap().unwrap().unwrap();
            waiting(reply.outcome, WaitKind::Timer);
        }
        clock.advance(Duration::from_secs(3601));
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        loop {
            let counts = store.count_by_state().unwrap();
            let succeeded = counts
                .iter()
                .find(|(state, _)| *state == RunState::Succeeded)
                .map_or(0, |(_, n)| *n);
            if succeeded == RUNS as u64 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{succeeded} of {RUNS} runs woke: {counts:?}"
            );
            actix_rt::time::sleep(Duration::from_millis(20)).await;
        }
    });
}
