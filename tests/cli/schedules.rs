//! `agentrt schedules` lists the schedules; `agentrt schedule pause|resume NAME` pauses and
//! resumes one, on either backend.

use agentrt::{Missed, Schedule, testkit::TempStore};
use predicates::prelude::*;
use serde_json::{Value, json};

use crate::support::cli::agentrt;

fn json_of(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).unwrap()
}

#[test]
fn schedules_are_listed_paused_and_resumed_from_the_command_line() {
    let db = TempStore::new();
    let store = db.open();
    let nightly = Schedule::new("nightly", "0 2 * * *", "reports", json!({"kind": "daily"}))
        .missed(Missed::CatchUp);
    store.put_schedule(&nightly).unwrap();
    store
        .put_schedule(&Schedule::new("tick", "*/5 * * * *", "probe", json!(null)))
        .unwrap();

    agentrt(db.location())
        .arg("schedules")
        .assert()
        .success()
        .stdout(
            predicate::str::contains("SCHEDULE")
                .and(predicate::str::contains("nightly"))
                .and(predicate::str::contains("0 2 * * *"))
                .and(predicate::str::contains("catch_up"))
                .and(predicate::str::contains("tick")),
        );
    let out = agentrt(db.location())
        .args(["--json", "schedules"])
        .output()
        .unwrap();
    let listed = json_of(&out.stdout);
    assert_eq!(listed[0]["name"], json!("nightly"));
    assert_eq!(listed[0]["input"], json!({"kind": "daily"}));
    assert_eq!(listed[0]["missed"], json!("catch_up"));
    assert_eq!(listed[0]["paused"], json!(false));
    assert!(listed[0]["next_at"].is_i64());
    assert_eq!(listed[1]["name"], json!("tick"));

    agentrt(db.location())
        .args(["schedule", "pause", "nightly"])
        .assert()
        .success()
        .stdout("schedule nightly paused\n");
    assert!(store.schedule("nightly").unwrap().paused);
    agentrt(db.location())
        .arg("schedules")
        .assert()
        .success()
        .stdout(predicate::str::contains("paused"));

    let out = agentrt(db.location())
        .args(["--json", "schedule", "resume", "nightly"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let resumed = json_of(&out.stdout);
    assert_eq!(resumed["paused"], json!(false));
    assert!(!store.schedule("nightly").unwrap().paused);
    agentrt(db.location())
        .args(["schedule", "resume", "nightly"])
        .assert()
        .success()
        .stdout(predicate::str::starts_with(
            "schedule nightly resumed; its next run is at ",
        ));
}

#[test]
fn an_unknown_schedule_is_named_in_one_line_and_nothing_changes() {
    let db = TempStore::new();
    let store = db.open();
    store
        .put_schedule(&Schedule::new("tick", "* * * * *", "a", json!({})))
        .unwrap();
    let before = store.schedules().unwrap();
    for action in ["pause", "resume"] {
        agentrt(db.location())
            .args(["schedule", action, "nope"])
            .assert()
            .failure()
            .stderr("agentrt: no schedule named \"nope\"; check the name (`agentrt schedules` lists them)\n");
    }
    assert_eq!(store.schedules().unwrap(), before);
}
