//! The web API over real HTTP: every route, and every error with its stable code.

use std::collections::BTreeSet;

use crate::support::web::{ALICE, Client, code, paying_agent, serve};
use agentrt::{
    Config, RunId, RunState,
    testkit::{RecordingTool, TempStore, with_system},
    web::Api,
};
use serde_json::{Value, json};

use crate::support::supervise;

#[test]
fn a_run_is_started_listed_shown_approved_and_followed_to_its_end_over_http() {
    let db = TempStore::new();
    let store = db.open();
    let transfer = RecordingTool::new("transfer");
    with_system(|| async move {
        let supervisor = supervise(
            store.clone(),
            Config::default().lease_owner("web-test"),
            "payments",
            paying_agent(&transfer),
        );
        let api = Api::new(store.clone())
            .supervisor(supervisor)
            .token("alice", ALICE)
            .unwrap();
        let (addr, _server) = serve(api).await;
        let client = Client::new(addr, Some(ALICE));

        let (status, body) = client.get("/health").await;
        assert_eq!((status, body), (200, json!({"status": "ok"})));
        let (status, body) = client.get("/ready").await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["status"], "ready");
        let (status, me) = client.get("/whoami").await;
        assert_eq!(status, 200);
        assert_eq!(me["operator"], "alice");
        assert_eq!(me["authenticated"], true);
        assert_eq!(me["executes"], true);

        // Two runs, each waiting for its payment's approval.
        for id in ["pay-a", "pay-b"] {
            let (status, body) = client
                .post(
                    "/runs",
                    json!({"agent": "payments", "input": {"order": id}, "run_id": id}),
                )
                .await;
            assert_eq!((status, body), (202, json!({"run_id": id})));
        }
        let waiting = client.wait_state("pay-a", "WAITING_FOR_APPROVAL").await;
        client.wait_state("pay-b", "WAITING_FOR_APPROVAL").await;
        assert_eq!(waiting["agent"], "payments");
        assert_eq!(waiting["input"], json!({"order": "pay-a"}));
        assert_eq!(waiting["pending_calls"][0]["call_id"], "pay-1");
        assert_eq!(waiting["pending_calls"][0]["tool"], "transfer");
        assert!(waiting["usage"].is_object());
        assert!(waiting.get("lease").is_some());
        assert_eq!(waiting["lease_expired"], false);

        // The list, a page at a time, and its filters.
        let (status, page) = client.get("/runs?limit=1").await;
        assert_eq!(status, 200, "{page}");
        assert_eq!(page["runs"].as_array().unwrap().len(), 1);
        assert_eq!(page["runs"][0]["id"], "pay-a");
        let next = page["next"].as_str().unwrap().to_owned();
        let (_, page) = client
            .get(&format!("/runs?limit=1&after={}", urlencode(&next)))
            .await;
        assert_eq!(page["runs"][0]["id"], "pay-b");
        assert_eq!(page["next"], Value::Null);
        let (_, page) = client
            .get("/runs?state=WAITING_FOR_APPROVAL&agent=payments")
            .await;
        assert_eq!(page["runs"].as_array().unwrap().len(), 2);
        let (_, page) = client.get("/runs?state=SUCCEEDED").await;
        assert_eq!(page["runs"], json!([]));
        let (_, page) = client.get("/runs?agent=nobody").await;
        assert_eq!(page["runs"], json!([]));

        // The inbox shows both calls, with the policy's reason.
        let (status, inbox) = client.get("/approvals").await;
        assert_eq!(status, 200);
        let calls = inbox["calls"].as_array().unwrap();
        assert_eq!(calls.len(), 2, "{inbox}");
        assert_eq!(calls[0]["run_id"], "pay-a");
        assert_eq!(calls[0]["tool"], "transfer");
        assert_eq!(calls[0]["args"], json!({"amount": 100, "to": "ada"}));
        assert_eq!(calls[0]["reason"], "policy");
        assert_eq!(calls[0]["policy_reason"], "transfer requires an approval");

        // Approve one: recorded under the token's operator, then resumed to its end.
        let (status, approval) = client
            .post(
                "/runs/pay-a/calls/pay-1/approve",
                json!({"note": "checked the invoice"}),
            )
            .await;
        assert_eq!(status, 200, "{approval}");
        assert_eq!(approval["by"], "alice");
        assert_eq!(approval["approved"], true);
        assert_eq!(approval["note"], "checked the invoice");
        let done = client.wait_state("pay-a", "SUCCEEDED").await;
        assert_eq!(done["output"], "paid");
        assert_eq!(done["lease"], Value::Null);
        assert_eq!(transfer.executions().len(), 1);

        // Deny the other: the model is told, and the run ends without paying.
        let (status, denial) = client.post("/runs/pay-b/calls/pay-1/deny", json!({})).await;
        assert_eq!(status, 200, "{denial}");
        assert_eq!(denial["approved"], false);
        client.wait_state("pay-b", "SUCCEEDED").await;
        assert_eq!(transfer.executions().len(), 1);
        let (_, inbox) = client.get("/approvals").await;
        assert_eq!(inbox["calls"], json!([]));

        // Its events, whole and after a seq.
        let (status, events) = client.get("/runs/pay-a/events").await;
        assert_eq!(status, 200);
        let events = events.as_array().unwrap().clone();
        assert_eq!(events[0]["kind"], "run.started");
        assert_eq!(events.last().unwrap()["kind"], "run.finished");
        let seqs: Vec<u64> = events.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
        assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>());
        let (_, later) = client.get("/runs/pay-a/events?after=2").await;
        assert_eq!(later.as_array().unwrap().len(), events.len() - 2);
        assert_eq!(later[0]["seq"], 3);

        // A fork of the finished run at its first model step: a new run, executed here.
        let (status, forked) = client
            .post(
                "/runs/pay-a/fork",
                json!({"at": 1, "new_id": "pay-a-again"}),
            )
            .await;
        assert_eq!((status, &forked), (201, &json!({"run_id": "pay-a-again"})));
        client
            .wait_state("pay-a-again", "WAITING_FOR_APPROVAL")
            .await;

        // Cancel it: the reason keeps who cancelled.
        let (status, cancelled) = client
            .post("/runs/pay-a-again/cancel", json!({"reason": "duplicate"}))
            .await;
        assert_eq!(status, 200, "{cancelled}");
        assert_eq!(cancelled["state"], "CANCELLED");
        let run = client.wait_state("pay-a-again", "CANCELLED").await;
        assert!(run["error"].as_str().unwrap().contains("alice"), "{run}");

        // A resume of a run that waits: accepted, and the run waits again for its call.
        let (status, body) = client
            .post("/runs", json!({"agent": "payments", "run_id": "pay-c"}))
            .await;
        assert_eq!(status, 202, "{body}");
        client.wait_state("pay-c", "WAITING_FOR_APPROVAL").await;
        let (status, body) = client.post("/runs/pay-c/resume", json!(null)).await;
        assert_eq!((status, body), (202, json!({"run_id": "pay-c"})));
        assert_eq!(store_state(&db, "pay-c"), RunState::WaitingForApproval);
    });
}

