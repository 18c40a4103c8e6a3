//! Waits other than an approval: a call that waits for a person's answer, an event, a time or
//! a child run; what wakes it (an answer, a delivery, a child's end); and the resume that goes
//! on with what came. One move per kind of wake-up, each recording what came on the wait's
//! row, which the change feed tells the replicas of.

use serde_json::{Value, json};

use super::{
    Leased, Move,
    guard::{Cx, RunMove},
};
use crate::{
    error::{Error, Result},
    store::{
        backend::{MoveKind, NewRun, StepUpdate},
        model::{WaitRow, idempotency_key},
    },
    types::{
        Answer, Delivered, Delivery, EventKind, RunId, RunState, StepState, ToolCall, ToolResult,
        Wait, WaitKind,
    },
};

/// What a waiting call asks to wait for.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum WaitRequest {
    /// A person's answer to `question`, checked against `schema` when given.
    Answer {
        question: String,
        schema: Option<Value>,
    },
    /// The first event named `name` delivered to the run (or kept for it).
    Event { name: String },
    /// Time `at` (milliseconds by `Config::clock`). With `retry`, the call is made again
    /// then (the tool asked for it); otherwise the call ends then.
    Timer {
        at: i64,
        reason: String,
        retry: bool,
    },
    /// Child run of `agent` with `input`, at most `max_depth` runs below the root.
    Child {
        agent: String,
        input: Value,
        max_depth: u32,
    },
}

impl WaitRequest {
    fn kind(&self) -> WaitKind {
        match self {
            WaitRequest::Answer { .. } => WaitKind::Answer,
            WaitRequest::Event { .. } => WaitKind::Event,
            WaitRequest::Timer { .. } => WaitKind::Timer,
            WaitRequest::Child { .. } => WaitKind::Child,
        }
    }
}

/// How a wait's beginning ended.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Began {
    /// The run waits: it released its lease.
    Waiting(Wait),
    /// Nothing to wait for (an event kept for it, a time already past, a child already
    /// finished, or a refusal): the call finished with this result, and the run goes on.
    Finished(ToolResult),
}

/// The call in flight at `attempt` of step `step` waits: its step waits, its wait is
/// inserted, and the run moves to the state of its kind, releasing its lease, all in one
/// transaction. A child run is inserted in the same transaction, under the call's idempotency
/// key as its id, so that no crash can start two. An event already kept for the run, a timer
/// already due, or a depth past the limit finish the call at once instead.
pub(crate) struct BeginWait {
    pub by: Leased,
    pub step: u32,
    pub attempt: u32,
    pub call: ToolCall,
    pub request: WaitRequest,
}

impl Move for BeginWait {
    type Output = Began;

    fn kind(&self) -> MoveKind {
        MoveKind::BeginWait
    }

