//! The Chat Completions adapter in real runs, against a scripted server on 127.0.0.1: what it
//! sends, how it reads answers, and which failures the model policy retries.

use std::time::Duration;

use agentrt::{
    Agent, EventKind, ModelPolicy, Outcome, models::openai::OpenAi, testkit::RecordingTool,
};
use serde_json::{Value, json};

use crate::support::fake_llm::{FakeLlm, Ran, Reply, fast_policy, notify, weather};

const KEY: &str = "sk-test-4f1c9a";

fn completion(message: Value) -> Value {
    json!({
        "id": "chatcmpl-1", "object": "chat.completion", "model": "gpt-test-0613",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 31, "completion_tokens": 7, "total_tokens": 38},
    })
}

fn answer(text: &str) -> Reply {
    Reply::ok(completion(json!({"role": "assistant", "content": text})))
}

fn model(server: &FakeLlm) -> OpenAi {
    OpenAi::new("gpt-test")
        .base_url(format!("{}/v1/", server.url()))
        .api_key(KEY)
}

fn agent(server: &FakeLlm, policy: ModelPolicy) -> Agent {
    Agent::new(model(server))
        .instructions("Be brief.")
        .model_policy(policy)
}

#[test]
fn several_tool_calls_in_one_answer_go_back_with_their_results_tied_to_their_ids() {
    let server = FakeLlm::start(vec![
        Reply::ok(json!({
            "model": "gpt-test-0613",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": null,
                "tool_calls": [
                    {"index": 0, "id": "call_a", "type": "function",
                     "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}},
                    {"index": 1, "id": "call_b", "type": "function",
                     "function": {"name": "notify", "arguments": "{\"to\": \"ops\"}"}},
                ]}}],
            "usage": {"prompt_tokens": 120, "completion_tokens": 25},
        })),
        answer("Clear, 18 degrees."),
    ]);
    let (weather, notify) = (weather(), notify());
    let agent = agent(&server, fast_policy())
        .tool(weather.clone())
        .tool(notify.clone());
    let ran = Ran::of(agent, json!("Weather in Oslo? Page ops."));

    assert_eq!(
        ran.reply.outcome,
        Outcome::Succeeded {
            output: "Clear, 18 degrees.".into()
        }
    );
    assert_eq!(weather.calls(), [json!({"city": "Oslo"})]);
    assert_eq!(notify.calls(), [json!({"to": "ops"})]);

    let requests = server.requests();
    assert_eq!(requests.len(), 2);
    for request in &requests {
        assert_eq!(request.method, "POST");
        assert_eq!(request.path, "/v1/chat/completions");
        assert_eq!(
            request.header("authorization"),
            Some(format!("Bearer {KEY}").as_str())
        );
        assert_eq!(request.header("content-type"), Some("application/json"));
        assert_eq!(request.body["model"], "gpt-test");
        assert_eq!(request.body["tool_choice"], "auto");
        // In name order, each with its description and schema.
        assert_eq!(
            request.body["tools"],
            json!([
                {"type": "function", "function": {
                    "name": "notify", "description": "Pages someone.",
                    "parameters": {"type": "object", "properties": {"to": {"type": "string"}}}}},
                {"type": "function", "function": {
                    "name": "weather", "description": "The weather in a city.",
                    "parameters": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "description": "The city's name."}},
                        "required": ["city"]}}},
            ])
        );
    }
    let opening = json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo? Page ops."},
    ]);
    assert_eq!(requests[0].body["messages"], opening);
    let messages = requests[1].body["messages"].as_array().unwrap();
    assert_eq!(messages[..2], opening.as_array().unwrap()[..]);
    assert_eq!(
        messages[2],
        json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_a", "type": "function",
             "function": {"name": "weather", "arguments": "{\"city\":\"Oslo\"}"}},
            {"id": "call_b", "type": "function",
             "function": {"name": "notify", "arguments": "{\"to\":\"ops\"}"}},
        ]})
    );
    assert_eq!(messages[3]["role"], "tool");
    assert_eq!(messages[3]["tool_call_id"], "call_a");
    let output: Value = serde_json::from_str(messages[3]["content"].as_str().unwrap()).unwrap();
    assert_eq!(output, json!({"sky": "clear", "celsius": 18}));
    assert_eq!(
        messages[4],
        json!({"role": "tool", "tool_call_id": "call_b",
               "content": "Error: the tool call failed: the pager is down"})
    );
    assert_eq!(messages.len(), 5);

    // Steps: 1 the model, 2 and 3 the calls, 4 the model again.
    let first = ran.payload(EventKind::ModelFinished, 1);
    assert_eq!(
        first["usage"],
        json!({"input_tokens": 120, "output_tokens": 25})
    );
    assert_eq!(first["model"], "gpt-test-0613");
    let last = ran.payload(EventKind::ModelFinished, 4);
    assert_eq!(
        last["usage"],
        json!({"input_tokens": 31, "output_tokens": 7})
    );
    assert_eq!(ran.model_attempts(1), [(EventKind::ModelStarted, 1)]);
}

