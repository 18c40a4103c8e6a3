//! The example service's shape over real HTTP on a loopback port: a supervisor with recovery
//! and a watch, and `agentrt::web` mounted under `/agentrt`: a run started, approved and
//! finished, and at start-up the runs a dead process left taken over.

use std::time::Duration;

use actix_web::{App, HttpServer};
use agentrt::{
    Agent, Config, ModelResponse, Recovery, StartRun, ToolCall, Watch,
    testkit::{Behaviour, RecordingTool, ScriptedModel, TempStore, with_system},
    web::Api,
};
use serde_json::{Value, json};

use crate::support::{quickstart_agent, supervise};

/// Starts the service as `examples/service.rs` does, on a free port; returns its base URL.
fn serve(store: agentrt::Store, agent: Agent, config: Config) -> String {
    let supervisor = supervise(
        store.clone(),
        config.watch(Watch::default()),
        "support",
        agent,
    );
    let api = Api::new(store).supervisor(supervisor);
    let server = HttpServer::new(move || App::new().service(api.scope("/agentrt")))
        .workers(1)
        .disable_signals()
        .bind("127.0.0.1:0")
        .unwrap();
    let url = format!("http://{}/agentrt", server.addrs()[0]);
    actix_rt::spawn(server.run());
    url
}

async fn state_when(client: &awc::Client, url: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let mut shown = client.get(url).send().await.unwrap();
        let shown: Value = shown.json().await.unwrap();
        if done(&shown) {
            return shown;
        }
        assert!(std::time::Instant::now() < deadline, "never: {shown}");
        actix_rt::time::sleep(Duration::from_millis(20)).await;
    }
}

#[test]
fn the_quickstart_agent_runs_to_its_end_through_the_mounted_api() {
    let db = TempStore::new();
    let store = db.open();
    with_system(|| async move {
        let url = serve(
            store,
            quickstart_agent::agent(),
            Config::default().recovery(Recovery::default()),
        );
        let client = awc::Client::default();
        let started = client
            .post(format!("{url}/runs"))
            .send_json(&json!({"agent": "support", "input": {"customer": "ada"}, "run_id": "r1"}))
            .await
            .unwrap();
        assert_eq!(started.status().as_u16(), 202);
        let run = state_when(&client, &format!("{url}/runs/r1"), |run| {
            run["state"] == "WAITING_FOR_APPROVAL"
        })
        .await;
        let call = run["pending_calls"][0]["call_id"]
            .as_str()
            .unwrap()
            .to_owned();
        let approved = client
            .post(format!("{url}/runs/r1/calls/{call}/approve"))
            .send()
            .await
            .unwrap();
        assert_eq!(approved.status().as_u16(), 200);
        let run = state_when(&client, &format!("{url}/runs/r1"), |run| {
            run["state"] == "SUCCEEDED"
        })
        .await;
        assert!(run["output"].as_str().unwrap().contains("ada"), "{run}");
        let console = client.get(format!("{url}/health")).send().await.unwrap();
        assert_eq!(console.status().as_u16(), 200);
    });
}

#[test]
fn at_start_up_the_service_takes_over_runs_a_dead_process_left_running() {
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
        let sup = supervise(store, dying_config, "support", dying);
        actix_rt::spawn(sup.send(StartRun::new("support", json!({})).with_id("left")));
        probe.wait_executions(1).await;
    });
    deploy.set_behaviour(Behaviour::Succeed);

    let (store, recovering) = (db.open(), agent());
    let config = config.recovery(Recovery::default().every(Duration::from_millis(100)));
    let run = with_system(|| async move {
        let url = serve(store, recovering, config);
        let client = awc::Client::default();
        state_when(&client, &format!("{url}/runs/left"), |run| {
            run["state"] != "RUNNING"
        })
        .await
    });
    assert_eq!(run["state"], "SUCCEEDED", "{run}");
    assert_eq!(
        deploy.executions().len(),
        2,
        "the interrupted idempotent deploy ran again once"
    );
}
