//! All of agentrt's SQL: the moves (each applied inside one transaction by `Store::transact`)
//! and the reads. Every move's guard (state, step, attempt) sits in the statement that
//! changes the row, so a move that lost a race changes nothing.

use std::{collections::HashSet, sync::Arc, time::Duration};

use rusqlite::{Connection, OptionalExtension, Row, Transaction, params};
use serde_json::{Value, json};

use super::{Now, from_millis, wall_millis};
use crate::{
    error::{Error, Result},
    types::{
        Approval, ApprovalReason, Event, EventKind, Lease, LeaseLostReason, ModelResponse,
        PendingCall, Run, RunId, RunState, ToolCall, ToolResult,
    },
};

/// What a step is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StepKind {
    Model,
    Tool,
}

/// Where a step is; see migrations/0002_steps.sql.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StepState {
    Pending,
    Waiting,
    InFlight,
    Interrupted,
    Finished,
}

impl StepState {
    fn as_str(self) -> &'static str {
        match self {
            StepState::Pending => "pending",
            StepState::Waiting => "waiting",
            StepState::InFlight => "in_flight",
            StepState::Interrupted => "interrupted",
            StepState::Finished => "finished",
        }
    }

    fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "pending" => StepState::Pending,
            "waiting" => StepState::Waiting,
            "in_flight" => StepState::InFlight,
            "interrupted" => StepState::Interrupted,
            "finished" => StepState::Finished,
            other => return Err(Error::Corrupt(format!("unknown step state {other:?}"))),
        })
    }
}

/// A step as stored.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StepRow {
    pub step: u32,
    pub kind: StepKind,
    pub state: StepState,
    pub attempt: u32,
    /// Tool steps: the call.
    pub call: Option<ToolCall>,
    /// Model steps: the response; tool steps: a `ToolResult`.
    pub result: Option<Value>,
    pub waiting_for: Option<ApprovalReason>,
}

/// An operator's decision as the loop needs it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ApprovalRow {
    pub approved: bool,
    pub by: String,
    pub note: Option<String>,
}

/// What a loop needs to execute a run: the run, its steps, and the decision recorded for the
/// step that waits, if any.
#[derive(Debug, Clone)]
pub(crate) struct RunSnapshot {
    pub run: Run,
    pub steps: Vec<StepRow>,
    pub approval: Option<ApprovalRow>,
}

/// The idempotency key of a tool call: stable across attempts, unique across calls.
pub(crate) fn idempotency_key(run_id: &RunId, step: u32) -> String {
    format!("{run_id}/{step}")
}

// ---------------------------------------------------------------------------------------------
// Guards and the log

/// The lease a loop executes under: its owner, and how long a stamp or renewal lasts.
#[derive(Debug, Clone)]
pub(crate) struct Holder {
    pub owner: Arc<str>,
    pub ttl: Duration,
}

impl Holder {
    /// The expiry of a lease stamped at wall-clock time `wall`.
    fn expiry(&self, wall: i64) -> i64 {
        wall + self.ttl.as_millis() as i64
    }
}

/// What a loop's move needs of its lease. Moves that start a side effect need it unexpired by
/// the wall clock; the others need it held (nobody took it over).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Need {
    Held,
    Unexpired,
}

/// A run's state and lease as stored.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LeaseRow {
    pub state: RunState,
    pub owner: Option<String>,
    pub expires_at: Option<i64>,
}

pub(crate) fn lease_row(conn: &Connection, run_id: &RunId) -> Result<Option<LeaseRow>> {
    let row: Option<(String, Option<String>, Option<i64>)> = conn
        .prepare_cached("SELECT state, lease_owner, lease_expires_at FROM runs WHERE id = ?1")?
        .query_row([run_id.as_str()], |row| {
            Ok((row.get(0)?, row.get(1)?, row.get(2)?))
        })
        .optional()?;
    row.map(|(state, owner, expires_at)| {
        Ok(LeaseRow {
            state: state.parse().map_err(Error::Corrupt)?,
            owner,
            expires_at,
        })
    })
    .transpose()
}

/// Explains a guard that matched no row: the run does not exist, is in another state, or (for
/// a loop's move) its lease is another owner's, released, or expired.
fn refused(conn: &Connection, run_id: &RunId, holder: Option<&Holder>, reason: &str) -> Error {
    let row = match lease_row(conn, run_id) {
        Ok(Some(row)) => row,
        Ok(None) => return Error::RunNotFound(run_id.clone()),
        Err(err) => return err,
    };
    match (row.state, holder, row.owner) {
        (RunState::Running, Some(holder), Some(owner)) if *owner != *holder.owner => {
            Error::RunLeased {
                run_id: run_id.clone(),
                owner,
                expires_at: from_millis(row.expires_at.unwrap_or_default()),
            }
        }
        (RunState::Running, Some(_), Some(_)) => Error::LeaseLost {
            run_id: run_id.clone(),
            reason: LeaseLostReason::Expired,
        },
        (RunState::Running, Some(_), None) => Error::LeaseLost {
            run_id: run_id.clone(),
            reason: LeaseLostReason::ReleasedOrCancelled,
        },
        // A loop's run was moved by someone else than an operator's cancel: only an owner
        // that took it over can have done that.
        (state, Some(_), _) if state != RunState::Cancelled => Error::LeaseLost {
            run_id: run_id.clone(),
            reason: LeaseLostReason::ReleasedOrCancelled,
        },
        (state, ..) => Error::RunState {
            run_id: run_id.clone(),
            state,
            reason: reason.to_owned(),
        },
    }
}

fn run_state(conn: &Connection, run_id: &RunId) -> Result<Option<RunState>> {
    Ok(lease_row(conn, run_id)?.map(|row| row.state))
}

/// Stamps a RUNNING run that `holder` holds as moved now; refuses it otherwise.
fn touch_held(
    tx: &Transaction<'_>,
    now: &mut Now<'_>,
    run_id: &RunId,
    holder: &Holder,
    need: Need,
    what: &str,
) -> Result<()> {
    let unexpired_at = (need == Need::Unexpired).then(wall_millis);
    let changed = tx
        .prepare_cached(
            "UPDATE runs SET updated_at = ?2
             WHERE id = ?1 AND state = 'RUNNING' AND lease_owner = ?3
               AND (?4 IS NULL OR lease_expires_at > ?4)",
        )?
        .execute(params![
            run_id.as_str(),
            now.millis(),
            &*holder.owner,
            unexpired_at
        ])?;
    if changed == 1 {
        Ok(())
    } else {
        Err(refused(tx, run_id, Some(holder), what))
    }
}

/// A move of a run between states. Leaving RUNNING releases the lease in the same statement;
/// entering it takes the lease for `take`.
struct RunMove<'a> {
    from: &'a [RunState],
    to: RunState,
    output: Option<&'a str>,
    error: Option<&'a str>,
    /// The holder whose lease the run must be under (a loop's move); `None` for an operator's.
    guard: Option<&'a Holder>,
    /// The holder that takes the lease (entering RUNNING).
    take: Option<&'a Holder>,
    what: &'a str,
}

