//! Schedules: each occurrence starts one run across every replica, a paused schedule starts
//! nothing, and missed occurrences are skipped or caught up once.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use agentrt::{
    Agent, Config, EventKind, Missed, Model, ModelError, ModelRequest, ModelResponse, Recovery,
    RunId, RunState, Schedule, Store,
    testkit::{ManualClock, TempStore, with_system},
};
use serde_json::json;

use crate::support::supervise;

/// Answers at once: each run of a schedule finishes at its first step.
struct Done;

#[agentrt::async_trait(?Send)]
impl Model for Done {
    async fn complete(&self, _: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        Ok(ModelResponse::answer("done"))
    }
}

/// A supervisor that recovers, with passes often, on `clock`.
fn recovering(clock: &ManualClock) -> Config {
    Config::default()
        .clock(clock.clone())
        .recovery(Recovery::default().every(Duration::from_millis(50)))
        .lease_ttl(Duration::from_millis(500))
}

fn millis(time: SystemTime) -> i64 {
    time.duration_since(UNIX_EPOCH).unwrap().as_millis() as i64
}

/// The id of the run of `name`'s occurrence at `at`, as a schedule names it.
fn run_of(name: &str, at: SystemTime) -> String {
    let seconds = millis(at) / 1000;
    let (days, of_day) = (seconds / 86_400, seconds % 86_400);
    // Civil date from days since the epoch (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let (era, doe) = (z / 146_097, z % 146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{name}@{year:04}-{month:02}-{day:02}T{:02}:{:02}:00Z",
        of_day / 3600,
        of_day / 60 % 60
    )
}

/// The ids of the runs of schedule `name`, sorted.
fn runs_of(store: &Store, name: &str) -> Vec<String> {
    let prefix = format!("{name}@");
    let mut ids: Vec<String> = store
        .runs(None)
        .unwrap()
        .into_iter()
        .map(|run| run.id.as_str().to_owned())
        .filter(|id| id.starts_with(&prefix))
        .collect();
    ids.sort();
    ids
}

/// Waits, polling the store, until `done` holds; panics after a minute (a bound for a loaded
/// machine, not a guess at how long it takes).
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "never: {what}");
        actix_rt::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Moves `clock` to one second after `at`, wherever it stands now (before `at`).
fn move_to(clock: &ManualClock, at: SystemTime) {
    let now = agentrt::Clock::now(clock);
    clock.advance(at.duration_since(now).unwrap() + Duration::from_secs(1));
}

/// Whether run `id` exists and succeeded.
fn finished(store: &Store, id: &str) -> bool {
    store
        .run(&RunId::from(id))
        .is_ok_and(|run| run.state == RunState::Succeeded)
}

#[test]
fn two_replicas_start_every_occurrence_of_a_schedule_once() {
    let db = TempStore::new();
    let store = db.open();
    let put = store
        .put_schedule(&Schedule::new("tick", "* * * * *", "a", json!({"n": 1})))
        .unwrap();
    let first = put.next_at.unwrap();
    let clock = ManualClock::new();
    let (replica_a, replica_b) = (db.open(), db.open());
    let occurrences: Vec<SystemTime> = (0..4)
        .map(|n| first + Duration::from_secs(60 * n))
        .collect();
    let expected: Vec<String> = occurrences.iter().map(|at| run_of("tick", *at)).collect();
    let (seen, moved) = (store.clone(), clock.clone());
    let want = expected.clone();
    with_system(|| async move {
        let config = recovering(&moved);
        let _a = supervise(replica_a, config.clone(), "a", Agent::new(Done));
        let _b = supervise(replica_b, config, "a", Agent::new(Done));
        // One occurrence at a time, each found on time by both replicas' passes.
        for (n, at) in occurrences.iter().enumerate() {
            move_to(&moved, *at);
            let id = &want[n];
            until(&format!("{id} finished"), || finished(&seen, id)).await;
        }
    });

    assert_eq!(runs_of(&store, "tick"), expected, "each occurrence once");
    for id in &expected {
        let events = store.events(&RunId::from(id.as_str())).unwrap();
        let started: Vec<_> = events
            .iter()
            .filter(|e| e.kind == EventKind::RunStarted)
            .collect();
        assert_eq!(started.len(), 1, "{id}");
        assert_eq!(started[0].payload["schedule"]["name"], json!("tick"));
        assert_eq!(started[0].payload["input"], json!({"n": 1}));
        assert_eq!(started[0].payload["queued"], json!(true));
    }
    let after = store.schedule("tick").unwrap().next_at.unwrap();
    assert_eq!(after, first + Duration::from_secs(60 * 4));
}

