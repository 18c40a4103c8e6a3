//! What an agent is made of: a [`Model`], [`Tool`]s and a [`Policy`].

use std::{
    collections::BTreeMap,
    fmt,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, SystemTime},
};

use async_trait::async_trait;
use serde_json::Value;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::model_policy::ModelPolicy;
use crate::types::{ChatMessage, FencingToken, ModelResponse, RunId, ToolCall, ToolSpec};

/// The default for [`Agent::max_steps`].
pub const DEFAULT_MAX_STEPS: u32 = 64;

/// The default for [`Agent::tool_timeout`], 10 minutes: the longest a tool call may take
/// unless its tool says otherwise ([`Tool::timeout`]). Long enough for a slow job, short enough
/// that a call stuck on a connection nobody answers gives its run back.
pub const DEFAULT_TOOL_TIMEOUT: Duration = Duration::from_secs(600);

/// The default for [`Agent::tool_grace`], 5 s: how long a call whose cancellation signal fired
/// for its timeout has to return before it is recorded as timed out.
pub const DEFAULT_TOOL_GRACE: Duration = Duration::from_secs(5);

/// The default for [`Agent::progress_every`], 5 s: a call's heartbeats are kept at most once
/// per period. A crash loses at most that much of what the heartbeats told.
pub const DEFAULT_PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// The largest heartbeat value kept, serialized as JSON: 16 KiB. A larger one is refused
/// (see [`ToolContext::heartbeat`]).
pub const MAX_PROGRESS_BYTES: usize = 16 * 1024;

/// What the model is asked.
///
/// Built by the run loop for each attempt of a model call; a [`Model`] reads it and answers.
#[derive(Debug)]
#[non_exhaustive]
pub struct ModelRequest<'a> {
    /// The run.
    pub run_id: &'a RunId,
    /// The step number of this model call.
    pub step: u32,
    /// 1 for the first attempt of this call, then 2, 3, ...: an attempt after a retryable
    /// error, or the call dispatched again after its executor died.
    pub attempt: u32,
    /// The run's input, as it was started.
    pub input: &'a Value,
    /// The whole conversation, in order: the agent's instructions as a
    /// [`ChatMessage::System`] (when it has some), the run's input as [`ChatMessage::User`] turns
    /// (see [`Agent::map_input`]), then every earlier response and the result of each of its
    /// tool calls.
    pub messages: &'a [ChatMessage],
    /// The tools the model may call, with their descriptions and argument schemas, in name
    /// order.
    pub tools: &'a [ToolSpec],
}

impl<'a> ModelRequest<'a> {
    /// A request for the first attempt of model step 1 of `run_id`: how a model adapter's own
    /// tests call it without a supervisor. [`at`](Self::at) sets the step and attempt.
    pub fn new(
        run_id: &'a RunId,
        input: &'a Value,
        messages: &'a [ChatMessage],
        tools: &'a [ToolSpec],
    ) -> Self {
        ModelRequest {
            run_id,
            step: 1,
            attempt: 1,
            input,
            messages,
            tools,
        }
    }

    /// The same request, as attempt `attempt` of step `step`.
    pub fn at(mut self, step: u32, attempt: u32) -> Self {
        self.step = step;
        self.attempt = attempt;
        self
    }
}

/// Why a model gave no answer: [fatal](ModelError::fatal) (the run fails at once), or
/// [retryable](ModelError::retryable) (the agent's [`ModelPolicy`] tries again, and fails the
/// run only when it gives up).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ModelError {
    message: String,
    retryable: bool,
    retry_after: Option<Duration>,
}

impl ModelError {
    /// A fatal error saying `message`: the run fails without another attempt.
    pub fn new(message: impl Into<String>) -> Self {
        ModelError::fatal(message)
    }

    /// A fatal error saying `message`: a request the server refused as invalid or
    /// unauthorized (a 400, a 401), a response that cannot be read as an answer.
    pub fn fatal(message: impl Into<String>) -> Self {
        ModelError {
            message: message.into(),
            retryable: false,
            retry_after: None,
        }
    }

    /// A transient error saying `message`: a rate limit, a server error (5xx), a timeout, a
    /// dropped connection. Another attempt may succeed.
    pub fn retryable(message: impl Into<String>) -> Self {
        ModelError {
            retryable: true,
            ..ModelError::fatal(message)
        }
    }

