//! The schedules' cases: an operator's put, pause, resume and delete, each refusal changing
//! nothing; the reads of a supervisor's pass; and the advance of a due schedule, which starts
//! its occurrence once whoever applies it.

use serde_json::json;

use super::{Fixture, in_one_group, queued};
use crate::{
    Error, EventKind, Missed, RunState, Schedule,
    clock::to_millis,
    schedule::Due,
    store::{
        Store,
        model::ScheduleRow,
        moves::{AdvanceSchedule, Advanced},
    },
};

const MINUTE: i64 = 60_000;

fn row(store: &Store, name: &str) -> ScheduleRow {
    store
        .read(|reads| reads.schedule(name))
        .unwrap()
        .expect("the schedule is stored")
}

/// The advance of `name` as stored, for its next occurrence, starting it if `start`.
fn advance(store: &Store, name: &str, start: bool) -> AdvanceSchedule {
    let seen = row(store, name);
    let due = Due {
        occurrence: seen.next_at,
        start,
        next: seen.next_at + MINUTE,
    };
    AdvanceSchedule::new(seen, due)
}

fn apply(store: &Store, advance: AdvanceSchedule) -> Advanced {
    store.apply(&crate::clock::SystemClock, advance).unwrap()
}

pub(crate) fn a_schedule_is_put_paused_resumed_and_deleted_by_name(f: &dyn Fixture) {
    let store = f.store();
    let before = to_millis(std::time::SystemTime::now());
    let put = store
        .put_schedule(&Schedule::new(
            "nightly",
            "30 2 * * *",
            "reports",
            json!({"k": 1}),
        ))
        .unwrap();
    let next_at = to_millis(put.next_at.unwrap());
    // At half past: never an hourly schedule's occurrence, which the put below compares with.
    assert!(next_at > before && next_at % (24 * 60 * MINUTE) == 150 * MINUTE);
    assert_eq!(store.schedules().unwrap(), std::slice::from_ref(&put));
    assert_eq!(store.schedule("nightly").unwrap(), put);

    // Put again with the same expression: the next occurrence is kept.
    let again =
        Schedule::new("nightly", "30 2 * * *", "reports", json!({"k": 2})).missed(Missed::CatchUp);
    let replaced = store.put_schedule(&again).unwrap();
    assert_eq!(replaced.next_at, put.next_at);
    assert_eq!(
        (replaced.input, replaced.missed),
        (json!({"k": 2}), Missed::CatchUp)
    );

    let paused = store.pause_schedule("nightly").unwrap();
    assert!(paused.paused);
    assert_eq!(
        store.pause_schedule("nightly").unwrap(),
        paused,
        "once paused, it stays"
    );
    // A put keeps whether it is paused; a new expression takes its own next occurrence.
    let hourly = store
        .put_schedule(&Schedule::new("nightly", "@hourly", "reports", json!({})))
        .unwrap();
    assert!(hourly.paused);
    assert_eq!(to_millis(hourly.next_at.unwrap()) % (60 * MINUTE), 0);
    assert_ne!(hourly.next_at, put.next_at);

    let resumed = store.resume_schedule("nightly").unwrap();
    assert!(!resumed.paused);
    assert!(to_millis(resumed.next_at.unwrap()) > before);
    assert_eq!(
        store.resume_schedule("nightly").unwrap(),
        resumed,
        "not paused: unchanged"
    );
    assert_eq!(store.schedule("nightly").unwrap(), resumed);

    // A new one may start paused.
    let held = Schedule::new("held", "* * * * *", "a", json!(null)).paused(true);
    assert!(store.put_schedule(&held).unwrap().paused);
    let names: Vec<String> = store
        .schedules()
        .unwrap()
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(names, ["held", "nightly"], "by name");

    store.delete_schedule("nightly").unwrap();
    assert!(matches!(
        store.schedule("nightly"),
        Err(Error::ScheduleNotFound(name)) if name == "nightly"
    ));
    assert_eq!(store.schedules().unwrap().len(), 1);
    assert!(
        store.runs(None).unwrap().is_empty(),
        "no move of a schedule made a run"
    );
}

