//! The `agentrt` binary against a PostgreSQL URL: the commands that read write nothing, an
//! approval recorded by it resumes in a supervisor like one recorded on a file, and its
//! answers and signals reach waiting runs.

#![cfg(feature = "postgres")]

use agentrt::{
    Agent, Config, RequireApprovalFor, RunId, RunState, StartRun, Store, Supervisor,
    testkit::{
        RecordingTool,
        postgres::{Schema, server},
        with_system,
    },
};
use predicates::prelude::*;
use serde_json::json;

use crate::support::{
    cli::{agentrt, seed_waits_into},
    pay_then_answer, supervise,
};

/// A run `done` that finished and a run `wait` waiting for the approval of `pay-1`.
fn seed(url: &str, pay: &RecordingTool) -> Store {
    let store = Store::connect(url).unwrap();
    let (plain, waits) = (
        Agent::new(pay_then_answer()).tool(pay.clone()),
        Agent::new(pay_then_answer())
            .tool(pay.clone())
            .policy(RequireApprovalFor::tools(["pay"])),
    );
    let seeded = store.clone();
    with_system(|| async move {
        let sup = Supervisor::builder(seeded)
            .agent("plain", plain)
            .agent("waits", waits)
            .start()
            .unwrap();
        for (agent, id) in [("plain", "done"), ("waits", "wait")] {
            sup.send(StartRun::new(agent, json!({})).with_id(id))
                .await
                .unwrap()
                .unwrap();
        }
    });
    store
}

/// Every row of the schema's tables, as text.
fn everything(schema: &Schema) -> Vec<String> {
    let mut client = schema.client();
    [
        "runs",
        "steps",
        "events",
        "approvals",
        "waits",
        "inbox",
        "run_changes",
        "agentrt_migrations",
    ]
    .iter()
    .map(|table| {
        client
            .query_one(
                &format!(
                    "SELECT coalesce(string_agg(t::text, '|' ORDER BY t::text), '') FROM {table} t"
                ),
                &[],
            )
            .unwrap()
            .get(0)
    })
    .collect()
}

#[test]
fn the_reading_commands_take_a_url_and_write_nothing() {
    let Some(server) = server() else { return };
    let schema = Schema::new(&server);
    let url = schema.url();
    drop(seed(&url, &RecordingTool::new("pay")));
    let before = everything(&schema);
    agentrt(&url)
        .arg("runs")
        .assert()
        .success()
        .stdout(predicate::str::contains("done").and(predicate::str::contains("wait")));
    agentrt(&url)
        .args(["show", "wait"])
        .assert()
        .success()
        .stdout(predicate::str::contains("pay-1"));
    agentrt(&url)
        .args(["events", "done"])
        .assert()
        .success()
        .stdout(predicate::str::contains("run.finished"));
    agentrt(&url).args(["lease", "done"]).assert().success();
    agentrt(&url)
        .arg("doctor")
        .assert()
        .success()
        .stdout(predicate::str::contains("integrity       ok"));
    agentrt(&url)
        .args(["purge", "--finished-before", "0s", "--dry-run"])
        .assert()
        .success();
    agentrt(&url)
        .args(["show", "nope"])
        .assert()
        .failure()
        .stderr(predicate::str::contains("no run with id"));
    assert_eq!(everything(&schema), before);
}

#[test]
fn an_approval_recorded_by_url_resumes_and_the_tool_runs_once() {
    let Some(server) = server() else { return };
    let schema = Schema::new(&server);
    let url = schema.url();
    let pay = RecordingTool::new("pay");
    let store = seed(&url, &pay);
    agentrt(&url)
        .args(["approve", "wait", "pay-1", "--by", "alice"])
        .assert()
        .success();
    let waits = Agent::new(pay_then_answer())
        .tool(pay.clone())
        .policy(RequireApprovalFor::tools(["pay"]));
    let resumed = store.clone();
    with_system(|| async move {
        let sup = supervise(resumed, Config::default(), "waits", waits);
        sup.send(agentrt::ResumeRun::new("wait"))
            .await
            .unwrap()
            .unwrap();
    });
    assert_eq!(
        store.run(&RunId::from("wait")).unwrap().state,
        RunState::Succeeded
    );
    // Once for `done`, once for `wait` after the approval.
    assert_eq!(pay.executions().len(), 2);
}

#[test]
fn migrate_by_url_reports_then_applies_in_one_migration() {
    let Some(server) = server() else { return };
    let schema = Schema::new(&server);
    let url = schema.url();
    // The first migration makes the schema PostgreSQL was first supported at; each later
    // version adds one.
    let pending = agentrt::postgres::migrations_pending(0);
    agentrt(&url)
        .arg("migrate")
        .assert()
        .success()
        .stdout(predicate::str::contains(format!(
            "{pending} migration(s) pending"
        )));
    assert!(everything_is_absent(&schema));
    agentrt(&url)
        .args(["migrate", "--apply"])
        .assert()
        .success()
        .stdout(predicate::str::contains(format!(
            "applied {pending} migration(s): schema version 0 -> {}",
            agentrt::SCHEMA_VERSION
        )));
    agentrt(&url).arg("runs").assert().success();
}

fn everything_is_absent(schema: &Schema) -> bool {
    schema
        .client()
        .query(
            "SELECT 1 FROM pg_tables WHERE schemaname = $1",
            &[&schema.name()],
        )
        .unwrap()
        .is_empty()
}

#[test]
fn waiting_runs_are_listed_without_a_write_then_answered_and_signalled_by_url() {
    let Some(server) = server() else { return };
    let schema = Schema::new(&server);
    let url = schema.url();
    let store = Store::connect(&url).unwrap();
    seed_waits_into(store.clone());
    let before = everything(&schema);
    agentrt(&url).arg("waits").assert().success().stdout(
        predicate::str::contains("Which account?").and(predicate::str::contains("parent/2")),
    );
    agentrt(&url)
        .args(["show", "question"])
        .assert()
        .success()
        .stdout(predicate::str::contains("waits     for an answer since"));
    assert_eq!(everything(&schema), before, "the reads wrote nothing");

    agentrt(&url)
        .args(["answer", "question", "c1", r#"{"acct": 1}"#])
        .assert()
        .failure()
        .stderr(predicate::str::contains(
            "does not match the question's schema",
        ));
    assert_eq!(
        everything(&schema),
        before,
        "a refused answer wrote nothing"
    );
    agentrt(&url)
        .args(["answer", "question", "c1", r#"{"account": "savings"}"#])
        .assert()
        .success();
    agentrt(&url)
        .args(["signal", "payment", "payment", "--id", "evt-1"])
        .assert()
        .success()
        .stdout("woke\n");
    for run in ["question", "payment"] {
        let woken = store.events(&RunId::from(run)).unwrap().pop().unwrap();
        assert_eq!(woken.kind, agentrt::EventKind::WaitWoken, "{run}");
    }
}