    /// The server asked not to be called again before `after` (its `Retry-After`): the next
    /// attempt waits at least that long.
    pub fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// What went wrong.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether another attempt may succeed.
    pub fn is_retryable(&self) -> bool {
        self.retryable
    }

    /// How long the server asked to wait before the next attempt, if it said.
    pub fn retry_after_hint(&self) -> Option<Duration> {
        self.retry_after
    }
}

/// A language model (or anything that answers like one).
///
/// A model call has no external side effect: when its executor dies mid-call, the call is
/// simply dispatched again.
#[async_trait(?Send)]
pub trait Model: Send + Sync + 'static {
    /// Answers with text, tool calls, or both.
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError>;
}

/// A tool call failed. The model sees the message; the run goes on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ToolError(pub String);

impl ToolError {
    /// A tool error saying `message`.
    pub fn new(message: impl Into<String>) -> Self {
        ToolError(message.into())
    }
}

impl From<&str> for ToolError {
    fn from(message: &str) -> Self {
        ToolError(message.to_owned())
    }
}

impl From<String> for ToolError {
    fn from(message: String) -> Self {
        ToolError(message)
    }
}

/// Fires when an execution should stop: an operator cancelled the run, its lease was lost,
/// or (for a tool call's, [`ToolContext::cancellation`]) the call ran past its timeout.
///
/// A tool may watch it to stop early; whatever it returns is still recorded (after its
/// timeout, if it returns within the grace: see [`Agent::tool_grace`]).
#[derive(Debug, Clone, Default)]
pub struct Cancellation(CancellationToken);

impl Cancellation {
    pub(crate) fn new() -> Self {
        Cancellation(CancellationToken::new())
    }

    /// A signal that fires with this one, and that can also be fired alone: one tool call's,
    /// which its timeout fires without cancelling the run.
    pub(crate) fn child(&self) -> Self {
        Cancellation(self.0.child_token())
    }

    pub(crate) fn fire(&self) {
        self.0.cancel();
    }

    /// True once fired.
    pub fn is_cancelled(&self) -> bool {
        self.0.is_cancelled()
    }

    /// Completes when fired.
    pub async fn cancelled(&self) {
        self.0.cancelled().await
    }
}

/// What a tool is told about the call it executes.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ToolContext {
    /// The run.
    pub run_id: RunId,
    /// The step of this call.
    pub step: u32,
    /// The call's id.
    pub call_id: String,
    /// 1 for the first attempt, then 2, 3, ... when an interrupted call is run again.
    pub attempt: u32,
    /// The same for every attempt of this call, and unique across calls: pass it to external
    /// APIs that deduplicate requests.
    pub idempotency_key: String,
    /// The fencing token of the lease this attempt runs under (the reconcile hook's too):
    /// pass it, with the idempotency key, to systems that can refuse a stale owner's request.
    /// `step.tool_started` records it.
    pub fencing_token: FencingToken,
    /// Fires when an operator cancels the run, when the run's lease is lost, and when this call
    /// runs past its timeout ([`Tool::timeout`]) or its heartbeats stop
    /// ([`Tool::heartbeat_timeout`]). A call that returns within [`Agent::tool_grace`] of its
    /// timeout has its outcome recorded; one that does not is dropped where it stands and
    /// recorded as timed out. A tool that hands work to threads or tasks of its own must stop
    /// them when this fires: dropping the call does not.
    pub cancellation: Cancellation,
    /// The progress an earlier attempt of this call reported ([`heartbeat`](Self::heartbeat))
    /// and agentrt kept, as of its last kept heartbeat: where a long job resumes after a crash,
    /// a takeover or a timeout. `None` when no attempt kept any (always for the first). The
    /// reconcile hook is given it too. This attempt's own heartbeats do not change it.
    pub progress: Option<Value>,
    pub(crate) heart: Heart,
    /// A time this call asked to be made again at ([`call_again_at`](Self::call_again_at)).
    pub(crate) again: Arc<std::sync::Mutex<Option<(SystemTime, String)>>>,
}

