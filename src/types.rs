//! The data agentrt stores and hands back: runs, events, outcomes, and the messages a model sees.
//!
//! Every type here is `Serialize` and `Deserialize` with a stable JSON shape, shown on each
//! type: fields in `snake_case`, enums as the names they are stored under, and times as integer
//! milliseconds since the Unix epoch (negative before it), the precision they are stored at.

use std::{fmt, str::FromStr, time::SystemTime};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Error, Result};

/// The id of a run: chosen by the caller of `StartRun`, or a new time-ordered UUID.
///
/// JSON: the id as a string, `"order-17"`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RunId(String);

impl RunId {
    /// A new unique id: a UUID v7, whose leading bits are the time it was drawn. Runs started
    /// together get ids that sort together, so the rows a step writes (keyed by the run's id)
    /// land in the same few pages of each table, however large the database has grown; random
    /// ids would spread them over the whole file.
    pub fn random() -> Self {
        RunId(uuid::Uuid::now_v7().to_string())
    }

    /// The id as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The longest id a new run is given, in bytes: ids are keys, not documents.
    pub const MAX_LEN: usize = 200;

    /// Whether a new run may be given this id, which names it in the API's and the console's
    /// paths and on the command line: 1 to [`RunId::MAX_LEN`] bytes, not `.` or `..`, with no
    /// control character and no Unicode bidirectional control (U+061C, U+200E, U+200F,
    /// U+202A to U+202E, U+2066 to U+2069, which make an id read otherwise than it is).
    /// Starting or forking a run under any other id is refused with this error, writing
    /// nothing; [`RunId::random`]'s ids always pass. Runs that exist are read and resumed
    /// whatever their ids.
    ///
    /// ```
    /// use agentrt::RunId;
    ///
    /// assert!(RunId::from("order-17").check().is_ok());
    /// assert!(matches!(
    ///     RunId::from("..").check(),
    ///     Err(agentrt::Error::InvalidInput(_))
    /// ));
    /// ```
    pub fn check(&self) -> Result<()> {
        let id = self.as_str();
        let refuse = |rule: &str| {
            Err(Error::InvalidInput(format!(
                "run id {id:?} is refused: a run id {rule}"
            )))
        };
        if id.is_empty() {
            return refuse("must not be empty");
        }
        if id.len() > RunId::MAX_LEN {
            return Err(Error::InvalidInput(format!(
                "a run id of {} bytes is refused: a run id is at most {} bytes",
                id.len(),
                RunId::MAX_LEN
            )));
        }
        if id == "." || id == ".." {
            return refuse("must not be \".\" or \"..\", which name a place in a path");
        }
        if id.chars().any(char::is_control) {
            return refuse("must not hold control characters");
        }
        if id.chars().any(is_bidi_control) {
            return refuse(
                "must not hold Unicode bidirectional controls (U+061C, U+200E, U+200F, \
                 U+202A to U+202E, U+2066 to U+2069), which make it read otherwise than it is",
            );
        }
        Ok(())
    }
}

/// The characters that change the direction text is shown in.
fn is_bidi_control(c: char) -> bool {
    matches!(
        c,
        '\u{061C}' | '\u{200E}' | '\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}'
    )
}

impl fmt::Display for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(&self.0)
    }
}

impl From<&str> for RunId {
    fn from(id: &str) -> Self {
        RunId(id.to_owned())
    }
}

impl From<String> for RunId {
    fn from(id: String) -> Self {
        RunId(id)
    }
}

/// Where a run is in its life. See `docs/runs.md` for the moves between states.
///
/// JSON: the name it is stored under, [`RunState::as_str`]: `"RUNNING"`,
/// `"WAITING_FOR_APPROVAL"`, `"WAITING_FOR_ANSWER"`, `"WAITING_FOR_EVENT"`,
/// `"WAITING_FOR_TIMER"`, `"WAITING_FOR_CHILD"`, `"SUCCEEDED"`, `"FAILED"` or `"CANCELLED"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum RunState {
    /// Being executed, or its executor died and it waits to be resumed.
    Running,
    /// Paused until an operator decides a tool call; resumed with `ResumeRun`.
    WaitingForApproval,
    /// Paused until a person answers its question (`ask_person`). See `docs/waits.md`.
    WaitingForAnswer,
    /// Paused until an event of a name is delivered to it (`wait_for_event`).
    WaitingForEvent,
    /// Paused until a time (`sleep_until`, or a tool that asked to be called again later).
    WaitingForTimer,
    /// Paused until the child run it delegated a task to finishes.
    WaitingForChild,
    /// Finished with a final answer.
    Succeeded,
    /// Finished with an error (the model failed, or the step limit was reached).
    Failed,
    /// Cancelled by an operator.
    Cancelled,
}

