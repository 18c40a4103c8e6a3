//! What an agent is made of: a [`Model`], [`Tool`]s and a [`Policy`].

use std::{collections::BTreeMap, fmt, sync::Arc};

use async_trait::async_trait;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::types::{FencingToken, Message, ModelResponse, RunId, ToolCall};

/// The default for [`Agent::max_steps`].
pub const DEFAULT_MAX_STEPS: u32 = 64;

/// What the model is asked.
#[derive(Debug)]
pub struct ModelRequest<'a> {
    /// The run.
    pub run_id: &'a RunId,
    /// The step number of this model call.
    pub step: u32,
    /// The run's input.
    pub input: &'a Value,
    /// The conversation so far: earlier responses and the results of their tool calls.
    pub messages: &'a [Message],
}

/// A model failed to answer. It fails the run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ModelError(pub String);

impl ModelError {
    /// A model error saying `message`.
    pub fn new(message: impl Into<String>) -> Self {
        ModelError(message.into())
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

/// Fires when the run's execution should stop: an operator cancelled the run.
///
/// A tool may watch it to stop early; whatever it returns is still recorded.
#[derive(Debug, Clone, Default)]
pub struct Cancellation(CancellationToken);

impl Cancellation {
    pub(crate) fn new() -> Self {
        Cancellation(CancellationToken::new())
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
    /// Fires when an operator cancels the run.
    pub cancellation: Cancellation,
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

    /// True when running the same call twice has the effect of running it once. An interrupted
    /// call of an idempotent tool whose outcome is unknown is simply run again.
    fn idempotent(&self) -> bool {
        false
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
pub trait Policy: Send + Sync + 'static {
    /// The decision for `call` in run `run_id`.
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

/// An agent: a model, the tools it may call, and the policy that decides each call.
///
/// Registered on a supervisor by name; a run stores that name, so any process that registered
/// an agent under the same name can resume the run.
///
/// ```
/// use agentrt::{Agent, RequireApprovalFor};
/// # use agentrt::testkit::{ScriptedModel, RecordingTool};
/// # let model = ScriptedModel::new(vec![]);
/// # let (send_email, lookup) = (RecordingTool::new("send_email"), RecordingTool::new("lookup"));
/// let agent = Agent::new(model)
///     .tool(send_email)
///     .tool(lookup)
///     .policy(RequireApprovalFor::tools(["send_email"]))
///     .max_steps(20);
/// ```
#[derive(Clone)]
pub struct Agent {
    pub(crate) model: Arc<dyn Model>,
    pub(crate) tools: BTreeMap<String, Arc<dyn Tool>>,
    pub(crate) policy: Arc<dyn Policy>,
    pub(crate) max_steps: u32,
}

impl Agent {
    /// An agent answering with `model`, with no tools, allowing every call.
    pub fn new(model: impl Model) -> Self {
        Agent {
            model: Arc::new(model),
            tools: BTreeMap::new(),
            policy: Arc::new(AllowAll),
            max_steps: DEFAULT_MAX_STEPS,
        }
    }

    /// Adds a tool, under its [`Tool::name`]; a tool of the same name is replaced.
    pub fn tool(mut self, tool: impl Tool) -> Self {
        self.tools.insert(tool.name().to_owned(), Arc::new(tool));
        self
    }

    /// Adds a shared tool.
    pub fn shared_tool(mut self, tool: Arc<dyn Tool>) -> Self {
        self.tools.insert(tool.name().to_owned(), tool);
        self
    }

    /// Sets the policy (the default allows every call).
    pub fn policy(mut self, policy: impl Policy) -> Self {
        self.policy = Arc::new(policy);
        self
    }

    /// The most steps (model calls and tool calls together) a run may take: a model call that
    /// would be step `max_steps + 1` or later fails the run instead. Defaults to
    /// [`DEFAULT_MAX_STEPS`].
    pub fn max_steps(mut self, max_steps: u32) -> Self {
        self.max_steps = max_steps;
        self
    }
}

impl fmt::Debug for Agent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Agent")
            .field("tools", &self.tools.keys().collect::<Vec<_>>())
            .field("max_steps", &self.max_steps)
            .finish_non_exhaustive()
    }
}
