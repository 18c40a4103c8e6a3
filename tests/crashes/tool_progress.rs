//! A tool's heartbeats survive a real crash: a child process runs a call that reports its
//! progress, and is killed with SIGKILL mid-call once its last beat is kept; the parent takes
//! the run over, and both the reconcile hook and the call's next attempt are given that beat.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use agentrt::{
    Agent, Config, EventKind, MoveInfo, MoveKind, MoveObserver, Outcome, Reconciliation, RunId,
    RunState, Store, Tool, ToolContext, ToolError, async_trait,
    testkit::{TempStore, with_system},
};
use serde_json::{Value, json};
use tokio::sync::watch;

use crate::support::{PATIENCE, call_then_answer, child, fast_lease, resume_when_free_on, spawn};

const DB_VAR: &str = "AGENTRT_TEST_PROGRESS_CHILD_DB";
const TTL: Duration = Duration::from_millis(500);
/// The beats the child's call reports, `{"done": 1}` to `{"done": BEATS}`.
const BEATS: u64 = 3;

/// What a call or a reconcile hook (`"call"`, `"reconcile"`) of an attempt was given.
type Given = (&'static str, u32, Option<Value>);

/// A copy that reports how many batches it has done.
#[derive(Clone)]
struct Copy {
    /// In the child: how many of its beats are kept. The call beats once, waits for that
    /// beat to be kept, then beats again; after the last it reports `READY` and never returns.
    kept: Option<watch::Receiver<u64>>,
    /// In the parent: the progress the reconcile hook and each attempt were given.
    given: Arc<Mutex<Vec<Given>>>,
}

#[async_trait(?Send)]
impl Tool for Copy {
    fn name(&self) -> &str {
        "copy"
    }

    async fn call(&self, ctx: &ToolContext, _: &Value) -> Result<Value, ToolError> {
        let Some(kept) = &self.kept else {
            let given = ("call", ctx.attempt, ctx.progress.clone());
            self.given.lock().unwrap().push(given);
            return Ok(json!({"copied": true}));
        };
        let mut kept = kept.clone();
        for done in 1..=BEATS {
            ctx.heartbeat(json!({ "done": done }));
            kept.wait_for(|&writes| writes >= done).await.unwrap();
        }
        println!("READY");
        std::future::pending().await
    }

    async fn reconcile(&self, ctx: &ToolContext, _: &Value) -> Option<Reconciliation> {
        let given = ("reconcile", ctx.attempt, ctx.progress.clone());
        self.given.lock().unwrap().push(given);
        Some(Reconciliation::NotApplied)
    }
}

fn agent(copy: Copy) -> Agent {
    Agent::new(call_then_answer("c1", "copy", json!({}), "copied"))
        .tool(copy)
        // Short, so that a beat is kept soon after the one before.
        .progress_every(Duration::from_millis(50))
}

/// Counts the progress writes committed, for the child's call.
struct KeptBeats(watch::Sender<u64>);

impl MoveObserver for KeptBeats {
    fn after_commit(&self, info: &MoveInfo) {
        if info.kind == MoveKind::RecordProgress {
            self.0.send_modify(|writes| *writes += 1);
        }
    }
}

/// The child's side. Only meaningful as a child process of the test below, hence ignored.
#[test]
#[ignore = "the child process of a_tools_last_kept_heartbeat_reaches_its_next_attempt_after_a_kill"]
fn child_process_beats_and_is_killed() {
    let location = std::env::var(DB_VAR).expect("run by the parent test");
    let store = Store::connect(&location).unwrap();
    let (writes, kept) = watch::channel(0);
    let copy = Copy {
        kept: Some(kept),
        given: Arc::default(),
    };
    with_system(|| async move {
        let config = Config::default()
            .lease_owner("child")
            .lease_ttl(TTL)
            .observer(KeptBeats(writes));
        let supervisor = crate::support::supervise(store, config, "copier", agent(copy));
        spawn(&supervisor, "copier", "run-1").await;
        std::future::pending::<()>().await;
    });
}

#[test]
fn a_tools_last_kept_heartbeat_reaches_its_next_attempt_after_a_kill() {
    let db = TempStore::new();
    drop(db.open());
    child::killed_after(
        module_path!(),
        "child_process_beats_and_is_killed",
        DB_VAR,
        &db.location(),
        "READY",
    );
    let run_id = RunId::from("run-1");
    let store = db.open();
    assert_eq!(store.run(&run_id).unwrap().state, RunState::Running);
    assert_eq!(
        store.events(&run_id).unwrap().last().unwrap().kind,
        EventKind::ToolStarted,
        "killed mid-call"
    );

    let copy = Copy {
        kept: None,
        given: Arc::default(),
    };
    let reply = resume_when_free_on(
        db.open(),
        fast_lease(),
        "copier",
        agent(copy.clone()),
        &run_id,
        PATIENCE,
    )
    .unwrap();

    assert_eq!(
        reply.outcome,
        Outcome::Succeeded {
            output: "copied".into()
        }
    );
    let last = Some(json!({ "done": BEATS }));
    assert_eq!(
        *copy.given.lock().unwrap(),
        [("reconcile", 1, last.clone()), ("call", 2, last)],
        "the hook and the next attempt were given the last beat kept"
    );
    agentrt::testkit::assert_no_run_leased(&db.open());
}