    fn run_id(&self) -> &RunId {
        &self.by.run_id
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<Began> {
        let (grant, step, attempt) = (&self.by.grant, self.step, self.attempt);
        let what = "a call cannot wait";
        cx.touch_held(grant, super::guard::Need::Held, what)?;
        let now = cx.now.millis();
        let (key, detail, due_at) = match &self.request {
            WaitRequest::Answer { question, schema } => (
                self.call.id.clone(),
                json!({ "question": question, "schema": schema }),
                None,
            ),
            WaitRequest::Event { name } => {
                if let Some((event_id, payload)) = cx.tx.take_inbox(cx.run_id, name, step)? {
                    let detail = json!({ "event_id": event_id });
                    return self.finish(cx, ToolResult::Ok(payload), detail);
                }
                (name.clone(), json!({ "name": name }), None)
            }
            WaitRequest::Timer { at, reason, retry } => {
                if *at <= now && !retry {
                    let woke = json!({ "woke_at": now, "reason": reason });
                    return self.finish(cx, ToolResult::Ok(woke), json!({}));
                }
                (
                    reason.clone(),
                    json!({ "reason": reason, "retry": retry }),
                    Some(*at),
                )
            }
            WaitRequest::Child {
                agent,
                input,
                max_depth,
            } => {
                let child = RunId::from(idempotency_key(cx.run_id, step));
                if let Err(err) = child.check() {
                    let error = format!("the run cannot delegate: {err}");
                    return self.finish(cx, ToolResult::Error(error), json!({}));
                }
                let depth = ancestors(cx, cx.run_id)? + 1;
                if depth > *max_depth {
                    let error = format!(
                        "the run cannot delegate: child runs nest at most {max_depth} deep"
                    );
                    return self.finish(cx, ToolResult::Error(error), json!({}));
                }
                if cx.tx.lease_row(&child)?.is_some() {
                    let error = format!(
                        "the run cannot delegate: a run {child} exists that is not this call's child"
                    );
                    return self.finish(cx, ToolResult::Error(error), json!({}));
                }
                cx.tx.insert_run(&NewRun {
                    run_id: &child,
                    agent,
                    input,
                    at: now,
                    lease: None,
                })?;
                let payload = json!({
                    "agent": agent,
                    "input": input,
                    "fencing_token": 0,
                    "queued": true,
                    "parent": { "run_id": cx.run_id, "step": step, "call_id": self.call.id },
                });
                Cx::new(cx.tx, cx.now, &child).append_started(payload, None)?;
                (
                    child.as_str().to_owned(),
                    json!({ "agent": agent, "task": input }),
                    None,
                )
            }
        };
        let kind = self.request.kind();
        cx.move_step(
            step,
            StepUpdate {
                from: StepState::InFlight,
                attempt,
                to: StepState::Waiting,
                starts: false,
                result: None,
                result_text: None,
                waiting_for: None,
            },
        )?;
        let row = WaitRow {
            step,
            call_id: self.call.id.clone(),
            kind,
            key,
            detail,
            since: now,
            due_at,
            ready_at: due_at,
            result: None,
        };
        cx.tx.insert_wait(cx.run_id, &row)?;
        cx.move_run(RunMove {
            guard: Some(grant),
            ..RunMove::new(&[RunState::Running], kind.state(), "it cannot wait")
        })?;
        let mut payload = json!({
            "call_id": self.call.id,
            "tool": self.call.name,
            "waits_for": kind.as_str(),
            "key": row.key,
            "detail": row.detail,
        });
        if let Some(due_at) = due_at {
            payload["due_at"] = json!(due_at);
        }
        cx.append(EventKind::RunWaiting, Some(step), &payload)?;
        Ok(Began::Waiting(row.public(cx.run_id)))
    }
}

impl BeginWait {
    /// Ends the call at once with `result` (nothing to wait for): the step finishes, as a
    /// tool's outcome would.
    fn finish(&self, cx: &mut Cx<'_, '_>, result: ToolResult, extra: Value) -> Result<Began> {
        let json = serde_json::to_value(&result).expect("a result serializes");
        cx.close_step(self.step, StepState::InFlight, self.attempt, Some(&json))?;
        let mut payload = tool_finished(&self.call.id, self.attempt, &result);
        if let (Some(payload), Value::Object(extra)) = (payload.as_object_mut(), extra) {
            payload.extend(extra);
        }
        cx.append(EventKind::ToolFinished, Some(self.step), &payload)?;
        Ok(Began::Finished(result))
    }
}

/// How many runs above `run_id` wait for it, each for the one below: its depth from the root.
fn ancestors(cx: &mut Cx<'_, '_>, run_id: &RunId) -> Result<u32> {
    let (mut depth, mut at) = (0, run_id.clone());
    // Only a child's id holds a `/` (see `wake_parent`).
    while at.as_str().contains('/')
        && let Some((parent, _)) = cx.tx.parent_wait(&at)?
    {
        depth += 1;
        at = parent;
        // A cycle cannot be made (a child's id is new), but a bound costs nothing.
        if depth > 1000 {
            return Err(Error::Corrupt(format!("run {run_id} nests in a cycle")));
        }
    }
    Ok(depth)
}

/// The payload of a `step.tool_finished` for `result`.
fn tool_finished(call_id: &str, attempt: u32, result: &ToolResult) -> Value {
    let mut payload = json!({ "call_id": call_id, "attempt": attempt });
    match result {
        ToolResult::Ok(output) => payload["output"] = output.clone(),
        ToolResult::Error(error) => payload["error"] = json!(error),
    }
    payload
}

/// How a resume went on.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Resumed {
    /// The call finished with what the wait brought.
    Finished(ToolResult),
    /// The call is made again (a tool's own timer): its next attempt is in flight.
    Again,
}

/// Resumes a run whose wait is ready (its answer, event or child's end came, or its time
/// passed): back to RUNNING under the resumer's lease, the wait deleted, and the waiting call
/// finished with what came (or, for a tool's own timer, started again), in one compare-and-set
/// on the run's state, so of two resumers one wins. A wait not ready is refused unchanged.
/// Returns the lease's expiry and how it went on.
pub(crate) struct ResumeWait {
    pub by: Leased,
    pub step: u32,
    pub attempt: u32,
    pub call: ToolCall,
}

impl Move for ResumeWait {
    type Output = (i64, Resumed);

    fn kind(&self) -> MoveKind {
        MoveKind::ResumeWait
    }

