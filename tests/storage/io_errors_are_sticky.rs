//! I/O errors are sticky: once a write, a sync or a checkpoint of the database fails with an
//! I/O error (SQLite's own, in a commit or a checkpoint, or the log sync agentrt does itself),
//! the store refuses every later write, and so no side effect starts after it, until the
//! database is opened again. A commit that met the error is reported as one that may or may
//! not have been written; reopened, the database holds it whole or not at all, and resuming the
//! run reconciles.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use agentrt::{
    Agent, Config, Error, EventKind, ModelResponse, RunId, StartRun, Store, Tool, ToolCall,
    ToolContext, ToolError, async_trait,
    testkit::{
        FaultKind, ReconcileHook, RecordingTool, ScriptedModel, TempStore, check_invariants,
        faults, resume_when_free, with_system,
    },
};
use serde_json::{Value, json};

use crate::support::supervise;

/// The fault a case injects.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// Of SQLite's calls on the store's files, through its VFS.
    Vfs(FaultKind),
    /// The log sync agentrt does itself, outside SQLite's commits.
    DeferredSync,
}

/// When the tool arms the fault, at its first call.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Arm {
    /// Arms it and returns: the next call of its kind is the tool's outcome's commit, or (for
    /// a checkpoint's) a checkpoint after a later commit.
    AndReturn,
    /// Arms it and returns only once it was injected: while the tool runs, only the lease
    /// keeper writes.
    AndWait,
}

/// The tool of these runs: a [`RecordingTool`] (its executions are the side effects) that, at
/// its first call, injects the fault into the store; and notes at each call the faults
/// injected when it began.
struct Arming {
    recording: RecordingTool,
    store: Store,
    fault: Option<(Fault, Arm)>,
    began_after: Arc<Mutex<Vec<usize>>>,
}

impl Arming {
    fn injected(&self) -> usize {
        faults(&self.store).unwrap().injected()
    }
}

#[async_trait(?Send)]
impl Tool for Arming {
    fn name(&self) -> &str {
        "t"
    }

    async fn call(&self, ctx: &ToolContext, args: &Value) -> Result<Value, ToolError> {
        let first = self.began_after.lock().unwrap().is_empty();
        self.began_after.lock().unwrap().push(self.injected());
        if let (true, Some((fault, arm))) = (first, self.fault) {
            let faults = faults(&self.store).unwrap();
            match fault {
                Fault::Vfs(kind) => faults.fail_next(kind),
                Fault::DeferredSync => faults.fail_next_sync(),
            }
            if arm == Arm::AndWait {
                let deadline = Instant::now() + Duration::from_secs(30);
                while self.injected() == 0 {
                    assert!(Instant::now() < deadline, "{fault:?} was never injected");
                    actix_rt::time::sleep(Duration::from_millis(5)).await;
                }
            }
        }
        self.recording.call(ctx, args).await
    }

    async fn reconcile(&self, ctx: &ToolContext, args: &Value) -> Option<agentrt::Reconciliation> {
        self.recording.reconcile(ctx, args).await
    }
}

/// A run of `steps` tool calls, one per model turn, then an answer.
fn agent(tool: Arming, steps: usize) -> Agent {
    let mut script: Vec<ModelResponse> = (0..steps)
        .map(|i| ModelResponse::calls(vec![ToolCall::new(format!("c{i}"), "t", json!({}))]))
        .collect();
    script.push(ModelResponse::answer("done"));
    scripted(tool, script)
}

/// The agent that resumes such a run: it answers at whatever turn the run is.
fn answering(tool: Arming, steps: usize) -> Agent {
    scripted(tool, vec![ModelResponse::answer("done"); steps + 1])
}

fn scripted(tool: Arming, script: Vec<ModelResponse>) -> Agent {
    let steps = 2 * script.len() as u32 + 2;
    Agent::new(ScriptedModel::new(script))
        .tool(tool)
        .max_steps(steps)
}

/// Long enough that a renewal (every third of it) coming between the arming of a fault and the
/// commit it is for is most unlikely, even on a loaded machine; short enough for the resume
/// after the reopening to wait for its expiry.
const TTL: Duration = Duration::from_secs(9);