impl ToolContext {
    /// Tells agentrt the call is alive, and how far it got: `progress`, a small JSON value
    /// (`null` for none), is kept for the call's next attempt ([`progress`](Self::progress))
    /// should this one be cut off. Cheap: call it as often as convenient; agentrt keeps the
    /// latest value at most once per [`Agent::progress_every`], not at every beat.
    ///
    /// A beat resets the call's [`Tool::heartbeat_timeout`]. A value larger than
    /// [`MAX_PROGRESS_BYTES`] serialized is refused (logged once per attempt, as a warning):
    /// the beat still counts as a sign of life, and the value kept before stays. From any
    /// thread; a no-op in the reconcile hook.
    ///
    /// ```
    /// use agentrt::{async_trait, Tool, ToolContext, ToolError};
    /// use serde_json::{json, Value};
    ///
    /// /// Copies rows, resuming after the last batch a cut-off attempt reported.
    /// struct CopyRows;
    ///
    /// #[async_trait(?Send)]
    /// impl Tool for CopyRows {
    ///     fn name(&self) -> &str {
    ///         "copy_rows"
    ///     }
    ///
    ///     fn heartbeat_timeout(&self) -> Option<std::time::Duration> {
    ///         Some(std::time::Duration::from_secs(30))
    ///     }
    ///
    ///     async fn call(&self, ctx: &ToolContext, _: &Value) -> Result<Value, ToolError> {
    ///         let start = ctx.progress.as_ref().and_then(|p| p["done"].as_u64()).unwrap_or(0);
    ///         for batch in start..10 {
    ///             // ... copy batch `batch` (an upsert: doing it twice is harmless) ...
    ///             ctx.heartbeat(json!({ "done": batch + 1 }));
    ///         }
    ///         Ok(json!({ "batches": 10 }))
    ///     }
    /// }
    /// ```
    pub fn heartbeat(&self, progress: Value) {
        self.heart.beat(progress);
    }

    /// Asks to be called again at `at` (by `Config::clock`), with `reason`: "not ready, check
    /// again tomorrow". Return the error it gives. The run then waits for the time (state
    /// `WAITING_FOR_TIMER`, holding no lease and no slot), and the call is made again then as
    /// its next attempt, with the same idempotency key; nothing of this attempt is shown to
    /// the model.
    ///
    /// ```
    /// use std::time::{Duration, SystemTime};
    /// use agentrt::{async_trait, Tool, ToolContext, ToolError};
    /// use serde_json::{json, Value};
    ///
    /// struct ReportReady;
    ///
    /// #[async_trait(?Send)]
    /// impl Tool for ReportReady {
    ///     fn name(&self) -> &str {
    ///         "report_ready"
    ///     }
    ///
    ///     async fn call(&self, ctx: &ToolContext, _: &Value) -> Result<Value, ToolError> {
    ///         let ready = ctx.attempt > 1; // ... ask the report service ...
    ///         if !ready {
    ///             let later = SystemTime::now() + Duration::from_secs(3600);
    ///             return Err(ctx.call_again_at(later, "the report is not ready"));
    ///         }
    ///         Ok(json!({ "ready": true }))
    ///     }
    /// }
    /// ```
    pub fn call_again_at(&self, at: SystemTime, reason: impl Into<String>) -> ToolError {
        let reason = reason.into();
        *self.again.lock().unwrap_or_else(|e| e.into_inner()) = Some((at, reason.clone()));
        ToolError::new(format!("called again later: {reason}"))
    }
}

/// The heartbeats of one attempt: beaten through its [`ToolContext`] (and its clones, on any
/// thread), watched by the run's loop.
#[derive(Debug, Clone)]
pub(crate) struct Heart(Arc<HeartInner>);

#[derive(Debug)]
struct HeartInner {
    beats: watch::Sender<Beat>,
    /// Set once an oversized value was refused: the warning is logged once per attempt.
    warned: AtomicBool,
}

/// The latest heartbeat of an attempt.
#[derive(Debug, Clone, Default)]
pub(crate) struct Beat {
    /// Beats so far, of any size.
    pub(crate) count: u64,
    /// The latest value accepted, with the beat that carried it.
    pub(crate) progress: Option<(u64, Value)>,
}

impl Heart {
    /// A heart, and the loop's watch on it.
    pub(crate) fn new() -> (Self, watch::Receiver<Beat>) {
        let (beats, watch) = watch::channel(Beat::default());
        let inner = HeartInner {
            beats,
            warned: AtomicBool::new(false),
        };
        (Heart(Arc::new(inner)), watch)
    }

    fn beat(&self, progress: Value) {
        let size = match &progress {
            Value::Null => 0,
            value => serde_json::to_vec(value).map_or(usize::MAX, |bytes| bytes.len()),
        };
        let accepted = size <= MAX_PROGRESS_BYTES;
        if !accepted && !self.0.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                size,
                limit = MAX_PROGRESS_BYTES,
                "a tool's heartbeat value is too large to keep: refused (the beat counts, the \
                 value kept before stays); report less progress"
            );
        }
        self.0.beats.send_modify(|beat| {
            beat.count += 1;
            if accepted && !progress.is_null() {
                beat.progress = Some((beat.count, progress));
            }
        });
    }
}