impl RunState {
    /// Every state, in the order of a run's life.
    pub const ALL: [RunState; 9] = [
        RunState::Running,
        RunState::WaitingForApproval,
        RunState::WaitingForAnswer,
        RunState::WaitingForEvent,
        RunState::WaitingForTimer,
        RunState::WaitingForChild,
        RunState::Succeeded,
        RunState::Failed,
        RunState::Cancelled,
    ];

    /// The name stored in the database and shown to people.
    pub fn as_str(self) -> &'static str {
        match self {
            RunState::Running => "RUNNING",
            RunState::WaitingForApproval => "WAITING_FOR_APPROVAL",
            RunState::WaitingForAnswer => "WAITING_FOR_ANSWER",
            RunState::WaitingForEvent => "WAITING_FOR_EVENT",
            RunState::WaitingForTimer => "WAITING_FOR_TIMER",
            RunState::WaitingForChild => "WAITING_FOR_CHILD",
            RunState::Succeeded => "SUCCEEDED",
            RunState::Failed => "FAILED",
            RunState::Cancelled => "CANCELLED",
        }
    }

    /// True for the states of a paused run, which holds no lease: waiting for an approval, an
    /// answer, an event, a timer or a child run.
    pub fn is_waiting(self) -> bool {
        self.waits_for().is_some() || self == RunState::WaitingForApproval
    }

    /// What a run in this state waits for, other than an approval.
    pub fn waits_for(self) -> Option<WaitKind> {
        match self {
            RunState::WaitingForAnswer => Some(WaitKind::Answer),
            RunState::WaitingForEvent => Some(WaitKind::Event),
            RunState::WaitingForTimer => Some(WaitKind::Timer),
            RunState::WaitingForChild => Some(WaitKind::Child),
            _ => None,
        }
    }

    /// True for the states a run never leaves.
    pub fn is_finished(self) -> bool {
        matches!(
            self,
            RunState::Succeeded | RunState::Failed | RunState::Cancelled
        )
    }
}

impl fmt::Display for RunState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

impl FromStr for RunState {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "RUNNING" => RunState::Running,
            "WAITING_FOR_APPROVAL" => RunState::WaitingForApproval,
            "WAITING_FOR_ANSWER" => RunState::WaitingForAnswer,
            "WAITING_FOR_EVENT" => RunState::WaitingForEvent,
            "WAITING_FOR_TIMER" => RunState::WaitingForTimer,
            "WAITING_FOR_CHILD" => RunState::WaitingForChild,
            "SUCCEEDED" => RunState::Succeeded,
            "FAILED" => RunState::Failed,
            "CANCELLED" => RunState::Cancelled,
            other => return Err(format!("unknown run state {other:?}")),
        })
    }
}

/// A run as stored.
///
/// JSON (times in milliseconds since the Unix epoch; `output` and `error` are `null` when
/// absent):
///
/// ```json
/// {
///   "id": "order-17",
///   "agent": "support",
///   "input": {"customer": "ada"},
///   "state": "SUCCEEDED",
///   "output": "done",
///   "error": null,
///   "created_at": 1700000000000,
///   "updated_at": 1700000000250
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Run {
    /// Its id.
    pub id: RunId,
    /// The name of the agent that executes it.
    pub agent: String,
    /// The input it was started with.
    pub input: Value,
    /// Its state.
    pub state: RunState,
    /// The final answer, once succeeded.
    pub output: Option<String>,
    /// Why it failed or was cancelled.
    pub error: Option<String>,
    /// When it was started, by `Config::clock`.
    #[serde(with = "millis")]
    pub created_at: SystemTime,
    /// When it last moved, by `Config::clock`.
    #[serde(with = "millis")]
    pub updated_at: SystemTime,
}

