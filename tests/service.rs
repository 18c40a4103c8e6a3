//! The example service over real HTTP on a loopback port: start a run, approve its call,
//! resume it, read its event stream, and cancel another run.

#[path = "../examples/support/quickstart_agent.rs"]
mod quickstart_agent;
#[path = "../examples/support/service_app.rs"]
mod service_app;

use actix_web::{App, HttpServer, web};
use std::time::{Duration, SystemTime};

use actix::Actor;
use agentrt::{
    Agent, Config, ModelResponse, Recovery, StartRun, SubscribeLeaseLost, Supervisor, ToolCall,
    testkit::{Behaviour, RecordingTool, ScriptedModel, TempStore, with_system},
};
use serde_json::{Value, json};
use service_app::{AppState, LeaseLostLogger, routes};

/// Starts the service on 127.0.0.1 at a free port, as `examples/service.rs` does; returns its
/// base URL.
fn serve(store: agentrt::Store) -> String {
    serve_agent(
        store,
        quickstart_agent::agent(),
        Config::default().recovery(Recovery::default()),
    )
}

fn serve_agent(store: agentrt::Store, agent: Agent, config: Config) -> String {
    let supervisor = Supervisor::builder(store.clone())
        .config(config)
        .agent("support", agent)
        .start()
        .unwrap();
    supervisor.do_send(SubscribeLeaseLost(LeaseLostLogger.start().recipient()));
    let state = web::Data::new(AppState { supervisor, store });
    let server = HttpServer::new(move || App::new().app_data(state.clone()).configure(routes))
        .workers(1)
        .bind("127.0.0.1:0")
        .unwrap();
    let url = format!("http://{}", server.addrs()[0]);
    actix_rt::spawn(server.run());
    url
}

