//! The conversation a model is given: the agent's instructions, the run's input as the user's
//! turn, then every response and tool result in order; a denial's note reaches the model.

use agentrt::{
    Agent, Approval, ChatMessage, Config, ModelResponse, Outcome, RequireApprovalFor, StartRun,
    ToolCall, ToolResult,
    testkit::{RecordingTool, ScriptedModel, TempStore},
};
use serde_json::{Value, json};

use crate::support::{ask, start_then_decide};

fn first_request(agent: Agent, model: &ScriptedModel, input: Value) -> Vec<ChatMessage> {
    let db = TempStore::new();
    ask(
        db.open(),
        Config::default(),
        "a",
        agent,
        StartRun::new("a", input),
    )
    .unwrap();
    model.seen().remove(0)
}

fn system(text: &str) -> ChatMessage {
    ChatMessage::System { text: text.into() }
}

fn user(text: &str) -> ChatMessage {
    ChatMessage::User { text: text.into() }
}

#[test]
fn the_conversation_opens_with_the_instructions_then_the_input() {
    let model = ScriptedModel::new(vec![ModelResponse::answer("on its way")]);
    let agent = Agent::new(model.clone()).instructions("You track parcels. Be brief.");

    let seen = first_request(agent, &model, json!("Where is parcel 7?"));

    assert_eq!(
        seen,
        [
            system("You track parcels. Be brief."),
            user("Where is parcel 7?")
        ]
    );
}

#[test]
fn an_input_that_is_not_a_string_is_given_as_its_json_and_null_as_nothing() {
    let model = ScriptedModel::new(vec![ModelResponse::answer("ok")]);
    let seen = first_request(Agent::new(model.clone()), &model, json!({"parcel": 7}));
    assert_eq!(seen, [user(r#"{"parcel":7}"#)]);

    let model = ScriptedModel::new(vec![ModelResponse::answer("ok")]);
    let seen = first_request(Agent::new(model.clone()), &model, Value::Null);
    assert_eq!(seen, []);
}

#[test]
fn an_agent_may_map_its_input_to_its_own_opening_turns() {
    let model = ScriptedModel::new(vec![ModelResponse::answer("ok")]);
    let agent = Agent::new(model.clone())
        .instructions("Answer in French.")
        .map_input(|input| {
            vec![
                user("Here is an example: parcel 1 is in Lyon."),
                user(&format!("Where is parcel {}?", input["parcel"])),
            ]
        });

    let seen = first_request(agent, &model, json!({"parcel": 7}));

    assert_eq!(
        seen,
        [
            system("Answer in French."),
            user("Here is an example: parcel 1 is in Lyon."),
            user("Where is parcel 7?"),
        ]
    );
}

#[test]
fn a_denials_note_reaches_the_model() {
    let db = TempStore::new();
    let refund = RecordingTool::new("refund");
    let model = ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new("r1", "refund", json!({"order": 7}))]),
        ModelResponse::answer("I could not refund it."),
    ]);
    let agent = Agent::new(model.clone())
        .tool(refund.clone())
        .policy(RequireApprovalFor::tools(["refund"]));
    let start = StartRun::new("a", json!("refund order 7")).with_id("run-1");
    let denial = Approval::deny("run-1", "r1", "carol").note("not eligible: past 90 days");

    let outcome = start_then_decide(db.open(), Config::default(), "a", agent, start, denial);

    assert_eq!(
        outcome,
        Outcome::Succeeded {
            output: "I could not refund it.".into()
        }
    );
    assert!(refund.executions().is_empty());
    let last = model.seen().pop().unwrap();
    assert_eq!(
        last.last().unwrap(),
        &ChatMessage::Tool {
            call_id: "r1".into(),
            name: "refund".into(),
            result: ToolResult::Error(
                "the call was denied: denied by carol: not eligible: past 90 days".into()
            ),
        }
    );
}
