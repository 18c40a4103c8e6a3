#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

// A store needs a backend: without one, every `Store` constructor could only fail.
#[cfg(not(any(feature = "sqlite", feature = "postgres")))]
compile_error!(
    "agentrt needs a store backend: enable its feature `sqlite` (a default one) or `postgres`"
);

mod actors;
mod agent;
mod builtin;
mod clock;
mod cron;
mod error;
mod metrics;
mod model_policy;
#[cfg(any(feature = "openai", feature = "anthropic"))]
pub mod models;
mod schedule;
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
#[doc = include_str!("../docs/upgrading.md")]
mod upgrading_md {}
#[cfg(all(doctest, feature = "testkit"))]
#[doc = include_str!("../docs/testing.md")]
mod testing_md {}
#[cfg(all(doctest, feature = "testkit"))]
#[doc = include_str!("../docs/waits.md")]
mod waits_md {}
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
#[cfg(doctest)]
#[doc = include_str!("../docs/reconciliation.md")]
mod reconciliation_md {}
#[cfg(doctest)]
#[doc = include_str!("../docs/schedules.md")]
mod schedules_md {}
#[cfg(all(doctest, feature = "web", feature = "otel"))]
#[doc = include_str!("../docs/operate.md")]
mod operate_md {}
#[cfg(all(doctest, feature = "postgres"))]
#[doc = include_str!("../docs/postgres.md")]
mod postgres_md {}

pub use actix;
pub use actors::{
    lease_keeper::{LeaseLost, SubscribeLeaseLost},
    supervisor::{
        AnswerQuestion, CancelRun, Config, DEFAULT_ANSWER_WATCH, DEFAULT_DRAIN_DEADLINE,
        DEFAULT_DRAIN_GRACE, DEFAULT_LEASE_TTL, DEFAULT_MAX_CONCURRENT_RUNS, DecideAndResume,
        DeliverEvent, Drain, DrainReport, ForkRun, RecordApproval, Recovery, RegisterAgent,
        ResumeRun, RunSettled, SpawnRun, StartRun, SubscribeRuns, Supervisor, SupervisorBuilder,
        Watch, drain_on_signal, stop_on_signal,
    },
};
pub use agent::{
    Agent, AllowAll, Cancellation, DEFAULT_MAX_STEPS, DEFAULT_PROGRESS_EVERY, DEFAULT_TOOL_GRACE,
    DEFAULT_TOOL_TIMEOUT, Decision, InputMapper, MAX_PROGRESS_BYTES, Model, ModelError,
    ModelRequest, Policy, Reconciliation, RequireApprovalFor, Tool, ToolContext, ToolError,
    schema_for,
};
pub use async_trait::async_trait;
pub use builtin::DEFAULT_MAX_DEPTH;
pub use clock::{Clock, SystemClock};
pub use error::{DatabaseError, Error, Result};
pub use model_policy::{DEFAULT_MODEL_TIMEOUT, ModelPolicy};
pub use schedule::{MISSED_AFTER, Missed, Schedule};
/// The `schemars` this crate derives schemas with (see [`schema_for`]).
pub use schemars;
/// The `serde_json` whose `Value` runs take as input and tools take and return.
pub use serde_json;
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
pub use types::{
    Answer, Approval, ApprovalReason, ChatMessage, Delivered, Delivery, Event, EventKind,
    FencingToken, Lease, LeaseLostReason, ModelResponse, Outcome, PendingCall, Run, RunId,
    RunReply, RunState, RunUsage, ToolCall, ToolResult, ToolSpec, Usage, Wait, WaitKind,
};

/// What an application that defines and runs agents uses: `use agentrt::prelude::*;`.
///
/// It brings no name that collides with actix's own (`Message` is actix's; a chat turn is
/// [`ChatMessage`]).
pub mod prelude {
    pub use crate::{
        Agent, Approval, CancelRun, ChatMessage, Config, Decision, Drain, Error, Model, ModelError,
        ModelRequest, ModelResponse, Outcome, Policy, RecordApproval, Result, ResumeRun, RunId,
        RunReply, SpawnRun, StartRun, Store, Supervisor, Tool, ToolCall, ToolContext, ToolError,
        ToolResult, actix, async_trait, serde_json,
    };
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    /// The `(major, minor)` a version requirement names: `0.11`, `^0.11.2`, `=0.11.0`; the
    /// minor is `None` when the requirement has none (`1`).
    fn major_minor(requirement: &str) -> Option<(u64, Option<u64>)> {
        let version = requirement.trim_start_matches(['=', '^', '~', '>', '<', ' ']);
        let mut parts = version.split('.');
        let major = parts.next()?.trim().parse().ok()?;
        let minor = match parts.next() {
            Some(minor) => Some(minor.trim().parse().ok()?),
            None => None,
        };
        Some((major, minor))
    }

