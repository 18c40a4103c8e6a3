//! Tools describe themselves: every model request carries each tool's name, description and
//! argument schema, and a call whose arguments do not match the schema is never run: the
//! model is told why, as a failed result of that call.

use agentrt::{
    Agent, ChatMessage, EventKind, ModelResponse, Outcome, RunId, Tool, ToolCall, ToolContext,
    ToolError, ToolResult, ToolSpec, async_trait, schema_for,
    testkit::{RecordingTool, ScriptedModel, TempStore},
};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};
use std::sync::{Arc, Mutex};

use crate::support::outcome_of;

/// Refund part of an order.
#[derive(Deserialize, JsonSchema)]
#[allow(dead_code)]
struct RefundArgs {
    /// The order's id.
    order_id: String,
    /// How much to refund, in cents.
    cents: u64,
}

/// A tool with a schema derived from its arguments' type, recording the calls it ran.
#[derive(Clone, Default)]
struct Refund {
    calls: Arc<Mutex<Vec<Value>>>,
}

#[async_trait(?Send)]
impl Tool for Refund {
    fn name(&self) -> &str {
        "refund"
    }

    fn description(&self) -> &str {
        "Refunds part of an order to the card it was paid with."
    }

    fn parameters(&self) -> Value {
        schema_for::<RefundArgs>()
    }

    async fn call(&self, _: &ToolContext, args: &Value) -> Result<Value, ToolError> {
        let args: RefundArgs =
            serde_json::from_value(args.clone()).map_err(|e| ToolError::new(e.to_string()))?;
        self.calls.lock().unwrap().push(json!(args.cents));
        Ok(json!({ "refunded": args.cents }))
    }
}

/// A tool whose schema is not JSON Schema at all.
struct Broken;

#[async_trait(?Send)]
impl Tool for Broken {
    fn name(&self) -> &str {
        "broken"
    }

    fn parameters(&self) -> Value {
        json!({ "type": "no such type" })
    }

    async fn call(&self, _: &ToolContext, _: &Value) -> Result<Value, ToolError> {
        panic!("a tool whose schema is invalid is never called");
    }
}

fn run(db: &TempStore, agent: Agent) -> Outcome {
    outcome_of(db, agent, json!("refund order 7"))
}

/// The results the model saw on its last turn, by call id.
fn results_seen(model: &ScriptedModel) -> Vec<(String, ToolResult)> {
    model
        .seen()
        .last()
        .unwrap()
        .iter()
        .filter_map(|m| match m {
            ChatMessage::Tool {
                call_id, result, ..
            } => Some((call_id.clone(), result.clone())),
            _ => None,
        })
        .collect()
}

fn call(id: &str, name: &str, args: Value) -> ModelResponse {
    ModelResponse::calls(vec![ToolCall::new(id, name, args)])
}

#[test]
fn arguments_that_do_not_match_the_schema_give_a_failed_result_and_the_tool_is_not_called() {
    let db = TempStore::new();
    let refund = Refund::default();
    let model = ScriptedModel::new(vec![
        call("r1", "refund", json!({"order_id": "7", "cents": "five"})),
        call("r2", "refund", json!({"cents": 5})),
        call("r3", "refund", json!({"order_id": "7", "cents": 500})),
        ModelResponse::answer("refunded"),
    ]);
    let agent = Agent::new(model.clone()).tool(refund.clone());

    let outcome = run(&db, agent);

    assert_eq!(
        outcome,
        Outcome::Succeeded {
            output: "refunded".into()
        }
    );
    assert_eq!(
        *refund.calls.lock().unwrap(),
        [json!(500)],
        "only the valid call ran"
    );
    let results = results_seen(&model);
    let error = |i: usize| match &results[i].1 {
        ToolResult::Error(error) => error.clone(),
        other => panic!("call {} was not refused: {other:?}", results[i].0),
    };
    assert_eq!(results[0].0, "r1");
    assert!(
        error(0).starts_with("the arguments do not match the tool's schema: at /cents: ")
            && error(0).contains("\"five\""),
        "{}",
        error(0)
    );
    assert!(
        error(1).contains("\"order_id\" is a required property"),
        "{}",
        error(1)
    );
    assert_eq!(
        results[2],
        ("r3".into(), ToolResult::Ok(json!({"refunded": 500})))
    );
    // Nothing started for the refused calls: no `step.tool_started` for steps 2 and 4.
    let store = db.open();
    let started: Vec<u32> = store
        .events(&RunId::from("run-1"))
        .unwrap()
        .iter()
        .filter(|e| e.kind == EventKind::ToolStarted)
        .filter_map(|e| e.step)
        .collect();
    assert_eq!(started, [6]);
}

