//! What reading costs the disk: the inbox over many waiting runs and an idle event stream
//! sync nothing, since nothing they read could be taken back by a power loss; a read that
//! follows a commit left unsynced (another process's, say) still syncs the log first.

use std::time::Duration;

use agentrt::{
    Outcome, StartRun,
    testkit::{RecordingTool, TempStore, faults, with_system},
};
use serde_json::json;

use crate::support::web::{Client, EventStream, paying_agent, serve_supervised};

const WAITING: usize = 200;

#[test]
fn an_inbox_over_two_hundred_waiting_runs_and_an_idle_streams_keep_alives_sync_nothing_until_a_commit_is_left_unsynced()
 {
    let db = TempStore::sqlite();
    let store = db.open();
    let transfer = RecordingTool::new("transfer");
    with_system(|| async move {
        let (addr, supervisor, _) =
            serve_supervised(&store, "payments", paying_agent(&transfer), |api| {
                api.keep_alive(Duration::from_millis(20))
            })
            .await;
        // Started together, each answered once its wait is durable: then nothing is left to
        // sync, and nothing more is written while the runs wait.
        let started = (0..WAITING).map(|n| {
            supervisor.send(StartRun::new("payments", json!({})).with_id(format!("r{n:03}")))
        });
        for reply in futures_util::future::join_all(started).await {
            let outcome = reply.unwrap().unwrap().outcome;
            assert!(
                matches!(outcome, Outcome::WaitingForApproval { .. }),
                "{outcome:?}"
            );
        }
        let syncs = || faults(&store).expect("an SQLite store").syncs();
        let before = syncs();
        let client = Client::new(addr, None);
        let (status, inbox) = client.get("/approvals").await;
        assert_eq!(status, 200);
        assert_eq!(inbox["calls"].as_array().unwrap().len(), WAITING);
        assert_eq!(syncs(), before, "the inbox read only what was durable");
        // An idle stream: its first read and then its keep-alives.
        let mut stream = EventStream::open(addr, "/runs/r000/events/stream", &[]).await;
        assert!(stream.read_until("event: policy.decided").await);
        let start = stream.text.len();
        while stream.text[start..].matches(": keep-alive\n\n").count() < 3 {
            assert!(stream.read_more().await, "the stream ended");
        }
        assert_eq!(syncs(), before, "the stream read only what was durable");
        // Closed: its reads of the commit below would race the inbox's for the one sync.
        drop(stream);
        // Another connection commits without syncing, as another process's group that waits
        // for its sync does: the next read syncs before it answers, and the one after does not.
        let other = rusqlite::Connection::open(db.path()).unwrap();
        other
            .execute_batch(
                "PRAGMA synchronous = OFF; \
                 UPDATE runs SET updated_at = updated_at + 1 WHERE id = 'r000'",
            )
            .unwrap();
        let (status, _) = client.get("/approvals").await;
        assert_eq!(status, 200);
        assert_eq!(
            syncs(),
            before + 1,
            "the read of an unsynced commit synced it"
        );
        client.get("/approvals").await;
        assert_eq!(syncs(), before + 1);
    });
}
