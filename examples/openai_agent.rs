//! An agent on a real model behind the Chat Completions API: OpenAI, or a local server that
//! speaks it (llama.cpp's `llama-server`, Ollama, vLLM).
//!
//! The agent has two tools: `weather` (allowed) and `send_email` (which needs an approval).
//! When the run waits for one, the example asks on the terminal, or takes the answer from
//! `AGENTRT_APPROVE` (`yes` or `no`); with neither it denies the call. It prints the run's
//! events at the end.
//!
//! ```text
//! # Ollama on this machine
//! OPENAI_BASE_URL=http://localhost:11434/v1 OPENAI_MODEL=llama3.1 \
//!     cargo run --features openai --example openai_agent
//! # OpenAI, with a question of your own, approving without asking
//! OPENAI_API_KEY=sk-... AGENTRT_APPROVE=yes \
//!     cargo run --features openai --example openai_agent -- "Email bob@example.com the weather in Lima"
//! ```
//!
//! `OPENAI_MODEL` defaults to `gpt-4o-mini`. The run is stored in `agentrt-openai-agent.db`
//! in the current directory, for the operator CLI to inspect.

use std::io::{BufRead, IsTerminal, Write};

use agentrt::{
    Agent, Approval, Outcome, PendingCall, RecordApproval, RequireApprovalFor, ResumeRun, StartRun,
    Store, Supervisor, Tool, ToolContext, ToolError, async_trait, models::openai::OpenAi,
    schema_for,
};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};

const DEFAULT_MODEL: &str = "gpt-4o-mini";
const DEFAULT_QUESTION: &str =
    "What is the weather in Oslo? Email the forecast to ops@example.com, in one sentence.";

/// The arguments of `weather`.
#[derive(Deserialize, JsonSchema)]
struct WeatherArgs {
    /// The city, by its English name.
    city: String,
}

/// Made-up weather: the example needs no weather service.
struct Weather;

#[async_trait(?Send)]
impl Tool for Weather {
    fn name(&self) -> &str {
        "weather"
    }

    fn description(&self) -> &str {
        "The current weather in a city: the sky, and the temperature in degrees Celsius."
    }

    fn parameters(&self) -> Value {
        schema_for::<WeatherArgs>()
    }

    fn idempotent(&self) -> bool {
        true
    }

    async fn call(&self, _: &ToolContext, args: &Value) -> Result<Value, ToolError> {
        let args: WeatherArgs =
            serde_json::from_value(args.clone()).map_err(|err| ToolError::new(err.to_string()))?;
        let celsius = 10 + args.city.len() % 15;
        Ok(json!({ "city": args.city, "sky": "partly cloudy", "celsius": celsius }))
    }
}

/// The arguments of `send_email`.
#[derive(Deserialize, JsonSchema)]
struct EmailArgs {
    /// The recipient's address.
    to: String,
    /// The subject line.
    subject: String,
    /// The message.
    body: String,
}

/// Prints the email instead of sending it.
struct SendEmail;

#[async_trait(?Send)]
impl Tool for SendEmail {
    fn name(&self) -> &str {
        "send_email"
    }

    fn description(&self) -> &str {
        "Sends an email. A person approves each one before it goes out."
    }

    fn parameters(&self) -> Value {
        schema_for::<EmailArgs>()
    }

    async fn call(&self, ctx: &ToolContext, args: &Value) -> Result<Value, ToolError> {
        let email: EmailArgs =
            serde_json::from_value(args.clone()).map_err(|err| ToolError::new(err.to_string()))?;
        println!(
            "\n[send_email] to {} ({}): {}\n",
            email.to, email.subject, email.body
        );
        Ok(json!({ "sent": true, "message_id": ctx.idempotency_key }))
    }
}

