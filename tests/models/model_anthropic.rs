//! The Messages adapter in real runs, against a scripted server on 127.0.0.1: what it sends,
//! how it reads answers, and which failures the model policy retries.

use std::time::Duration;

use agentrt::{Agent, EventKind, ModelPolicy, Outcome, models::anthropic::Anthropic};
use serde_json::{Value, json};

use crate::support::fake_llm::{FakeLlm, Ran, Reply, fast_policy, notify, weather};

const KEY: &str = "sk-ant-test-77e0";

fn message(content: Value, stop_reason: &str) -> Value {
    json!({
        "id": "msg_01", "type": "message", "role": "assistant", "model": "claude-test-20250101",
        "content": content, "stop_reason": stop_reason,
        "usage": {"input_tokens": 40, "output_tokens": 9},
    })
}

fn answer(text: &str) -> Reply {
    Reply::ok(message(json!([{"type": "text", "text": text}]), "end_turn"))
}

fn agent(server: &FakeLlm, policy: ModelPolicy) -> Agent {
    let model = Anthropic::new("claude-test")
        .base_url(server.url())
        .api_key(KEY);
    Agent::new(model)
        .instructions("Be brief.")
        .model_policy(policy)
}

#[test]
fn several_tool_uses_in_one_answer_go_back_as_one_turn_of_results() {
    let server = FakeLlm::start(vec![
        Reply::ok(json!({
            "id": "msg_00", "type": "message", "role": "assistant", "model": "claude-test-20250101",
            "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_a", "name": "weather", "input": {"city": "Oslo"}},
                {"type": "tool_use", "id": "toolu_b", "name": "notify", "input": {"to": "ops"}},
            ],
            "stop_reason": "tool_use",
            "usage": {"input_tokens": 20, "output_tokens": 30,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 100},
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
        assert_eq!(request.path, "/v1/messages");
        assert_eq!(request.header("x-api-key"), Some(KEY));
        assert_eq!(request.header("anthropic-version"), Some("2023-06-01"));
        assert_eq!(request.header("authorization"), None);
        assert_eq!(request.body["model"], "claude-test");
        assert_eq!(request.body["max_tokens"], 4096);
        assert_eq!(request.body["system"], "Be brief.");
        assert_eq!(
            request.body["tools"],
            json!([
                {"name": "notify", "description": "Pages someone.",
                 "input_schema": {"type": "object", "properties": {"to": {"type": "string"}}}},
                {"name": "weather", "description": "The weather in a city.",
                 "input_schema": {
                     "type": "object",
                     "properties": {"city": {"type": "string", "description": "The city's name."}},
                     "required": ["city"]}},
            ])
        );
    }
    let question = json!({"role": "user", "content": [
        {"type": "text", "text": "Weather in Oslo? Page ops."}]});
    assert_eq!(requests[0].body["messages"], json!([question]));
    let messages = requests[1].body["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 3);
    assert_eq!(messages[0], question);
    assert_eq!(
        messages[1],
        json!({"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_a", "name": "weather", "input": {"city": "Oslo"}},
            {"type": "tool_use", "id": "toolu_b", "name": "notify", "input": {"to": "ops"}},
        ]})
    );
    let results = &messages[2];
    assert_eq!(results["role"], "user");
    assert_eq!(results["content"][0]["type"], "tool_result");
    assert_eq!(results["content"][0]["tool_use_id"], "toolu_a");
    assert!(results["content"][0].get("is_error").is_none());
    let output: Value =
        serde_json::from_str(results["content"][0]["content"].as_str().unwrap()).unwrap();
    assert_eq!(output, json!({"sky": "clear", "celsius": 18}));
    assert_eq!(
        results["content"][1],
        json!({"type": "tool_result", "tool_use_id": "toolu_b",
               "content": "the pager is down", "is_error": true})
    );

    // The cached part of the prompt counts as input.
    let first = ran.payload(EventKind::ModelFinished, 1);
    assert_eq!(
        first["usage"],
        json!({"input_tokens": 120, "output_tokens": 30})
    );
    assert_eq!(first["model"], "claude-test-20250101");
    assert_eq!(first["text"], "Checking.");
    let last = ran.payload(EventKind::ModelFinished, 4);
    assert_eq!(
        last["usage"],
        json!({"input_tokens": 40, "output_tokens": 9})
    );
}

#[test]
fn a_rate_limit_is_retried_no_earlier_than_its_retry_after() {
    let server = FakeLlm::start(vec![
        Reply::status(
            429,
            json!({"type": "error", "error": {"type": "rate_limit_error",
                                              "message": "Number of requests has exceeded your rate limit"}}),
        )
        .header("retry-after", "1"),
        answer("done"),
    ]);
    let ran = Ran::of(agent(&server, fast_policy()), json!("hi"));

    assert!(matches!(ran.reply.outcome, Outcome::Succeeded { .. }));
    let requests = server.requests();
    assert_eq!(requests.len(), 2);
    let waited = requests[1].at.duration_since(requests[0].at);
    assert!(waited >= Duration::from_secs(1), "retried after {waited:?}");
    let failed = &ran.payloads(EventKind::ModelAttemptFailed)[0];
    assert_eq!(
        failed["error"],
        "the Anthropic API answered 429 Too Many Requests: \
         Number of requests has exceeded your rate limit"
    );
    assert_eq!(failed["retry_in_ms"], 1000);
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
fn a_server_error_is_retried() {
    let server = FakeLlm::start(vec![
        Reply::status(
            500,
            json!({"type": "error", "error": {"type": "api_error", "message": "Internal server error"}}),
        ),
        answer("done"),
    ]);
    let ran = Ran::of(agent(&server, fast_policy()), json!("hi"));

    assert!(matches!(ran.reply.outcome, Outcome::Succeeded { .. }));
    assert_eq!(server.requests().len(), 2);
    assert_eq!(
        ran.attempt_errors(),
        ["the Anthropic API answered 500 Internal Server Error: Internal server error"]
    );
}

#[test]
fn an_overloaded_api_is_retried() {
    let server = FakeLlm::start(vec![
        Reply::status(
            529,
            json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
        ),
        answer("done"),
    ]);
    let ran = Ran::of(agent(&server, fast_policy()), json!("hi"));

    assert!(matches!(ran.reply.outcome, Outcome::Succeeded { .. }));
    assert_eq!(server.requests().len(), 2);
    assert_eq!(
        ran.attempt_errors(),
        ["the Anthropic API answered 529: Overloaded"]
    );
    assert_eq!(
        ran.model_attempts(1).last(),
        Some(&(EventKind::ModelStarted, 2))
    );
}

#[test]
fn an_api_that_hangs_times_out_and_the_next_attempt_answers() {
    let server = FakeLlm::start(vec![Reply::Hang, answer("done")]);
    let policy = fast_policy().timeout(Duration::from_secs(2));
    let ran = Ran::of(agent(&server, policy), json!("hi"));

    assert!(matches!(ran.reply.outcome, Outcome::Succeeded { .. }));
    assert_eq!(server.requests().len(), 2);
    assert_eq!(ran.attempt_errors(), ["no answer within 2 s"]);
}

#[test]
fn a_malformed_answer_or_a_closed_connection_is_retried() {
    let server = FakeLlm::start(vec![
        Reply::malformed(),
        Reply::ok(json!({"type": "message", "role": "assistant"})),
        Reply::Close,
        answer("done"),
    ]);
    let ran = Ran::of(agent(&server, fast_policy()), json!("hi"));

    assert!(matches!(ran.reply.outcome, Outcome::Succeeded { .. }));
    assert_eq!(server.requests().len(), 4);
    let errors = ran.attempt_errors();
    assert_eq!(errors.len(), 3, "{errors:?}");
    assert!(errors[0].starts_with("the Anthropic API: the answer is not the API's JSON"));
    assert!(
        errors[1].contains("missing field `content`"),
        "{}",
        errors[1]
    );
    assert!(
        errors[2].starts_with("the Anthropic API: the connection failed"),
        "{}",
        errors[2]
    );
    assert_eq!(
        ran.model_attempts(1).last(),
        Some(&(EventKind::ModelStarted, 4))
    );
}

#[test]
fn an_invalid_key_fails_the_run_at_once() {
    let server = FakeLlm::start(vec![Reply::status(
        401,
        json!({"type": "error", "error": {"type": "authentication_error", "message": "invalid x-api-key"}}),
    )]);
    let ran = Ran::of(agent(&server, fast_policy()), json!("hi"));

    let Outcome::Failed { error } = &ran.reply.outcome else {
        panic!("{:?}", ran.reply.outcome)
    };
    assert!(
        error.contains("the Anthropic API answered 401 Unauthorized: invalid x-api-key"),
        "{error}"
    );
    assert_eq!(server.requests().len(), 1);
    assert_eq!(ran.model_attempts(1), [(EventKind::ModelStarted, 1)]);
    let finished = &ran.payloads(EventKind::RunFinished)[0];
    assert_eq!(finished["model_attempts"], 1);
}

/// An answer that stopped at `max_tokens` fails the run: its `tool_use` input may be cut off,
/// and it never runs.
#[test]
fn an_answer_cut_off_at_max_tokens_fails_the_run_and_its_call_never_runs() {
    let server = FakeLlm::start(vec![Reply::ok(message(
        json!([{"type": "tool_use", "id": "toolu_a", "name": "weather", "input": {"city": "Os"}}]),
        "max_tokens",
    ))]);
    let weather = weather();
    let agent = agent(&server, fast_policy()).tool(weather.clone());
    let ran = Ran::of(agent, json!("Weather in Oslo?"));

    let Outcome::Failed { error } = &ran.reply.outcome else {
        panic!("{:?}", ran.reply.outcome)
    };
    assert!(
        error.contains(
            "the Anthropic API: the answer was cut off at the token limit (max_tokens 4096)"
        ),
        "{error}"
    );
    assert!(weather.calls().is_empty());
    assert_eq!(server.requests().len(), 1);
}

/// The API wants a user turn first: a run whose input gives none fails before any request.
#[test]
fn a_run_whose_input_gives_no_user_turn_fails_before_sending() {
    let server = FakeLlm::start(vec![]);
    let ran = Ran::of(agent(&server, fast_policy()), Value::Null);

    let Outcome::Failed { error } = &ran.reply.outcome else {
        panic!("{:?}", ran.reply.outcome)
    };
    assert!(
        error.contains("needs the conversation to open with a user turn"),
        "{error}"
    );
    assert!(error.contains("Agent::map_input"), "{error}");
    assert!(server.requests().is_empty());
    assert_eq!(ran.model_attempts(1), [(EventKind::ModelStarted, 1)]);
}