fn store_state(db: &TempStore, run_id: &str) -> RunState {
    db.open().run(&RunId::from(run_id)).unwrap().state
}

fn urlencode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[test]
fn every_error_is_json_with_a_stable_code() {
    let db = TempStore::new();
    let store = db.open();
    let transfer = RecordingTool::new("transfer");
    with_system(|| async move {
        let supervisor = supervise(
            store.clone(),
            Config::default(),
            "payments",
            paying_agent(&transfer),
        );
        let api = Api::new(store.clone())
            .supervisor(supervisor)
            .token("alice", ALICE)
            .unwrap();
        let (addr, _server) = serve(api).await;
        let client = Client::new(addr, Some(ALICE));
        client
            .post("/runs", json!({"agent": "payments", "run_id": "r1"}))
            .await;
        client.wait_state("r1", "WAITING_FOR_APPROVAL").await;

        let cases: Vec<(u16, &str, (u16, Value))> = vec![
            (404, "not_found", client.get("/runs/nope").await),
            (404, "not_found", client.get("/runs/nope/events").await),
            (
                404,
                "not_found",
                client.get("/runs/nope/events/stream").await,
            ),
            (
                404,
                "not_found",
                client.post("/runs/r1/calls/nope/approve", json!({})).await,
            ),
            (
                404,
                "not_found",
                client
                    .post("/runs/nope/cancel", json!({"reason": "x"}))
                    .await,
            ),
            (404, "not_found", client.get("/no/such/route").await),
            (400, "invalid_run_id", client.get("/runs/a%01b").await),
            (
                400,
                "invalid_run_id",
                client.get(&format!("/runs/{}", "x".repeat(201))).await,
            ),
            (
                400,
                "invalid_run_id",
                client
                    .post("/runs", json!({"agent": "payments", "run_id": ""}))
                    .await,
            ),
            (400, "invalid_query", client.get("/runs?limit=0").await),
            (400, "invalid_query", client.get("/runs?limit=lots").await),
            (400, "invalid_query", client.get("/runs?state=ASLEEP").await),
            (
                400,
                "invalid_query",
                client.get("/runs?after=not-a-cursor").await,
            ),
            (400, "invalid_query", client.get("/runs?colour=blue").await),
            (
                400,
                "malformed_json",
                client
                    .post_raw("/runs", "application/json", b"{\"agent\": ".to_vec())
                    .await,
            ),
            (
                415,
                "unsupported_media_type",
                client
                    .post_raw("/runs", "text/plain", b"{\"agent\": \"payments\"}".to_vec())
                    .await,
            ),
            (
                413,
                "payload_too_large",
                client
                    .post_raw(
                        "/runs",
                        "application/json",
                        format!(
                            "{{\"agent\": \"payments\", \"input\": \"{}\"}}",
                            "x".repeat(300_000)
                        )
                        .into_bytes(),
                    )
                    .await,
            ),
            (
                422,
                "invalid_body",
                client.post("/runs", json!({"agent": 7})).await,
            ),
            (
                422,
                "invalid_body",
                client.post("/runs/r1/cancel", json!({"reason": " "})).await,
            ),
            (
                422,
                "unknown_agent",
                client.post("/runs", json!({"agent": "nobody"})).await,
            ),
            (
                409,
                "run_exists",
                client
                    .post("/runs", json!({"agent": "payments", "run_id": "r1"}))
                    .await,
            ),
            (
                422,
                "invalid_input",
                client.post("/runs/r1/fork", json!({"at": 0})).await,
            ),
            (
                405,
                "method_not_allowed",
                client.request("DELETE", "/runs/r1").await,
            ),
            (
                405,
                "method_not_allowed",
                client.post("/health", json!({})).await,
            ),
            (
                413,
                "payload_too_large",
                client
                    .post_raw(
                        "/runs/r1/calls/pay-1/approve",
                        "application/json",
                        vec![b' '; 300_000],
                    )
                    .await,
            ),
            (
                400,
                "malformed_json",
                client
                    .post_raw(
                        "/runs/r1/calls/pay-1/deny",
                        "application/json",
                        b"{".to_vec(),
                    )
                    .await,
            ),
            (
                415,
                "unsupported_media_type",
                client
                    .post_raw("/runs/r1/calls/pay-1/deny", "text/plain", b"{}".to_vec())
                    .await,
            ),
        ];
        for (status, expected, (got, body)) in cases {
            assert_eq!((got, code(&body)), (status, expected), "{body}");
            assert!(
                body["error"]["message"].as_str().unwrap().len() > 10,
                "{body}"
            );
        }

        // A finished run: its waiting call is gone, and a resume is a state error.
        client
            .post("/runs/r1/cancel", json!({"reason": "test over"}))
            .await;
        let (status, body) = client.post("/runs/r1/resume", json!(null)).await;
        assert_eq!((status, code(&body)), (409, "run_state"), "{body}");
        let (status, body) = client
            .post("/runs/r1/cancel", json!({"reason": "again"}))
            .await;
        assert_eq!((status, code(&body)), (409, "run_state"), "{body}");
        let (status, body) = client.post("/runs/r1/calls/pay-1/approve", json!({})).await;
        assert_eq!((status, code(&body)), (409, "run_state"), "{body}");
        assert!(transfer.executions().is_empty());
    });
}