/// The kinds of event in the log. `docs/events.md` describes each one, when it is written, and its payload.
///
/// JSON: the name stored in the log, [`EventKind::as_str`], such as `"run.started"` or
/// `"step.tool_finished"`; any other string is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EventKind {
    /// `run.started`
    RunStarted,
    /// `run.forked`: the run is a fork of another's history before a step; the copies follow.
    RunForked,
    /// `step.model_started`: a model call is reserved, before it is dispatched.
    ModelStarted,
    /// `step.model_finished`
    ModelFinished,
    /// `step.model_attempt_failed`: an attempt of a model call failed, and is tried again.
    ModelAttemptFailed,
    /// `policy.decided`
    PolicyDecided,
    /// `run.waiting`
    RunWaiting,
    /// `approval.recorded`
    ApprovalRecorded,
    /// `run.resumed`
    RunResumed,
    /// `step.tool_started`: written before the tool is called.
    ToolStarted,
    /// `step.tool_finished`
    ToolFinished,
    /// `step.interrupted`
    StepInterrupted,
    /// `step.reconciled`
    StepReconciled,
    /// `step.tool_timed_out`: a tool call ran past its timeout (or its heartbeats stopped)
    /// and did not return within the grace after its cancellation: it is reconciled like an
    /// interrupted call.
    ToolTimedOut,
    /// `lease.taken_over`: a resume took over a lease another owner (or this one) let expire.
    LeaseTakenOver,
    /// `run.released`: a draining supervisor released the lease at a step boundary, with
    /// nothing in flight.
    RunReleased,
    /// `run.handed_over`: another owner took up a released run, with no wait and nothing to
    /// reconcile.
    RunHandedOver,
    /// `event.received`: an event delivered to the run, taken by its wait or kept for one.
    EventReceived,
    /// `wait.woken`: what a waiting run waited for came (an answer, an event, its child's
    /// end); the run goes on at its resume.
    WaitWoken,
    /// `run.finished`
    RunFinished,
}

impl EventKind {
    /// Every kind, in the order of `docs/events.md`.
    pub const ALL: [EventKind; 20] = [
        EventKind::RunStarted,
        EventKind::RunForked,
        EventKind::ModelStarted,
        EventKind::ModelAttemptFailed,
        EventKind::ModelFinished,
        EventKind::PolicyDecided,
        EventKind::RunWaiting,
        EventKind::ApprovalRecorded,
        EventKind::RunResumed,
        EventKind::ToolStarted,
        EventKind::ToolFinished,
        EventKind::StepInterrupted,
        EventKind::ToolTimedOut,
        EventKind::StepReconciled,
        EventKind::LeaseTakenOver,
        EventKind::RunReleased,
        EventKind::RunHandedOver,
        EventKind::EventReceived,
        EventKind::WaitWoken,
        EventKind::RunFinished,
    ];

    /// The name stored in the log.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::RunStarted => "run.started",
            EventKind::RunForked => "run.forked",
            EventKind::ModelStarted => "step.model_started",
            EventKind::ModelFinished => "step.model_finished",
            EventKind::ModelAttemptFailed => "step.model_attempt_failed",
            EventKind::PolicyDecided => "policy.decided",
            EventKind::RunWaiting => "run.waiting",
            EventKind::ApprovalRecorded => "approval.recorded",
            EventKind::RunResumed => "run.resumed",
            EventKind::ToolStarted => "step.tool_started",
            EventKind::ToolFinished => "step.tool_finished",
            EventKind::StepInterrupted => "step.interrupted",
            EventKind::StepReconciled => "step.reconciled",
            EventKind::ToolTimedOut => "step.tool_timed_out",
            EventKind::LeaseTakenOver => "lease.taken_over",
            EventKind::RunReleased => "run.released",
            EventKind::RunHandedOver => "run.handed_over",
            EventKind::EventReceived => "event.received",
            EventKind::WaitWoken => "wait.woken",
            EventKind::RunFinished => "run.finished",
        }
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

impl FromStr for EventKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        EventKind::ALL
            .into_iter()
            .find(|kind| kind.as_str() == s)
            .ok_or_else(|| format!("unknown event kind {s:?}"))
    }
}

/// One entry of a run's event log.
///
/// JSON (`at` in milliseconds since the Unix epoch; `step` is `null` for a run-level event):
///
/// ```json
/// {
///   "run_id": "order-17",
///   "seq": 3,
///   "kind": "step.model_finished",
///   "at": 1700000000100,
///   "step": 1,
///   "payload": {"text": "hi", "tool_calls": []}
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// The run it belongs to.
    pub run_id: RunId,
    /// Its place in the run's log: 1, 2, 3, ... without gaps.
    pub seq: u64,
    /// What happened.
    pub kind: EventKind,
    /// When, by `Config::clock`.
    #[serde(with = "millis")]
    pub at: SystemTime,
    /// The step it concerns, if any.
    pub step: Option<u32>,
    /// The details; `docs/events.md` lists the fields of each kind.
    pub payload: Value,
}