#[test]
fn a_paused_schedule_starts_nothing_while_another_goes_on() {
    let db = TempStore::new();
    let store = db.open();
    let put = |name: &str| {
        store
            .put_schedule(&Schedule::new(name, "* * * * *", "a", json!({})))
            .unwrap()
            .next_at
            .unwrap()
    };
    let first = put("held");
    put("going");
    let paused = store.pause_schedule("held").unwrap();
    assert!(paused.paused);
    assert_eq!(store.schedule("held").unwrap(), paused);
    let clock = ManualClock::new();
    let (replica_a, replica_b, seen, moved) = (db.open(), db.open(), store.clone(), clock.clone());
    with_system(|| async move {
        let config = recovering(&moved);
        let _a = supervise(replica_a, config.clone(), "a", Agent::new(Done));
        let _b = supervise(replica_b, config, "a", Agent::new(Done));
        for n in 0..3 {
            let at = first + Duration::from_secs(60 * n);
            move_to(&moved, at);
            // The passes that started the other schedule's run have read the paused one too.
            let id = run_of("going", at);
            until(&format!("{id} finished"), || finished(&seen, &id)).await;
        }
    });

    assert_eq!(runs_of(&store, "going").len(), 3);
    assert_eq!(runs_of(&store, "held"), Vec::<String>::new());
    assert_eq!(
        store.schedule("held").unwrap().next_at,
        Some(first),
        "a paused schedule is not advanced"
    );
}

#[test]
fn after_downtime_missed_occurrences_are_skipped_or_the_latest_caught_up_once() {
    let db = TempStore::new();
    let store = db.open();
    let hourly = |name: &str, missed: Missed| {
        store
            .put_schedule(&Schedule::new(name, "0 * * * *", "a", json!({})).missed(missed))
            .unwrap()
            .next_at
            .unwrap()
    };
    let first = hourly("skipper", Missed::Skip);
    hourly("catcher", Missed::CatchUp);
    let hour = Duration::from_secs(3600);
    // Down over four occurrences; the last ten minutes late when a supervisor starts.
    let latest = first + 3 * hour;
    let next = latest + hour;
    let clock = ManualClock::new();
    move_to(&clock, latest + Duration::from_secs(600));

    let (replica, seen, moved) = (db.open(), store.clone(), clock.clone());
    with_system(|| async move {
        let _supervisor = supervise(replica, recovering(&moved), "a", Agent::new(Done));
        let caught = run_of("catcher", latest);
        until("the latest missed occurrence caught up", || {
            finished(&seen, &caught)
        })
        .await;
        until("the skipping schedule moved on", || {
            seen.schedule("skipper").unwrap().next_at == Some(next)
        })
        .await;
        // Then each goes on as usual.
        move_to(&moved, next);
        for name in ["skipper", "catcher"] {
            let id = run_of(name, next);
            until(&format!("{id} finished"), || finished(&seen, &id)).await;
        }
    });

    assert_eq!(runs_of(&store, "skipper"), [run_of("skipper", next)]);
    assert_eq!(
        runs_of(&store, "catcher"),
        [run_of("catcher", latest), run_of("catcher", next)]
    );
}