impl<'a> RunMove<'a> {
    fn new(from: &'a [RunState], to: RunState, what: &'a str) -> Self {
        RunMove {
            from,
            to,
            output: None,
            error: None,
            guard: None,
            take: None,
            what,
        }
    }
}

/// Applies a [`RunMove`]; returns the expiry of the lease it took, if any.
fn move_run(
    tx: &Transaction<'_>,
    now: &mut Now<'_>,
    run_id: &RunId,
    m: RunMove<'_>,
) -> Result<Option<i64>> {
    let expires_at = m.take.map(|holder| holder.expiry(wall_millis()));
    let changed = tx
        .prepare_cached(
            "UPDATE runs SET state = ?2, output = ?3, error = ?4, updated_at = ?5,
                             lease_owner = ?8, lease_expires_at = ?9
             WHERE id = ?1 AND state IN (?6, ?7) AND (?10 IS NULL OR lease_owner = ?10)",
        )?
        .execute(params![
            run_id.as_str(),
            m.to.as_str(),
            m.output,
            m.error,
            now.millis(),
            m.from[0].as_str(),
            m.from.get(1).unwrap_or(&m.from[0]).as_str(),
            m.take.map(|holder| &*holder.owner),
            expires_at,
            m.guard.map(|holder| &*holder.owner),
        ])?;
    if changed == 1 {
        Ok(expires_at)
    } else {
        Err(refused(tx, run_id, m.guard, m.what))
    }
}

/// Moves one step out of the state (and attempt) its executor saw: `starts` adds an attempt.
/// A step found elsewhere means another executor got there first, and nothing changes.
#[allow(clippy::too_many_arguments)]
fn move_step(
    tx: &Transaction<'_>,
    run_id: &RunId,
    step: u32,
    from: StepState,
    attempt: u32,
    to: StepState,
    starts: bool,
    result: Option<&Value>,
    waiting_for: Option<ApprovalReason>,
) -> Result<()> {
    let changed = tx
        .prepare_cached(
            "UPDATE steps SET state = ?5, attempt = attempt + ?6, result = COALESCE(?7, result),
                              waiting_for = ?8
             WHERE run_id = ?1 AND step = ?2 AND state = ?3 AND attempt = ?4",
        )?
        .execute(params![
            run_id.as_str(),
            step,
            from.as_str(),
            attempt,
            to.as_str(),
            u32::from(starts),
            result.map(Value::to_string),
            waiting_for.map(ApprovalReason::as_str),
        ])?;
    if changed == 1 {
        return Ok(());
    }
    let state = run_state(tx, run_id)?.ok_or_else(|| Error::RunNotFound(run_id.clone()))?;
    Err(Error::RunState {
        run_id: run_id.clone(),
        state,
        reason: format!(
            "step {step} is no longer {} at attempt {attempt}",
            from.as_str()
        ),
    })
}

/// Finishes a step (with its result, if any) from the state and attempt its executor saw.
fn close_step(
    tx: &Transaction<'_>,
    run_id: &RunId,
    step: u32,
    from: StepState,
    attempt: u32,
    result: Option<&Value>,
) -> Result<()> {
    move_step(
        tx,
        run_id,
        step,
        from,
        attempt,
        StepState::Finished,
        false,
        result,
        None,
    )
}

/// Starts the next attempt of a tool step and writes its `step.tool_started`.
fn start_tool_attempt(
    tx: &Transaction<'_>,
    now: &mut Now<'_>,
    run_id: &RunId,
    step: u32,
    from: StepState,
    attempt: u32,
    call: &ToolCall,
) -> Result<()> {
    start_attempt(tx, run_id, step, from, attempt)?;
    tool_started(tx, now, run_id, step, call, attempt + 1)
}

/// Moves a step in flight as its next attempt.
fn start_attempt(
    tx: &Transaction<'_>,
    run_id: &RunId,
    step: u32,
    from: StepState,
    attempt: u32,
) -> Result<()> {
    move_step(
        tx,
        run_id,
        step,
        from,
        attempt,
        StepState::InFlight,
        true,
        None,
        None,
    )
}

/// Appends one event: its sequence number is the run's last plus one, inside the move's
/// transaction, so the log has no gaps.
fn append(
    tx: &Transaction<'_>,
    now: &mut Now<'_>,
    run_id: &RunId,
    kind: EventKind,
    step: Option<u32>,
    payload: &Value,
) -> Result<()> {
    tx.prepare_cached(
        // A scalar subquery, not INSERT ... SELECT: reading the table being inserted into would
        // make SQLite stage the row in a temporary table.
        "INSERT INTO events (run_id, seq, kind, at, step, payload)
         VALUES (?1, (SELECT COALESCE(MAX(seq), 0) + 1 FROM events WHERE run_id = ?1),
                 ?2, ?3, ?4, ?5)",
    )?
    .execute(params![
        run_id.as_str(),
        kind.as_str(),
        now.millis(),
        step,
        payload.to_string()
    ])?;
    Ok(())
}

fn tool_started(
    tx: &Transaction<'_>,
    now: &mut Now<'_>,
    run_id: &RunId,
    step: u32,
    call: &ToolCall,
    attempt: u32,
) -> Result<()> {
    append(
        tx,
        now,
        run_id,
        EventKind::ToolStarted,
        Some(step),
        &json!({
            "call_id": call.id,
            "tool": call.name,
            "args": call.args,
            "attempt": attempt,
            "idempotency_key": idempotency_key(run_id, step),
        }),
    )
}

// ---------------------------------------------------------------------------------------------
// Moves

/// Inserts a new RUNNING run and its `run.started`. An existing id is refused unchanged.
/// The lease is stamped in the insert; returns its expiry.
pub(crate) fn create_run(
    tx: &Transaction<'_>,
    now: &mut Now<'_>,
    run_id: &RunId,
    agent: &str,
    input: &Value,
    holder: &Holder,
) -> Result<i64> {
    if run_state(tx, run_id)?.is_some() {
        return Err(Error::RunExists(run_id.clone()));
    }
    let at = now.millis();
    let expires_at = holder.expiry(wall_millis());
    tx.prepare_cached(
        "INSERT INTO runs (id, agent, input, state, created_at, updated_at, lease_owner,
                           lease_expires_at)
         VALUES (?1, ?2, ?3, 'RUNNING', ?4, ?4, ?5, ?6)",
    )?
    .execute(params![
        run_id.as_str(),
        agent,
        input.to_string(),
        at,
        &*holder.owner,
        expires_at
    ])?;
    append(
        tx,
        now,
        run_id,
        EventKind::RunStarted,
        None,
        &json!({ "agent": agent, "input": input }),
    )?;
    Ok(expires_at)
}