#[test]
fn every_request_carries_each_tool_with_its_description_and_schema() {
    let db = TempStore::new();
    let model = ScriptedModel::new(vec![ModelResponse::answer("nothing to do")]);
    let agent = Agent::new(model.clone())
        .tool(Refund::default())
        .tool(RecordingTool::new("lookup"));

    run(&db, agent);

    let tools = &model.requests()[0].tools;
    assert_eq!(
        tools.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(),
        ["lookup", "refund"],
        "in name order"
    );
    let refund: &ToolSpec = &tools[1];
    assert_eq!(
        refund.description,
        "Refunds part of an order to the card it was paid with."
    );
    assert_eq!(refund.parameters["type"], json!("object"));
    assert_eq!(refund.parameters["required"], json!(["order_id", "cents"]));
    assert_eq!(
        refund.parameters["properties"]["cents"]["description"],
        json!("How much to refund, in cents.")
    );
    assert!(refund.parameters.get("$schema").is_none());
    // A tool that says nothing of its arguments takes any object.
    assert_eq!(tools[0].parameters, json!({"type": "object"}));
    assert_eq!(tools[0].description, "");
}

#[test]
fn arguments_that_are_not_json_are_refused_with_a_result_the_model_sees() {
    let db = TempStore::new();
    let refund = Refund::default();
    // What a model adapter keeps of arguments that did not parse: the raw text.
    let model = ScriptedModel::new(vec![
        call("r1", "refund", json!("{\"order_id\": \"7\", \"cents\": ")),
        ModelResponse::answer("gave up"),
    ]);
    let agent = Agent::new(model.clone()).tool(refund.clone());

    let outcome = run(&db, agent);

    assert_eq!(
        outcome,
        Outcome::Succeeded {
            output: "gave up".into()
        }
    );
    assert!(refund.calls.lock().unwrap().is_empty());
    let results = results_seen(&model);
    assert_eq!(
        results[0].1,
        ToolResult::Error(
            "the arguments of a tool call must be a JSON object; these are not JSON: \
             {\"order_id\": \"7\", \"cents\": "
                .into()
        )
    );
}

#[test]
fn a_tool_whose_schema_is_invalid_is_never_called() {
    let db = TempStore::new();
    let model = ScriptedModel::new(vec![
        call("b1", "broken", json!({})),
        ModelResponse::answer("ok"),
    ]);
    let agent = Agent::new(model.clone()).tool(Broken);

    run(&db, agent);

    let results = results_seen(&model);
    match &results[0].1 {
        ToolResult::Error(error) => assert!(
            error.starts_with("the tool's argument schema is invalid: "),
            "{error}"
        ),
        other => panic!("the call was not refused: {other:?}"),
    }
}

/// A tool whose schema asks for formats.
struct Schedule;

#[async_trait(?Send)]
impl Tool for Schedule {
    fn name(&self) -> &str {
        "schedule"
    }

    fn parameters(&self) -> Value {
        json!({
            "type": "object",
            "properties": {"when": {"type": "string", "format": "date-time"}},
            "required": ["when"]
        })
    }

    async fn call(&self, _: &ToolContext, args: &Value) -> Result<Value, ToolError> {
        Ok(json!({ "scheduled": args["when"] }))
    }
}

#[test]
fn formats_are_checked_and_a_string_holding_json_is_named_as_such() {
    let db = TempStore::new();
    let model = ScriptedModel::new(vec![
        call("s1", "schedule", json!({"when": "yesterday"})),
        call(
            "s2",
            "schedule",
            json!(r#"{"when": "2026-12-01T10:00:00Z"}"#),
        ),
        call("s3", "schedule", json!({"when": "2026-12-01T10:00:00Z"})),
        ModelResponse::answer("scheduled"),
    ]);
    let agent = Agent::new(model.clone()).tool(Schedule);

    run(&db, agent);

    let results = results_seen(&model);
    let ToolResult::Error(bad_format) = &results[0].1 else {
        panic!("a date-time that is not one was accepted: {:?}", results[0]);
    };
    assert!(
        bad_format.contains("is not a \"date-time\""),
        "{bad_format}"
    );
    assert_eq!(
        results[1].1,
        ToolResult::Error(
            "the arguments of a tool call must be a JSON object, not a string holding JSON: \
             {\"when\": \"2026-12-01T10:00:00Z\"}"
                .into()
        )
    );
    assert_eq!(
        results[2].1,
        ToolResult::Ok(json!({"scheduled": "2026-12-01T10:00:00Z"}))
    );
}
