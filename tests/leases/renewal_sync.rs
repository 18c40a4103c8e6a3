//! On SQLite a lease renewal commits without syncing the log: a power loss may undo it, which
//! only ends the lease sooner, and every holder of a lease on that file dies with the machine
//! (see `docs/lease.md`). The lease is renewed all the same, and the run goes on.

use std::time::{Duration, SystemTime};

use agentrt::{
    Agent, Config, Lease, Outcome, RunId, StartRun, Store,
    testkit::{Behaviour, FaultKind, RecordingTool, TempStore, faults, with_system},
};
use serde_json::json;

use crate::support::{PATIENCE, call_then_answer, supervise};

/// Renewals every 100 ms.
const TTL: Duration = Duration::from_millis(300);

/// The renewals waited for while nothing else writes.
const RENEWALS: usize = 3;

/// The stored lease of `r1`, read off the actix thread.
async fn lease(store: &Store) -> Lease {
    let store = store.clone();
    actix_rt::task::spawn_blocking(move || store.lease(&RunId::from("r1")).unwrap())
        .await
        .unwrap()
        .expect("leased")
}

/// Waits until the stored lease of `r1` expires later than `after`.
async fn renewed_past(store: &Store, after: SystemTime) -> Lease {
    let deadline = SystemTime::now() + PATIENCE;
    loop {
        let now = lease(store).await;
        if now.expires_at > after {
            return now;
        }
        assert!(SystemTime::now() < deadline, "the lease was not renewed");
        actix_rt::time::sleep(TTL / 30).await;
    }
}

#[test]
fn a_lease_renewal_on_sqlite_does_not_sync_the_log_and_still_extends_the_lease() {
    let db = TempStore::sqlite();
    let store = db.open();
    let tool = RecordingTool::new("t").behaviour(Behaviour::Block);
    let agent = Agent::new(call_then_answer("c1", "t", json!({}), "done")).tool(tool.clone());
    let (synced, renewals, reply) = {
        let store = store.clone();
        with_system(|| async move {
            let config = Config::default().lease_ttl(TTL);
            let supervisor = supervise(store.clone(), config, "a", agent);
            let call = supervisor.send(StartRun::new("a", json!({})).with_id("r1"));
            let call = actix_rt::spawn(call);
            // While the tool blocks, only the lease keeper writes.
            tool.wait_executions(1).await;
            // The first renewal may be the one that starts the log over after a checkpoint,
            // which syncs the log's new header: counted from after it.
            let mut last = renewed_past(&store, lease(&store).await.expires_at).await;
            let faults = faults(&store).unwrap();
            let before = faults.count(FaultKind::LogSync);
            let mut renewals = vec![last.clone()];
            for _ in 0..RENEWALS {
                last = renewed_past(&store, last.expires_at).await;
                renewals.push(last.clone());
            }
            let synced = faults.count(FaultKind::LogSync) - before;
            tool.release();
            let reply = call.await.unwrap().unwrap();
            (synced, renewals, reply)
        })
    };
    assert_eq!(synced, 0, "log syncs during {RENEWALS} renewals");
    // Each renewal extended the same lease, under the same fencing token.
    for pair in renewals.windows(2) {
        assert!(pair[1].expires_at > pair[0].expires_at, "{pair:?}");
        assert_eq!(pair[1].owner, pair[0].owner);
        assert_eq!(pair[1].fencing_token, pair[0].fencing_token);
    }
    let reply = reply.expect("the run goes on under its renewed lease");
    assert!(
        matches!(reply.outcome, Outcome::Succeeded { .. }),
        "{reply:?}"
    );
}
