//! Quickstart: a scripted support agent on an embedded SQLite file.
//!
//! The agent looks a customer up (allowed by the policy) and then emails them (which needs an
//! approval). The run pauses, an operator approves, the run resumes and finishes; the example
//! prints the run's events and where the database is.
//!
//! ```text
//! cargo run --example quickstart
//! ```

use agentrt::{Approval, Outcome, RecordApproval, ResumeRun, StartRun, Store, Supervisor};
use serde_json::json;

#[path = "support/quickstart_agent.rs"]
mod quickstart_agent;

#[actix::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // RUST_LOG=agentrt=debug shows the run and step spans.
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let path = std::env::current_dir()?.join("agentrt-quickstart.db");
    let store = Store::open(&path)?;
    let supervisor = Supervisor::builder(store.clone())
        .agent("support", quickstart_agent::agent())
        .start()?;

    let reply = supervisor
        .send(StartRun::new("support", json!({ "customer": "ada" })))
        .await??;
    let run_id = reply.run_id;
    println!("run {run_id} started");
    let Outcome::WaitingForApproval { pending } = reply.outcome else {
        return Err(format!(
            "expected the run to wait for an approval, got {:?}",
            reply.outcome
        )
        .into());
    };
    println!(
        "waiting for approval of {} ({}) with {}",
        pending.call_id, pending.tool, pending.args
    );

    supervisor
        .send(RecordApproval(
            Approval::approve(run_id.clone(), pending.call_id, "operator@example.com")
                .note("refund ok"),
        ))
        .await??;
    println!("approved; resuming");
    let reply = supervisor.send(ResumeRun::new(run_id.clone())).await??;
    println!("outcome: {:?}", reply.outcome);

    // Inspection blocks on SQLite: keep it off the arbiter that hosts the runs.
    let events = actix_rt::task::spawn_blocking(move || store.events(&run_id)).await??;
    println!("\nevents:");
    for event in events {
        println!(
            "  {:>2} {:<20} step={:<4} {}",
            event.seq,
            event.kind,
            event.step.map(|s| s.to_string()).unwrap_or_default(),
            event.payload
        );
    }
    println!("\ndatabase: {}", path.display());
    match reply.outcome {
        Outcome::Succeeded { .. } => Ok(()),
        other => Err(format!("the run did not succeed: {other:?}").into()),
    }
}