    fn run_id(&self) -> &RunId {
        &self.by.run_id
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<(i64, Resumed)> {
        let (grant, step, attempt) = (&self.by.grant, self.step, self.attempt);
        let wait = match cx.tx.wait(cx.run_id)? {
            Some(wait) if wait.step == step => wait,
            _ => return Err(cx.state_error(format!("step {step} does not wait"))),
        };
        let now = cx.now.millis();
        if !wait.ready(now) {
            return Err(cx.state_error(format!("the wait of step {step} is not over")));
        }
        let from = wait.kind.state();
        let expires_at = cx
            .move_run(RunMove {
                take: Some(grant),
                ..RunMove::new(
                    &[from],
                    RunState::Running,
                    "only a waiting run can be resumed",
                )
            })?
            .expect("entering RUNNING takes the lease");
        let payload = json!({ "from": from.as_str(), "fencing_token": grant.token() });
        cx.append(EventKind::RunResumed, None, &payload)?;
        cx.tx.delete_wait(cx.run_id, step)?;
        if wait.kind == WaitKind::Timer && wait.detail["retry"] == json!(true) {
            cx.start_tool_attempt(grant, step, StepState::Waiting, attempt, &self.call)?;
            return Ok((expires_at, Resumed::Again));
        }
        let result = match &wait.result {
            Some(result) => serde_json::from_value(result.clone())
                .map_err(|err| Error::Corrupt(format!("a wait's result: {err}")))?,
            None => ToolResult::Ok(json!({ "woke_at": now, "reason": wait.key })),
        };
        let json = serde_json::to_value(&result).expect("a result serializes");
        cx.move_step(
            step,
            StepUpdate {
                from: StepState::Waiting,
                attempt,
                to: StepState::Finished,
                starts: false,
                result: Some(&json),
                result_text: None,
                waiting_for: None,
            },
        )?;
        let payload = tool_finished(&self.call.id, attempt, &result);
        cx.append(EventKind::ToolFinished, Some(step), &payload)?;
        Ok((expires_at, Resumed::Finished(result)))
    }
}

/// A person's answer to a run's question, whichever door it comes through. Checked against
/// the question's schema: an answer that does not match it is refused unchanged, with what
/// is wrong. A call that does not wait for an answer, or is answered already, is refused.
pub(crate) struct AnswerQuestion {
    pub answer: Answer,
}

impl Move for AnswerQuestion {
    type Output = ();

    fn kind(&self) -> MoveKind {
        MoveKind::AnswerQuestion
    }

    fn run_id(&self) -> &RunId {
        &self.answer.run_id
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<()> {
        let (answer, call_id) = (&self.answer, self.answer.call_id.as_str());
        let wait = match cx.tx.wait(cx.run_id)? {
            Some(wait) if wait.kind == WaitKind::Answer && wait.call_id == call_id => wait,
            _ => {
                let known = cx.tx.call_exists(cx.run_id, call_id)?;
                return Err(match cx.run_state()? {
                    None => Error::RunNotFound(cx.run_id.clone()),
                    Some(_) if known => {
                        cx.state_error(format!("call {call_id:?} does not wait for an answer"))
                    }
                    Some(_) => Error::CallNotFound {
                        run_id: cx.run_id.clone(),
                        call_id: call_id.to_owned(),
                    },
                });
            }
        };
        if wait.result.is_some() {
            return Err(cx.state_error(format!("call {call_id:?} is already answered")));
        }
        if let Some(schema) = wait.detail.get("schema").filter(|s| !s.is_null()) {
            check_answer(schema, &answer.answer)?;
        }
        let result = serde_json::to_value(ToolResult::Ok(answer.answer.clone())).unwrap();
        let at = cx.now.millis();
        if !cx.tx.wake_wait(cx.run_id, wait.step, &result, at)? {
            return Err(cx.state_error(format!("call {call_id:?} is already answered")));
        }
        let payload = json!({
            "call_id": call_id,
            "waits_for": "answer",
            "answer": answer.answer,
            "answered_by": answer.by,
        });
        cx.append(EventKind::WaitWoken, Some(wait.step), &payload)
    }
}

/// Why `answer` does not match `schema`: an `InvalidInput` naming each problem.
fn check_answer(schema: &Value, answer: &Value) -> Result<()> {
    let validator = jsonschema::options()
        .build(schema)
        .map_err(|err| Error::InvalidInput(format!("the question's schema is invalid: {err}")))?;
    let problems: Vec<String> = validator
        .iter_errors(answer)
        .take(5)
        .map(|err| {
            let at = err.instance_path().to_string();
            if at.is_empty() {
                err.to_string()
            } else {
                format!("at {at}: {err}")
            }
        })
        .collect();
    if problems.is_empty() {
        Ok(())
    } else {
        Err(Error::InvalidInput(format!(
            "the answer does not match the question's schema: {}",
            problems.join("; ")
        )))
    }
}

/// An event delivered to a run, whichever door it comes through. A run that waits for an
/// event of its name is woken with it; any other keeps it for its first wait on that name. An
/// event id delivered before is a duplicate, and nothing is written. An unknown run, or one
/// that has finished, is refused.
pub(crate) struct DeliverEvent {
    pub delivery: Delivery,
}

impl Move for DeliverEvent {
    type Output = Delivered;