#[actix::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let set = |name| std::env::var(name).is_ok_and(|v| !v.trim().is_empty());
    if !set("OPENAI_BASE_URL") && !set("OPENAI_API_KEY") {
        eprintln!(
            "No model endpoint is configured: set OPENAI_BASE_URL to an OpenAI-compatible server \
             (Ollama: http://localhost:11434/v1, llama-server: http://127.0.0.1:8080/v1), or \
             OPENAI_API_KEY for OpenAI itself; OPENAI_MODEL names the model (default {DEFAULT_MODEL})."
        );
        std::process::exit(2);
    }
    let model = std::env::var("OPENAI_MODEL")
        .ok()
        .filter(|m| !m.trim().is_empty())
        .unwrap_or_else(|| DEFAULT_MODEL.to_owned());
    let question = std::env::args()
        .nth(1)
        .unwrap_or_else(|| DEFAULT_QUESTION.to_owned());
    let adapter = OpenAi::from_env(&model);
    println!("model {model}: {adapter:?}");

    let agent = Agent::new(adapter)
        .instructions(
            "You are an operations assistant. Use the tools to look things up and to send \
             email; say briefly what you did.",
        )
        .tool(Weather)
        .tool(SendEmail)
        .policy(RequireApprovalFor::tools(["send_email"]))
        .max_steps(16);
    let path = std::env::current_dir()?.join("agentrt-openai-agent.db");
    let store = Store::open(&path)?;
    let supervisor = Supervisor::builder(store.clone())
        .agent("ops", agent)
        .start()?;

    println!("> {question}");
    let mut reply = supervisor
        .send(StartRun::new("ops", json!(question)))
        .await??;
    let run_id = reply.run_id.clone();
    while let Outcome::WaitingForApproval { pending } = &reply.outcome {
        // Waiting for a person blocks: off the arbiter, so that the system keeps running.
        let asked = pending.clone();
        let approved = actix_rt::task::spawn_blocking(move || decide(&asked)).await??;
        let approval = if approved {
            Approval::approve(run_id.clone(), pending.call_id.clone(), "terminal")
        } else {
            Approval::deny(run_id.clone(), pending.call_id.clone(), "terminal")
        };
        supervisor.send(RecordApproval(approval)).await??;
        reply = supervisor.send(ResumeRun::new(run_id.clone())).await??;
    }

    // Inspection blocks on SQLite: keep it off the arbiter that hosts the runs.
    let id = run_id.clone();
    let events = actix_rt::task::spawn_blocking(move || store.events(&id)).await??;
    println!("\nevents of run {run_id}:");
    for event in events {
        println!(
            "  {:>2} {:<26} step={:<4} {}",
            event.seq,
            event.kind,
            event.step.map(|s| s.to_string()).unwrap_or_default(),
            event.payload
        );
    }
    println!("\ndatabase: {}", path.display());
    match reply.outcome {
        Outcome::Succeeded { output } => {
            println!("\n{output}");
            Ok(())
        }
        other => Err(format!("the run did not succeed: {other:?}").into()),
    }
}

/// Approve `pending`? `AGENTRT_APPROVE` says, else a person at the terminal; nobody to ask
/// means no.
fn decide(pending: &PendingCall) -> std::io::Result<bool> {
    println!(
        "\n{} ({}) waits for an approval: {}",
        pending.tool, pending.call_id, pending.args
    );
    if let Ok(answer) = std::env::var("AGENTRT_APPROVE") {
        let approved = matches!(answer.trim(), "yes" | "y" | "1" | "true");
        println!("AGENTRT_APPROVE={answer}: {}", verdict(approved));
        return Ok(approved);
    }
    if !std::io::stdin().is_terminal() {
        println!("nobody to ask (set AGENTRT_APPROVE=yes to approve): denied");
        return Ok(false);
    }
    print!("approve? [y/N] ");
    std::io::stdout().flush()?;
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    let approved = matches!(line.trim(), "y" | "Y" | "yes");
    println!("{}", verdict(approved));
    Ok(approved)
}

fn verdict(approved: bool) -> &'static str {
    if approved { "approved" } else { "denied" }
}
