//! The schedules over HTTP: listed for readers, paused and resumed by an operator with a
//! token, an unknown one a 404.

use agentrt::{Missed, Schedule, testkit::TempStore, testkit::with_system, web::Api};
use serde_json::json;

use crate::support::web::{ALICE, Client, code, serve};

#[test]
fn schedules_are_listed_and_paused_and_resumed_by_an_operator_with_a_token() {
    let db = TempStore::new();
    let store = db.open();
    let nightly = Schedule::new("nightly", "0 2 * * *", "reports", json!({"kind": "daily"}))
        .missed(Missed::CatchUp);
    store.put_schedule(&nightly).unwrap();
    with_system(|| async move {
        let api = Api::new(store.clone()).token("alice", ALICE).unwrap();
        let (addr, _server) = serve(api).await;
        let (alice, nobody) = (Client::new(addr, Some(ALICE)), Client::new(addr, None));

        let (status, body) = nobody.get("/schedules").await;
        assert_eq!(status, 200, "{body}");
        let listed = &body["schedules"];
        assert_eq!(listed.as_array().unwrap().len(), 1);
        assert_eq!(listed[0]["name"], json!("nightly"));
        assert_eq!(listed[0]["cron"], json!("0 2 * * *"));
        assert_eq!(listed[0]["missed"], json!("catch_up"));
        assert_eq!(listed[0]["paused"], json!(false));
        assert!(listed[0]["next_at"].is_i64());

        for path in ["/schedules/nightly/pause", "/schedules/nightly/resume"] {
            let (status, body) = nobody.post(path, json!(null)).await;
            assert_eq!((status, code(&body)), (401, "unauthorized"), "{path}");
        }
        assert!(
            !store.schedule("nightly").unwrap().paused,
            "nothing changed"
        );

        let (status, body) = alice.post("/schedules/nightly/pause", json!(null)).await;
        assert_eq!(
            (status, body["paused"].clone()),
            (200, json!(true)),
            "{body}"
        );
        assert!(store.schedule("nightly").unwrap().paused);
        let (status, body) = alice.post("/schedules/nightly/resume", json!(null)).await;
        assert_eq!(
            (status, body["paused"].clone()),
            (200, json!(false)),
            "{body}"
        );
        assert!(!store.schedule("nightly").unwrap().paused);

        let (status, body) = alice.post("/schedules/nope/pause", json!(null)).await;
        assert_eq!((status, code(&body)), (404, "not_found"), "{body}");
        let (status, _) = alice.get("/schedules/nightly/pause").await;
        assert_eq!(status, 405);
    });
}