#[test]
fn a_rate_limit_is_retried_no_earlier_than_its_retry_after() {
    let server = FakeLlm::start(vec![
        Reply::status(
            429,
            json!({"error": {"message": "Rate limit reached for requests", "type": "requests"}}),
        )
        .header("Retry-After", "1"),
        answer("done"),
    ]);
    let ran = Ran::of(agent(&server, fast_policy()), json!("hi"));

    assert_eq!(
        ran.reply.outcome,
        Outcome::Succeeded {
            output: "done".into()
        }
    );
    let requests = server.requests();
    assert_eq!(requests.len(), 2);
    let waited = requests[1].at.duration_since(requests[0].at);
    assert!(waited >= Duration::from_secs(1), "retried after {waited:?}");
    assert_eq!(
        ran.model_attempts(1),
        [
            (EventKind::ModelStarted, 1),
            (EventKind::ModelAttemptFailed, 1),
            (EventKind::ModelStarted, 2),
        ]
    );
    let failed = &ran.payloads(EventKind::ModelAttemptFailed)[0];
    assert_eq!(
        failed["error"],
        "the chat completions server answered 429 Too Many Requests: Rate limit reached for requests"
    );
    assert_eq!(failed["retry_in_ms"], 1000);
    // The retry sends the same conversation.
    assert_eq!(requests[0].body, requests[1].body);
}

#[test]
fn a_server_error_is_retried() {
    let server = FakeLlm::start(vec![
        Reply::status(
            500,
            json!({"error": {"message": "The server had an error"}}),
        ),
        answer("done"),
    ]);
    let ran = Ran::of(agent(&server, fast_policy()), json!("hi"));

    assert!(matches!(ran.reply.outcome, Outcome::Succeeded { .. }));
    assert_eq!(server.requests().len(), 2);
    assert_eq!(
        ran.attempt_errors(),
        ["the chat completions server answered 500 Internal Server Error: The server had an error"]
    );
    assert_eq!(
        ran.model_attempts(1).last(),
        Some(&(EventKind::ModelStarted, 2))
    );
    let finished = ran.payload(EventKind::ModelFinished, 1);
    assert_eq!(finished["usage"]["input_tokens"], 31);
}

#[test]
fn a_server_that_hangs_times_out_and_the_next_attempt_answers() {
    let server = FakeLlm::start(vec![Reply::Hang, answer("done")]);
    let policy = fast_policy().timeout(Duration::from_secs(2));
    let ran = Ran::of(agent(&server, policy), json!("hi"));

    assert!(matches!(ran.reply.outcome, Outcome::Succeeded { .. }));
    assert_eq!(server.requests().len(), 2);
    assert_eq!(ran.attempt_errors(), ["no answer within 2 s"]);
    assert_eq!(
        ran.model_attempts(1),
        [
            (EventKind::ModelStarted, 1),
            (EventKind::ModelAttemptFailed, 1),
            (EventKind::ModelStarted, 2),
        ]
    );
}

