//! A draining supervisor behind the API: a start, a resume and a fork answer 503 `draining`,
//! and write nothing, so that a client sends them to another replica.

use agentrt::{
    Drain, RunId,
    testkit::{RecordingTool, TempStore, with_system},
};
use serde_json::json;

use crate::support::web::{Client, code, paying_agent, serve_supervised};

#[test]
fn a_draining_supervisors_api_refuses_starts_resumes_and_forks_and_writes_nothing() {
    let db = TempStore::new();
    let store = db.open();
    let agent = paying_agent(&RecordingTool::new("transfer"));
    with_system(|| async move {
        let (addr, supervisor, _) = serve_supervised(&store, "a", agent, |api| api).await;
        let client = Client::new(addr, None);
        let (status, _) = client
            .post("/runs", json!({"agent": "a", "run_id": "waits"}))
            .await;
        assert_eq!(status, 202);
        client.wait_state("waits", "WAITING_FOR_APPROVAL").await;
        let report = supervisor.send(Drain::default()).await.unwrap();
        assert!(report.is_clean());
        let before = store.events(&RunId::from("waits")).unwrap();

        let (status, body) = client
            .post("/runs", json!({"agent": "a", "run_id": "new"}))
            .await;
        assert_eq!((status, code(&body)), (503, "draining"), "{body}");
        let (status, body) = client.post("/runs/waits/resume", json!({})).await;
        assert_eq!((status, code(&body)), (503, "draining"), "{body}");
        let (status, body) = client
            .post("/runs/waits/fork", json!({"at": 1, "new_id": "forked"}))
            .await;
        assert_eq!((status, code(&body)), (503, "draining"), "{body}");

        let ids: Vec<RunId> = store
            .runs(None)
            .unwrap()
            .into_iter()
            .map(|r| r.id)
            .collect();
        assert_eq!(ids, [RunId::from("waits")]);
        assert_eq!(store.events(&RunId::from("waits")).unwrap(), before);
    });
}
