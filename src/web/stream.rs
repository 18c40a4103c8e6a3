//! Server-sent events: a run's events as they are committed, and a store-wide "something
//! changed". One thread per API checks the store for commits, whatever the number of
//! clients, only while a stream is open; a stream reads the store only after a commit.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use actix_web::web::Bytes;
use futures_util::{Stream, StreamExt, stream};
use tokio::sync::watch;

use crate::{Event, RunId, RunState, Store};

/// What the API's streams cost, as counters: for dashboards, and for the tests that show a
/// stream's work ends with its client.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub open_streams: AtomicUsize,
    pub store_reads: AtomicU64,
    pub checks: AtomicU64,
}

/// The commits' news, shared by every stream of one API.
pub(crate) struct Hub {
    store: Store,
    every: Duration,
    news: watch::Sender<u64>,
    /// Whether the checking thread runs; taken with the count of receivers, so that the last
    /// stream's end and a new stream's start never both miss it.
    running: Mutex<bool>,
    pub counters: Arc<Counters>,
}

impl Hub {
    pub(crate) fn new(store: Store, every: Duration) -> Arc<Hub> {
        Arc::new(Hub {
            store,
            every,
            news: watch::channel(0).0,
            running: Mutex::new(false),
            counters: Arc::default(),
        })
    }

    /// The check period for other processes' commits.
    pub(crate) fn every(&self) -> Duration {
        self.every
    }

    /// Whether the checking thread runs.
    pub(crate) fn checking(&self) -> bool {
        *self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// News of commits, from now on: the checking thread runs while a receiver is held.
    fn subscribe(self: &Arc<Self>) -> watch::Receiver<u64> {
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        let news = self.news.subscribe();
        if !*running {
            let hub = self.clone();
            let started = std::thread::Builder::new()
                .name("agentrt-web-pulse".into())
                .spawn(move || hub.check());
            *running = started.is_ok();
            if let Err(err) = started {
                tracing::warn!(error = %err, "the web API could not start its commit check");
            }
        }
        news
    }

    /// The checking thread: reads the store's commit marker after each commit this process
    /// makes, and at least every `every` for those of other processes; stops when no stream
    /// is left.
    fn check(self: Arc<Self>) {
        let bell = self.store.bell().clone();
        let mut pulse = None;
        let mut last = None;
        loop {
            {
                let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
                if self.news.receiver_count() == 0 {
                    *running = false;
                    return;
                }
            }
            let rung = bell.rung();
            if pulse.is_none() {
                pulse = self.store.pulse().ok();
            }
            if let Some(check) = pulse.as_mut() {
                self.counters.checks.fetch_add(1, Ordering::Relaxed);
                match check.marker() {
                    Ok(marker) => {
                        // The first marker is news too: a stream that subscribed while the
                        // thread started may have read the store before a commit it carries.
                        if last.as_ref() != Some(&marker) {
                            self.news.send_modify(|n| *n += 1);
                            last = Some(marker);
                        }
                    }
                    // Read again from a new connection at the next check; the streams are
                    // told, so that they read the store themselves meanwhile.
                    Err(_) => {
                        pulse = None;
                        self.news.send_modify(|n| *n += 1);
                    }
                }
            }
            bell.wait(rung, self.every);
        }
    }
}

/// Counts a stream as open while it lives.
struct Open(Arc<Counters>);

impl Open {
    fn new(counters: Arc<Counters>) -> Self {
        counters.open_streams.fetch_add(1, Ordering::SeqCst);
        Open(counters)
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open_streams.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One server-sent event: `id`, `event`, and the data as one line of JSON.
fn frame(id: Option<u64>, event: &str, data: &str) -> String {
    let mut text = String::new();
    if let Some(id) = id {
        text.push_str(&format!("id: {id}\n"));
    }
    text.push_str(&format!("event: {event}\ndata: {data}\n\n"));
    text
}

const KEEP_ALIVE: &str = ": keep-alive\n\n";

/// A run's events after `after`, then each one as it is committed, with keep-alive comments
/// every `keep_alive` while nothing comes; `end` once the run has finished and every event is
/// sent.
pub(crate) fn run_events(
    hub: &Arc<Hub>,
    run_id: RunId,
    after: u64,
    keep_alive: Duration,
) -> impl Stream<Item = Result<Bytes, actix_web::Error>> + use<> {
    struct State {
        store: Store,
        counters: Arc<Counters>,
        news: watch::Receiver<u64>,
        run_id: RunId,
        after: u64,
        done: bool,
        _open: Open,
    }
    let state = State {
        store: hub.store.clone(),
        counters: hub.counters.clone(),
        // Subscribed before the first read: a commit after it is news.
        news: hub.subscribe(),
        run_id,
        after,
        done: false,
        _open: Open::new(hub.counters.clone()),
    };
    stream::unfold(state, move |mut state| async move {
        if state.done {
            return None;
        }
        loop {
            state.news.borrow_and_update();
            let read = {
                let (store, run_id, after) =
                    (state.store.clone(), state.run_id.clone(), state.after);
                state.counters.store_reads.fetch_add(1, Ordering::Relaxed);
                actix_web::web::block(move || -> crate::Result<(Vec<Event>, RunState)> {
                    // The state first: a run read finished has every event committed already.
                    let run_state = store.run(&run_id)?.state;
                    Ok((store.events_after(&run_id, after)?, run_state))
                })
                .await
            };
            let (events, run_state) = match read {
                Ok(Ok(read)) => read,
                Ok(Err(err)) => {
                    state.done = true;
                    let data = serde_json::json!({ "message": err.to_string() }).to_string();
                    return Some((Ok(Bytes::from(frame(None, "error", &data))), state));
                }
                Err(_) => return None,
            };
            if let Some(last) = events.last().map(|event| event.seq) {
                let mut chunk = String::new();
                for event in &events {
                    let data = serde_json::to_string(event).expect("an event serializes");
                    chunk.push_str(&frame(Some(event.seq), event.kind.as_str(), &data));
                }
                state.after = last;
                return Some((Ok(Bytes::from(chunk)), state));
            }
            if run_state.is_finished() {
                state.done = true;
                let data = serde_json::json!({ "state": run_state }).to_string();
                return Some((Ok(Bytes::from(frame(None, "end", &data))), state));
            }
            match tokio::time::timeout(keep_alive, state.news.changed()).await {
                Ok(Ok(())) => continue,
                Ok(Err(_)) => return None,
                Err(_) => return Some((Ok(Bytes::from_static(KEEP_ALIVE.as_bytes())), state)),
            }
        }
    })
}

/// `changed` whenever something was committed to the store (coalesced: one event for the
/// commits made while the last one was sent), with keep-alive comments between.
pub(crate) fn changes(
    hub: &Arc<Hub>,
    keep_alive: Duration,
) -> impl Stream<Item = Result<Bytes, actix_web::Error>> + use<> {
    let state = (hub.subscribe(), Open::new(hub.counters.clone()));
    let first = stream::once(async { Ok(Bytes::from_static(b": connected\n\n")) });
    first.chain(stream::unfold(state, move |(mut news, open)| async move {
        let chunk = match tokio::time::timeout(keep_alive, news.changed()).await {
            Ok(Ok(())) => {
                news.borrow_and_update();
                frame(None, "changed", "{}")
            }
            Ok(Err(_)) => return None,
            Err(_) => KEEP_ALIVE.to_owned(),
        };
        Some((Ok(Bytes::from(chunk)), (news, open)))
    }))
}