/// What a tool's reconcile hook found out about an interrupted attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum Reconciliation {
    /// The call took effect; this is its output. Nothing runs again.
    Applied(Value),
    /// The call did not take effect: it is run again.
    NotApplied,
    /// It cannot be told: an idempotent tool runs again, any other waits for a person.
    Unknown,
}

/// A tool the model can call: the place where side effects happen.
#[async_trait(?Send)]
pub trait Tool: Send + Sync + 'static {
    /// The name the model calls it by.
    fn name(&self) -> &str;

    /// What it does, for the model: when to call it, and what it returns. Sent with every
    /// model request. Empty by default.
    fn description(&self) -> &str {
        ""
    }

    /// The JSON Schema of its arguments, sent with every model request. A call whose
    /// arguments do not match it is not run: the model is told why, as a failed result. By
    /// default any JSON object. Derive it from the arguments' Rust type with
    /// [`schema_for`](crate::schema_for), or write it by hand.
    fn parameters(&self) -> Value {
        serde_json::json!({ "type": "object" })
    }

    /// True when running the same call twice has the effect of running it once (a read, an
    /// upsert by a key, an API that deduplicates on [`ToolContext::idempotency_key`]). False
    /// by default.
    ///
    /// It is read only after a crash, for a call that was in flight and whose outcome nobody
    /// can tell (no [`reconcile`](Self::reconcile) hook, or the hook answered
    /// [`Reconciliation::Unknown`]): the call of an idempotent tool is run again, with the
    /// same idempotency key; that of any other waits for a person to approve or deny running
    /// it again. A hook's `Applied` or `NotApplied` is followed whatever this says. See
    /// `docs/reconciliation.md`.
    fn idempotent(&self) -> bool {
        false
    }

    /// The longest a call may take; `None`, the default, means the agent's
    /// ([`Agent::tool_timeout`], [`DEFAULT_TOOL_TIMEOUT`] unless set), and so does zero.
    ///
    /// Past it the call's [`ToolContext::cancellation`] fires; a call that has not returned
    /// [`Agent::tool_grace`] later is dropped and recorded as timed out
    /// (`step.tool_timed_out`), and then reconciled as an interrupted call: the
    /// [`reconcile`](Self::reconcile) hook, then [`idempotent`](Self::idempotent), then a
    /// person. See `docs/reconciliation.md`.
    fn timeout(&self) -> Option<Duration> {
        None
    }

    /// The longest a call may go without a [`ToolContext::heartbeat`] (counted from its start
    /// for the first); `None`, the default, means no such limit. A call whose heartbeats stop
    /// times out as one past its [`timeout`](Self::timeout) does, which still applies.
    fn heartbeat_timeout(&self) -> Option<Duration> {
        None
    }

    /// Executes the call. An error is a result the model sees, not a failure of the run.
    async fn call(&self, ctx: &ToolContext, args: &Value) -> Result<Value, ToolError>;

    /// Asked when an attempt of this call was interrupted (its executor died), with the same
    /// idempotency key as the attempt: did it take effect? `None`, the default, means the tool
    /// has no such hook.
    async fn reconcile(&self, ctx: &ToolContext, args: &Value) -> Option<Reconciliation> {
        let _ = (ctx, args);
        None
    }
}

/// What the policy decides about a tool call, before it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Run it.
    Allow,
    /// Do not run it; the model is told the call was denied, with this reason.
    Deny(String),
    /// Pause the run until a person approves or denies the call.
    RequireApproval(String),
}

