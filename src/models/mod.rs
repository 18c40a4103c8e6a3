//! Models served over HTTP: an adapter for the Chat Completions API (feature `openai`: OpenAI,
//! and any server that speaks it, such as llama.cpp, vLLM or Ollama) and one for Anthropic's
//! Messages API (feature `anthropic`).
//!
//! Each adapter is a [`Model`](crate::Model): give it to [`Agent::new`](crate::Agent::new).
//! One call of [`complete`](crate::Model::complete) makes one HTTP request. The agent's
//! [`ModelPolicy`](crate::ModelPolicy) times each attempt out and retries the failures that
//! are worth retrying, each attempt in the run's log; the adapter says which those are (see
//! `docs/models.md`, "Adapters"), and passes on the server's `Retry-After`.
//!
//! ```no_run
//! # #[cfg(feature = "openai")] {
//! use agentrt::{Agent, models::openai::OpenAi};
//!
//! // A local llama.cpp server: no key.
//! let model = OpenAi::new("qwen2.5-7b-instruct").base_url("http://127.0.0.1:8080/v1");
//! let agent = Agent::new(model).instructions("Answer briefly.");
//! # }
//! ```

mod http;
mod options;

#[cfg(feature = "anthropic")]
pub mod anthropic;
#[cfg(feature = "openai")]
pub mod openai;