/// Reserves model step `step` before the request is dispatched.
pub(crate) fn begin_model_step(
    tx: &Transaction<'_>,
    now: &mut Now<'_>,
    run_id: &RunId,
    holder: &Holder,
    step: u32,
) -> Result<()> {
    touch_held(
        tx,
        now,
        run_id,
        holder,
        Need::Unexpired,
        "a model call cannot start",
    )?;
    tx.prepare_cached(
        "INSERT INTO steps (run_id, step, kind, state, attempt) VALUES (?1, ?2, 'model', 'in_flight', 1)",
    )?
    .execute(params![run_id.as_str(), step])?;
    append(
        tx,
        now,
        run_id,
        EventKind::ModelStarted,
        Some(step),
        &json!({ "attempt": 1 }),
    )
}

/// How a model step ended.
pub(crate) enum ModelOutcome {
    /// The answer, and its JSON as recorded (built by the loop, off the writer's thread).
    Answered {
        response: ModelResponse,
        recorded: Value,
    },
    Failed(String),
}

/// Records the model's answer. Tool calls (their ids already unique within the run) become
/// pending steps numbered after this one; a final answer finishes the run; a model error fails
/// it.
pub(crate) fn finish_model_step(
    tx: &Transaction<'_>,
    now: &mut Now<'_>,
    run_id: &RunId,
    holder: &Holder,
    step: u32,
    attempt: u32,
    outcome: &ModelOutcome,
) -> Result<()> {
    touch_held(
        tx,
        now,
        run_id,
        holder,
        Need::Held,
        "the model's answer cannot be recorded",
    )?;
    let (response, recorded_json) = match outcome {
        ModelOutcome::Failed(error) => {
            close_step(tx, run_id, step, StepState::InFlight, attempt, None)?;
            append(
                tx,
                now,
                run_id,
                EventKind::ModelFinished,
                Some(step),
                &json!({ "error": error }),
            )?;
            finish_run(
                tx,
                now,
                run_id,
                holder,
                RunState::Failed,
                None,
                Some(&format!("the model failed: {error}")),
            )?;
            return Ok(());
        }
        ModelOutcome::Answered { response, recorded } => (response, recorded),
    };

    // The loop made the call ids unique within the run, from every id it read back on resume;
    // the database checks only those of waiting calls (migration 7).
    for (call, tool_step) in response.tool_calls.iter().zip(step + 1..) {
        tx.prepare_cached(
            "INSERT INTO steps (run_id, step, kind, state, attempt, call_id, tool, args)
             VALUES (?1, ?2, 'tool', 'pending', 0, ?3, ?4, ?5)",
        )?
        .execute(params![
            run_id.as_str(),
            tool_step,
            call.id,
            call.name,
            call.args.to_string()
        ])?;
    }
    close_step(
        tx,
        run_id,
        step,
        StepState::InFlight,
        attempt,
        Some(recorded_json),
    )?;
    append(
        tx,
        now,
        run_id,
        EventKind::ModelFinished,
        Some(step),
        recorded_json,
    )?;
    if response.tool_calls.is_empty() {
        let output = response.text.clone().unwrap_or_default();
        finish_run(
            tx,
            now,
            run_id,
            holder,
            RunState::Succeeded,
            Some(&output),
            None,
        )?;
    }
    Ok(())
}

/// Moves a RUNNING run to a finished state and writes `run.finished`.
fn finish_run(
    tx: &Transaction<'_>,
    now: &mut Now<'_>,
    run_id: &RunId,
    holder: &Holder,
    state: RunState,
    output: Option<&str>,
    error: Option<&str>,
) -> Result<()> {
    move_run(
        tx,
        now,
        run_id,
        RunMove {
            output,
            error,
            guard: Some(holder),
            ..RunMove::new(&[RunState::Running], state, "it cannot finish")
        },
    )?;
    let mut payload = json!({ "state": state.as_str() });
    if let Some(output) = output {
        payload["output"] = json!(output);
    }
    if let Some(error) = error {
        payload["error"] = json!(error);
    }
    append(tx, now, run_id, EventKind::RunFinished, None, &payload)
}

/// Fails a RUNNING run (e.g. it reached its step limit).
pub(crate) fn fail_run(
    tx: &Transaction<'_>,
    now: &mut Now<'_>,
    run_id: &RunId,
    holder: &Holder,
    error: &str,
) -> Result<()> {
    finish_run(tx, now, run_id, holder, RunState::Failed, None, Some(error))
}

/// A decision on a tool call, as it is recorded.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ToolDecision {
    /// Run it: the step starts (its next attempt).
    Allow {
        reason: Option<String>,
        by: Option<String>,
        note: Option<String>,
    },
    /// Do not run it; the model is told why.
    Deny {
        reason: String,
        by: Option<String>,
        note: Option<String>,
    },
    /// Wait for an approval.
    RequireApproval { reason: String },
}

impl ToolDecision {
    fn payload(&self, call: &ToolCall, source: &str) -> Value {
        let (decision, reason, by, note) = match self {
            ToolDecision::Allow { reason, by, note } => ("allow", reason.as_deref(), by, note),
            ToolDecision::Deny { reason, by, note } => ("deny", Some(reason.as_str()), by, note),
            ToolDecision::RequireApproval { reason } => {
                ("require_approval", Some(reason.as_str()), &None, &None)
            }
        };
        let mut payload = json!({
            "call_id": call.id,
            "tool": call.name,
            "decision": decision,
            "source": source,
        });
        if let Some(reason) = reason {
            payload["reason"] = json!(reason);
        }
        if let Some(by) = by {
            payload["decided_by"] = json!(by);
        }
        if let Some(note) = note {
            payload["note"] = json!(note);
        }
        payload
    }
}

/// Records the policy's decision on a pending tool call and acts on it in the same
/// transaction: starts the tool, records the denial, or pauses the run.
pub(crate) fn decide_tool(
    tx: &Transaction<'_>,
    now: &mut Now<'_>,
    run_id: &RunId,
    holder: &Holder,
    step: u32,
    call: &ToolCall,
    decision: &ToolDecision,
) -> Result<()> {
    let what = "a tool call cannot be decided";
    match decision {
        ToolDecision::RequireApproval { .. } => pause(tx, now, run_id, holder)?,
        ToolDecision::Allow { .. } => touch_held(tx, now, run_id, holder, Need::Unexpired, what)?,
        ToolDecision::Deny { .. } => touch_held(tx, now, run_id, holder, Need::Held, what)?,
    }
    append(
        tx,
        now,
        run_id,
        EventKind::PolicyDecided,
        Some(step),
        &decision.payload(call, "policy"),
    )?;
    apply_decision(
        tx,
        now,
        run_id,
        step,
        StepState::Pending,
        0,
        call,
        decision,
        ApprovalReason::Policy,
    )
}