/// Decides each tool call before it runs. Called again when a waiting run is resumed.
///
/// A policy decides from the call alone, at once and with no side effect: it runs on the
/// run's thread between two commits, and may be asked again for the same call (at a resume,
/// or after a crash before its decision was written). A closure
/// `Fn(&RunId, &ToolCall) -> Decision` is a policy too. See `docs/models.md`, "Writing a
/// policy".
///
/// ```
/// use agentrt::{Decision, Policy, RunId, ToolCall};
///
/// /// Calls that delete something wait for a person.
/// struct CarefulWithDeletes;
///
/// impl Policy for CarefulWithDeletes {
///     fn decide(&self, _run: &RunId, call: &ToolCall) -> Decision {
///         if call.name.starts_with("delete_") {
///             Decision::RequireApproval(format!("{} deletes data", call.name))
///         } else {
///             Decision::Allow
///         }
///     }
/// }
///
/// let call = ToolCall::new("c1", "delete_account", serde_json::json!({"id": 7}));
/// let decision = CarefulWithDeletes.decide(&RunId::from("r1"), &call);
/// assert!(matches!(decision, Decision::RequireApproval(_)));
/// ```
pub trait Policy: Send + Sync + 'static {
    /// The decision for `call` in run `run_id`: [`Decision::Allow`] runs it,
    /// [`Decision::Deny`] gives the model the reason as the call's failed result, and
    /// [`Decision::RequireApproval`] pauses the run until a person decides.
    fn decide(&self, run_id: &RunId, call: &ToolCall) -> Decision;
}

impl<F> Policy for F
where
    F: Fn(&RunId, &ToolCall) -> Decision + Send + Sync + 'static,
{
    fn decide(&self, run_id: &RunId, call: &ToolCall) -> Decision {
        self(run_id, call)
    }
}

/// Allows every call.
#[derive(Debug, Clone, Copy, Default)]
pub struct AllowAll;

impl Policy for AllowAll {
    fn decide(&self, _: &RunId, _: &ToolCall) -> Decision {
        Decision::Allow
    }
}

/// Requires an approval for the named tools and allows every other.
#[derive(Debug, Clone, Default)]
pub struct RequireApprovalFor(Vec<String>);

impl RequireApprovalFor {
    /// Calls of these tools need an approval.
    pub fn tools<I, S>(names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RequireApprovalFor(names.into_iter().map(Into::into).collect())
    }
}

impl Policy for RequireApprovalFor {
    fn decide(&self, _: &RunId, call: &ToolCall) -> Decision {
        if self.0.contains(&call.name) {
            Decision::RequireApproval(format!("{} requires an approval", call.name))
        } else {
            Decision::Allow
        }
    }
}

/// The JSON Schema of `T`, for [`Tool::parameters`]: derived with `schemars` (derive
/// `schemars::JsonSchema` on the arguments' type beside `serde::Deserialize`), without the
/// `$schema` and `title` keys that model APIs do not need.
///
/// ```
/// use schemars::JsonSchema;
/// use serde::Deserialize;
///
/// /// Refund an order.
/// #[derive(Deserialize, JsonSchema)]
/// struct Refund {
///     /// The order's id.
///     order_id: String,
///     /// How much, in cents.
///     cents: u64,
/// }
///
/// let schema = agentrt::schema_for::<Refund>();
/// assert_eq!(schema["type"], "object");
/// assert_eq!(schema["required"], serde_json::json!(["order_id", "cents"]));
/// ```
pub fn schema_for<T: schemars::JsonSchema>() -> Value {
    let mut schema = serde_json::to_value(schemars::schema_for!(T)).expect("a schema serializes");
    if let Some(object) = schema.as_object_mut() {
        object.remove("$schema");
        object.remove("title");
    }
    schema
}

/// Turns a run's input into the user turns that open its conversation.
pub type InputMapper = dyn Fn(&Value) -> Vec<ChatMessage> + Send + Sync;

/// A tool as an agent holds it: with its description and schema, read once, and the
/// schema's validator.
pub(crate) struct RegisteredTool {
    pub(crate) tool: Arc<dyn Tool>,
    /// What a built-in tool waits for: its calls wait instead of being made.
    pub(crate) wait: Option<crate::builtin::WaitTool>,
    /// Why the schema cannot check arguments, if it cannot: every call of the tool is then
    /// refused with it.
    validator: std::result::Result<jsonschema::Validator, String>,
}

impl RegisteredTool {
    fn new(tool: Arc<dyn Tool>) -> (Self, ToolSpec) {
        let spec = ToolSpec {
            name: tool.name().to_owned(),
            description: tool.description().to_owned(),
            parameters: tool.parameters(),
        };
        let validator = jsonschema::options()
            .should_validate_formats(true)
            .build(&spec.parameters)
            .map_err(|err| {
            tracing::error!(tool = %spec.name, %err, "the tool's argument schema is invalid: every call of it is refused");
            format!("the tool's argument schema is invalid: {err}")
        });
        (
            RegisteredTool {
                tool,
                wait: None,
                validator,
            },
            spec,
        )
    }

