//! The quickstart's agent: a scripted support model, a lookup that needs no approval, and an
//! email that does. Shared by `examples/quickstart.rs` and the crash-point explorer's tests.

use agentrt::{
    Agent, ChatMessage, Model, ModelError, ModelRequest, ModelResponse, RequireApprovalFor, Tool,
    ToolCall, ToolContext, ToolError, async_trait,
};
use serde_json::{Value, json};

/// The quickstart's agent.
pub fn agent() -> Agent {
    Agent::new(ScriptedSupportModel)
        .tool(LookupCustomer)
        .tool(SendEmail)
        .policy(RequireApprovalFor::tools(["send_email"]))
}

/// Plays the model's part from a fixed script: look up, then email, then answer.
pub struct ScriptedSupportModel;

#[async_trait(?Send)]
impl Model for ScriptedSupportModel {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        let turn = request
            .messages
            .iter()
            .filter(|m| matches!(m, ChatMessage::Assistant(_)))
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
pub struct LookupCustomer;

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
pub struct SendEmail;

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