#[test]
fn a_malformed_or_truncated_answer_is_retried() {
    let server = FakeLlm::start(vec![Reply::malformed(), Reply::truncated(), answer("done")]);
    let ran = Ran::of(agent(&server, fast_policy()), json!("hi"));

    assert!(matches!(ran.reply.outcome, Outcome::Succeeded { .. }));
    assert_eq!(server.requests().len(), 3);
    let errors = ran.attempt_errors();
    assert_eq!(errors.len(), 2);
    assert!(
        errors[0].starts_with("the chat completions server: the answer is not the API's JSON"),
        "{}",
        errors[0]
    );
    assert!(
        errors[1].starts_with("the chat completions server: the answer was cut off"),
        "{}",
        errors[1]
    );
    assert_eq!(
        ran.model_attempts(1).last(),
        Some(&(EventKind::ModelStarted, 3))
    );
}

#[test]
fn a_connection_closed_without_an_answer_is_retried() {
    let server = FakeLlm::start(vec![Reply::Close, answer("done")]);
    let ran = Ran::of(agent(&server, fast_policy()), json!("hi"));

    assert!(matches!(ran.reply.outcome, Outcome::Succeeded { .. }));
    assert_eq!(server.requests().len(), 2);
    let errors = ran.attempt_errors();
    assert_eq!(errors.len(), 1);
    assert!(
        errors[0].starts_with("the chat completions server: the connection failed"),
        "{}",
        errors[0]
    );
}

#[test]
fn an_unauthorized_request_fails_the_run_at_once_without_naming_the_key() {
    let server = FakeLlm::start(vec![Reply::status(
        401,
        json!({"error": {"message": format!("Incorrect API key provided: {KEY}"),
                         "type": "invalid_request_error", "code": "invalid_api_key"}}),
    )]);
    let ran = Ran::of(agent(&server, fast_policy()), json!("hi"));

    let expected = "the chat completions server answered 401 Unauthorized: \
                    Incorrect API key provided: [redacted]";
    let Outcome::Failed { error } = &ran.reply.outcome else {
        panic!("{:?}", ran.reply.outcome)
    };
    assert!(error.contains(expected), "{error}");
    assert!(!error.contains(KEY));
    assert_eq!(server.requests().len(), 1);
    assert_eq!(ran.model_attempts(1), [(EventKind::ModelStarted, 1)]);
    assert_eq!(ran.payload(EventKind::ModelFinished, 1)["error"], expected);
    let finished = &ran.payloads(EventKind::RunFinished)[0];
    assert_eq!(finished["state"], "FAILED");
    assert_eq!(finished["model_attempts"], 1);
}

#[test]
fn a_run_fails_once_the_policy_gives_up_with_the_attempts_counted() {
    let unavailable = || Reply::status(503, json!({"error": "loading model"}));
    let server = FakeLlm::start(vec![unavailable(), unavailable(), unavailable()]);
    let ran = Ran::of(agent(&server, fast_policy().max_attempts(3)), json!("hi"));

    assert!(matches!(ran.reply.outcome, Outcome::Failed { .. }));
    assert_eq!(server.requests().len(), 3);
    assert_eq!(
        ran.model_attempts(1),
        [
            (EventKind::ModelStarted, 1),
            (EventKind::ModelAttemptFailed, 1),
            (EventKind::ModelStarted, 2),
            (EventKind::ModelAttemptFailed, 2),
            (EventKind::ModelStarted, 3),
        ]
    );
    let finished = &ran.payloads(EventKind::RunFinished)[0];
    assert_eq!(finished["model_attempts"], 3);
    assert!(
        finished["error"]
            .as_str()
            .unwrap()
            .contains("503 Service Unavailable: loading model"),
        "{finished}"
    );
}

