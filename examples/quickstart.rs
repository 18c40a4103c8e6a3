//! Quickstart: a scripted support agent on an embedded SQLite file.
//!
//! The agent looks a customer up (allowed by the policy) and then emails them (which needs an
//! approval). The run pauses, an operator approves, the run resumes and finishes; the example
//! prints the run's events and where the database is.
//!
//! ```text
//! cargo run --example quickstart
//! ```

use agentrt::{
    Agent, Approval, Message, Model, ModelError, ModelRequest, ModelResponse, Outcome,
    RecordApproval, RequireApprovalFor, ResumeRun, StartRun, Store, Supervisor, Tool, ToolCall,
    ToolContext, ToolError, async_trait,
};
use serde_json::{Value, json};

/// Plays the model's part from a fixed script: look up, then email, then answer.
struct ScriptedSupportModel;

#[async_trait(?Send)]
impl Model for ScriptedSupportModel {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        let turn = request
            .messages
            .iter()
            .filter(|m| matches!(m, Message::Assistant(_)))
            .count();
        let customer = request.input["customer"].as_str().unwrap_or("unknown");
        Ok(match turn {
            0 => ModelResponse::calls(vec![ToolCall::new(
                "lookup-1",
                "lookup_customer",
                json!({ "id": customer }),
            )]),
            1 => ModelResponse::calls(vec![ToolCall::new(
                "email-1",
                "send_email",
                json!({ "to": format!("{customer}@example.com"), "subject": "Your refund" }),
            )]),
            _ => ModelResponse::answer(format!("Refund confirmed and {customer} was emailed.")),
        })
    }
}

/// A read-only lookup: no approval needed.
struct LookupCustomer;

#[async_trait(?Send)]
impl Tool for LookupCustomer {
    fn name(&self) -> &str {
        "lookup_customer"
    }

    fn idempotent(&self) -> bool {
        true
    }

    async fn call(&self, _: &ToolContext, args: &Value) -> Result<Value, ToolError> {
        Ok(json!({ "id": args["id"], "plan": "pro", "refund_eligible": true }))
    }
}

/// A side effect in the world: the policy makes it wait for a person.
struct SendEmail;

#[async_trait(?Send)]
impl Tool for SendEmail {
    fn name(&self) -> &str {
        "send_email"
    }

    async fn call(&self, ctx: &ToolContext, args: &Value) -> Result<Value, ToolError> {
        // A real tool passes ctx.idempotency_key to the email API, so a retry sends nothing twice.
        println!(
            "  (sending an email to {} with idempotency key {})",
            args["to"], ctx.idempotency_key
        );
        Ok(json!({ "sent": true }))
    }
}

#[actix::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::current_dir()?.join("agentrt-quickstart.db");
    let store = Store::open(&path)?;
    let agent = Agent::new(ScriptedSupportModel)
        .tool(LookupCustomer)
        .tool(SendEmail)
        .policy(RequireApprovalFor::tools(["send_email"]));
    let supervisor = Supervisor::builder(store.clone())
        .agent("support", agent)
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
