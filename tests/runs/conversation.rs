//! The conversation a model is given: the agent's instructions, the run's input as the user's
//! turn, then every response and tool result in order; a denial's note reaches the model.

use agentrt::{
    Agent, Approval, Message, ModelResponse, Outcome, RecordApproval, RequireApprovalFor,
    ResumeRun, StartRun, Supervisor, ToolCall, ToolResult,
    testkit::{RecordingTool, ScriptedModel, TempStore, with_system},
};
use serde_json::{Value, json};

fn first_request(agent: Agent, model: &ScriptedModel, input: Value) -> Vec<Message> {
    let db = TempStore::new();
    let store = db.open();
    with_system(|| async move {
        let supervisor = Supervisor::builder(store)
            .agent("a", agent)
            .start()
            .unwrap();
        supervisor.send(StartRun::new("a", input)).await.unwrap()
    })
    .unwrap();
    model.seen().remove(0)
}

fn system(text: &str) -> Message {
    Message::System { text: text.into() }
}

fn user(text: &str) -> Message {
    Message::User { text: text.into() }
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
    let store = db.open();

    let outcome = with_system(|| async move {
        let supervisor = Supervisor::builder(store)
            .agent("a", agent)
            .start()
            .unwrap();
        let reply = supervisor
            .send(StartRun::new("a", json!("refund order 7")).with_id("run-1"))
            .await
            .unwrap()
            .unwrap();
        assert!(matches!(reply.outcome, Outcome::WaitingForApproval { .. }));
        let denial = Approval::deny("run-1", "r1", "carol").note("not eligible: past 90 days");
        supervisor
            .send(RecordApproval(denial))
            .await
            .unwrap()
            .unwrap();
        supervisor
            .send(ResumeRun::new("run-1"))
            .await
            .unwrap()
            .unwrap()
            .outcome
    });

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
        &Message::Tool {
            call_id: "r1".into(),
            name: "refund".into(),
            result: ToolResult::Error(
                "the call was denied: denied by carol: not eligible: past 90 days".into()
            ),
        }
    );
}