/// A tool call the model asked for.
///
/// JSON: `{"id": "c1", "name": "weather", "args": {"city": "Oslo"}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call's id. agentrt keeps ids unique within a run: an empty or repeated id is
    /// replaced by `call-STEP` (`call-STEP-2`, `-3`, ... if the model itself used that one).
    pub id: String,
    /// The tool's name.
    pub name: String,
    /// The arguments: must be a JSON object, or the model is told the call was rejected.
    pub args: Value,
}

impl ToolCall {
    /// A call of tool `name` with `args`.
    pub fn new(id: impl Into<String>, name: impl Into<String>, args: Value) -> Self {
        ToolCall {
            id: id.into(),
            name: name.into(),
            args,
        }
    }
}

/// What the model answered: text, tool calls, or both. No tool calls means a final answer.
///
/// JSON (this is also how a response is stored in the log): `text`, `usage` and `model` are
/// left out when absent, and `tool_calls` may be left out when empty on input:
///
/// ```json
/// {"text": "Let me look.", "tool_calls": [{"id": "c1", "name": "weather", "args": {}}],
///  "usage": {"input_tokens": 412, "output_tokens": 18}, "model": "gpt-4o-mini-2024-07-18"}
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelResponse {
    /// The text of the answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// The tools to call, in order.
    #[serde(default)]
    pub tool_calls: Vec<ToolCall>,
    /// The tokens the call used, as the server reported them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// The model that answered, as the server named it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

/// Tokens a model call used, as the server reported them; summed for a run by
/// `Store::usage`.
///
/// JSON: `{"input_tokens": 412, "output_tokens": 18}`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Usage {
    /// Tokens of the request (the prompt), cached ones included.
    #[serde(default)]
    pub input_tokens: u64,
    /// Tokens of the answer.
    #[serde(default)]
    pub output_tokens: u64,
}

impl Usage {
    /// `input_tokens` of the request and `output_tokens` of the answer.
    pub fn new(input_tokens: u64, output_tokens: u64) -> Self {
        Usage {
            input_tokens,
            output_tokens,
        }
    }
}

impl std::ops::AddAssign for Usage {
    fn add_assign(&mut self, other: Usage) {
        self.input_tokens += other.input_tokens;
        self.output_tokens += other.output_tokens;
    }
}

/// What a run's model calls used, summed over its log (`Store::usage`). A fork's copies of
/// its origin's events are not counted: those calls were the origin's.
///
/// JSON: `{"input_tokens": 1200, "output_tokens": 90, "answers": 3, "attempts": 4,
/// "models": ["gpt-4o-mini-2024-07-18"]}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct RunUsage {
    /// The tokens of every answer recorded, as the servers reported them.
    #[serde(flatten)]
    pub tokens: Usage,
    /// The answers recorded (`step.model_finished` without an error).
    pub answers: u32,
    /// The attempts dispatched (`step.model_started`): more than the answers when an attempt
    /// failed, timed out, or was cut off by a crash and dispatched again. A cut-off attempt
    /// may still have been paid for, though its usage was never reported.
    pub attempts: u32,
    /// The models that answered, as the servers named them, in the order first seen.
    pub models: Vec<String>,
}

/// A tool as a model is told of it: its name, what it does, and the JSON Schema of its
/// arguments (see `Tool::description` and `Tool::parameters`).
///
/// JSON: `{"name": "weather", "description": "The weather in a city.", "parameters":
/// {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ToolSpec {
    /// The name the model calls it by.
    pub name: String,
    /// What it does; may be empty.
    pub description: String,
    /// The JSON Schema of its arguments.
    pub parameters: Value,
}

impl ToolSpec {
    /// The spec of tool `name`.
    pub fn new(name: impl Into<String>, description: impl Into<String>, parameters: Value) -> Self {
        ToolSpec {
            name: name.into(),
            description: description.into(),
            parameters,
        }
    }
}

impl ModelResponse {
    /// A final answer.
    pub fn answer(text: impl Into<String>) -> Self {
        ModelResponse {
            text: Some(text.into()),
            ..ModelResponse::default()
        }
    }

    /// A response that asks for tool calls.
    pub fn calls(tool_calls: Vec<ToolCall>) -> Self {
        ModelResponse {
            tool_calls,
            ..ModelResponse::default()
        }
    }
}

/// The outcome of a tool call as the model sees it.
///
/// JSON (as stored in the log): `{"ok": OUTPUT}` or `{"error": "why"}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolResult {
    /// The tool's output.
    Ok(Value),
    /// Why there is no output: the tool failed, or the call was denied or rejected.
    Error(String),
}