#[test]
fn an_api_without_a_supervisor_records_decisions_and_refuses_to_start_runs() {
    let db = TempStore::new();
    let store = db.open();
    let transfer = RecordingTool::new("transfer");
    with_system(|| async move {
        // A supervisor elsewhere (here, in the same system, but not the API's) executes.
        let supervisor = supervise(
            db.open(),
            Config::default().watch(agentrt::Watch::default()),
            "payments",
            paying_agent(&transfer),
        );
        supervisor
            .send(agentrt::SpawnRun::new("payments", json!({})).with_id("r1"))
            .await
            .unwrap()
            .unwrap();
        let (addr, _server) = serve(Api::new(store.clone()).token("alice", ALICE).unwrap()).await;
        let client = Client::new(addr, Some(ALICE));
        client.wait_state("r1", "WAITING_FOR_APPROVAL").await;
        let (_, me) = client.get("/whoami").await;
        assert_eq!(me["executes"], false);

        let (status, body) = client.post("/runs", json!({"agent": "payments"})).await;
        assert_eq!((status, code(&body)), (409, "no_supervisor"), "{body}");
        let (status, body) = client.post("/runs/r1/resume", json!(null)).await;
        assert_eq!((status, code(&body)), (409, "no_supervisor"), "{body}");

        // The decision is recorded here; the watching supervisor resumes the run.
        let (status, body) = client.post("/runs/r1/calls/pay-1/approve", json!({})).await;
        assert_eq!(status, 200, "{body}");
        client.wait_state("r1", "SUCCEEDED").await;
        assert_eq!(transfer.executions().len(), 1);
    });
}