/// Moves the run to WAITING_FOR_APPROVAL, releasing `holder`'s lease.
fn pause(tx: &Transaction<'_>, now: &mut Now<'_>, run_id: &RunId, holder: &Holder) -> Result<()> {
    let pause = RunMove::new(
        &[RunState::Running],
        RunState::WaitingForApproval,
        "it cannot pause",
    );
    move_run(
        tx,
        now,
        run_id,
        RunMove {
            guard: Some(holder),
            ..pause
        },
    )?;
    Ok(())
}

/// The step's side of a decision: start it, close it with the denial, or make it wait.
#[allow(clippy::too_many_arguments)]
fn apply_decision(
    tx: &Transaction<'_>,
    now: &mut Now<'_>,
    run_id: &RunId,
    step: u32,
    from: StepState,
    attempt: u32,
    call: &ToolCall,
    decision: &ToolDecision,
    reason: ApprovalReason,
) -> Result<()> {
    match decision {
        ToolDecision::Allow { .. } => {
            start_tool_attempt(tx, now, run_id, step, from, attempt, call)
        }
        ToolDecision::Deny { reason: why, .. } => {
            let result =
                serde_json::to_value(ToolResult::Error(format!("the call was denied: {why}")))
                    .unwrap();
            close_step(tx, run_id, step, from, attempt, Some(&result))?;
            if attempt > 0 {
                // An attempt ran before (and was interrupted): close the step in the log too.
                append(
                    tx,
                    now,
                    run_id,
                    EventKind::ToolFinished,
                    Some(step),
                    &json!({ "call_id": call.id, "attempt": attempt, "error": format!("the call was denied: {why}"), "denied": true }),
                )?;
            }
            Ok(())
        }
        ToolDecision::RequireApproval { .. } => {
            move_step(
                tx,
                run_id,
                step,
                from,
                attempt,
                StepState::Waiting,
                false,
                None,
                Some(reason),
            )?;
            append(
                tx,
                now,
                run_id,
                EventKind::RunWaiting,
                Some(step),
                &json!({ "call_id": call.id, "tool": call.name, "reason": reason.as_str() }),
            )
        }
    }
}

/// Closes a pending call the loop cannot execute (unknown tool, arguments not an object): the
/// model is told why; nothing ran.
pub(crate) fn reject_tool(
    tx: &Transaction<'_>,
    now: &mut Now<'_>,
    run_id: &RunId,
    holder: &Holder,
    step: u32,
    call: &ToolCall,
    error: &str,
) -> Result<()> {
    touch_held(
        tx,
        now,
        run_id,
        holder,
        Need::Held,
        "a tool call cannot be rejected",
    )?;
    let result = serde_json::to_value(ToolResult::Error(error.to_owned())).unwrap();
    close_step(tx, run_id, step, StepState::Pending, 0, Some(&result))?;
    append(
        tx,
        now,
        run_id,
        EventKind::ToolFinished,
        Some(step),
        &json!({ "call_id": call.id, "attempt": 0, "error": error, "rejected": true }),
    )
}

/// Records a tool's outcome. On a RUNNING run it is an ordinary step; on a run an operator
/// cancelled meanwhile it is recorded as late (the run stays cancelled). Returns whether late.
#[allow(clippy::too_many_arguments)]
pub(crate) fn finish_tool(
    tx: &Transaction<'_>,
    now: &mut Now<'_>,
    run_id: &RunId,
    holder: &Holder,
    step: u32,
    attempt: u32,
    call_id: &str,
    result: &ToolResult,
    result_json: &Value,
) -> Result<bool> {
    // Written only while the loop holds the lease (or, late, once an operator cancelled):
    // otherwise the step stays in flight for the owner that took the run over.
    let what = "the tool's outcome cannot be recorded";
    let late = match touch_held(tx, now, run_id, holder, Need::Held, what) {
        Ok(()) => false,
        Err(Error::RunState {
            state: RunState::Cancelled,
            ..
        }) => true,
        Err(err) => return Err(err),
    };
    close_step(
        tx,
        run_id,
        step,
        StepState::InFlight,
        attempt,
        Some(result_json),
    )?;
    let mut payload = json!({ "call_id": call_id, "attempt": attempt });
    match result {
        ToolResult::Ok(output) => payload["output"] = output.clone(),
        ToolResult::Error(error) => payload["error"] = json!(error),
    }
    if late {
        payload["late"] = json!(true);
    }
    append(
        tx,
        now,
        run_id,
        EventKind::ToolFinished,
        Some(step),
        &payload,
    )?;
    Ok(late)
}

/// Resumes a waiting run: back to RUNNING, the resume-time decision recorded and acted on, in
/// one compare-and-set on the run's state, so of two resumers one wins.
#[allow(clippy::too_many_arguments)]
pub(crate) fn resume_waiting(
    tx: &Transaction<'_>,
    now: &mut Now<'_>,
    run_id: &RunId,
    holder: &Holder,
    step: u32,
    attempt: u32,
    call: &ToolCall,
    reason: ApprovalReason,
    decision: &ToolDecision,
    source: &str,
) -> Result<i64> {
    let what = "only a run waiting for approval can be resumed this way";
    let resume = RunMove::new(&[RunState::WaitingForApproval], RunState::Running, what);
    let expires_at = move_run(
        tx,
        now,
        run_id,
        RunMove {
            take: Some(holder),
            ..resume
        },
    )?
    .expect("entering RUNNING takes the lease");
    append(
        tx,
        now,
        run_id,
        EventKind::RunResumed,
        None,
        &json!({ "from": RunState::WaitingForApproval.as_str() }),
    )?;
    append(
        tx,
        now,
        run_id,
        EventKind::PolicyDecided,
        Some(step),
        &decision.payload(call, source),
    )?;
    apply_decision(
        tx,
        now,
        run_id,
        step,
        StepState::Waiting,
        attempt,
        call,
        decision,
        reason,
    )?;
    Ok(expires_at)
}

