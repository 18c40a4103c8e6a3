//! Runs that wait over HTTP: the waits listed a page at a time and each run's wait shown; a
//! question answered as the token's operator, refused when off its schema with nothing
//! written; events delivered, kept or found duplicates; and the runs they wake resumed, by the
//! API's supervisor or by one that watches the store.

use agentrt::{
    Agent, Config, EventKind, ModelResponse, RunId, SpawnRun, ToolCall, ToolResult, Watch,
    testkit::{ScriptedModel, TempStore, with_system},
    web::Api,
};
use serde_json::{Value, json};

use crate::support::{
    last_tool_result,
    web::{ALICE, Client, code, serve},
};

fn one_call(tool: &str, args: Value) -> ScriptedModel {
    ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new("c1", tool, args)]),
        ModelResponse::answer("done"),
    ])
}

/// The agents of these tests, each named after what its run waits for: `asks` (an object with
/// an `account` string), `listens` (an event named `payment`), `sleeps` (an hour).
fn agents(asks: &ScriptedModel) -> Vec<(&'static str, Agent)> {
    vec![
        ("asks", Agent::new(asks.clone()).ask_person()),
        (
            "listens",
            Agent::new(one_call("wait_for_event", json!({"name": "payment"}))).wait_for_event(),
        ),
        (
            "sleeps",
            Agent::new(one_call(
                "sleep_until",
                json!({"seconds": 3600, "reason": "check tomorrow"}),
            ))
            .sleep_until(),
        ),
    ]
}

fn asking() -> ScriptedModel {
    one_call(
        "ask_person",
        json!({
            "question": "Which account?",
            "schema": {
                "type": "object",
                "properties": {"account": {"type": "string"}},
                "required": ["account"]
            }
        }),
    )
}

