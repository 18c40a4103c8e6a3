//! A side effect starts only with the start margin left on the lease, judged by the loop's own
//! monotonic deadline: a loop short of it waits for a renewal, or stops with `LeaseLost`, and
//! moving the wall clock (forward or back) changes nothing of that.

use std::{
    sync::{
        Arc, Condvar, Mutex, OnceLock,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use agentrt::{
    Agent, Config, Error, EventKind, ModelResponse, MoveInfo, MoveKind, MoveObserver, Outcome,
    RunId, StartRun, Store, SubscribeLeaseLost, Supervisor, ToolCall,
    testkit::{
        LeaseLostLog, RecordingTool, ScriptedModel, TempStore, WallClockShift,
        assert_no_run_leased, with_system,
    },
};
use serde_json::json;

use crate::support::supervise;

const TTL: Duration = Duration::from_millis(600);

/// The wall clock is the process's: one test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// Holds the store's writer before it applies the model's answer (and the tool's start planned
/// with it), until released: a writer stalled where nothing of the move is written yet.
#[derive(Default)]
struct StallAnswer {
    armed: AtomicBool,
    entered: AtomicBool,
    released: (Mutex<bool>, Condvar),
}

impl StallAnswer {
    fn release(&self) {
        let (released, wake) = &self.released;
        *released.lock().unwrap() = true;
        wake.notify_all();
    }
}

impl MoveObserver for StallAnswer {
    fn before_apply(&self, info: &MoveInfo) {
        if info.kind != MoveKind::FinishModelStep || !self.armed.swap(false, Ordering::SeqCst) {
            return;
        }
        self.entered.store(true, Ordering::SeqCst);
        let (released, wake) = &self.released;
        let mut released = released.lock().unwrap();
        while !*released {
            released = wake.wait(released).unwrap();
        }
    }
}

/// Polls `done` until it holds, failing the test after a minute.
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        actix_rt::time::sleep(Duration::from_millis(2)).await;
    }
}

fn wall_millis() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// The model answers with a call of `charge`; renewals stop (another connection blocks every
/// write) while the store's writer is held before the answer, until the keeper finds the
/// lease expired by its deadline. Then the wall clock moves by `shift`, and the writer goes on:
/// the answer is recorded, the call is not started.
fn short_of_the_margin(shift: i64) {
    let db = TempStore::new();
    let store = db.open();
    let charge = RecordingTool::new("charge");
    let model = ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new("c1", "charge", json!({"cents": 500}))]),
        ModelResponse::answer("charged"),
    ]);
    let agent = Agent::new(model).tool(charge.clone());
    let stall = Arc::new(StallAnswer::default());
    stall.armed.store(true, Ordering::SeqCst);
    let lost = LeaseLostLog::new();
    let (observer, db_ref, seen) = (stall.clone(), &db, lost.clone());
    let reply = with_system(move || async move {
        let config = Config::default()
            .lease_ttl(TTL)
            .observer(ObserverRef(observer.clone()));
        let sup = supervise(store, config, "a", agent);
        sup.send(SubscribeLeaseLost(seen.recipient()))
            .await
            .unwrap();
        let call = actix_rt::spawn(sup.send(StartRun::new("a", json!({})).with_id("r1")));
        until("the writer holds the answer", || {
            observer.entered.load(Ordering::SeqCst)
        })
        .await;
        let lock = db_ref.block_writes();
        until("the keeper finds the lease expired", || {
            !seen.seen().is_empty()
        })
        .await;
        let location = db_ref.location();
        let expires_at = actix_rt::task::spawn_blocking(move || {
            let lease = Store::connect(&location).unwrap().lease(&RunId::from("r1"));
            let expires_at = lease.unwrap().expect("stale, not released").expires_at;
            expires_at.duration_since(UNIX_EPOCH).unwrap().as_millis() as i64
        })
        .await
        .unwrap();
        let moved = WallClockShift::by(shift);
        if shift < 0 {
            // By the moved wall clock, the stored lease has far more than the margin left: only
            // the loop's own deadline can refuse the start.
            assert!(expires_at > wall_millis() + shift + (TTL / 3).as_millis() as i64);
        }
        drop(lock);
        observer.release();
        let reply = call.await.unwrap().unwrap();
        drop(moved);
        reply
    });

    let err = reply.unwrap_err();
    assert!(matches!(err, Error::LeaseLost { .. }), "{err}");
    assert!(charge.executions().is_empty(), "the call was not started");
    let store = db.open();
    let kinds: Vec<EventKind> = store
        .events(&RunId::from("r1"))
        .unwrap()
        .into_iter()
        .map(|e| e.kind)
        .collect();
    assert!(kinds.contains(&EventKind::ModelFinished), "{kinds:?}");
    assert!(!kinds.contains(&EventKind::ToolStarted), "{kinds:?}");
    assert!(!kinds.contains(&EventKind::PolicyDecided), "{kinds:?}");
    // The call that stopped released its lease: a resume need not wait out the TTL.
    assert_no_run_leased(&store);
}