/// Takes over a RUNNING run whose lease expired or is absent: the lease is taken and every
/// step in flight marked interrupted, in one transaction with `run.resumed` (and
/// `lease.taken_over` when someone held it). Returns the steps marked and the new expiry.
///
/// A live lease of another owner is refused with `RunLeased` before the clock is read or
/// anything is written.
pub(crate) fn take_over(
    tx: &Transaction<'_>,
    now: &mut Now<'_>,
    run_id: &RunId,
    holder: &Holder,
) -> Result<(Vec<u32>, i64)> {
    let what = "only a RUNNING run can be taken over";
    let row = lease_row(tx, run_id)?.ok_or_else(|| Error::RunNotFound(run_id.clone()))?;
    if row.state != RunState::Running {
        return Err(refused(tx, run_id, None, what));
    }
    let wall = wall_millis();
    if let (Some(owner), Some(expires_at)) = (&row.owner, row.expires_at) {
        // This supervisor's own live lease is not refused: the caller checked that it executes
        // no call of this run, so that lease is a leftover.
        if expires_at > wall && **owner != *holder.owner {
            return Err(Error::RunLeased {
                run_id: run_id.clone(),
                owner: owner.clone(),
                expires_at: from_millis(expires_at),
            });
        }
    }
    let expires_at = holder.expiry(wall);
    let changed = tx
        .prepare_cached(
            "UPDATE runs SET lease_owner = ?2, lease_expires_at = ?3, updated_at = ?4
             WHERE id = ?1 AND state = 'RUNNING' AND lease_owner IS ?5 AND lease_expires_at IS ?6",
        )?
        .execute(params![
            run_id.as_str(),
            &*holder.owner,
            expires_at,
            now.millis(),
            row.owner,
            row.expires_at
        ])?;
    if changed != 1 {
        return Err(refused(tx, run_id, None, what));
    }
    append(
        tx,
        now,
        run_id,
        EventKind::RunResumed,
        None,
        &json!({ "from": RunState::Running.as_str() }),
    )?;
    if let Some(previous) = &row.owner {
        append(
            tx,
            now,
            run_id,
            EventKind::LeaseTakenOver,
            None,
            &json!({
                "previous_owner": previous,
                "previous_expires_at": row.expires_at,
                "new_owner": &*holder.owner,
                "new_expires_at": expires_at,
            }),
        )?;
    }
    let interrupted: Vec<(u32, String, u32)> = tx
        .prepare_cached(
            "UPDATE steps SET state = 'interrupted' WHERE run_id = ?1 AND state = 'in_flight'
             RETURNING step, kind, attempt",
        )?
        .query_map([run_id.as_str()], |row| {
            Ok((row.get(0)?, row.get(1)?, row.get(2)?))
        })?
        .collect::<rusqlite::Result<_>>()?;
    let mut steps = Vec::with_capacity(interrupted.len());
    for (step, kind, attempt) in interrupted {
        append(
            tx,
            now,
            run_id,
            EventKind::StepInterrupted,
            Some(step),
            &json!({ "kind": kind, "attempt": attempt }),
        )?;
        steps.push(step);
    }
    steps.sort_unstable();
    Ok((steps, expires_at))
}

/// What reconciling an interrupted step decided.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Resolution {
    /// A model step: dispatch it again.
    Redispatch,
    /// A tool step that took effect: this is its output.
    Applied(Value),
    /// Run the tool again; `outcome` says what the hook answered ("not_applied", "unknown",
    /// "no_hook").
    Retry { outcome: &'static str },
    /// Ask a person; `outcome` as for `Retry`.
    AwaitApproval { outcome: &'static str },
}

/// Records the one reconciliation of an interrupted step together with what it leads to.
#[allow(clippy::too_many_arguments)]
pub(crate) fn reconcile(
    tx: &Transaction<'_>,
    now: &mut Now<'_>,
    run_id: &RunId,
    holder: &Holder,
    step: u32,
    attempt: u32,
    call: Option<&ToolCall>,
    resolution: &Resolution,
) -> Result<()> {
    let what = "an interrupted step cannot be reconciled";
    match resolution {
        Resolution::AwaitApproval { .. } => pause(tx, now, run_id, holder)?,
        // Running again starts a side effect: the lease must be unexpired.
        Resolution::Redispatch | Resolution::Retry { .. } => {
            touch_held(tx, now, run_id, holder, Need::Unexpired, what)?
        }
        Resolution::Applied(_) => touch_held(tx, now, run_id, holder, Need::Held, what)?,
    }
    let from = StepState::Interrupted;
    let (outcome, action) = match resolution {
        Resolution::Redispatch => ("model_call", "dispatch_again"),
        Resolution::Applied(_) => ("applied", "record_output"),
        Resolution::Retry { outcome } => (*outcome, "run_again"),
        Resolution::AwaitApproval { outcome } => (*outcome, "await_approval"),
    };
    append(
        tx,
        now,
        run_id,
        EventKind::StepReconciled,
        Some(step),
        &json!({ "attempt": attempt, "outcome": outcome, "action": action }),
    )?;
    match (resolution, call) {
        (Resolution::Redispatch, _) => {
            start_attempt(tx, run_id, step, from, attempt)?;
            append(
                tx,
                now,
                run_id,
                EventKind::ModelStarted,
                Some(step),
                &json!({ "attempt": attempt + 1 }),
            )
        }
        (Resolution::Applied(output), Some(call)) => {
            let result = serde_json::to_value(ToolResult::Ok(output.clone())).unwrap();
            close_step(tx, run_id, step, from, attempt, Some(&result))?;
            append(
                tx,
                now,
                run_id,
                EventKind::ToolFinished,
                Some(step),
                &json!({ "call_id": call.id, "attempt": attempt, "output": output, "reconciled": true }),
            )
        }
        (Resolution::Retry { .. }, Some(call)) => {
            start_tool_attempt(tx, now, run_id, step, from, attempt, call)
        }
        (Resolution::AwaitApproval { .. }, Some(call)) => {
            let decision = ToolDecision::RequireApproval {
                reason: String::new(),
            };
            apply_decision(
                tx,
                now,
                run_id,
                step,
                from,
                attempt,
                call,
                &decision,
                ApprovalReason::Reconcile,
            )
        }
        (_, None) => Err(Error::Corrupt(format!(
            "tool step {step} of run {run_id} has no call"
        ))),
    }
}

/// The step and attempt count of a run's call that waits for a decision, found through the
/// index of waiting calls (migration 7): the literal state is what lets SQLite use it.
const WAITING_CALL: &str = "SELECT step, attempt FROM steps
     WHERE run_id = ?1 AND call_id = ?2 AND state = 'waiting'";

/// Records an operator's decision on a call that waits for one. A call that does not wait, or
/// whose decision is already recorded, is refused unchanged.
pub(crate) fn record_approval(
    tx: &Transaction<'_>,
    now: &mut Now<'_>,
    approval: &Approval,
) -> Result<()> {
    let run_id = &approval.run_id;
    let waiting: Option<(u32, u32)> = tx
        .prepare_cached(WAITING_CALL)?
        .query_row(params![run_id.as_str(), approval.call_id], |row| {
            Ok((row.get(0)?, row.get(1)?))
        })
        .optional()?;
    let not_pending = |reason: String| -> Error {
        match run_state(tx, run_id) {
            Ok(Some(state)) => Error::RunState {
                run_id: run_id.clone(),
                state,
                reason,
            },
            Ok(None) => Error::RunNotFound(run_id.clone()),
            Err(err) => err,
        }
    };
    let Some((step, attempt)) = waiting else {
        // Which error: a scan of the run's steps, on this path only.
        let known = tx
            .prepare_cached("SELECT 1 FROM steps WHERE run_id = ?1 AND call_id = ?2")?
            .exists(params![run_id.as_str(), approval.call_id])?;
        return Err(match run_state(tx, run_id)? {
            None => Error::RunNotFound(run_id.clone()),
            Some(_) if known => not_pending(format!(
                "call {:?} is not waiting for an approval",
                approval.call_id
            )),
            Some(_) => Error::CallNotFound {
                run_id: run_id.clone(),
                call_id: approval.call_id.clone(),
            },
        });
    };
    let changed = tx
        .prepare_cached(
            "UPDATE runs SET updated_at = ?2 WHERE id = ?1 AND state = 'WAITING_FOR_APPROVAL'",
        )?
        .execute(params![run_id.as_str(), now.millis()])?;
    if changed != 1 {
        return Err(not_pending(format!(
            "call {:?} cannot be decided: the run is not waiting",
            approval.call_id
        )));
    }
    let inserted = tx
        .prepare_cached(
            "INSERT INTO approvals (run_id, step, attempt, approved, decided_by, note, at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) ON CONFLICT DO NOTHING",
        )?
        .execute(params![
            run_id.as_str(),
            step,
            attempt + 1,
            approval.approved,
            approval.by,
            approval.note,
            now.millis()
        ])?;
    if inserted != 1 {
        return Err(not_pending(format!(
            "call {:?} is already decided",
            approval.call_id
        )));
    }
    let mut payload = json!({ "call_id": approval.call_id, "approved": approval.approved, "decided_by": approval.by });
    if let Some(note) = &approval.note {
        payload["note"] = json!(note);
    }
    append(
        tx,
        now,
        run_id,
        EventKind::ApprovalRecorded,
        Some(step),
        &payload,
    )
}

/// An operator's cancel: no lease needed; the run moves to CANCELLED from RUNNING or
/// WAITING_FOR_APPROVAL, and its lease is released with the move.
pub(crate) fn cancel_run(
    tx: &Transaction<'_>,
    now: &mut Now<'_>,
    run_id: &RunId,
    reason: &str,
) -> Result<()> {
    let from = [RunState::Running, RunState::WaitingForApproval];
    let cancel = RunMove::new(
        &from,
        RunState::Cancelled,
        "a finished run cannot be cancelled",
    );
    move_run(
        tx,
        now,
        run_id,
        RunMove {
            error: Some(reason),
            ..cancel
        },
    )?;
    append(
        tx,
        now,
        run_id,
        EventKind::RunFinished,
        None,
        &json!({ "state": "CANCELLED", "reason": reason }),
    )
}

// ---------------------------------------------------------------------------------------------
// The lease outside the moves

/// Releases `owner`'s lease on a run that stays RUNNING (its call returned with an error):
/// compare-and-set on the owner, no event, no clock, so another process need not wait out the
/// TTL. Returns whether it held the lease.
pub(crate) fn release(conn: &Connection, run_id: &RunId, owner: &str) -> Result<bool> {
    let changed = conn
        .prepare_cached(
            "UPDATE runs SET lease_owner = NULL, lease_expires_at = NULL
             WHERE id = ?1 AND lease_owner = ?2",
        )?
        .execute(params![run_id.as_str(), owner])?;
    Ok(changed == 1)
}

/// What one renewal tick found.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Renewal {
    /// The new expiry of every run renewed.
    pub expires_at: i64,
    /// The runs renewed.
    pub renewed: Vec<RunId>,
    /// The runs asked for but not renewed, with their row as found (`None`: no such run).
    pub missing: Vec<(RunId, Option<LeaseRow>)>,
}