async fn post(client: &awc::Client, url: String, body: Value) -> (u16, Value) {
    let mut response = client.post(url).send_json(&body).await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

#[test]
fn a_run_is_started_approved_resumed_and_streamed_and_another_cancelled_over_http() {
    let db = TempStore::new();
    let store = db.open();
    with_system(|| async move {
        let url = serve(store);
        let client = awc::Client::default();

        let (status, started) = post(
            &client,
            format!("{url}/runs"),
            json!({"agent": "support", "input": {"customer": "ada"}, "run_id": "r1"}),
        )
        .await;
        assert_eq!(status, 200, "{started}");
        assert_eq!(started["outcome"]["status"], json!("waiting_for_approval"));
        let call = started["outcome"]["pending"]["call_id"]
            .as_str()
            .unwrap()
            .to_owned();

        let (status, decided) = post(
            &client,
            format!("{url}/runs/r1/approvals/{call}"),
            json!({"approved": true, "by": "ops", "note": "fine"}),
        )
        .await;
        assert_eq!(status, 200, "{decided}");
        assert_eq!(
            decided,
            json!({"run_id": "r1", "call_id": call, "approved": true, "by": "ops", "note": "fine"})
        );

        let (status, resumed) = post(&client, format!("{url}/runs/r1/resume"), json!({})).await;
        assert_eq!(status, 200, "{resumed}");
        assert_eq!(resumed["outcome"]["status"], json!("succeeded"));

        // The event stream, from the start: it ends once the run has finished.
        let mut stream = client
            .get(format!("{url}/runs/r1/events"))
            .send()
            .await
            .unwrap();
        assert_eq!(
            stream.headers().get("content-type").unwrap(),
            "text/event-stream"
        );
        let body = String::from_utf8(stream.body().limit(1 << 20).await.unwrap().to_vec()).unwrap();
        let ids: Vec<u64> = body
            .lines()
            .filter_map(|line| line.strip_prefix("id: "))
            .map(|id| id.parse().unwrap())
            .collect();
        assert_eq!(
            ids,
            (1..=ids.len() as u64).collect::<Vec<_>>(),
            "every event, in order"
        );
        assert!(
            body.contains("event: approval.recorded") && body.contains("event: run.finished"),
            "{body}"
        );
        // Each event's data is the event in agentrt's JSON shape.
        let first: agentrt::Event = body
            .lines()
            .find_map(|line| line.strip_prefix("data: "))
            .map(|data| serde_json::from_str(data).unwrap())
            .unwrap();
        assert_eq!(
            (first.run_id.as_str(), first.seq, first.kind),
            ("r1", 1, agentrt::EventKind::RunStarted)
        );
        // From a sequence number on: only what came after.
        let mut tail = client
            .get(format!("{url}/runs/r1/events?after=16"))
            .send()
            .await
            .unwrap();
        let tail = String::from_utf8(tail.body().await.unwrap().to_vec()).unwrap();
        assert!(tail.starts_with("id: 17\n"), "{tail}");

        // Another run waits for its approval; an operator cancels it.
        let (_, second) = post(
            &client,
            format!("{url}/runs"),
            json!({"agent": "support", "input": {"customer": "bob"}, "run_id": "r2"}),
        )
        .await;
        assert_eq!(second["outcome"]["status"], json!("waiting_for_approval"));
        let (status, cancelled) = post(
            &client,
            format!("{url}/runs/r2/cancel"),
            json!({"reason": "customer left"}),
        )
        .await;
        assert_eq!(status, 200, "{cancelled}");
        let mut shown = client.get(format!("{url}/runs/r2")).send().await.unwrap();
        let shown: Value = shown.json().await.unwrap();
        assert_eq!(shown["state"], json!("CANCELLED"));
        assert_eq!(shown["error"], json!("customer left"));
        assert_eq!(cancelled, json!({"run_id": "r2", "state": "CANCELLED"}));
        // The run in agentrt's JSON shape, its lease and waiting calls beside it.
        assert_eq!(shown["id"], json!("r2"));
        assert!(shown["created_at"].is_u64(), "{shown}");
        assert_eq!(
            (shown["lease"].clone(), shown["pending_calls"].clone()),
            (Value::Null, json!([]))
        );
    });
}

#[test]
fn malformed_json_and_unknown_ids_get_a_4xx_with_a_json_error() {
    let db = TempStore::new();
    let store = db.open();
    with_system(|| async move {
        let url = serve(store);
        let client = awc::Client::default();

        let mut bad = client
            .post(format!("{url}/runs"))
            .content_type("application/json")
            .send_body("{\"agent\": ")
            .await
            .unwrap();
        assert_eq!(bad.status().as_u16(), 400);
        let error: Value = bad.json().await.unwrap();
        assert!(
            error["error"].as_str().unwrap().contains("malformed"),
            "{error}"
        );

        let mut missing = client.get(format!("{url}/runs/nope")).send().await.unwrap();
        assert_eq!(missing.status().as_u16(), 404);
        let error: Value = missing.json().await.unwrap();
        assert!(error["error"].as_str().unwrap().contains("nope"), "{error}");
        let events = client
            .get(format!("{url}/runs/nope/events"))
            .send()
            .await
            .unwrap();
        assert_eq!(events.status().as_u16(), 404);

        let (status, error) = post(&client, format!("{url}/runs"), json!({"agent": "ghost"})).await;
        assert_eq!(status, 422, "{error}");
        let (_, started) = post(
            &client,
            format!("{url}/runs"),
            json!({"agent": "support", "run_id": "r1"}),
        )
        .await;
        assert_eq!(started["outcome"]["status"], json!("waiting_for_approval"));
        let (status, error) = post(
            &client,
            format!("{url}/runs"),
            json!({"agent": "support", "run_id": "r1"}),
        )
        .await;
        assert_eq!(status, 409, "a second start of one id: {error}");
        let (status, error) = post(
            &client,
            format!("{url}/runs/r1/approvals/nope"),
            json!({"approved": true, "by": "ops"}),
        )
        .await;
        assert_eq!(status, 404, "{error}");
        let (status, _) = post(
            &client,
            format!("{url}/runs/r1/approvals/email-1"),
            json!({"approved": true, "by": "ops"}),
        )
        .await;
        assert_eq!(status, 200);
        let (status, error) = post(
            &client,
            format!("{url}/runs/r1/approvals/email-1"),
            json!({"approved": false, "by": "ops"}),
        )
        .await;
        assert_eq!(status, 409, "decided already: {error}");
        let (status, error) = post(&client, format!("{url}/runs/nope/resume"), json!({})).await;
        assert_eq!(status, 404, "{error}");
    });
}

#[test]
fn at_start_up_the_service_resumes_runs_a_dead_process_left_running() {
    let db = TempStore::new();
    let deploy = RecordingTool::new("deploy")
        .idempotent(true)
        .behaviour(Behaviour::Block);
    let agent = || {
        let model = ScriptedModel::new(vec![
            ModelResponse::calls(vec![ToolCall::new("d1", "deploy", json!({}))]),
            ModelResponse::answer("deployed"),
        ]);
        Agent::new(model).tool(deploy.clone())
    };
    let config = Config::default().lease_ttl(Duration::from_millis(300));
    // A process dies with the deploy in flight; its lease is still live when the service starts.
    let (store, dying, probe, dying_config) = (db.open(), agent(), deploy.clone(), config.clone());
    with_system(|| async move {
        let sup = Supervisor::builder(store)
            .config(dying_config)
            .agent("support", dying)
            .start()
            .unwrap();
        actix_rt::spawn(sup.send(StartRun::new("support", json!({})).with_id("left")));
        probe.wait_executions(1).await;
    });
    deploy.set_behaviour(Behaviour::Succeed);

    let (store, recovering) = (db.open(), agent());
    let config = config.recovery(Recovery::default().every(Duration::from_millis(100)));
    let state = with_system(|| async move {
        let url = serve_agent(store, recovering, config);
        let client = awc::Client::default();
        let deadline = SystemTime::now() + Duration::from_secs(20);
        loop {
            let mut shown = client.get(format!("{url}/runs/left")).send().await.unwrap();
            let shown: Value = shown.json().await.unwrap();
            if shown["state"] != json!("RUNNING") || SystemTime::now() > deadline {
                return shown["state"].clone();
            }
            actix_rt::time::sleep(Duration::from_millis(50)).await;
        }
    });
    assert_eq!(state, json!("SUCCEEDED"));
    assert_eq!(
        deploy.executions().len(),
        2,
        "the interrupted idempotent deploy ran again once"
    );
}