/// One entry of the conversation given to the model.
///
/// JSON: tagged by `role`: `"system"` and `"user"` with their `text`, `"assistant"` with the
/// fields of a [`ModelResponse`], or `"tool"`:
///
/// ```json
/// {"role": "system", "text": "You answer customers of Example Corp."}
/// {"role": "user", "text": "Where is my order?"}
/// {"role": "assistant", "text": "Let me look.", "tool_calls": []}
/// {"role": "tool", "call_id": "c1", "name": "weather", "result": {"ok": {"sky": "clear"}}}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "snake_case")]
#[non_exhaustive]
pub enum ChatMessage {
    /// The agent's instructions (the system prompt).
    System {
        /// Their text.
        text: String,
    },
    /// A turn of the user: the run's input, as the agent maps it.
    User {
        /// Its text.
        text: String,
    },
    /// An earlier response of the model.
    Assistant(ModelResponse),
    /// The result of one tool call.
    Tool {
        /// The call's id.
        call_id: String,
        /// The tool's name.
        name: String,
        /// What came of it.
        result: ToolResult,
    },
}

/// Why a tool call waits for a person.
///
/// JSON: `"policy"` or `"reconcile"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalReason {
    /// The policy requires an approval for this call.
    Policy,
    /// An attempt of this call was interrupted, and whether it took effect is unknown: a person
    /// decides whether to run it again.
    Reconcile,
}

impl ApprovalReason {
    /// The name stored in the log and shown to people: `policy` or `reconcile`.
    pub fn as_str(self) -> &'static str {
        match self {
            ApprovalReason::Policy => "policy",
            ApprovalReason::Reconcile => "reconcile",
        }
    }
}

/// A tool call waiting for an approval.
///
/// JSON:
///
/// ```json
/// {"step": 2, "call_id": "pay-1", "tool": "pay", "args": {"cents": 100}, "reason": "policy"}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PendingCall {
    /// The step of the call.
    pub step: u32,
    /// The id to approve or deny.
    pub call_id: String,
    /// The tool.
    pub tool: String,
    /// Its arguments.
    pub args: Value,
    /// Why it waits.
    pub reason: ApprovalReason,
}

/// How a call to `StartRun` or `ResumeRun` ended.
///
/// JSON: tagged by `status` (`"succeeded"`, `"failed"`, `"waiting_for_approval"`,
/// `"waiting"` or `"cancelled"`), beside the variant's field:
///
/// ```json
/// {"status": "succeeded", "output": "done"}
/// {"status": "failed", "error": "the step limit was reached"}
/// {"status": "waiting_for_approval", "pending": {"step": 2, "call_id": "pay-1", "tool": "pay", "args": {}, "reason": "policy"}}
/// {"status": "waiting", "wait": {"run_id": "order-17", "step": 4, "call_id": "c2", "kind": "timer", "key": "recheck", "detail": {"reason": "recheck"}, "since": 1700000000000, "due_at": 1700003600000, "woken_at": null}}
/// {"status": "cancelled", "reason": "duplicate order"}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Outcome {
    /// The run finished with this final answer.
    Succeeded {
        /// The model's final text.
        output: String,
    },
    /// The run finished with an error.
    Failed {
        /// What went wrong.
        error: String,
    },
    /// The run is paused until this call is approved or denied.
    WaitingForApproval {
        /// The call that waits.
        pending: PendingCall,
    },
    /// The run is paused until what it waits for comes: an answer, an event, a time, or its
    /// child run's end.
    Waiting {
        /// What it waits for.
        wait: Wait,
    },
    /// An operator cancelled the run.
    Cancelled {
        /// The operator's reason.
        reason: String,
    },
}

/// What a waiting run waits for, other than an approval. See `docs/waits.md`.
///
/// JSON: `"answer"`, `"event"`, `"timer"` or `"child"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WaitKind {
    /// A person's answer to a question (`ask_person`).
    Answer,
    /// An event delivered by name (`wait_for_event`).
    Event,
    /// A time (`sleep_until`, or a tool that asked to be called again later).
    Timer,
    /// The end of a child run.
    Child,
}