fn supervisor_of(
    store: agentrt::Store,
    config: Config,
    agents: Vec<(&'static str, Agent)>,
) -> actix::Addr<agentrt::Supervisor> {
    let mut builder = agentrt::Supervisor::builder(store).config(config);
    for (name, agent) in agents {
        builder = builder.agent(name, agent);
    }
    builder.start().unwrap()
}

/// Starts a run of each agent, its id the agent's name, and waits until each waits.
async fn start_waiting_runs(client: &Client) {
    for (agent, state) in [
        ("asks", "WAITING_FOR_ANSWER"),
        ("listens", "WAITING_FOR_EVENT"),
        ("sleeps", "WAITING_FOR_TIMER"),
    ] {
        let (status, body) = client
            .post("/runs", json!({"agent": agent, "run_id": agent}))
            .await;
        assert_eq!(status, 202, "{body}");
        client.wait_state(agent, state).await;
    }
}

#[test]
fn waits_are_listed_and_shown_and_a_question_is_answered_as_the_tokens_operator() {
    let db = TempStore::new();
    let store = db.open();
    let asks = asking();
    let model = asks.clone();
    with_system(|| async move {
        let supervisor = supervisor_of(store.clone(), Config::default(), agents(&asks));
        let api = Api::new(store.clone())
            .supervisor(supervisor)
            .token("alice", ALICE)
            .unwrap();
        let (addr, _server) = serve(api).await;
        let client = Client::new(addr, Some(ALICE));
        start_waiting_runs(&client).await;

        // Each run shows its wait; the list pages through them, longest waiting first.
        let (_, run) = client.get("/runs/asks").await;
        assert_eq!(run["wait"]["kind"], "answer");
        assert_eq!(run["wait"]["call_id"], "c1");
        assert_eq!(run["wait"]["detail"]["question"], "Which account?");
        assert!(run["wait"]["since"].is_u64(), "{run}");
        let (_, run) = client.get("/runs/sleeps").await;
        assert_eq!(run["wait"]["key"], "check tomorrow");
        assert!(run["wait"]["due_at"].is_u64(), "{run}");
        let (status, page) = client.get("/waits").await;
        assert_eq!(status, 200, "{page}");
        let runs: Vec<&str> = page["waits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["run_id"].as_str().unwrap())
            .collect();
        assert_eq!(runs, ["asks", "listens", "sleeps"]);
        assert_eq!(page["next"], Value::Null);
        let mut seen = Vec::new();
        let mut path = "/waits?limit=1".to_owned();
        loop {
            let (status, page) = client.get(&path).await;
            assert_eq!(status, 200, "{page}");
            assert!(page["waits"].as_array().unwrap().len() <= 1);
            seen.extend(page["waits"].as_array().unwrap().iter().cloned());
            match page["next"].as_str() {
                Some(next) => path = format!("/waits?limit=1&after={next}"),
                None => break,
            }
        }
        assert_eq!(
            Value::Array(seen),
            page["waits"],
            "each wait once, in order"
        );
        let (_, answers) = client.get("/waits?kind=answer").await;
        assert_eq!(answers["waits"].as_array().unwrap().len(), 1);
        assert_eq!(answers["waits"][0]["run_id"], "asks");

        // Refusals write nothing.
        let events = store.events(&RunId::from("asks")).unwrap().len();
        let refusals: Vec<(u16, &str, (u16, Value))> = vec![
            (
                400,
                "invalid_answer",
                client
                    .post("/runs/asks/calls/c1/answer", json!({"answer": {"acct": 7}}))
                    .await,
            ),
            (
                422,
                "invalid_body",
                client
                    .post(
                        "/runs/asks/calls/c1/answer",
                        json!({"answer": {"account": "x"}, "by": "mallory"}),
                    )
                    .await,
            ),
            (
                422,
                "invalid_body",
                client.post("/runs/asks/calls/c1/answer", json!({})).await,
            ),
            (
                404,
                "not_found",
                client
                    .post("/runs/asks/calls/c9/answer", json!({"answer": 1}))
                    .await,
            ),
            (
                404,
                "not_found",
                client
                    .post("/runs/nobody/calls/c1/answer", json!({"answer": 1}))
                    .await,
            ),
            (
                409,
                "run_state",
                client
                    .post("/runs/listens/calls/c1/answer", json!({"answer": 1}))
                    .await,
            ),
            (
                401,
                "unauthorized",
                Client::new(addr, None)
                    .post("/runs/asks/calls/c1/answer", json!({"answer": 1}))
                    .await,
            ),
        ];
        for (status, expected, (got, body)) in refusals {
            assert_eq!((got, code(&body)), (status, expected), "{body}");
        }
        let (_, off_schema) = client
            .post("/runs/asks/calls/c1/answer", json!({"answer": {"acct": 7}}))
            .await;
        let message = off_schema["error"]["message"].as_str().unwrap();
        assert!(message.contains("account"), "{message}");
        assert_eq!(store.events(&RunId::from("asks")).unwrap().len(), events);

        // The answer is alice's; the API's supervisor resumes the run at once.
        let (status, answer) = client
            .post(
                "/runs/asks/calls/c1/answer",
                json!({"answer": {"account": "savings"}}),
            )
            .await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(
            answer,
            json!({"run_id": "asks", "call_id": "c1", "answer": {"account": "savings"}, "by": "alice"})
        );
        let done = client.wait_state("asks", "SUCCEEDED").await;
        assert_eq!(done["wait"], Value::Null);
        let woken = store
            .events(&RunId::from("asks"))
            .unwrap()
            .into_iter()
            .find(|e| e.kind == EventKind::WaitWoken)
            .unwrap();
        assert_eq!(woken.payload["answered_by"], "alice");
        let (status, again) = client
            .post(
                "/runs/asks/calls/c1/answer",
                json!({"answer": {"account": "x"}}),
            )
            .await;
        assert_eq!((status, code(&again)), (409, "run_state"), "{again}");
        let (_, page) = client.get("/waits?kind=answer").await;
        assert_eq!(page["waits"], json!([]));
    });
    assert_eq!(
        last_tool_result(&model),
        ToolResult::Ok(json!({"account": "savings"}))
    );
}

#[test]
fn an_event_wakes_its_run_is_kept_by_another_and_a_repeat_is_a_duplicate() {
    let db = TempStore::new();
    let store = db.open();
    with_system(|| async move {
        let supervisor = supervisor_of(store.clone(), Config::default(), agents(&asking()));
        let api = Api::new(store.clone())
            .supervisor(supervisor)
            .token("alice", ALICE)
            .unwrap();
        let (addr, _server) = serve(api).await;
        let client = Client::new(addr, Some(ALICE));
        start_waiting_runs(&client).await;

        let event =
            |id: &str| json!({"name": "payment", "event_id": id, "payload": {"amount": 10}});
        // The sleeping run waits for no event: it keeps it for a wait on its name.
        let (status, body) = client.post("/runs/sleeps/events", event("evt-1")).await;
        assert_eq!((status, body), (200, json!({"delivered": "kept"})));
        let (_, body) = client.post("/runs/sleeps/events", event("evt-1")).await;
        assert_eq!(body, json!({"delivered": "duplicate"}));

        let (_, body) = client.post("/runs/listens/events", event("evt-2")).await;
        assert_eq!(body, json!({"delivered": "woke"}));
        let done = client.wait_state("listens", "SUCCEEDED").await;
        assert_eq!(done["output"], "done");

        let refusals: Vec<(u16, &str, (u16, Value))> = vec![
            (
                409,
                "run_state",
                client.post("/runs/listens/events", event("evt-3")).await,
            ),
            (
                404,
                "not_found",
                client.post("/runs/nobody/events", event("evt-3")).await,
            ),
            (
                422,
                "invalid_body",
                client
                    .post(
                        "/runs/sleeps/events",
                        json!({"name": " ", "event_id": "evt-4"}),
                    )
                    .await,
            ),
            (
                422,
                "invalid_body",
                client
                    .post("/runs/sleeps/events", json!({"name": "payment"}))
                    .await,
            ),
            (
                401,
                "unauthorized",
                Client::new(addr, None)
                    .post("/runs/sleeps/events", event("evt-4"))
                    .await,
            ),
            (400, "invalid_query", client.get("/waits?kind=nap").await),
            (400, "invalid_query", client.get("/waits?limit=0").await),
            (400, "invalid_query", client.get("/waits?limit=1001").await),
            (
                400,
                "invalid_query",
                client.get("/waits?after=r1.1.61").await,
            ),
        ];
        for (status, expected, (got, body)) in refusals {
            assert_eq!((got, code(&body)), (status, expected), "{body}");
        }
        let received: Vec<Value> = store
            .events(&RunId::from("sleeps"))
            .unwrap()
            .into_iter()
            .filter(|e| e.kind == EventKind::EventReceived)
            .map(|e| e.payload)
            .collect();
        assert_eq!(received.len(), 1, "kept once: {received:?}");
        assert_eq!(received[0]["kept"], true);
    });
}

#[test]
fn an_api_without_a_supervisor_records_an_answer_and_an_event_for_a_watching_supervisor() {
    let db = TempStore::new();
    let store = db.open();
    with_system(|| async move {
        // A supervisor elsewhere (here, in the same system, but not the API's) executes.
        let supervisor = supervisor_of(
            db.open(),
            Config::default().watch(Watch::default()),
            agents(&asking()),
        );
        for agent in ["asks", "listens"] {
            supervisor
                .send(SpawnRun::new(agent, json!({})).with_id(agent))
                .await
                .unwrap()
                .unwrap();
        }
        let (addr, _server) = serve(Api::new(store.clone()).token("alice", ALICE).unwrap()).await;
        let client = Client::new(addr, Some(ALICE));
        client.wait_state("asks", "WAITING_FOR_ANSWER").await;
        client.wait_state("listens", "WAITING_FOR_EVENT").await;

        let (status, body) = client
            .post(
                "/runs/asks/calls/c1/answer",
                json!({"answer": {"account": "checking"}}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        let (status, body) = client
            .post(
                "/runs/listens/events",
                json!({"name": "payment", "event_id": "evt-1"}),
            )
            .await;
        assert_eq!((status, body), (200, json!({"delivered": "woke"})));
        client.wait_state("asks", "SUCCEEDED").await;
        client.wait_state("listens", "SUCCEEDED").await;
        drop(supervisor);
    });
}