    /// Why `args` cannot be passed to the tool, if they cannot.
    pub(crate) fn refuse(&self, args: &Value) -> Option<String> {
        let validator = match &self.validator {
            Ok(validator) => validator,
            Err(why) => return Some(why.clone()),
        };
        let problems: Vec<String> = validator
            .iter_errors(args)
            .take(MAX_SCHEMA_ERRORS)
            .map(|err| {
                let at = err.instance_path().to_string();
                let what = shortened(&err.to_string());
                if at.is_empty() {
                    what
                } else {
                    format!("at {at}: {what}")
                }
            })
            .collect();
        (!problems.is_empty()).then(|| {
            format!(
                "the arguments do not match the tool's schema: {}",
                problems.join("; ")
            )
        })
    }
}

/// The most schema violations one refusal names: enough for a model to mend its call.
const MAX_SCHEMA_ERRORS: usize = 5;

/// The most characters of one violation (which quotes the offending value) a refusal keeps.
const MAX_PROBLEM_CHARS: usize = 200;

/// `text`, cut to [`MAX_PROBLEM_CHARS`] characters with an ellipsis when longer.
pub(crate) fn shortened(text: &str) -> String {
    match text.char_indices().nth(MAX_PROBLEM_CHARS) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_owned(),
    }
}

/// An agent: a model, the tools it may call, the policy that decides each call, and how its
/// model is called.
///
/// Registered on a supervisor by name; a run stores that name, so any process that registered
/// an agent under the same name can resume the run.
///
/// ```
/// use agentrt::{Agent, ModelPolicy, RequireApprovalFor};
/// # use agentrt::testkit::{ScriptedModel, RecordingTool};
/// # let model = ScriptedModel::new(vec![]);
/// # let (send_email, lookup) = (RecordingTool::new("send_email"), RecordingTool::new("lookup"));
/// let agent = Agent::new(model)
///     .instructions("You answer customers of Example Corp. Be brief.")
///     .tool(send_email)
///     .tool(lookup)
///     .policy(RequireApprovalFor::tools(["send_email"]))
///     .model_policy(ModelPolicy::default().max_attempts(5))
///     .max_steps(20);
/// ```
#[derive(Clone)]
pub struct Agent {
    pub(crate) model: Arc<dyn Model>,
    pub(crate) tools: BTreeMap<String, Arc<RegisteredTool>>,
    /// The tools' specs, in name order, as each request carries them.
    pub(crate) specs: Arc<[ToolSpec]>,
    pub(crate) policy: Arc<dyn Policy>,
    pub(crate) model_policy: ModelPolicy,
    pub(crate) instructions: Option<String>,
    pub(crate) map_input: Option<Arc<InputMapper>>,
    pub(crate) max_steps: u32,
    pub(crate) tool_timeout: Duration,
    pub(crate) tool_grace: Duration,
    pub(crate) progress_every: Duration,
    pub(crate) max_depth: u32,
}

impl Agent {
    /// An agent answering with `model`, with no tools and no instructions, allowing every
    /// call, calling its model with the default [`ModelPolicy`].
    pub fn new(model: impl Model) -> Self {
        Agent {
            model: Arc::new(model),
            tools: BTreeMap::new(),
            specs: Arc::from(Vec::new()),
            policy: Arc::new(AllowAll),
            model_policy: ModelPolicy::default(),
            instructions: None,
            map_input: None,
            max_steps: DEFAULT_MAX_STEPS,
            tool_timeout: DEFAULT_TOOL_TIMEOUT,
            tool_grace: DEFAULT_TOOL_GRACE,
            progress_every: DEFAULT_PROGRESS_EVERY,
            max_depth: crate::builtin::DEFAULT_MAX_DEPTH,
        }
    }

    /// Adds a tool, under its [`Tool::name`]; a tool of the same name is replaced. Its
    /// description and schema are read now. A schema that is not valid JSON Schema is logged
    /// as an error: the tool is not offered to the model, and a call of it is refused with
    /// the reason.
    pub fn tool(self, tool: impl Tool) -> Self {
        self.shared_tool(Arc::new(tool))
    }

    /// Adds a shared tool.
    pub fn shared_tool(self, tool: Arc<dyn Tool>) -> Self {
        self.register(tool, None)
    }

