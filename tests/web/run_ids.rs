//! A new run's id names it in the API's and the console's paths: a start or a fork under an
//! id that is empty, `.` or `..`, too long, or holds a control character or a Unicode
//! bidirectional control is a 400 `invalid_run_id`, and writes nothing.

use agentrt::{
    Agent, RunId,
    testkit::{RecordingTool, TempStore, with_system},
};
use serde_json::json;

use crate::support::{
    call_then_answer,
    web::{Client, code, serve_supervised},
};

#[test]
fn a_start_or_a_fork_under_an_id_that_names_no_run_is_refused_and_writes_nothing() {
    let db = TempStore::new();
    let store = db.open();
    let agent =
        Agent::new(call_then_answer("c1", "t", json!({}), "done")).tool(RecordingTool::new("t"));
    with_system(|| async move {
        let (addr, _supervisor, _) = serve_supervised(&store, "a", agent, |api| api).await;
        let client = Client::new(addr, None);
        let (status, _) = client
            .post("/runs", json!({"agent": "a", "run_id": "origin"}))
            .await;
        assert_eq!(status, 202);
        client.wait_state("origin", "SUCCEEDED").await;
        let events = store.events(&RunId::from("origin")).unwrap();

        let long = "x".repeat(RunId::MAX_LEN + 1);
        for id in [
            "",
            ".",
            "..",
            "a\u{0}b",
            "a\nb",
            "invoice\u{202E}fdp.exe",
            "\u{2066}x\u{2069}",
            "x\u{061C}",
            "\u{200E}",
            long.as_str(),
        ] {
            let started = client
                .post("/runs", json!({"agent": "a", "run_id": id}))
                .await;
            let forked = client
                .post("/runs/origin/fork", json!({"at": 1, "new_id": id}))
                .await;
            for (door, (status, body)) in [("start", started), ("fork", forked)] {
                assert_eq!(
                    (status, code(&body)),
                    (400, "invalid_run_id"),
                    "{door} {id:?}: {body}"
                );
            }
        }
        let runs = store.runs(None).unwrap();
        assert_eq!(runs.len(), 1, "{runs:?}");
        assert_eq!(store.events(&RunId::from("origin")).unwrap(), events);
    });
}
