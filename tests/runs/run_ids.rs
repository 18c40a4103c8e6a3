//! The id a new run is given names it in the API's and the console's paths and on the command
//! line: one that is empty, `.` or `..`, too long, or holds a control character or a Unicode
//! bidirectional control is refused, writing nothing, whichever way the run is made.

use agentrt::{
    Agent, Config, Error, ForkRun, RunId, SpawnRun, StartRun, Store,
    testkit::{RecordingTool, TempStore, with_system},
};
use serde_json::json;

use crate::support::{call_then_answer, supervise};

/// Ids no new run may have, and what each breaks.
fn bad_ids() -> Vec<(&'static str, String)> {
    vec![
        ("empty", String::new()),
        ("a path's here", ".".into()),
        ("a path's parent", "..".into()),
        ("a NUL", "a\u{0}b".into()),
        ("a newline", "a\nb".into()),
        ("an escape", "\u{1b}[31mred".into()),
        ("a right-to-left override", "invoice\u{202E}fdp.exe".into()),
        ("a left-to-right isolate", "\u{2066}x\u{2069}".into()),
        ("an Arabic letter mark", "x\u{061C}".into()),
        ("a right-to-left mark", "\u{200F}".into()),
        ("too long", "x".repeat(RunId::MAX_LEN + 1)),
    ]
}

fn agent() -> Agent {
    Agent::new(call_then_answer("c1", "t", json!({}), "done")).tool(RecordingTool::new("t"))
}

/// The runs the store holds.
fn run_ids(store: &Store) -> Vec<String> {
    let mut ids: Vec<String> = store
        .runs(None)
        .unwrap()
        .into_iter()
        .map(|run| run.id.as_str().to_owned())
        .collect();
    ids.sort();
    ids
}

fn assert_refused(what: &str, door: &str, result: agentrt::Result<impl std::fmt::Debug>) {
    match result {
        Err(Error::InvalidInput(message)) => {
            assert!(message.contains("a run id"), "{door}, {what}: {message}")
        }
        other => panic!("{door}, {what}: {other:?}"),
    }
}

#[test]
fn a_new_run_id_that_is_empty_a_path_step_too_long_or_holds_controls_is_refused_everywhere() {
    let db = TempStore::new();
    let store = db.open();
    let origin = {
        let store = store.clone();
        with_system(|| async move {
            let supervisor = supervise(store, Config::default(), "a", agent());
            supervisor
                .send(StartRun::new("a", json!({})).with_id("origin"))
                .await
                .unwrap()
                .unwrap()
                .run_id
        })
    };
    let (runs, events) = (run_ids(&store), store.events(&origin).unwrap());

    for (what, id) in bad_ids() {
        let (started, spawned, forked) = {
            let (store, id) = (store.clone(), id.clone());
            with_system(|| async move {
                let supervisor = supervise(store, Config::default(), "a", agent());
                let started = supervisor
                    .send(StartRun::new("a", json!({})).with_id(id.as_str()))
                    .await
                    .unwrap();
                let spawned = supervisor
                    .send(SpawnRun::new("a", json!({})).with_id(id.as_str()))
                    .await
                    .unwrap();
                let forked = supervisor
                    .send(ForkRun::new("origin", 1).with_id(id.as_str()))
                    .await
                    .unwrap();
                (started, spawned, forked)
            })
        };
        assert_refused(what, "StartRun", started);
        assert_refused(what, "SpawnRun", spawned);
        assert_refused(what, "ForkRun", forked);
        assert_refused(
            what,
            "Store::fork",
            store.fork(&origin, 1, Some(RunId::from(id.as_str()))),
        );
        assert_eq!(run_ids(&store), runs, "{what}: nothing written");
        assert_eq!(store.events(&origin).unwrap(), events, "{what}");
    }
}