impl WaitKind {
    /// The name stored and shown: `answer`, `event`, `timer` or `child`.
    pub fn as_str(self) -> &'static str {
        match self {
            WaitKind::Answer => "answer",
            WaitKind::Event => "event",
            WaitKind::Timer => "timer",
            WaitKind::Child => "child",
        }
    }

    /// The run state of a run that waits for this.
    pub fn state(self) -> RunState {
        match self {
            WaitKind::Answer => RunState::WaitingForAnswer,
            WaitKind::Event => RunState::WaitingForEvent,
            WaitKind::Timer => RunState::WaitingForTimer,
            WaitKind::Child => RunState::WaitingForChild,
        }
    }

    pub(crate) fn parse(s: &str) -> crate::error::Result<Self> {
        match s {
            "answer" => Ok(WaitKind::Answer),
            "event" => Ok(WaitKind::Event),
            "timer" => Ok(WaitKind::Timer),
            "child" => Ok(WaitKind::Child),
            other => Err(Error::Corrupt(format!("unknown wait kind {other:?}"))),
        }
    }
}

impl fmt::Display for WaitKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

/// A run's wait, as stored: what its waiting tool call waits for, and since when.
///
/// `key` is the question's call id (an answer), the event's name (an event), the timer's
/// reason (a timer), or the child run's id (a child). `detail` holds what a person or an
/// operator is shown: `{"question": ..., "schema": ...}` for an answer, `{"name": ...}` for an
/// event, `{"reason": ..., "retry": bool}` for a timer, `{"agent": ..., "task": ...}` for a child.
///
/// JSON: `{"run_id": "r1", "step": 4, "call_id": "c2", "kind": "answer", "key": "c2",
/// "detail": {"question": "Which account?"}, "since": 1700000000000, "due_at": null,
/// "woken_at": null}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Wait {
    /// The run that waits.
    pub run_id: RunId,
    /// Its waiting step.
    pub step: u32,
    /// The id of the tool call that waits.
    pub call_id: String,
    /// What it waits for.
    pub kind: WaitKind,
    /// The call id, the event's name, the timer's reason or the child's id.
    pub key: String,
    /// What the wait shows.
    pub detail: Value,
    /// Since when it waits, by `Config::clock`.
    #[serde(with = "millis")]
    pub since: SystemTime,
    /// A timer's due time, by `Config::clock`.
    #[serde(default, with = "opt_millis")]
    pub due_at: Option<SystemTime>,
    /// When what it waited for came (an answer, an event, its child's end): the run goes on
    /// at its resume, which a supervisor makes at once. `None` while nothing came.
    #[serde(default, with = "opt_millis")]
    pub woken_at: Option<SystemTime>,
}

/// An event delivered to a run ([`Store::deliver_event`](crate::Store::deliver_event)).
///
/// JSON: `{"run_id": "order-17", "name": "payment", "event_id": "evt_42", "payload": {...}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Delivery {
    /// The run it is for.
    pub run_id: RunId,
    /// The event's name, which a wait names.
    pub name: String,
    /// The sender's id for it: a second delivery with the same id is kept once.
    pub event_id: String,
    /// What it carries; becomes the waiting call's result.
    #[serde(default)]
    pub payload: Value,
}

/// What came of a delivery.
///
/// JSON: `"woke"`, `"kept"` or `"duplicate"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Delivered {
    /// The run waited for it: it goes on.
    Woke,
    /// The run does not wait for it yet: it is kept for the run's first wait on its name.
    Kept,
    /// An event of the same id was delivered before: nothing was written.
    Duplicate,
}

/// A person's answer to a run's question.
///
/// JSON: `{"run_id": "r1", "call_id": "c2", "answer": {"account": "savings"}, "by": "alice"}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Answer {
    /// The run.
    pub run_id: RunId,
    /// The question's call id ([`Wait::call_id`]).
    pub call_id: String,
    /// The answer: checked against the question's schema, then the call's result.
    pub answer: Value,
    /// Who answered.
    pub by: String,
}

/// The reply to `StartRun` and `ResumeRun`: the run, and how this call ended.
///
/// Three names, three things: [`RunState`] is where the run is, as stored, for anyone who
/// reads it; [`Outcome`] is how one call that executed it ended (it finished, it paused for an
/// approval, it was cancelled); `RunReply` is the message that carries an outcome back with the
/// run's id.
///
/// JSON: `{"run_id": "order-17", "outcome": {"status": "succeeded", "output": "done"}}`, the
/// outcome as [`Outcome`] shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunReply {
    /// The run.
    pub run_id: RunId,
    /// How the call ended.
    pub outcome: Outcome,
}

