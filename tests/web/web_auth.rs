//! Operators are authenticated: a write needs a configured token, reads may too, the approver
//! recorded is the token's operator, and an API without tokens listens only on loopback.

use std::net::SocketAddr;

use agentrt::{
    Config,
    testkit::{RecordingTool, TempStore, with_system},
    web::{Api, token_digest},
};
use serde_json::json;

use crate::support::{
    supervise,
    web::{self, ALICE, Client, code, paying_agent, serve},
};

/// A supervisor with a run `r1` waiting for its payment's approval, and the API over it.
async fn waiting_run(store: agentrt::Store, transfer: &RecordingTool, api: Api) -> SocketAddr {
    let supervisor = supervise(
        store.clone(),
        Config::default(),
        "payments",
        paying_agent(transfer),
    );
    let (addr, server) = serve(api.supervisor(supervisor)).await;
    std::mem::forget(server);
    let client = Client::new(addr, Some(ALICE));
    let (status, body) = client
        .post("/runs", json!({"agent": "payments", "run_id": "r1"}))
        .await;
    assert_eq!(status, 202, "{body}");
    client.wait_state("r1", "WAITING_FOR_APPROVAL").await;
    addr
}

#[test]
fn a_write_without_a_token_or_with_a_wrong_one_is_refused_and_changes_nothing() {
    let db = TempStore::new();
    let store = db.open();
    let transfer = RecordingTool::new("transfer");
    with_system(|| async move {
        let api = Api::new(store.clone()).token("alice", ALICE).unwrap();
        let addr = waiting_run(store.clone(), &transfer, api).await;
        for token in [None, Some("not-alices-token"), Some("")] {
            let client = Client::new(addr, token);
            for (path, body) in [
                ("/runs/r1/calls/pay-1/approve", json!({})),
                ("/runs/r1/calls/pay-1/deny", json!({})),
                ("/runs/r1/cancel", json!({"reason": "x"})),
                ("/runs/r1/fork", json!({"at": 1})),
                ("/runs/r1/resume", json!(null)),
                ("/runs", json!({"agent": "payments"})),
            ] {
                let (status, body) = client.post(path, body).await;
                assert_eq!(
                    (status, code(&body)),
                    (401, "unauthorized"),
                    "{path} {token:?}"
                );
            }
        }
        // Nothing was recorded: the run waits as it did, with its one run, and nothing paid.
        let run = store.run(&"r1".into()).unwrap();
        assert_eq!(run.state, agentrt::RunState::WaitingForApproval);
        assert_eq!(store.pending_calls(&"r1".into()).unwrap().len(), 1);
        assert_eq!(store.runs(None).unwrap().len(), 1);
        assert!(
            !store
                .events(&"r1".into())
                .unwrap()
                .iter()
                .any(|e| e.kind == agentrt::EventKind::ApprovalRecorded)
        );
        assert!(transfer.executions().is_empty());
        // Reads need no token unless told.
        let (status, _) = Client::new(addr, None).get("/runs/r1").await;
        assert_eq!(status, 200);
    });
}

#[test]
fn the_unauthorized_answer_asks_for_a_bearer_token() {
    let db = TempStore::new();
    let store = db.open();
    with_system(|| async move {
        let (addr, _server) = serve(Api::new(store).token("alice", ALICE).unwrap()).await;
        let response = awc::Client::new()
            .post(format!("http://{addr}{}/runs/r1/cancel", web::PREFIX))
            .send_json(&json!({"reason": "x"}))
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 401);
        let challenge = response.headers().get("www-authenticate").unwrap();
        assert!(challenge.to_str().unwrap().starts_with("Bearer"));
        // A header that is not `Bearer TOKEN` is refused the same way.
        let response = awc::Client::new()
            .post(format!("http://{addr}{}/runs/r1/cancel", web::PREFIX))
            .insert_header(("authorization", format!("Basic {ALICE}")))
            .send_json(&json!({"reason": "x"}))
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 401);
    });
}