/// What the first process saw.
struct Failed {
    /// The run's error.
    error: Error,
    /// The errors of later writes: a new run, an operator's cancel, a durable read.
    later: Vec<Error>,
    /// The tool's executions when the run failed, and after the later writes.
    executions: (usize, usize),
    /// Per execution, the faults injected when it began.
    began_after: Vec<usize>,
}

/// Runs `r1` (of `steps` steps) with `fault` armed at its first tool call, then tries later
/// writes; then reopens the database, checks that it is consistent, and resumes the run.
fn case(fault: Fault, arm: Arm, ttl: Duration, steps: usize) -> Failed {
    // An SQLite file on either pass: the faults are injected in the SQLite backend's I/O.
    let db = TempStore::sqlite();
    let store = db.open();
    let recording = RecordingTool::new("t").reconcile_hook(ReconcileHook::FromLog);
    let began_after = Arc::new(Mutex::new(Vec::new()));
    let tool = Arming {
        recording: recording.clone(),
        store: store.clone(),
        fault: Some((fault, arm)),
        began_after: began_after.clone(),
    };
    let config = Config::default().lease_ttl(ttl);
    let (error, later, counts) = {
        let (store, recording) = (store.clone(), recording.clone());
        with_system(move || async move {
            let supervisor = supervise(store.clone(), config, "a", agent(tool, steps));
            let error = supervisor
                .send(StartRun::new("a", json!({})).with_id("r1"))
                .await
                .unwrap()
                .expect_err("the run stops at the I/O error");
            let failed_at = recording.executions().len();
            let mut later = vec![
                supervisor
                    .send(StartRun::new("a", json!({})).with_id("r2"))
                    .await
                    .unwrap()
                    .expect_err("a new run is refused"),
            ];
            let (cancel, read) = actix_rt::task::spawn_blocking(move || {
                (store.cancel(&RunId::from("r1"), "x"), store.runs(None))
            })
            .await
            .unwrap();
            later.push(cancel.expect_err("a cancel is refused"));
            later.push(read.expect_err("a durable read is refused"));
            (error, later, (failed_at, recording.executions().len()))
        })
    };
    let began_after = began_after.lock().unwrap().clone();
    drop(store);

    // Reopened: the run's log is whole, and a resume reconciles it and finishes it.
    let store = db.open();
    let r1 = RunId::from("r1");
    // Whatever of the run reached the disk, it is a prefix of its moves, each whole.
    let events = store.events(&r1).unwrap();
    assert_eq!(events.first().unwrap().kind, EventKind::RunStarted);
    assert!(
        events
            .iter()
            .enumerate()
            .all(|(i, e)| e.seq == i as u64 + 1),
        "{events:?}"
    );
    assert!(
        store.run(&RunId::from("r2")).unwrap_err().is_not_found(),
        "the refused run wrote nothing"
    );
    let tool = Arming {
        recording: recording.clone(),
        store: store.clone(),
        fault: None,
        began_after: Arc::default(),
    };
    let resumed = {
        let (store, r1) = (store.clone(), r1.clone());
        with_system(move || async move {
            let supervisor = supervise(
                store,
                Config::default().lease_ttl(ttl),
                "a",
                answering(tool, steps),
            );
            resume_when_free(&supervisor, &r1, ttl * 5).await
        })
    };
    resumed.expect("the resume finishes the run");
    let executions: Vec<(String, u32)> = recording
        .executions()
        .into_iter()
        .map(|e| (e.idempotency_key, e.attempt))
        .collect();
    let violations = check_invariants(&store, &r1, &executions);
    assert!(violations.is_empty(), "{violations:?}");
    Failed {
        error,
        later,
        executions: counts,
        began_after,
    }
}