/// An operator's decision on a waiting tool call.
///
/// JSON (`note` is `null` when absent, and may be left out on input):
///
/// ```json
/// {"run_id": "order-17", "call_id": "pay-1", "approved": true, "by": "alice", "note": "checked"}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Approval {
    /// The run.
    pub run_id: RunId,
    /// The call, as named in [`PendingCall::call_id`].
    pub call_id: String,
    /// Approve (true) or deny (false).
    pub approved: bool,
    /// Who decided.
    pub by: String,
    /// Why, optionally.
    pub note: Option<String>,
}

impl Approval {
    /// `by` approves the call.
    pub fn approve(
        run_id: impl Into<RunId>,
        call_id: impl Into<String>,
        by: impl Into<String>,
    ) -> Self {
        Approval {
            run_id: run_id.into(),
            call_id: call_id.into(),
            approved: true,
            by: by.into(),
            note: None,
        }
    }

    /// `by` denies the call.
    pub fn deny(
        run_id: impl Into<RunId>,
        call_id: impl Into<String>,
        by: impl Into<String>,
    ) -> Self {
        Approval {
            approved: false,
            ..Approval::approve(run_id, call_id, by)
        }
    }

    /// Adds a note saying why.
    pub fn note(mut self, note: impl Into<String>) -> Self {
        self.note = Some(note.into());
        self
    }
}

/// The fencing token of a run's lease: incremented by every acquisition of the lease (a
/// start, a resume, a takeover), so a later owner's token is always higher than an earlier
/// one's. JSON: the number.
///
/// A lease cannot stop a process that stalls between its last check and its action (a long
/// pause, a stopped VM): by the time it acts, another process may have taken the run over and
/// run the call again. A system that a tool writes to closes that gap if it remembers, for each
/// idempotency key, the highest token it has seen, and refuses a request carrying a lower
/// one; the reconcile hook's query counts as seeing its token, so an owner that asked "did it
/// take effect?" fences off every owner before it. The testkit's `FencedResource` (feature
/// `testkit`) is such a system, for tests.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct FencingToken(u64);

impl FencingToken {
    /// The token numbered `value`.
    pub const fn new(value: u64) -> Self {
        FencingToken(value)
    }

    /// Its number.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A run's lease as stored: who executes it, until when, and the fencing token its
/// acquisition took.
///
/// JSON (`expires_at` in wall-clock milliseconds since the Unix epoch):
///
/// ```json
/// {"owner": "worker-1/3f2a", "expires_at": 1700000030000, "fencing_token": 2}
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    /// The owner: `Config::lease_owner`, `/`, and the holding supervisor's random suffix.
    pub owner: String,
    /// When it expires unless renewed, by the holder's wall clock. A time in the past means a
    /// stale lease: its holder died or stalled, and a resume takes the run over.
    #[serde(with = "millis")]
    pub expires_at: SystemTime,
    /// The fencing token of the lease's acquisition: a takeover's is higher than that of the
    /// lease it took over. 0 in JSON that has none (written before tokens existed).
    #[serde(default)]
    pub fencing_token: FencingToken,
}

/// Why a supervisor lost the lease of a run it was executing.
///
/// JSON: tagged by `kind`, with the new owner as `by` for a takeover:
///
/// ```json
/// {"kind": "taken_by", "by": "worker-2/9c1e"}
/// {"kind": "released_or_cancelled"}
/// {"kind": "expired"}
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "by", rename_all = "snake_case")]
pub enum LeaseLostReason {
    /// Another owner took the run over (this lease had expired).
    TakenBy(String),
    /// The run was released or cancelled by someone else (an operator's cancel).
    ReleasedOrCancelled,
    /// No renewal succeeded before the lease expired.
    Expired,
}

impl fmt::Display for LeaseLostReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LeaseLostReason::TakenBy(owner) => write!(f, "taken over by {owner}"),
            LeaseLostReason::ReleasedOrCancelled => f.write_str("released or cancelled"),
            LeaseLostReason::Expired => f.write_str("expired before it could be renewed"),
        }
    }
}

impl Serialize for EventKind {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for EventKind {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        // Borrowing would refuse strings with escapes; an owned string takes any.
        let name = String::deserialize(deserializer)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

/// `SystemTime` as integer milliseconds since the Unix epoch, negative before it: the
/// precision agentrt stores times at, so a stored time round-trips exactly.
pub(crate) mod millis {
    use std::{
        fmt,
        time::{Duration, SystemTime},
    };

    use serde::{Deserializer, Serializer, de};