pub(crate) fn what_cannot_be_put_or_is_not_there_is_refused_unchanged(f: &dyn Fixture) {
    let store = f.store();
    let put = store
        .put_schedule(&Schedule::new("s", "*/5 * * * *", "a", json!({})))
        .unwrap();
    for bad in [
        Schedule::new("s", "61 * * * *", "a", json!({})),
        Schedule::new("s", "* * *", "a", json!({})),
        Schedule::new("s/1", "* * * * *", "a", json!({})),
        Schedule::new("", "* * * * *", "a", json!({})),
        Schedule::new("s", "* * * * *", " ", json!({})),
    ] {
        let err = store.put_schedule(&bad).unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)), "{bad:?}: {err}");
    }
    assert_eq!(store.schedules().unwrap(), [put], "nothing was written");
    for err in [
        store.schedule("nope").unwrap_err(),
        store.pause_schedule("nope").unwrap_err(),
        store.resume_schedule("nope").unwrap_err(),
        store.delete_schedule("nope").unwrap_err(),
    ] {
        assert!(err.is_not_found(), "{err}");
        assert!(err.to_string().contains("\"nope\""), "{err}");
    }
}

pub(crate) fn a_pass_reads_the_due_schedules_of_its_agents_not_paused(f: &dyn Fixture) {
    let store = f.store();
    for (name, cron, agent) in [
        ("m", "* * * * *", "a"),
        ("h", "0 * * * *", "a"),
        ("other", "* * * * *", "b"),
        ("held", "* * * * *", "a"),
    ] {
        store
            .put_schedule(&Schedule::new(name, cron, agent, json!({})))
            .unwrap();
    }
    store.pause_schedule("held").unwrap();
    let (m, h) = (row(&store, "m").next_at, row(&store, "h").next_at);
    let due = |until: i64, agents: &[&str]| -> Vec<String> {
        let found = store
            .read(|reads| reads.due_schedules(until, agents, 10))
            .unwrap();
        let mut names: Vec<String> = found.into_iter().map(|row| row.name).collect();
        // Ties of the next occurrence come in any order.
        names.sort();
        names
    };
    assert!(due(m - 1, &["a"]).is_empty());
    assert_eq!(
        due(m, &["a"]),
        if h == m { vec!["h", "m"] } else { vec!["m"] }
    );
    assert_eq!(due(h, &["a"]), ["h", "m"]);
    assert_eq!(due(h, &["a", "b"]), ["h", "m", "other"]);
    assert!(due(h, &[]).is_empty());
    let next = |after: i64| {
        store
            .read(|reads| reads.next_scheduled_at(after, &["a"]))
            .unwrap()
    };
    assert_eq!(next(m - 1), Some(m));
    assert_eq!(next(h), None, "the paused one is not next");
}