    /// The first quoted string of `text`, which starts with it once blanks are skipped.
    fn quoted(text: &str) -> Option<&str> {
        let rest = text.trim_start().strip_prefix('"')?;
        rest.split('"').next()
    }

    /// The version requirement a TOML value gives: `"0.11"`, or the `version` of an inline
    /// table `{ version = "0.11", features = [..] }`. `None` for a path or git dependency.
    fn requirement(value: &str) -> Option<&str> {
        let value = value.trim_start();
        if value.starts_with('"') {
            return quoted(value);
        }
        let table = value.strip_prefix('{')?;
        let at = table.find("version")?;
        let rest = table[at + "version".len()..]
            .trim_start()
            .strip_prefix('=')?;
        quoted(rest)
    }

    /// The lines (numbered from 1) of the code blocks of `markdown` that make agentrt a
    /// dependency at a version whose major and minor are not `current`'s: `agentrt = "0.8"`,
    /// `agentrt = { version = "0.8", .. }`, or `version = "0.8"` under `[dependencies.agentrt]`.
    fn stale_dependency_lines(markdown: &str, current: (u64, u64)) -> Vec<(usize, String)> {
        let mut stale = Vec::new();
        let mut in_code = false;
        let mut in_agentrt_table = false;
        for (index, line) in markdown.lines().enumerate() {
            let text = line.trim();
            if text.starts_with("```") {
                in_code = !in_code;
                in_agentrt_table = false;
                continue;
            }
            if !in_code {
                continue;
            }
            if text.starts_with('[') {
                in_agentrt_table = text.trim_end_matches(']').ends_with("dependencies.agentrt");
                continue;
            }
            let key = if in_agentrt_table {
                "version"
            } else {
                "agentrt"
            };
            let Some(value) = text
                .strip_prefix(key)
                .and_then(|rest| rest.trim_start().strip_prefix('='))
            else {
                continue;
            };
            let Some(requirement) = requirement(value) else {
                continue;
            };
            let fits = match major_minor(requirement) {
                Some((major, Some(minor))) => (major, minor) == current,
                Some((major, None)) => major == current.0 && major != 0,
                None => false,
            };
            if !fits {
                stale.push((index + 1, text.to_owned()));
            }
        }
        stale
    }

    /// README.md and every Markdown file under docs/.
    fn documents() -> Vec<PathBuf> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut files = vec![root.join("README.md")];
        let mut folders = vec![root.join("docs")];
        while let Some(folder) = folders.pop() {
            for entry in std::fs::read_dir(&folder).expect("docs/ is readable") {
                let path = entry.expect("docs/ is readable").path();
                if path.is_dir() {
                    folders.push(path);
                } else if path.extension().is_some_and(|ext| ext == "md") {
                    files.push(path);
                }
            }
        }
        files.sort();
        files
    }

    fn current() -> (u64, u64) {
        match major_minor(env!("CARGO_PKG_VERSION")) {
            Some((major, Some(minor))) => (major, minor),
            other => panic!("the crate's version reads as {other:?}"),
        }
    }

    #[test]
    fn the_docs_depend_on_the_current_version() {
        let (major, minor) = current();
        let mut stale = Vec::new();
        for file in documents() {
            let text = std::fs::read_to_string(&file).expect("a document is readable");
            let shown = file
                .strip_prefix(env!("CARGO_MANIFEST_DIR"))
                .unwrap_or(&file)
                .display()
                .to_string();
            for (line, dependency) in stale_dependency_lines(&text, (major, minor)) {
                stale.push(format!("{shown}:{line}: {dependency}"));
            }
        }
        assert!(
            stale.is_empty(),
            "these snippets depend on another version than {major}.{minor} (Cargo.toml's): \
             name {major}.{minor} in them\n{}",
            stale.join("\n")
        );
    }

    #[test]
    fn a_dependency_on_another_version_is_found_in_every_form() {
        let markdown = r#"
agentrt = "0.8" is prose, not a snippet.

```toml
[dependencies]
agentrt = "0.8"
agentrt = "0.11"
agentrt = "^0.11.2"
agentrt = { version = "0.7", features = ["testkit"] }
agentrt = { version = "=0.11.0", features = ["otel"] }
agentrt = { path = "." }
serde_json = "1"

[dev-dependencies.agentrt]
version = "0.9"
features = ["testkit"]

[package]
version = "0.1.0"
```

```toml
agentrt = "1"
```
"#;
        let stale: Vec<usize> = stale_dependency_lines(markdown, (0, 11))
            .into_iter()
            .map(|(line, _)| line)
            .collect();
        assert_eq!(stale, [6, 9, 15, 23]);
        assert!(
            stale_dependency_lines(markdown, (0, 8))
                .iter()
                .any(|(line, _)| *line == 7)
        );
    }
}