    pub(crate) fn serialize<S: Serializer>(
        time: &SystemTime,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        let millis = match time.duration_since(SystemTime::UNIX_EPOCH) {
            Ok(after) => i64::try_from(after.as_millis()),
            Err(before) => i64::try_from(before.duration().as_millis()).map(|m| -m),
        }
        .map_err(|_| {
            serde::ser::Error::custom("time too far from the Unix epoch for an i64 of ms")
        })?;
        serializer.serialize_i64(millis)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<SystemTime, D::Error> {
        deserializer.deserialize_i64(Millis)
    }

    struct Millis;

    impl de::Visitor<'_> for Millis {
        type Value = SystemTime;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a time as integer milliseconds since the Unix epoch")
        }

        fn visit_i64<E: de::Error>(self, millis: i64) -> Result<SystemTime, E> {
            let offset = Duration::from_millis(millis.unsigned_abs());
            if millis >= 0 {
                SystemTime::UNIX_EPOCH.checked_add(offset)
            } else {
                SystemTime::UNIX_EPOCH.checked_sub(offset)
            }
            .ok_or_else(|| E::custom(format!("time {millis} ms is out of this platform's range")))
        }

        fn visit_u64<E: de::Error>(self, millis: u64) -> Result<SystemTime, E> {
            let millis = i64::try_from(millis)
                .map_err(|_| E::custom(format!("time {millis} ms is out of range")))?;
            self.visit_i64(millis)
        }
    }
}

/// An optional time as [`millis`] writes one, or `null`.
pub(crate) mod opt_millis {
    use std::time::SystemTime;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(crate) fn serialize<S: Serializer>(
        time: &Option<SystemTime>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        match time {
            Some(time) => super::millis::serialize(time, serializer),
            None => serializer.serialize_none(),
        }
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<SystemTime>, D::Error> {
        #[derive(Deserialize)]
        struct Wrapped(#[serde(with = "super::millis")] SystemTime);
        Ok(Option::<Wrapped>::deserialize(deserializer)?.map(|Wrapped(time)| time))
    }
}

/// What a step is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StepKind {
    Model,
    Tool,
}

impl StepKind {
    /// As stored and as `step.interrupted` names it.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            StepKind::Model => "model",
            StepKind::Tool => "tool",
        }
    }

    pub(crate) fn parse(s: &str) -> crate::error::Result<Self> {
        match s {
            "model" => Ok(StepKind::Model),
            "tool" => Ok(StepKind::Tool),
            other => Err(crate::error::Error::Corrupt(format!(
                "unknown step kind {other:?}"
            ))),
        }
    }
}

/// Where a step is: `pending` (a tool call not decided yet), `waiting` (for an approval),
/// `in_flight` (started, not finished), `interrupted` (its executor died), `finished`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StepState {
    Pending,
    Waiting,
    InFlight,
    Interrupted,
    Finished,
}

impl StepState {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            StepState::Pending => "pending",
            StepState::Waiting => "waiting",
            StepState::InFlight => "in_flight",
            StepState::Interrupted => "interrupted",
            StepState::Finished => "finished",
        }
    }

    pub(crate) fn parse(s: &str) -> crate::error::Result<Self> {
        Ok(match s {
            "pending" => StepState::Pending,
            "waiting" => StepState::Waiting,
            "in_flight" => StepState::InFlight,
            "interrupted" => StepState::Interrupted,
            "finished" => StepState::Finished,
            other => {
                return Err(crate::error::Error::Corrupt(format!(
                    "unknown step state {other:?}"
                )));
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_run_id_is_refused_empty_as_a_path_step_too_long_or_holding_controls() {
        let longest = "x".repeat(RunId::MAX_LEN);
        for id in ["order-17", "ünïcode", "a b", "..a", "a.b", &longest] {
            assert!(RunId::from(id).check().is_ok(), "{id:?}");
        }
        assert!(RunId::random().check().is_ok());
        let too_long = "x".repeat(RunId::MAX_LEN + 1);
        for id in [
            "",
            ".",
            "..",
            "a\nb",
            "a\u{7f}",
            "\u{0}",
            "a\u{202E}b",
            "\u{2066}x",
            "x\u{061C}",
            "\u{200F}",
            &too_long,
        ] {
            let err = RunId::from(id).check().unwrap_err();
            assert!(matches!(err, Error::InvalidInput(_)), "{id:?}");
            // The message shows the id escaped: it reads as what it is.
            let text = err.to_string();
            assert!(
                !text.chars().any(|c| c.is_control() || is_bidi_control(c)),
                "{text:?}"
            );
            assert!(text.contains("a run id"), "{text}");
        }
    }
}