/// Renews, in one statement outside any transaction, `owner`'s unexpired leases on `held`:
/// compare-and-set on the owner. The rows of runs that were not renewed are read afterwards,
/// which happens only when a lease was lost.
pub(crate) fn renew(
    conn: &Connection,
    owner: &str,
    held: &[RunId],
    ttl: Duration,
) -> Result<Renewal> {
    let wall = wall_millis();
    let expires_at = wall + ttl.as_millis() as i64;
    let ids = serde_json::to_string(held).expect("ids serialize");
    let renewed: Vec<RunId> = conn
        .prepare_cached(
            "UPDATE runs SET lease_expires_at = ?3
             WHERE lease_owner = ?1 AND state = 'RUNNING' AND lease_expires_at > ?2
               AND id IN (SELECT value FROM json_each(?4))
             RETURNING id",
        )?
        .query_map(params![owner, wall, expires_at, ids], |row| {
            row.get::<_, String>(0)
        })?
        .map(|id| id.map(RunId::from))
        .collect::<rusqlite::Result<_>>()?;
    let mut missing = Vec::new();
    if renewed.len() < held.len() {
        let renewed: HashSet<&RunId> = renewed.iter().collect();
        for run_id in held.iter().filter(|id| !renewed.contains(id)) {
            missing.push((run_id.clone(), lease_row(conn, run_id)?));
        }
    }
    Ok(Renewal {
        expires_at,
        renewed,
        missing,
    })
}

/// The stored lease of a run, read without taking or changing it.
pub(crate) fn lease(conn: &Connection, run_id: &RunId) -> Result<Option<Lease>> {
    let row = lease_row(conn, run_id)?.ok_or_else(|| Error::RunNotFound(run_id.clone()))?;
    Ok(match (row.owner, row.expires_at) {
        (Some(owner), Some(expires_at)) => Some(Lease {
            owner,
            expires_at: from_millis(expires_at),
        }),
        _ => None,
    })
}

// ---------------------------------------------------------------------------------------------
// Reads

const RUN_COLUMNS: &str = "id, agent, input, state, output, error, created_at, updated_at";

fn parse_json(text: String, what: &str) -> rusqlite::Result<Value> {
    serde_json::from_str(&text).map_err(|err| {
        rusqlite::Error::FromSqlConversionFailure(
            0,
            rusqlite::types::Type::Text,
            format!("{what}: {err}").into(),
        )
    })
}

fn run_from_row(row: &Row<'_>) -> rusqlite::Result<Run> {
    let state: String = row.get(3)?;
    Ok(Run {
        id: RunId::from(row.get::<_, String>(0)?),
        agent: row.get(1)?,
        input: parse_json(row.get(2)?, "run input")?,
        state: state.parse().map_err(|err: String| {
            rusqlite::Error::FromSqlConversionFailure(3, rusqlite::types::Type::Text, err.into())
        })?,
        output: row.get(4)?,
        error: row.get(5)?,
        created_at: from_millis(row.get(6)?),
        updated_at: from_millis(row.get(7)?),
    })
}

pub(crate) fn run(conn: &Connection, run_id: &RunId) -> Result<Run> {
    conn.prepare_cached(&format!("SELECT {RUN_COLUMNS} FROM runs WHERE id = ?1"))?
        .query_row([run_id.as_str()], run_from_row)
        .optional()?
        .ok_or_else(|| Error::RunNotFound(run_id.clone()))
}

