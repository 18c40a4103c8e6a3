//! Server-sent events: a run's events as they are committed, and a store-wide "something
//! changed". One thread per API checks the store for commits, whatever the number of
//! clients, only while a stream is open; a stream reads the store only after a commit.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use actix_web::web::Bytes;
use futures_util::{Stream, StreamExt, stream};
use tokio::sync::watch;

use crate::{RunId, Store};

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
    /// is left. Without a marker (the store refused one), each of this process's commits is
    /// news.
    fn check(self: Arc<Self>) {
        // Marks the thread stopped if it panics, so that the next stream starts another.
        struct Unwinding<'a>(&'a Hub);
        impl Drop for Unwinding<'_> {
            fn drop(&mut self) {
                if std::thread::panicking() {
                    *self.0.running.lock().unwrap_or_else(|p| p.into_inner()) = false;
                }
            }
        }
        let _unwinding = Unwinding(&self);
        let bell = self.store.bell().clone();
        let mut pulse = None;
        let mut last = None;
        let mut rung = bell.rung();
        loop {
            {
                let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
                if self.news.receiver_count() == 0 {
                    // Under the lock a new stream subscribes with: it starts another thread.
                    *running = false;
                    return;
                }
            }
            let was = rung;
            rung = bell.rung();
            if pulse.is_none() {
                pulse = match self.store.pulse() {
                    Ok(pulse) => Some(pulse),
                    Err(err) => {
                        tracing::warn!(error = %err, "the web API cannot check the store for commits; its streams hear only this process's");
                        None
                    }
                };
            }
            let news = match pulse.as_mut() {
                Some(check) => {
                    self.counters.checks.fetch_add(1, Ordering::Relaxed);
                    match check.marker() {
                        // The first marker is news too: a stream that subscribed while the
                        // thread started may have read the store before a commit it carries.
                        Ok(marker) => (last.as_ref() != Some(&marker))
                            .then(|| last = Some(marker))
                            .is_some(),
                        Err(err) => {
                            tracing::warn!(error = %err, "the web API's check for commits failed; it opens another connection");
                            pulse = None;
                            true
                        }
                    }
                }
                None => rung != was,
            };
            if news {
                self.news.send_modify(|n| *n += 1);
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
/// when nothing was sent for `keep_alive`; `end` once the run has finished and every event is
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
        /// When the next keep-alive is due: a wake that sends nothing does not push it back.
        quiet_until: Instant,
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
        quiet_until: Instant::now() + keep_alive,
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
                actix_web::web::block(move || store.state_and_events_after(&run_id, after)).await
            };
            let (run_state, events) = match read {
                Ok(Ok(read)) => read,
                Ok(Err(err)) => {
                    state.done = true;
                    let data = serde_json::json!({ "message": err.to_string() }).to_string();
                    return Some((Ok(Bytes::from(frame(None, "failure", &data))), state));
                }
                Err(_) => return None,
            };
            if let Some(last) = events.last().map(|event| event.seq) {
                state.quiet_until = Instant::now() + keep_alive;
                let mut chunk = String::new();
                for event in &events {
                    let data = serde_json::to_string(event).expect("an event serializes");
                    chunk.push_str(&frame(Some(event.seq), event.kind.as_str(), &data));
                }
                state.after = last;
                return Some((Ok(Bytes::from(chunk)), state));
            }
            // The state was read in the same snapshot: a finished run has no event to come.
            if run_state.is_finished() {
                state.done = true;
                let data = serde_json::json!({ "state": run_state }).to_string();
                return Some((Ok(Bytes::from(frame(None, "end", &data))), state));
            }
            let due = tokio::time::Instant::from_std(state.quiet_until);
            match tokio::time::timeout_at(due, state.news.changed()).await {
                Ok(Ok(())) => continue,
                Ok(Err(_)) => return None,
                Err(_) => {
                    state.quiet_until = Instant::now() + keep_alive;
                    return Some((Ok(Bytes::from_static(KEEP_ALIVE.as_bytes())), state));
                }
            }
        }
    })
}

/// The least time between two `changed` events of one stream: the commits of a busy store
/// coalesce into a few a second.
const CHANGED_EVERY: Duration = Duration::from_millis(250);

/// `changed` whenever something was committed to the store (coalesced: at most one per
/// 250 ms), with keep-alive comments between.
pub(crate) fn changes(
    hub: &Arc<Hub>,
    keep_alive: Duration,
) -> impl Stream<Item = Result<Bytes, actix_web::Error>> + use<> {
    let state = (
        hub.subscribe(),
        Open::new(hub.counters.clone()),
        None::<Instant>,
    );
    let first = stream::once(async { Ok(Bytes::from_static(b": connected\n\n")) });
    first.chain(stream::unfold(
        state,
        move |(mut news, open, sent)| async move {
            if let Some(sent) = sent {
                tokio::time::sleep_until(tokio::time::Instant::from_std(sent + CHANGED_EVERY))
                    .await;
            }
            let chunk = match tokio::time::timeout(keep_alive, news.changed()).await {
                Ok(Ok(())) => {
                    news.borrow_and_update();
                    frame(None, "changed", "{}")
                }
                Ok(Err(_)) => return None,
                Err(_) => KEEP_ALIVE.to_owned(),
            };
            Some((Ok(Bytes::from(chunk)), (news, open, Some(Instant::now()))))
        },
    ))
}