/// A local server's answer: no key, no usage, no model, a call without id or index whose
/// arguments are an object, and a call whose arguments are not JSON.
#[test]
fn a_local_servers_variations_are_tolerated() {
    let server = FakeLlm::start(vec![
        Reply::ok(
            json!({"choices": [{"message": {"content": "", "tool_calls": [
                {"function": {"name": "lookup", "arguments": {"id": 7}}},
                {"id": "x1", "function": {"name": "lookup", "arguments": "{\"id\": 7"}},
            ]}}]}),
        ),
        Reply::ok(json!({"choices": [{"message": {"content": "found"}}]})),
    ]);
    let lookup = RecordingTool::new("lookup");
    let agent = Agent::new(OpenAi::new("local").base_url(format!("{}/v1", server.url())))
        .tool(lookup.clone())
        .model_policy(fast_policy());
    let ran = Ran::of(agent, json!("find 7"));

    assert_eq!(
        ran.reply.outcome,
        Outcome::Succeeded {
            output: "found".into()
        }
    );
    let requests = server.requests();
    assert_eq!(requests[0].header("authorization"), None);
    assert_eq!(
        requests[0].body["messages"],
        json!([{"role": "user", "content": "find 7"}])
    );
    // The call without an id got one from the run loop; the one that is not JSON never ran.
    let executions = lookup.executions();
    assert_eq!(executions.len(), 1);
    assert_eq!(executions[0].args, json!({"id": 7}));
    let id = executions[0].call_id.clone();
    assert!(!id.is_empty());

    let messages = requests[1].body["messages"].as_array().unwrap();
    let calls = &messages[1]["tool_calls"];
    assert_eq!(calls[0]["id"], json!(id));
    assert_eq!(calls[0]["function"]["arguments"], "{\"id\":7}");
    assert_eq!(calls[1]["id"], "x1");
    // Not what the model wrote: servers that parse the history's arguments refuse text that
    // is not JSON. The refusal below tells the model.
    assert_eq!(calls[1]["function"]["arguments"], "{}");
    assert_eq!(messages[2]["tool_call_id"], json!(id));
    assert_eq!(messages[3]["tool_call_id"], "x1");
    let refusal = messages[3]["content"].as_str().unwrap();
    assert!(
        refusal.starts_with("Error: the tool call failed: "),
        "{refusal}"
    );

    let finished = ran.payload(EventKind::ModelFinished, 1);
    assert!(finished.get("usage").is_none(), "{finished}");
    assert!(finished.get("model").is_none(), "{finished}");
}

/// An answer that stopped at the token limit fails the run: its call's arguments may be cut
/// off, and it never runs.
#[test]
fn an_answer_cut_off_at_the_token_limit_fails_the_run_and_its_call_never_runs() {
    let server = FakeLlm::start(vec![Reply::ok(json!({
        "choices": [{"index": 0, "finish_reason": "length", "message": {
            "role": "assistant", "content": null, "tool_calls": [
                {"id": "call_a", "type": "function",
                 "function": {"name": "weather", "arguments": "{\"city\": \"Os"}}]}}],
    }))]);
    let weather = weather();
    let agent = Agent::new(model(&server).max_tokens(32))
        .tool(weather.clone())
        .model_policy(fast_policy());
    let ran = Ran::of(agent, json!("Weather in Oslo?"));

    let Outcome::Failed { error } = &ran.reply.outcome else {
        panic!("{:?}", ran.reply.outcome)
    };
    assert!(
        error.contains("the answer was cut off at the token limit (max_tokens 32)"),
        "{error}"
    );
    assert!(weather.calls().is_empty());
    assert_eq!(server.requests().len(), 1);
    assert_eq!(ran.model_attempts(1), [(EventKind::ModelStarted, 1)]);
}

/// A failed connection's message names the server's scheme and host, never the key, the base
/// URL's password, or the rest of the URL.
#[test]
fn an_error_names_the_host_but_no_secret_of_the_url() {
    // A port that was free a moment ago: nothing listens on it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let model = OpenAi::new("gpt-test")
        .base_url(format!(
            "http://bob:pw-77aa@127.0.0.1:{port}/v1?token=tok-91bb"
        ))
        .api_key(KEY);
    let agent = Agent::new(model).model_policy(fast_policy().max_attempts(1));
    let ran = Ran::of(agent, json!("hi"));

    let Outcome::Failed { error } = &ran.reply.outcome else {
        panic!("{:?}", ran.reply.outcome)
    };
    assert!(
        error.contains(&format!("could not connect (http://127.0.0.1:{port})")),
        "{error}"
    );
    for secret in [KEY, "bob", "pw-77aa", "tok-91bb", "/v1"] {
        assert!(!error.contains(secret), "{secret} in {error}");
    }
}
