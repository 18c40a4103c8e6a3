//! Models: the OpenAI and Anthropic adapters against a scripted HTTP server, and model retries,
//! across a crash too.

#[path = "../support/mod.rs"]
mod support;

#[cfg(feature = "anthropic")]
mod model_anthropic;
#[cfg(feature = "openai")]
mod model_openai;
mod model_retries;
mod model_retry_crash;