#[test]
fn the_openapi_document_lists_every_route() {
    let db = TempStore::new();
    let store = db.open();
    with_system(|| async move {
        let (addr, _server) = serve(Api::new(store)).await;
        let client = Client::new(addr, None);
        let (status, doc) = client.get("/openapi.json").await;
        assert_eq!(status, 200);
        assert_eq!(doc["openapi"], "3.1.0");
        assert_eq!(doc["info"]["version"], env!("CARGO_PKG_VERSION"));
        let paths: BTreeSet<&str> = doc["paths"]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        let expected: BTreeSet<&str> = [
            "/health",
            "/ready",
            "/openapi.json",
            "/metrics",
            "/whoami",
            "/stream",
            "/approvals",
            "/waits",
            "/runs",
            "/runs/{id}",
            "/runs/{id}/events",
            "/runs/{id}/events/stream",
            "/runs/{id}/calls/{call}/approve",
            "/runs/{id}/calls/{call}/deny",
            "/runs/{id}/calls/{call}/answer",
            "/runs/{id}/resume",
            "/runs/{id}/cancel",
            "/runs/{id}/fork",
            "/schedules",
            "/schedules/{name}/pause",
            "/schedules/{name}/resume",
            "/ui",
        ]
        .into();
        assert_eq!(paths, expected);
        // Each documented route answers (a GET route with a 2xx or one of its errors, never
        // the catch-all 404 of a path no route has).
        for path in expected.iter().filter(|path| **path != "/stream") {
            let concrete = path
                .replace("{id}", "none")
                .replace("{call}", "none")
                .replace("{name}", "none");
            let (status, body) = client.get(&concrete).await;
            assert!(
                !(status == 404
                    && body["error"]["message"]
                        .as_str()
                        .is_some_and(|m| m.starts_with("no route"))),
                "{path}: {status} {body}"
            );
        }
    });
}