/// Shares one observer between the test and the supervisor.
struct ObserverRef(Arc<StallAnswer>);

impl MoveObserver for ObserverRef {
    fn before_apply(&self, info: &MoveInfo) {
        self.0.before_apply(info);
    }
}

#[test]
fn a_start_short_of_the_margin_starts_nothing_with_the_wall_clock_moved_back() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    short_of_the_margin(-60_000);
}

#[test]
fn a_start_short_of_the_margin_starts_nothing_with_the_wall_clock_moved_forward() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    short_of_the_margin(60_000);
}

/// The log lines of every thread, from the first call on.
fn log() -> &'static Arc<Mutex<Vec<u8>>> {
    static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let log = Arc::new(Mutex::new(Vec::new()));
        let sink = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(move || Sink(sink.clone()))
            .finish();
        tracing::subscriber::set_global_default(subscriber).unwrap();
        log
    })
}

struct Sink(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Sink {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Stalls the store's writer once, for `stall`, before it applies a tool's outcome (and the
/// next start planned with it): on `:memory:`, renewals go through that writer, so none is made
/// meanwhile.
struct StallOutcome {
    armed: AtomicBool,
    stall: Duration,
}

impl MoveObserver for StallOutcome {
    fn before_apply(&self, info: &MoveInfo) {
        if info.kind == MoveKind::FinishTool && self.armed.swap(false, Ordering::SeqCst) {
            std::thread::sleep(self.stall);
        }
    }
}

#[test]
fn a_loop_short_of_the_margin_waits_for_a_renewal_and_goes_on() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let log = log();
    // Renewals every second, a margin of two: after a stall of a second and a half with no
    // renewal, the lease has between half a second and a second and a half left: short of
    // the margin, not expired. (A slower machine only makes the stall longer, never shorter.)
    let ttl = Duration::from_secs(3);
    let store = agentrt::Store::in_memory().unwrap();
    let tool = RecordingTool::new("lookup");
    let model = ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new("c1", "lookup", json!({}))]),
        ModelResponse::calls(vec![ToolCall::new("c2", "lookup", json!({}))]),
        ModelResponse::answer("done"),
    ]);
    let agent = Agent::new(model).tool(tool.clone());
    let lost = LeaseLostLog::new();
    let seen = lost.clone();
    let stall = StallOutcome {
        armed: AtomicBool::new(true),
        stall: ttl / 2,
    };
    let reply = with_system(move || async move {
        let config = Config::default()
            .lease_ttl(ttl)
            .start_margin(ttl * 2 / 3)
            .observer(stall);
        let sup = supervise(store, config, "a", agent);
        sup.send(SubscribeLeaseLost(seen.recipient()))
            .await
            .unwrap();
        sup.send(StartRun::new("a", json!({}))).await.unwrap()
    });
    assert!(matches!(reply.unwrap().outcome, Outcome::Succeeded { .. }));
    // The model call planned with the outcome was refused for want of the margin, and started
    // once a renewal gave it back: the run went on to its second call and its answer.
    let log = String::from_utf8(log.lock().unwrap().clone()).unwrap();
    assert!(log.contains("move refused move=begin_model_step"), "{log}");
    assert_eq!(tool.executions().len(), 2);
    assert!(lost.seen().is_empty());
}

#[test]
fn a_margin_a_renewed_lease_may_not_have_is_refused_at_start() {
    let db = TempStore::new();
    let store = db.open();
    // Renewed every second, a lease of three has two left at worst.
    let err = with_system(move || async move {
        let config = Config::default()
            .lease_ttl(Duration::from_secs(3))
            .start_margin(Duration::from_millis(2_001));
        Supervisor::builder(store).config(config).start().err()
    })
    .expect("refused");
    assert!(matches!(err, Error::InvalidInput(_)), "{err}");
    assert!(err.to_string().contains("start margin"), "{err}");
}
