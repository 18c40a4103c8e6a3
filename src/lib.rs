#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

// A store needs a backend: without one, every `Store` constructor could only fail.
#[cfg(not(any(feature = "sqlite", feature = "postgres")))]
compile_error!(
    "agentrt needs a store backend: enable its feature `sqlite` (a default one) or `postgres`"
);

mod actors;
mod agent;
mod clock;
mod error;
mod metrics;
mod model_policy;
#[cfg(any(feature = "openai", feature = "anthropic"))]
pub mod models;
mod store;
#[cfg(feature = "testkit")]
pub mod testkit;
mod trace_context;
mod types;
#[cfg(feature = "web")]
pub mod web;

// The examples in docs/ compile as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/lease.md")]
mod lease_md {}
#[cfg(doctest)]
#[doc = include_str!("../docs/runs.md")]
mod runs_md {}
#[cfg(doctest)]
#[doc = include_str!("../docs/upgrading-0.6.md")]
mod upgrading_0_6_md {}
#[cfg(all(doctest, feature = "testkit"))]
#[doc = include_str!("../docs/testing.md")]
mod testing_md {}
// Its adapters' example needs both adapter features.
#[cfg(all(
    doctest,
    feature = "testkit",
    feature = "openai",
    feature = "anthropic"
))]
#[doc = include_str!("../docs/models.md")]
mod models_md {}
#[cfg(doctest)]
#[doc = include_str!("../docs/production.md")]
mod production_md {}
#[cfg(all(doctest, feature = "web", feature = "otel"))]
#[doc = include_str!("../docs/operate.md")]
mod operate_md {}
#[cfg(all(doctest, feature = "postgres"))]
#[doc = include_str!("../docs/postgres.md")]
mod postgres_md {}

pub use actors::{
    lease_keeper::{LeaseLost, SubscribeLeaseLost},
    supervisor::{
        CancelRun, Config, DEFAULT_LEASE_TTL, DEFAULT_MAX_CONCURRENT_RUNS, DecideAndResume,
        ForkRun, RecordApproval, Recovery, RegisterAgent, ResumeRun, RunSettled, SpawnRun,
        StartRun, SubscribeRuns, Supervisor, SupervisorBuilder, Watch,
    },
};
pub use agent::{
    Agent, AllowAll, Cancellation, DEFAULT_MAX_STEPS, Decision, InputMapper, Model, ModelError,
    ModelRequest, Policy, Reconciliation, RequireApprovalFor, Tool, ToolContext, ToolError,
    schema_for,
};
pub use async_trait::async_trait;
pub use clock::{Clock, SystemClock};
pub use error::{DatabaseError, Error, Result};
pub use model_policy::{DEFAULT_MODEL_TIMEOUT, ModelPolicy};
/// The `schemars` this crate derives schemas with (see [`schema_for`]).
pub use schemars;
#[cfg(feature = "postgres")]
pub use store::postgres;
#[cfg(feature = "sqlite")]
pub use store::sqlite;
pub use store::{
    DEFAULT_PAGE_LIMIT, DEFAULT_PURGE_BATCH, Health, MAX_PAGE_LIMIT, MAX_PURGE_BATCH,
    PURGE_REPORT_IDS, Purge, PurgeReport, RunPage, RunQuery, SCHEMA_VERSION, SchemaStatus, Space,
    Store,
    backend::{MoveInfo, MoveKind, MoveObserver},
};
#[allow(deprecated)]
pub use types::RunOutcome;
pub use types::{
    Approval, ApprovalReason, Event, EventKind, FencingToken, Lease, LeaseLostReason, Message,
    ModelResponse, Outcome, PendingCall, Run, RunId, RunReply, RunState, RunUsage, ToolCall,
    ToolResult, ToolSpec, Usage,
};