    /// Adds `ask_person`: the model asks a person a question, with an optional JSON Schema
    /// for the answer, and the run waits (state `WAITING_FOR_ANSWER`, holding no lease and no
    /// slot) until it is answered through [`Store::answer`](crate::Store::answer), the API,
    /// the CLI or the console. The answer is the call's result. See `docs/waits.md`.
    pub fn ask_person(self) -> Self {
        let tool = Arc::new(crate::builtin::ask_person());
        self.register(tool, Some(crate::builtin::WaitTool::Answer))
    }

    /// Adds `sleep_until`: the model pauses the run until a time or for a number of seconds
    /// (state `WAITING_FOR_TIMER`). See `docs/waits.md`.
    pub fn sleep_until(self) -> Self {
        let tool = Arc::new(crate::builtin::sleep_until());
        self.register(tool, Some(crate::builtin::WaitTool::Timer))
    }

    /// Adds `wait_for_event`: the model waits for an event of a name delivered to the run
    /// ([`Store::deliver_event`](crate::Store::deliver_event)), whose payload is the call's
    /// result (state `WAITING_FOR_EVENT`). An event delivered before the wait is kept for it.
    pub fn wait_for_event(self) -> Self {
        let tool = Arc::new(crate::builtin::wait_for_event());
        self.register(tool, Some(crate::builtin::WaitTool::Event))
    }

    /// Adds a tool named `name` that hands its `task` to a child run of the agent registered
    /// as `agent`: the run waits (state `WAITING_FOR_CHILD`) until the child finishes, whose
    /// final answer is the call's result and whose failure or cancel its error. The child's
    /// id is the call's idempotency key (`RUN/STEP`), inserted in the same transaction as the
    /// wait: no crash starts two. Cancelling the run cancels the child. Child runs nest at
    /// most [`DEFAULT_MAX_DEPTH`](crate::DEFAULT_MAX_DEPTH) deep unless
    /// [`delegate_depth`](Self::delegate_depth) says otherwise.
    pub fn delegate(
        self,
        name: impl Into<String>,
        agent: impl Into<String>,
        description: impl Into<String>,
    ) -> Self {
        let (name, description) = (name.into(), description.into());
        let tool = Arc::new(crate::builtin::delegate(&name, &description));
        let wait = crate::builtin::WaitTool::Child {
            agent: agent.into(),
            max_depth: self.max_depth,
        };
        self.register(tool, Some(wait))
    }

    /// How deep the child runs of this agent's delegating tools added after it may nest
    /// below their root (at least 1): a call that would start a child deeper gets an error
    /// as its result. Defaults to [`DEFAULT_MAX_DEPTH`](crate::DEFAULT_MAX_DEPTH).
    pub fn delegate_depth(mut self, depth: u32) -> Self {
        self.max_depth = depth.max(1);
        self
    }

    fn register(mut self, tool: Arc<dyn Tool>, wait: Option<crate::builtin::WaitTool>) -> Self {
        let (mut registered, spec) = RegisteredTool::new(tool);
        registered.wait = wait;
        // A schema that cannot be checked is not offered either: a server that checks the
        // schemas it is sent would refuse every request.
        let offered = registered.validator.is_ok();
        self.tools.insert(spec.name.clone(), Arc::new(registered));
        let mut specs: Vec<ToolSpec> = self
            .specs
            .iter()
            .filter(|s| s.name != spec.name)
            .cloned()
            .collect();
        specs.extend(offered.then_some(spec));
        specs.sort_by(|a, b| a.name.cmp(&b.name));
        self.specs = specs.into();
        self
    }

    /// Sets the policy (the default allows every call).
    pub fn policy(mut self, policy: impl Policy) -> Self {
        self.policy = Arc::new(policy);
        self
    }

    /// Sets how the model is called: the timeout of each attempt, and the retries.
    pub fn model_policy(mut self, policy: ModelPolicy) -> Self {
        self.model_policy = policy;
        self
    }

    /// The system prompt: the conversation's first message, a [`ChatMessage::System`].
    pub fn instructions(mut self, instructions: impl Into<String>) -> Self {
        self.instructions = Some(instructions.into());
        self
    }

    /// How a run's input becomes the user turns that open its conversation. By default a
    /// string input is one user message of that text, `null` is none, and any other value
    /// is one user message of its JSON.
    pub fn map_input<F>(mut self, map: F) -> Self
    where
        F: Fn(&Value) -> Vec<ChatMessage> + Send + Sync + 'static,
    {
        self.map_input = Some(Arc::new(map));
        self
    }

