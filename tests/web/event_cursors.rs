//! An event cursor (`?after=`, `Last-Event-ID`) past the largest seq a store can hold is
//! refused as a query the route does not take, rather than wrapping round to the first event.

use crate::support::web::{Client, EventStream, code, paying_agent, serve_supervised};
use agentrt::testkit::{RecordingTool, TempStore, with_system};

/// The smallest cursor past every seq: 2^63.
const PAST: u64 = i64::MAX as u64 + 1;

#[test]
fn an_event_cursor_past_the_largest_seq_is_refused_not_wrapped_round() {
    let db = TempStore::new();
    let store = db.open();
    let transfer = RecordingTool::new("transfer");
    with_system(|| async move {
        let (addr, supervisor, _) =
            serve_supervised(&store, "payments", paying_agent(&transfer), |api| api).await;
        crate::support::spawn(&supervisor, "payments", "r1").await;
        let client = Client::new(addr, None);
        client.wait_state("r1", "WAITING_FOR_APPROVAL").await;

        // The largest seq there can be is taken: nothing comes after it.
        let (status, events) = client
            .get(&format!("/runs/r1/events?after={}", i64::MAX))
            .await;
        assert_eq!((status, events), (200, serde_json::json!([])));
        for after in [PAST, u64::MAX] {
            let (status, body) = client.get(&format!("/runs/r1/events?after={after}")).await;
            assert_eq!((status, code(&body)), (400, "invalid_query"), "{body}");
            assert!(
                body["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("9223372036854775807"),
                "{body}"
            );

            let mut stream =
                EventStream::open(addr, &format!("/runs/r1/events/stream?after={after}"), &[])
                    .await;
            stream.read_until("\r\n\r\n").await;
            assert!(stream.text.starts_with("HTTP/1.1 400"), "{}", stream.text);
            stream.read_to_end().await;
            assert!(stream.text.contains("invalid_query"), "{}", stream.text);

            let last = after.to_string();
            let mut stream = EventStream::open(
                addr,
                "/runs/r1/events/stream",
                &[("last-event-id", last.as_str())],
            )
            .await;
            stream.read_until("\r\n\r\n").await;
            assert!(stream.text.starts_with("HTTP/1.1 400"), "{}", stream.text);
            stream.read_to_end().await;
            assert!(stream.text.contains("invalid_query"), "{}", stream.text);
        }
    });
}