pub(crate) fn runs(conn: &Connection, state: Option<RunState>) -> Result<Vec<Run>> {
    let runs = match state {
        Some(state) => conn
            .prepare_cached(&format!(
                "SELECT {RUN_COLUMNS} FROM runs WHERE state = ?1 ORDER BY created_at, id"
            ))?
            .query_map([state.as_str()], run_from_row)?
            .collect::<rusqlite::Result<_>>()?,
        None => conn
            .prepare_cached(&format!(
                "SELECT {RUN_COLUMNS} FROM runs ORDER BY created_at, id"
            ))?
            .query_map([], run_from_row)?
            .collect::<rusqlite::Result<_>>()?,
    };
    Ok(runs)
}

pub(crate) fn events(conn: &Connection, run_id: &RunId) -> Result<Vec<Event>> {
    events_after(conn, run_id, 0)
}

fn event_from_row(run_id: &RunId, row: &Row<'_>) -> rusqlite::Result<Event> {
    let kind: String = row.get(1)?;
    Ok(Event {
        run_id: run_id.clone(),
        seq: row.get::<_, i64>(0)? as u64,
        kind: kind.parse().map_err(|err: String| {
            rusqlite::Error::FromSqlConversionFailure(1, rusqlite::types::Type::Text, err.into())
        })?,
        at: from_millis(row.get(2)?),
        step: row.get(3)?,
        payload: parse_json(row.get(4)?, "event payload")?,
    })
}

/// A run's events after `after`; an unknown run is not found (every run has `run.started`).
pub(crate) fn events_after(conn: &Connection, run_id: &RunId, after: u64) -> Result<Vec<Event>> {
    let events: Vec<Event> = conn
        .prepare_cached(
            "SELECT seq, kind, at, step, payload FROM events WHERE run_id = ?1 AND seq > ?2 ORDER BY seq",
        )?
        .query_map(params![run_id.as_str(), after as i64], |row| event_from_row(run_id, row))?
        .collect::<rusqlite::Result<_>>()?;
    if events.is_empty() {
        run(conn, run_id)?;
    }
    Ok(events)
}

/// RUNNING runs whose lease expired, with that lease; and RUNNING runs nobody holds.
pub(crate) type LeaseReport = (Vec<(RunId, Lease)>, Vec<RunId>);

/// RUNNING runs whose lease expired before `wall`, and RUNNING runs nobody holds.
pub(crate) fn lease_report(conn: &Connection, wall: i64) -> Result<LeaseReport> {
    let rows: Vec<(String, Option<String>, Option<i64>)> = conn
        .prepare_cached(
            "SELECT id, lease_owner, lease_expires_at FROM runs
             WHERE state = 'RUNNING' AND (lease_owner IS NULL OR lease_expires_at <= ?1)
             ORDER BY id",
        )?
        .query_map([wall], |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)))?
        .collect::<rusqlite::Result<_>>()?;
    let (mut stale, mut unleased) = (Vec::new(), Vec::new());
    for (id, owner, expires_at) in rows {
        match (owner, expires_at) {
            (Some(owner), Some(expires_at)) => stale.push((
                RunId::from(id),
                Lease {
                    owner,
                    expires_at: from_millis(expires_at),
                },
            )),
            _ => unleased.push(RunId::from(id)),
        }
    }
    Ok((stale, unleased))
}

/// SQLite's `PRAGMA integrity_check`: `["ok"]`, or the problems found.
pub(crate) fn integrity_check(conn: &Connection) -> Result<Vec<String>> {
    Ok(conn
        .prepare("PRAGMA integrity_check")?
        .query_map([], |row| row.get(0))?
        .collect::<rusqlite::Result<_>>()?)
}

fn steps(conn: &Connection, run_id: &RunId) -> Result<Vec<StepRow>> {
    let rows = conn
        .prepare_cached(
            "SELECT step, kind, state, attempt, call_id, tool, args, result, waiting_for
             FROM steps WHERE run_id = ?1 ORDER BY step",
        )?
        .query_map([run_id.as_str()], |row| {
            let kind: String = row.get(1)?;
            let state: String = row.get(2)?;
            let call_id: Option<String> = row.get(4)?;
            let call = match call_id {
                Some(id) => Some(ToolCall {
                    id,
                    name: row.get::<_, Option<String>>(5)?.unwrap_or_default(),
                    args: parse_json(
                        row.get::<_, Option<String>>(6)?
                            .unwrap_or_else(|| "null".into()),
                        "tool args",
                    )?,
                }),
                None => None,
            };
            let result: Option<String> = row.get(7)?;
            let waiting_for: Option<String> = row.get(8)?;
            Ok((
                row.get::<_, u32>(0)?,
                kind,
                state,
                row.get::<_, u32>(3)?,
                call,
                result,
                waiting_for,
            ))
        })?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    rows.into_iter()
        .map(|(step, kind, state, attempt, call, result, waiting_for)| {
            Ok(StepRow {
                step,
                kind: if kind == "model" {
                    StepKind::Model
                } else {
                    StepKind::Tool
                },
                state: StepState::parse(&state)?,
                attempt,
                call,
                result: result
                    .map(|text| serde_json::from_str(&text))
                    .transpose()
                    .map_err(|err| Error::Corrupt(format!("step result: {err}")))?,
                waiting_for: match waiting_for.as_deref() {
                    Some("policy") => Some(ApprovalReason::Policy),
                    Some("reconcile") => Some(ApprovalReason::Reconcile),
                    _ => None,
                },
            })
        })
        .collect()
}

/// The run, its steps, and the decision recorded for its waiting step.
pub(crate) fn load(conn: &Connection, run_id: &RunId) -> Result<RunSnapshot> {
    let run = run(conn, run_id)?;
    let steps = steps(conn, run_id)?;
    let approval = match steps.iter().find(|s| s.state == StepState::Waiting) {
        Some(waiting) => conn
            .prepare_cached(
                "SELECT approved, decided_by, note FROM approvals WHERE run_id = ?1 AND step = ?2 AND attempt = ?3",
            )?
            .query_row(params![run_id.as_str(), waiting.step, waiting.attempt + 1], |row| {
                Ok(ApprovalRow { approved: row.get(0)?, by: row.get(1)?, note: row.get(2)? })
            })
            .optional()?,
        None => None,
    };
    Ok(RunSnapshot {
        run,
        steps,
        approval,
    })
}

