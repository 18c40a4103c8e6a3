//! The event streams: every event once with its seq as the SSE id, a reconnect from
//! `Last-Event-ID`, keep-alive comments, wakes by commits rather than by polling each client,
//! and a client that goes away takes its server-side work with it.

use std::time::Duration;

use agentrt::{
    Agent, Config, ModelResponse, RunState, ToolCall,
    testkit::{Behaviour, RecordingTool, ScriptedModel, TempStore, with_system},
    web::Api,
};
use serde_json::json;

use crate::support::{
    spawn, supervise,
    web::{ALICE, Client, EventStream, paying_agent, serve, serve_supervised, wait_until},
};

/// An agent whose tool blocks until the test releases it.
fn gated_agent(tool: &RecordingTool) -> Agent {
    let model = ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new("c1", "work", json!({}))]),
        ModelResponse::answer("done"),
    ]);
    Agent::new(model).tool(tool.clone())
}

#[test]
fn a_run_stream_sends_each_event_once_with_its_seq_and_ends_after_the_run() {
    let db = TempStore::new();
    let store = db.open();
    let work = RecordingTool::new("work").behaviour(Behaviour::Block);
    with_system(|| async move {
        let supervisor = supervise(
            store.clone(),
            Config::default(),
            "gated",
            gated_agent(&work),
        );
        let api = Api::new(store.clone()).supervisor(supervisor.clone());
        let (addr, _server) = serve(api).await;
        spawn(&supervisor, "gated", "r1").await;
        work.wait_executions(1).await;
        let mut stream = EventStream::open(addr, "/runs/r1/events/stream", &[]).await;
        assert!(stream.read_until("event: step.tool_started").await);
        assert!(stream.text.starts_with("HTTP/1.1 200"), "{}", stream.text);
        assert!(stream.text.contains("text/event-stream"));
        let before = stream.ids().len();
        // The run goes on while the stream is open: the new events come, then `end`.
        work.release();
        assert!(stream.read_until("event: end").await, "{}", stream.text);
        stream.read_to_end().await;
        let ids = stream.ids();
        let all = store.events(&"r1".into()).unwrap();
        assert!(ids.len() > before);
        assert_eq!(ids, all.iter().map(|e| e.seq).collect::<Vec<_>>());
        let kinds = stream.events();
        assert_eq!(kinds.last().unwrap(), "end");
        assert_eq!(kinds[kinds.len() - 2], "run.finished");
        assert!(stream.text.contains("data: {\"state\":\"SUCCEEDED\"}"));
        // Each event's data is the event as JSON.
        let first = stream
            .text
            .lines()
            .find_map(|line| line.strip_prefix("data: "))
            .unwrap();
        let first: serde_json::Value = serde_json::from_str(first).unwrap();
        assert_eq!(first["kind"], "run.started");
        assert_eq!(first["seq"], 1);
    });
}

#[test]
fn a_reconnect_with_last_event_id_resumes_after_that_event() {
    let db = TempStore::new();
    let store = db.open();
    let transfer = RecordingTool::new("transfer");
    with_system(|| async move {
        let (addr, supervisor, _) =
            serve_supervised(&store, "payments", paying_agent(&transfer), |api| api).await;
        spawn(&supervisor, "payments", "r1").await;
        let client = Client::new(addr, None);
        client.wait_state("r1", "WAITING_FOR_APPROVAL").await;
        let total = store.events(&"r1".into()).unwrap().len() as u64;
        assert!(total >= 3);

        // `?after=` alone.
        let mut stream = EventStream::open(addr, "/runs/r1/events/stream?after=1", &[]).await;
        assert!(stream.read_until(&format!("id: {total}\n")).await);
        assert_eq!(stream.ids(), (2..=total).collect::<Vec<_>>());
        // `Last-Event-ID` wins over `?after=`: it is where the client's own stream stopped.
        let mut stream = EventStream::open(
            addr,
            "/runs/r1/events/stream?after=0",
            &[("last-event-id", &(total - 1).to_string())],
        )
        .await;
        assert!(stream.read_until(&format!("id: {total}\n")).await);
        assert_eq!(stream.ids(), vec![total]);
        // A Last-Event-ID that is not a seq is refused.
        let mut bad = EventStream::open(
            addr,
            "/runs/r1/events/stream",
            &[("last-event-id", "yesterday")],
        )
        .await;
        bad.read_to_end().await;
        let status = bad.text;
        assert!(status.starts_with("HTTP/1.1 400"), "{status}");
        assert!(status.contains("invalid_query"), "{status}");
    });
}