#[test]
fn the_approver_recorded_is_the_tokens_operator_and_never_the_body() {
    let db = TempStore::new();
    let store = db.open();
    let transfer = RecordingTool::new("transfer");
    with_system(|| async move {
        // Bob's token is configured by its digest only.
        let api = Api::new(store.clone())
            .token("alice", ALICE)
            .unwrap()
            .token_digest("bob", &token_digest("bobs-token"))
            .unwrap();
        let addr = waiting_run(store.clone(), &transfer, api).await;
        let bob = Client::new(addr, Some("bobs-token"));
        // A body naming someone else is refused: the route takes no such field.
        let (status, body) = bob
            .post("/runs/r1/calls/pay-1/approve", json!({"by": "mallory"}))
            .await;
        assert_eq!((status, code(&body)), (422, "invalid_body"), "{body}");
        let (status, approval) = bob
            .post("/runs/r1/calls/pay-1/approve", json!({"note": "ok"}))
            .await;
        assert_eq!(status, 200, "{approval}");
        assert_eq!(approval["by"], "bob");
        bob.wait_state("r1", "SUCCEEDED").await;
        let recorded = store
            .events(&"r1".into())
            .unwrap()
            .into_iter()
            .find(|e| e.kind == agentrt::EventKind::ApprovalRecorded)
            .unwrap();
        assert_eq!(
            recorded.payload["decided_by"], "bob",
            "{}",
            recorded.payload
        );
    });
}

#[test]
fn reads_need_a_token_when_the_api_says_so() {
    let db = TempStore::new();
    let store = db.open();
    with_system(|| async move {
        let api = Api::new(store)
            .token("alice", ALICE)
            .unwrap()
            .tokens_for_reads(true);
        let (addr, _server) = serve(api).await;
        let anonymous = Client::new(addr, None);
        for path in ["/runs", "/runs/r1", "/approvals", "/whoami", "/stream"] {
            let (status, body) = anonymous.get(path).await;
            assert_eq!((status, code(&body)), (401, "unauthorized"), "{path}");
        }
        let wrong = Client::new(addr, Some("guess"));
        assert_eq!(wrong.get("/runs").await.0, 401);
        let alice = Client::new(addr, Some(ALICE));
        assert_eq!(alice.get("/runs").await.0, 200);
        // Liveness, readiness and the document of the routes stay open: a prober has no token.
        assert_eq!(anonymous.get("/health").await.0, 200);
        assert_eq!(anonymous.get("/ready").await.0, 200);
        assert_eq!(anonymous.get("/openapi.json").await.0, 200);
    });
}

#[test]
fn an_api_without_tokens_refuses_to_listen_beyond_loopback() {
    let db = TempStore::new();
    let store = db.open();
    let open = Api::new(store.clone());
    let everywhere: SocketAddr = "0.0.0.0:0".parse().unwrap();
    let lan: SocketAddr = "192.0.2.7:8080".parse().unwrap();
    let loopback: SocketAddr = "127.0.0.1:0".parse().unwrap();
    for addr in [everywhere, lan, "[::]:0".parse().unwrap()] {
        let err = open.check_listen(&[loopback, addr]).unwrap_err();
        assert!(err.to_string().contains("token"), "{err}");
    }
    open.check_listen(&[loopback, "[::1]:0".parse().unwrap()])
        .unwrap();
    Api::new(store.clone())
        .token("alice", ALICE)
        .unwrap()
        .check_listen(&[everywhere])
        .unwrap();
    // `serve` refuses before anything listens: the port stays free.
    let refused =
        with_system(|| async move { agentrt::web::serve(Api::new(store), "0.0.0.0:0").await });
    let err = refused.unwrap_err();
    assert!(err.to_string().contains("refusing to listen"), "{err}");
}

#[test]
fn without_tokens_a_loopback_caller_decides_as_the_local_operator() {
    let db = TempStore::new();
    let store = db.open();
    let transfer = RecordingTool::new("transfer");
    with_system(|| async move {
        let addr = waiting_run(store.clone(), &transfer, Api::new(store.clone())).await;
        let local = Client::new(addr, None);
        let (_, me) = local.get("/whoami").await;
        assert_eq!(me["operator"], agentrt::web::LOCAL_OPERATOR);
        assert_eq!(me["tokens"], false);
        let (status, approval) = local.post("/runs/r1/calls/pay-1/approve", json!({})).await;
        assert_eq!(status, 200, "{approval}");
        assert_eq!(approval["by"], agentrt::web::LOCAL_OPERATOR);
    });
}