    /// The most steps (model calls and tool calls together) a run may take: a model call that
    /// would be step `max_steps + 1` or later fails the run instead. Defaults to
    /// [`DEFAULT_MAX_STEPS`].
    pub fn max_steps(mut self, max_steps: u32) -> Self {
        self.max_steps = max_steps;
        self
    }

    /// The longest a tool call may take when its tool does not say ([`Tool::timeout`]).
    /// Defaults to [`DEFAULT_TOOL_TIMEOUT`]; zero means the default, since a call that may
    /// take no time at all could never run. There is no unlimited setting: a call that hangs
    /// would hold its run (and its slot of the supervisor) for ever.
    pub fn tool_timeout(mut self, limit: Duration) -> Self {
        self.tool_timeout = if limit.is_zero() {
            DEFAULT_TOOL_TIMEOUT
        } else {
            limit
        };
        self
    }

    /// How long a tool call whose cancellation signal fired for its timeout (or for its
    /// stopped heartbeats) has to return before it is dropped and recorded as timed out.
    /// Defaults to [`DEFAULT_TOOL_GRACE`]; zero drops it at once.
    pub fn tool_grace(mut self, grace: Duration) -> Self {
        self.tool_grace = grace;
        self
    }

    /// How often, at most, a tool call's heartbeats are written to the store: the latest
    /// value, once per period (see [`ToolContext::heartbeat`]). Defaults to
    /// [`DEFAULT_PROGRESS_EVERY`]; zero means the default. A shorter period loses less of a
    /// cut-off call's progress and writes more.
    pub fn progress_every(mut self, period: Duration) -> Self {
        self.progress_every = if period.is_zero() {
            DEFAULT_PROGRESS_EVERY
        } else {
            period
        };
        self
    }

    /// The limit of a call of `tool`: its own timeout, or the agent's.
    pub(crate) fn timeout_of(&self, tool: &dyn Tool) -> Duration {
        tool.timeout()
            .filter(|limit| !limit.is_zero())
            .unwrap_or(self.tool_timeout)
    }

    /// The messages that open a run's conversation: the instructions, then the input's turns.
    pub(crate) fn opening(&self, input: &Value) -> Vec<ChatMessage> {
        let system = self
            .instructions
            .iter()
            .map(|text| ChatMessage::System { text: text.clone() });
        let user = match &self.map_input {
            Some(map) => map(input),
            None => match input {
                Value::Null => Vec::new(),
                Value::String(text) => vec![ChatMessage::User { text: text.clone() }],
                other => vec![ChatMessage::User {
                    text: other.to_string(),
                }],
            },
        };
        system.chain(user).collect()
    }
}

impl fmt::Debug for Agent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Agent")
            .field("tools", &self.tools.keys().collect::<Vec<_>>())
            .field("instructions", &self.instructions)
            .field("model_policy", &self.model_policy)
            .field("max_steps", &self.max_steps)
            .field("tool_timeout", &self.tool_timeout)
            .field("tool_grace", &self.tool_grace)
            .field("progress_every", &self.progress_every)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_heartbeat_counts_and_keeps_its_value_unless_null_or_too_large() {
        let (heart, watch) = Heart::new();
        heart.beat(json!({"done": 1}));
        heart.beat(Value::Null);
        let too_large = json!({ "log": "x".repeat(MAX_PROGRESS_BYTES) });
        heart.beat(too_large);
        let beat = watch.borrow().clone();
        assert_eq!(beat.count, 3, "every beat is a sign of life");
        assert_eq!(beat.progress, Some((1, json!({"done": 1}))));
        // Exactly at the limit is kept.
        let text = "y".repeat(MAX_PROGRESS_BYTES - r#"{"log":""}"#.len());
        heart.beat(json!({ "log": text }));
        assert_eq!(watch.borrow().progress.as_ref().unwrap().0, 4);
    }

    #[test]
    fn a_zero_timeout_or_period_means_the_default() {
        struct Silent;
        #[async_trait(?Send)]
        impl Model for Silent {
            async fn complete(&self, _: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
                Err(ModelError::new("silent"))
            }
        }
        let agent = Agent::new(Silent)
            .tool_timeout(Duration::ZERO)
            .progress_every(Duration::ZERO);
        assert_eq!(agent.tool_timeout, DEFAULT_TOOL_TIMEOUT);
        assert_eq!(agent.progress_every, DEFAULT_PROGRESS_EVERY);
    }
}
