//! A PostgreSQL store used from inside an actix system, as an application's `main` does: opened,
//! inspected, and watched there. The driver blocks on a runtime of its own, so each of these
//! must leave the arbiter's thread to do it.

#![cfg(feature = "postgres")]

use agentrt::{
    Agent, Config, ModelResponse, RequireApprovalFor, RunState, SpawnRun, Store, ToolCall, Watch,
    testkit::{
        RecordingTool, ScriptedModel,
        postgres::{Schema, server},
        with_system,
    },
};
use serde_json::json;

use crate::support::supervise;

#[test]
fn a_store_opened_and_watched_inside_an_actix_system_resumes_a_decided_run() {
    let Some(server) = server() else { return };
    let schema = Schema::new(&server);
    let url = schema.url();
    let pay = RecordingTool::new("pay");
    let tool = pay.clone();
    with_system(|| async move {
        // All on the arbiter's thread: the open, the supervisor's start (its lanes and its
        // watch), and the inspection.
        let store = Store::connect(&url).unwrap();
        let agent = Agent::new(ScriptedModel::new(vec![
            ModelResponse::calls(vec![ToolCall::new("pay-1", "pay", json!({}))]),
            ModelResponse::answer("paid"),
        ]))
        .tool(tool.clone())
        .policy(RequireApprovalFor::tools(["pay"]));
        let sup = supervise(
            store.clone(),
            Config::default().watch(Watch::default()),
            "a",
            agent,
        );
        let run_id = sup
            .send(SpawnRun::new("a", json!({})))
            .await
            .unwrap()
            .unwrap();
        while store.run(&run_id).unwrap().state != RunState::WaitingForApproval {
            actix_rt::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        // Recorded through the store, as another process would: the watch resumes it.
        store
            .record_approval(&agentrt::Approval::approve(
                run_id.clone(),
                "pay-1",
                "alice",
            ))
            .unwrap();
        while store.run(&run_id).unwrap().state != RunState::Succeeded {
            actix_rt::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        assert!(store.health().unwrap().is_ok());
    });
    assert_eq!(pay.executions().len(), 1);
}