#[test]
fn an_idle_stream_sends_keep_alive_comments() {
    let db = TempStore::new();
    let store = db.open();
    let transfer = RecordingTool::new("transfer");
    with_system(|| async move {
        let (addr, supervisor, _) =
            serve_supervised(&store, "payments", paying_agent(&transfer), |api| {
                api.keep_alive(Duration::from_millis(20))
            })
            .await;
        spawn(&supervisor, "payments", "r1").await;
        Client::new(addr, None)
            .wait_state("r1", "WAITING_FOR_APPROVAL")
            .await;
        let mut stream = EventStream::open(addr, "/runs/r1/events/stream", &[]).await;
        assert!(stream.read_until("event: policy.decided").await);
        // The run waits: nothing new, so comments keep the connection alive, more than once.
        let start = stream.text.len();
        while stream.text[start..].matches(": keep-alive\n\n").count() < 2 {
            assert!(
                stream.read_more().await,
                "the stream ended: {}",
                stream.text
            );
        }
        assert!(!stream.text[start..].contains("event:"), "{}", stream.text);
        let mut changes = EventStream::open(addr, "/stream", &[]).await;
        assert!(changes.read_until(": keep-alive").await);
    });
}

#[test]
fn a_commit_of_this_process_wakes_the_streams_without_waiting_for_a_check() {
    let db = TempStore::new();
    let store = db.open();
    let work = RecordingTool::new("work").behaviour(Behaviour::Block);
    with_system(|| async move {
        let supervisor = supervise(
            store.clone(),
            Config::default(),
            "gated",
            gated_agent(&work),
        );
        // A check for other processes' commits once an hour: only the bell of this process's
        // commits can wake the stream within the test.
        let api = Api::new(store.clone())
            .supervisor(supervisor.clone())
            .check_every(Duration::from_secs(3600))
            .keep_alive(Duration::from_secs(3600));
        let (addr, _server) = serve(api.clone()).await;
        spawn(&supervisor, "gated", "r1").await;
        work.wait_executions(1).await;
        let mut stream = EventStream::open(addr, "/runs/r1/events/stream", &[]).await;
        assert!(stream.read_until("event: step.tool_started").await);
        let mut changes = EventStream::open(addr, "/stream", &[]).await;
        assert!(changes.read_until(": connected").await);
        wait_until(|| async { (api.stats().commit_checks >= 1).then_some(()) }).await;
        work.release();
        assert!(stream.read_until("event: end").await, "{}", stream.text);
        assert!(changes.read_until("event: changed").await);
    });
}

#[test]
fn another_processs_commit_reaches_the_stream_at_the_next_check() {
    let db = TempStore::new();
    let store = db.open();
    let transfer = RecordingTool::new("transfer");
    with_system(|| async move {
        // The supervisor writes through a handle of its own, as another process would: its
        // commits ring no bell the API hears.
        let supervisor = supervise(
            db.open(),
            Config::default(),
            "payments",
            paying_agent(&transfer),
        );
        let api = Api::new(store.clone()).check_every(Duration::from_millis(20));
        let (addr, _server) = serve(api).await;
        let mut changes = EventStream::open(addr, "/stream", &[]).await;
        assert!(changes.read_until(": connected").await);
        spawn(&supervisor, "payments", "r1").await;
        assert!(changes.read_until("event: changed").await);
        let mut stream = EventStream::open(addr, "/runs/r1/events/stream", &[]).await;
        assert!(stream.read_until("event: policy.decided").await);
        // The decision, recorded through the API's own handle, resumes nothing here (no
        // supervisor); the other handle's supervisor is told by a resume.
        let client = Client::new(addr, Some(ALICE));
        let (status, _) = client.post("/runs/r1/calls/pay-1/approve", json!({})).await;
        assert_eq!(status, 200);
        supervisor
            .send(agentrt::ResumeRun::new("r1"))
            .await
            .unwrap()
            .unwrap();
        assert!(stream.read_until("event: end").await, "{}", stream.text);
    });
}