/// Every later write was refused with the sticky error, naming the first one's cause, and no
/// side effect began after the fault.
fn assert_sticky(failed: &Failed, cause: &str) {
    for err in &failed.later {
        assert!(matches!(err, Error::DiskStateUnknown(_)), "{err:?}");
        let text = err.to_string();
        assert!(text.contains("the store refused to write"), "{text}");
        assert!(text.contains("an earlier I/O error"), "{text}");
        assert!(text.contains(cause), "{text}");
        assert!(!text.contains("may or may not"), "{text}");
    }
    assert_eq!(
        failed.executions.0, failed.executions.1,
        "no side effect after the run stopped"
    );
    // A call may have begun as the fault fired (its start committed before it); none after.
    let late = failed.began_after.iter().filter(|&&n| n > 0).count();
    assert!(
        late <= 1,
        "calls that began after the fault: {:?}",
        failed.began_after
    );
}

/// The run's own error: its commit may or may not have been written.
fn assert_unknown(err: &Error) {
    assert!(matches!(err, Error::CommitUnknown(_)), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("may or may not have been written"), "{text}");
    assert!(!text.contains("nothing was written"), "{text}");
}

#[test]
fn a_failed_write_of_a_commits_frames_to_the_log_stops_the_store() {
    let failed = case(Fault::Vfs(FaultKind::LogWrite), Arm::AndReturn, TTL, 3);
    assert_unknown(&failed.error);
    assert_sticky(&failed, "committing the moves");
    assert_eq!(
        failed.executions.0, 1,
        "the call whose outcome failed, alone"
    );
}

#[test]
fn a_failed_sync_of_the_log_in_a_full_commit_stops_the_store() {
    let failed = case(Fault::Vfs(FaultKind::LogSync), Arm::AndReturn, TTL, 3);
    assert_unknown(&failed.error);
    assert_sticky(&failed, "committing the moves");
    assert_eq!(
        failed.executions.0, 1,
        "the call whose outcome failed, alone"
    );
}

/// Enough steps that the writer's schedule checkpoints (once per 100 ms of commits) while the
/// run goes on.
const MANY_STEPS: usize = 5_000;

/// A checkpoint between two commits meets `fault`: the next move is refused, nothing written,
/// and the store refuses every later write.
fn a_checkpoint_fault_stops_the_store(fault: FaultKind) {
    let failed = case(Fault::Vfs(fault), Arm::AndReturn, TTL, MANY_STEPS);
    assert!(
        matches!(failed.error, Error::DiskStateUnknown(_)),
        "{:?}",
        failed.error
    );
    assert_sticky(&failed, "a checkpoint");
    assert!(failed.executions.0 < MANY_STEPS);
}

#[test]
fn a_failed_write_of_a_checkpoint_to_the_database_file_stops_the_store() {
    a_checkpoint_fault_stops_the_store(FaultKind::DatabaseWrite);
}

#[test]
fn a_failed_truncation_of_the_database_file_at_a_checkpoint_stops_the_store() {
    // A checkpoint that copied the whole log sets the file's size to the database's.
    a_checkpoint_fault_stops_the_store(FaultKind::DatabaseTruncate);
}

#[test]
fn a_failed_sync_of_the_database_file_at_a_checkpoint_stops_the_store() {
    a_checkpoint_fault_stops_the_store(FaultKind::DatabaseSync);
}

#[test]
fn a_failed_deferred_log_sync_stops_the_store() {
    let failed = case(Fault::DeferredSync, Arm::AndReturn, TTL, MANY_STEPS);
    // The sync of a group whose callers wait fails them with its own error; one answered
    // once written has no caller left to tell, and the next move is refused.
    match &failed.error {
        Error::SyncFailed(_) => assert!(
            failed.error.to_string().contains("may not be durable"),
            "{}",
            failed.error
        ),
        other => assert!(matches!(other, Error::DiskStateUnknown(_)), "{other:?}"),
    }
    assert_sticky(&failed, "injected write-back failure");
}

#[test]
fn a_failed_write_of_a_lease_renewal_stops_the_store() {
    // Renewals every 100 ms; while the tool waits for the fault, they are the only writes.
    let failed = case(
        Fault::Vfs(FaultKind::LogWrite),
        Arm::AndWait,
        Duration::from_millis(300),
        3,
    );
    // The tool's outcome, the first move after the renewal failed, is refused.
    assert!(
        matches!(failed.error, Error::DiskStateUnknown(_)),
        "{:?}",
        failed.error
    );
    assert_sticky(&failed, "a lease renewal");
    assert_eq!(failed.executions.0, 1);
}