pub(crate) fn pending_calls(conn: &Connection, run_id: &RunId) -> Result<Vec<PendingCall>> {
    let snapshot = load(conn, run_id)?;
    if snapshot.run.state != RunState::WaitingForApproval {
        // A cancelled run keeps its waiting step as it was, but nothing waits any more.
        return Ok(Vec::new());
    }
    Ok(snapshot
        .steps
        .iter()
        .filter(|step| step.state == StepState::Waiting && snapshot.approval.is_none())
        .filter_map(|step| {
            let call = step.call.clone()?;
            Some(PendingCall {
                step: step.step,
                call_id: call.id,
                tool: call.name,
                args: call.args,
                reason: step.waiting_for.unwrap_or(ApprovalReason::Policy),
            })
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{clock::SystemClock, store::Store};

    fn holder(owner: &str, ttl_ms: u64) -> Holder {
        Holder {
            owner: owner.into(),
            ttl: Duration::from_millis(ttl_ms),
        }
    }

    /// A store with run `r` RUNNING under `owner`, whose lease expired `ago_ms` ago.
    fn run_with_lapsed_lease(owner: &Holder, ago_ms: i64) -> (Store, RunId) {
        let store = Store::in_memory().unwrap();
        let run_id = RunId::from("r");
        store
            .transact(&SystemClock, |tx, now| {
                create_run(tx, now, &run_id, "a", &json!({}), owner)
            })
            .unwrap();
        store
            .read(|conn| {
                conn.execute(
                    "UPDATE runs SET lease_expires_at = ?1",
                    [wall_millis() - ago_ms],
                )?;
                Ok(())
            })
            .unwrap();
        (store, run_id)
    }

    #[test]
    fn the_waiting_call_of_an_approval_is_found_through_its_index() {
        let store = Store::in_memory().unwrap();
        let plan: Vec<String> = store
            .read(|conn| {
                let mut stmt = conn.prepare(&format!("EXPLAIN QUERY PLAN {WAITING_CALL}"))?;
                let rows = stmt.query_map(["r", "c"], |row| row.get::<_, String>(3))?;
                Ok(rows.collect::<rusqlite::Result<_>>()?)
            })
            .unwrap();
        // "USING INDEX" or "USING COVERING INDEX", never a scan of the run's steps.
        assert!(
            plan.iter()
                .any(|line| line.contains("INDEX steps_waiting_call")),
            "{plan:?}"
        );
    }

    #[test]
    fn moves_that_start_a_side_effect_need_an_unexpired_lease() {
        let me = holder("me/000000000001", 30_000);
        let (store, run_id) = run_with_lapsed_lease(&me, 1);
        let err = store
            .transact(&SystemClock, |tx, now| {
                begin_model_step(tx, now, &run_id, &me, 1)
            })
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::LeaseLost {
                    reason: LeaseLostReason::Expired,
                    ..
                }
            ),
            "{err}"
        );
        // A move that starts nothing only needs the lease held: nobody took it over.
        store
            .transact(&SystemClock, |tx, now| {
                fail_run(tx, now, &run_id, &me, "stop")
            })
            .unwrap();
        assert_eq!(
            lease(&store.connection(), &run_id).unwrap(),
            None,
            "finishing released it"
        );
    }

    #[test]
    fn another_owners_live_lease_refuses_a_takeover_and_an_expired_one_is_taken_over() {
        let them = holder("them/000000000002", 30_000);
        let me = holder("me/000000000001", 30_000);
        let store = Store::in_memory().unwrap();
        let run_id = RunId::from("r");
        store
            .transact(&SystemClock, |tx, now| {
                create_run(tx, now, &run_id, "a", &json!({}), &them)
            })
            .unwrap();
        let err = store
            .transact(&SystemClock, |tx, now| take_over(tx, now, &run_id, &me))
            .unwrap_err();
        assert!(
            matches!(&err, Error::RunLeased { owner, .. } if owner == "them/000000000002"),
            "{err}"
        );

        let (store, run_id) = run_with_lapsed_lease(&them, 1);
        let (interrupted, _) = store
            .transact(&SystemClock, |tx, now| take_over(tx, now, &run_id, &me))
            .unwrap();
        assert!(interrupted.is_empty());
        let stored = lease(&store.connection(), &run_id).unwrap().unwrap();
        assert_eq!(stored.owner, "me/000000000001");
        let kinds: Vec<EventKind> = events(&store.connection(), &run_id)
            .unwrap()
            .iter()
            .map(|e| e.kind)
            .collect();
        assert_eq!(
            kinds,
            [
                EventKind::RunStarted,
                EventKind::RunResumed,
                EventKind::LeaseTakenOver
            ]
        );
    }

    #[test]
    fn a_renewal_tick_is_one_statement_whatever_the_number_of_runs_held() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static STATEMENTS: AtomicUsize = AtomicUsize::new(0);
        fn count(event: rusqlite::trace::TraceEvent<'_>) {
            if let rusqlite::trace::TraceEvent::Stmt(..) = event {
                STATEMENTS.fetch_add(1, Ordering::SeqCst);
            }
        }
        let me = holder("me/000000000001", 30_000);
        for held in [1, 100, 10_000] {
            let mut conn = Connection::open_in_memory().unwrap();
            crate::store::migrations().to_latest(&mut conn).unwrap();
            let tx = conn.transaction().unwrap();
            let ids: Vec<RunId> = (0..held).map(|i| RunId::from(format!("r{i}"))).collect();
            for id in &ids {
                create_run(
                    &tx,
                    &mut Now {
                        clock: &SystemClock,
                        read: None,
                    },
                    id,
                    "a",
                    &json!({}),
                    &me,
                )
                .unwrap();
            }
            tx.commit().unwrap();
            conn.trace_v2(
                rusqlite::trace::TraceEventCodes::SQLITE_TRACE_STMT,
                Some(count),
            );
            STATEMENTS.store(0, Ordering::SeqCst);
            let renewal = renew(&conn, &me.owner, &ids, me.ttl).unwrap();
            conn.trace_v2(rusqlite::trace::TraceEventCodes::empty(), None);
            assert_eq!(renewal.renewed.len(), held);
            assert_eq!(STATEMENTS.load(Ordering::SeqCst), 1, "{held} runs held");
        }
    }

    #[test]
    fn a_renewal_is_one_compare_and_set_on_the_owner_that_skips_expired_and_foreign_leases() {
        let me = holder("me/000000000001", 30_000);
        let store = Store::in_memory().unwrap();
        let ids: Vec<RunId> = (0..3).map(|i| RunId::from(format!("r{i}"))).collect();
        for id in &ids {
            store
                .transact(&SystemClock, |tx, now| {
                    create_run(tx, now, id, "a", &json!({}), &me)
                })
                .unwrap();
        }
        store
            .read(|conn| {
                conn.execute("UPDATE runs SET lease_expires_at = 1 WHERE id = 'r1'", [])?;
                conn.execute("UPDATE runs SET lease_owner = 'them' WHERE id = 'r2'", [])?;
                Ok(())
            })
            .unwrap();
        let renewal = store
            .read(|conn| renew(conn, &me.owner, &ids, me.ttl))
            .unwrap();
        assert_eq!(renewal.renewed, [RunId::from("r0")]);
        let missing: Vec<&str> = renewal.missing.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(missing, ["r1", "r2"]);
        assert_eq!(
            renewal.missing[1].1.as_ref().unwrap().owner.as_deref(),
            Some("them")
        );
    }
}