pub(crate) fn a_due_occurrence_starts_once_and_the_schedule_moves_past_it(f: &dyn Fixture) {
    let store = f.store();
    store
        .put_schedule(&Schedule::new("tick", "* * * * *", "a", json!({"n": 7})))
        .unwrap();
    let first = row(&store, "tick").next_at;
    let start = advance(&store, "tick", true);
    let run_id = start.run_id.clone();
    let again = AdvanceSchedule::new(start.seen.clone(), start.due);
    assert_eq!(
        apply(&store, start),
        Advanced::Started { agent: "a".into() }
    );

    let run = store.run(&run_id).unwrap();
    assert_eq!((run.state, run.agent.as_str()), (RunState::Running, "a"));
    assert_eq!(run.input, json!({"n": 7}));
    assert!(
        store.lease(&run_id).unwrap().is_none(),
        "queued: nobody holds it"
    );
    let events = store.events(&run_id).unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].kind, EventKind::RunStarted);
    assert_eq!(events[0].payload["queued"], json!(true));
    assert_eq!(events[0].payload["fencing_token"], json!(0));
    assert_eq!(
        events[0].payload["schedule"],
        json!({"name": "tick", "occurrence": first})
    );
    assert_eq!(row(&store, "tick").next_at, first + MINUTE);

    // Applied again, as a second replica that read the same schedule would: nothing.
    assert_eq!(apply(&store, again), Advanced::Taken);
    assert_eq!(store.events(&run_id).unwrap(), events);
    assert_eq!(row(&store, "tick").next_at, first + MINUTE);

    // Skipped: the schedule moves on, and no run is made.
    assert_eq!(
        apply(&store, advance(&store, "tick", false)),
        Advanced::Skipped
    );
    assert_eq!(row(&store, "tick").next_at, first + 2 * MINUTE);
    assert_eq!(store.runs(None).unwrap().len(), 1);

    // Paused, or replaced since the pass read it: nothing.
    let stale = advance(&store, "tick", true);
    store.pause_schedule("tick").unwrap();
    assert_eq!(apply(&store, stale), Advanced::Taken);
    let paused = advance(&store, "tick", true);
    assert_eq!(apply(&store, paused), Advanced::Taken);
    store.resume_schedule("tick").unwrap();
    let stale = advance(&store, "tick", true);
    store
        .put_schedule(&Schedule::new("tick", "*/2 * * * *", "a", json!({})))
        .unwrap();
    assert_eq!(apply(&store, stale), Advanced::Taken);
    store.delete_schedule("tick").unwrap();
    let gone = AdvanceSchedule::new(
        row_of_deleted(),
        Due {
            occurrence: first,
            start: true,
            next: first + MINUTE,
        },
    );
    assert_eq!(apply(&store, gone), Advanced::Taken);
    assert_eq!(store.runs(None).unwrap().len(), 1, "one run in all");
}

/// A schedule as a pass may have read it before its delete.
fn row_of_deleted() -> ScheduleRow {
    ScheduleRow {
        name: "tick".into(),
        agent: "a".into(),
        input: json!({}),
        cron: "*/2 * * * *".into(),
        missed: Missed::Skip,
        paused: false,
        next_at: 0,
        created_at: 0,
        updated_at: 0,
    }
}

pub(crate) fn an_occurrence_whose_run_exists_starts_nothing_and_moves_on(f: &dyn Fixture) {
    let store = f.store();
    store
        .put_schedule(&Schedule::new("tick", "* * * * *", "a", json!({})))
        .unwrap();
    let start = advance(&store, "tick", true);
    let (first, run_id) = (start.due.occurrence, start.run_id.clone());
    super::create(&store, &run_id, &super::me());
    let events = store.events(&run_id).unwrap();
    assert_eq!(apply(&store, start), Advanced::Existed);
    assert_eq!(row(&store, "tick").next_at, first + MINUTE);
    assert_eq!(store.runs(None).unwrap().len(), 1);
    assert_eq!(
        store.events(&run_id).unwrap(),
        events,
        "the run that was there is left alone"
    );
}

pub(crate) fn two_advances_of_one_occurrence_in_a_group_start_one_run(f: &dyn Fixture) {
    let store = f.store();
    store
        .put_schedule(&Schedule::new("tick", "* * * * *", "a", json!({})))
        .unwrap();
    let (one, two) = (advance(&store, "tick", true), advance(&store, "tick", true));
    let run_id = one.run_id.clone();
    let committed = in_one_group(&store, vec![queued(one), queued(two)]);
    assert_eq!(
        committed,
        [true, true],
        "the second is told it was taken, not refused"
    );
    assert_eq!(store.runs(None).unwrap().len(), 1);
    let started = store.events(&run_id).unwrap();
    assert_eq!(started.len(), 1);
}