    fn kind(&self) -> MoveKind {
        MoveKind::DeliverEvent
    }

    fn run_id(&self) -> &RunId {
        &self.delivery.run_id
    }

    fn apply(&self, cx: &mut Cx<'_, '_>) -> Result<Delivered> {
        let delivery = &self.delivery;
        if delivery.name.trim().is_empty() || delivery.event_id.trim().is_empty() {
            return Err(Error::InvalidInput(
                "an event needs a name and an event id that are not empty".into(),
            ));
        }
        let state = cx
            .run_state()?
            .ok_or_else(|| Error::RunNotFound(cx.run_id.clone()))?;
        let at = cx.now.millis();
        // A repeat is told so whatever the run's state since: the sender's retry of a
        // delivery that woke a run that has finished since is no error.
        if !cx.tx.insert_inbox(delivery, at)? {
            return Ok(Delivered::Duplicate);
        }
        if state.is_finished() {
            // Refused, and the insert with it.
            return Err(cx.state_error("a finished run takes no events".into()));
        }
        let waiting = cx.tx.wait(cx.run_id)?.filter(|wait| {
            wait.kind == WaitKind::Event && wait.key == delivery.name && wait.result.is_none()
        });
        let mut payload = json!({ "name": delivery.name, "event_id": delivery.event_id });
        let Some(wait) = waiting else {
            payload["kept"] = json!(true);
            cx.append(EventKind::EventReceived, None, &payload)?;
            return Ok(Delivered::Kept);
        };
        let result = serde_json::to_value(ToolResult::Ok(delivery.payload.clone())).unwrap();
        cx.tx.wake_wait(cx.run_id, wait.step, &result, at)?;
        cx.tx.mark_inbox(cx.run_id, &delivery.event_id, wait.step)?;
        cx.append(EventKind::EventReceived, Some(wait.step), &payload)?;
        let payload = json!({
            "call_id": wait.call_id,
            "waits_for": "event",
            "name": delivery.name,
            "event_id": delivery.event_id,
        });
        cx.append(EventKind::WaitWoken, Some(wait.step), &payload)?;
        Ok(Delivered::Woke)
    }
}

impl Cx<'_, '_> {
    /// A run just finished (`state`, with its output or error): the parent that waits for it,
    /// if any, is woken with its end as the delegating call's result.
    pub(super) fn wake_parent(
        &mut self,
        state: RunState,
        output: Option<&str>,
        error: Option<&str>,
    ) -> Result<()> {
        // A child's id is its parent's call's idempotency key, `PARENT/STEP`: a run whose id
        // has no `/` has no parent, and is not looked for.
        if !self.run_id.as_str().contains('/') {
            return Ok(());
        }
        let Some((parent, step)) = self.tx.parent_wait(self.run_id)? else {
            return Ok(());
        };
        let child = self.run_id.clone();
        let result = match state {
            RunState::Succeeded => ToolResult::Ok(json!(output.unwrap_or_default())),
            RunState::Cancelled => ToolResult::Error(format!(
                "the child run {child} was cancelled: {}",
                error.unwrap_or_default()
            )),
            _ => ToolResult::Error(format!(
                "the child run {child} failed: {}",
                error.unwrap_or_default()
            )),
        };
        let json = serde_json::to_value(&result).unwrap();
        let at = self.now.millis();
        // The parent's row first, as any writer of its log takes it: its events are numbered
        // after its last.
        self.tx.lock_run(&parent)?;
        let mut cx = Cx::new(self.tx, self.now, &parent);
        if cx.tx.wake_wait(&parent, step, &json, at)? {
            let payload = json!({
                "waits_for": "child",
                "child": child,
                "state": state.as_str(),
            });
            cx.append(EventKind::WaitWoken, Some(step), &payload)?;
        }
        Ok(())
    }

    /// A run just cancelled: its wait is dropped, and the child it waited for, if any, is
    /// cancelled too (and its own, down the tree). Returns the children cancelled.
    pub(super) fn cancel_below(&mut self, reason: &str) -> Result<Vec<RunId>> {
        let Some(wait) = self.tx.wait(self.run_id)? else {
            return Ok(Vec::new());
        };
        self.tx.delete_wait(self.run_id, wait.step)?;
        if wait.kind != WaitKind::Child {
            return Ok(Vec::new());
        }
        let child = RunId::from(wait.key);
        let mut cx = Cx::new(self.tx, self.now, &child);
        match cx.run_state()? {
            Some(state) if !state.is_finished() => {
                let reason = format!("its parent run was cancelled: {reason}");
                let mut below = super::lifecycle::cancel(&mut cx, &reason)?;
                below.insert(0, child);
                Ok(below)
            }
            _ => Ok(Vec::new()),
        }
    }
}