#[test]
fn a_client_that_goes_away_ends_its_streams_work() {
    let db = TempStore::new();
    let store = db.open();
    let transfer = RecordingTool::new("transfer");
    with_system(|| async move {
        let (addr, supervisor, api) =
            serve_supervised(&store, "payments", paying_agent(&transfer), |api| {
                api.check_every(Duration::from_millis(5))
                    .keep_alive(Duration::from_millis(20))
            })
            .await;
        let start = |id: &'static str| {
            let supervisor = supervisor.clone();
            async move {
                spawn(&supervisor, "payments", id).await;
            }
        };
        start("r1").await;
        let client = Client::new(addr, None);
        client.wait_state("r1", "WAITING_FOR_APPROVAL").await;

        let mut streams = Vec::new();
        for _ in 0..5 {
            let mut stream = EventStream::open(addr, "/runs/r1/events/stream", &[]).await;
            assert!(stream.read_until("event: policy.decided").await);
            streams.push(stream);
        }
        let mut changes = EventStream::open(addr, "/stream", &[]).await;
        assert!(changes.read_until(": connected").await);
        assert_eq!(api.stats().open_streams, 6);
        // While they are open, commits make them read.
        let reads = api.stats().store_reads;
        start("r2").await;
        client.wait_state("r2", "WAITING_FOR_APPROVAL").await;
        wait_until(|| async { (api.stats().store_reads > reads).then_some(()) }).await;

        // The clients go away: their streams end, and so does the check for commits.
        drop(streams);
        drop(changes);
        wait_until(|| async { (api.stats().open_streams == 0).then_some(()) }).await;
        // The check stops within one of its periods once no stream is left.
        wait_until(|| async { (!api.stats().checking).then_some(()) }).await;
        let settled = api.stats();
        // Commits now cost the API nothing: no check, no read.
        start("r3").await;
        client.wait_state("r3", "WAITING_FOR_APPROVAL").await;
        client
            .post("/runs/r3/cancel", json!({"reason": "done"}))
            .await;
        assert_eq!(store.run(&"r3".into()).unwrap().state, RunState::Cancelled);
        assert_eq!(api.stats(), settled);
    });
}

#[test]
fn a_reconnect_after_the_end_of_a_finished_run_is_told_there_is_nothing_more() {
    let db = TempStore::new();
    let store = db.open();
    let work = RecordingTool::new("work");
    with_system(|| async move {
        let (addr, supervisor, _) =
            serve_supervised(&store, "gated", gated_agent(&work), |api| api).await;
        spawn(&supervisor, "gated", "r1").await;
        Client::new(addr, None).wait_state("r1", "SUCCEEDED").await;
        let last = store.events(&"r1".into()).unwrap().len().to_string();
        let mut stream =
            EventStream::open(addr, "/runs/r1/events/stream", &[("last-event-id", &last)]).await;
        stream.read_to_end().await;
        assert!(stream.text.starts_with("HTTP/1.1 204"), "{}", stream.text);
        // From before its end, the stream sends what follows, then `end`.
        let mut stream =
            EventStream::open(addr, "/runs/r1/events/stream", &[("last-event-id", "1")]).await;
        stream.read_to_end().await;
        assert!(stream.text.starts_with("HTTP/1.1 200"), "{}", stream.text);
        assert_eq!(stream.events().last().unwrap(), "end");
    });
}

#[test]
fn commits_of_other_runs_do_not_hold_back_an_idle_streams_keep_alive() {
    let db = TempStore::new();
    let store = db.open();
    let transfer = RecordingTool::new("transfer");
    with_system(|| async move {
        let (addr, supervisor, _) =
            serve_supervised(&store, "payments", paying_agent(&transfer), |api| {
                api.keep_alive(Duration::from_millis(300))
            })
            .await;
        spawn(&supervisor, "payments", "r1").await;
        Client::new(addr, None)
            .wait_state("r1", "WAITING_FOR_APPROVAL")
            .await;
        let mut stream = EventStream::open(addr, "/runs/r1/events/stream", &[]).await;
        assert!(stream.read_until("event: policy.decided").await);
        // Another run starts every few milliseconds: each commit wakes the stream, which finds
        // nothing of its own run. Its keep-alive comes all the same.
        let busy = {
            let supervisor = supervisor.clone();
            actix_rt::spawn(async move {
                for n in 0.. {
                    spawn(&supervisor, "payments", format!("other-{n}")).await;
                    actix_rt::time::sleep(Duration::from_millis(5)).await;
                }
            })
        };
        let start = stream.text.len();
        while !stream.text[start..].contains(": keep-alive\n\n") {
            assert!(
                stream.read_more().await,
                "the stream ended: {}",
                stream.text
            );
        }
        busy.abort();
        assert!(!stream.text[start..].contains("event:"), "{}", stream.text);
    });
}