#[test]
fn a_caller_without_a_token_is_refused_before_its_body_is_read() {
    let db = TempStore::new();
    let store = db.open();
    with_system(|| async move {
        let (addr, _server) = serve(Api::new(store).token("alice", ALICE).unwrap()).await;
        let anonymous = Client::new(addr, None);
        // Bodies the routes would refuse: the caller learns nothing of what they take.
        for (path, body) in [
            ("/runs", json!({"agent": 7})),
            ("/runs/r1/cancel", json!({"why": "x"})),
            ("/runs/r1/fork", json!([])),
        ] {
            let (status, body) = anonymous.post(path, body).await;
            assert_eq!((status, code(&body)), (401, "unauthorized"), "{path}");
        }
        let (status, body) = anonymous
            .post_raw(
                "/runs/r1/calls/c/approve",
                "text/plain",
                vec![b'x'; 300_000],
            )
            .await;
        assert_eq!((status, code(&body)), (401, "unauthorized"));
    });
}

#[test]
fn the_bearer_scheme_is_read_in_any_case_and_short_tokens_are_refused() {
    let db = TempStore::new();
    let store = db.open();
    for short in [
        "",
        "secret",
        "with space in it!",
        " padded-token-0123456789",
    ] {
        let err = Api::new(store.clone()).token("alice", short).unwrap_err();
        assert!(err.to_string().contains("at least 16 bytes"), "{err}");
    }
    with_system(|| async move {
        let (addr, _server) = serve(Api::new(store).token("alice", ALICE).unwrap()).await;
        let response = awc::Client::new()
            .get(format!("http://{addr}{}/whoami", web::PREFIX))
            .insert_header(("authorization", format!("bearer {ALICE}")))
            .send()
            .await
            .unwrap()
            .json::<serde_json::Value>()
            .await
            .unwrap();
        assert_eq!(response["operator"], "alice");
    });
}

#[test]
fn without_tokens_a_request_from_another_site_a_proxy_or_another_name_is_refused() {
    let db = TempStore::new();
    let store = db.open();
    let transfer = RecordingTool::new("transfer");
    with_system(|| async move {
        let addr = waiting_run(store.clone(), &transfer, Api::new(store.clone())).await;
        let url = format!("http://{addr}{}/runs/r1/calls/pay-1/approve", web::PREFIX);
        let here = format!("http://{addr}");
        let refused: &[&[(&str, &str)]] = &[
            // A page of another site posting a form, or a fetch in no-cors mode.
            &[("origin", "https://evil.example")],
            &[("origin", "null")],
            &[("sec-fetch-site", "cross-site")],
            // A name rebound to 127.0.0.1.
            &[("host", "evil.example")],
            // A proxy on this host passing on a request from anywhere.
            &[("x-forwarded-for", "203.0.113.9")],
            &[("forwarded", "for=203.0.113.9")],
            &[("via", "1.1 proxy")],
        ];
        for headers in refused {
            let mut request = awc::Client::new().post(&url);
            for (name, value) in *headers {
                request = request.insert_header((*name, *value));
            }
            let mut response = request.send().await.unwrap();
            let body: serde_json::Value = response.json().await.unwrap();
            assert_eq!(
                (response.status().as_u16(), code(&body)),
                (403, "forbidden"),
                "{headers:?}"
            );
        }
        assert_eq!(
            store.run(&"r1".into()).unwrap().state,
            agentrt::RunState::WaitingForApproval
        );
        assert!(transfer.executions().is_empty());
        // The console's own page, from this origin, may.
        let response = awc::Client::new()
            .post(&url)
            .insert_header(("origin", here.as_str()))
            .insert_header(("sec-fetch-site", "same-origin"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 200);
    });
}
