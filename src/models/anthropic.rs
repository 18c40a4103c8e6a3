//! Anthropic's Messages API (`POST {base_url}/v1/messages`).

use std::fmt;

use async_trait::async_trait;
use reqwest::header::HeaderValue;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::http::{cut_off, excerpt};
use super::options::{HttpOptions, http_setters};
use crate::agent::{Model, ModelError, ModelRequest};
use crate::types::{ChatMessage, ModelResponse, ToolCall, ToolResult, ToolSpec, Usage};

/// Where [`Anthropic`] sends its requests unless told otherwise.
pub const DEFAULT_BASE_URL: &str = "https://api.anthropic.com";

/// The `anthropic-version` header sent unless told otherwise.
pub const DEFAULT_VERSION: &str = "2023-06-01";

/// The `max_tokens` of a request unless told otherwise (the API requires one).
pub const DEFAULT_MAX_TOKENS: u32 = 4096;

/// A model behind Anthropic's Messages API.
///
/// ```no_run
/// use agentrt::models::anthropic::Anthropic;
///
/// let model = Anthropic::new("claude-sonnet-4-5")
///     .api_key(std::env::var("ANTHROPIC_API_KEY").unwrap())
///     .max_tokens(2048);
/// // Or whatever ANTHROPIC_API_KEY and ANTHROPIC_BASE_URL say.
/// let configured = Anthropic::from_env("claude-sonnet-4-5");
/// ```
///
/// Each [`complete`](Model::complete) makes one request: the agent's instructions as
/// `system`, the rest of the conversation as `messages` (a tool call as a `tool_use` block,
/// its result as a `tool_result` block, consecutive results in one user turn), and the agent's
/// tools as `tools`. See `docs/models.md` for how answers are read and which failures are
/// retried.
#[derive(Clone)]
pub struct Anthropic {
    model: String,
    version: String,
    max_tokens: u32,
    http: HttpOptions,
}

impl Anthropic {
    /// The model named `model` on Anthropic's API, with no key (set one with
    /// [`api_key`](Self::api_key), or use [`from_env`](Self::from_env)).
    pub fn new(model: impl Into<String>) -> Self {
        Anthropic {
            model: model.into(),
            version: DEFAULT_VERSION.to_owned(),
            max_tokens: DEFAULT_MAX_TOKENS,
            http: HttpOptions::new(DEFAULT_BASE_URL),
        }
    }

    /// The model named `model`, with the key `ANTHROPIC_API_KEY` (else none), at
    /// `ANTHROPIC_BASE_URL` (else [`DEFAULT_BASE_URL`]), each without surrounding blanks. An
    /// empty variable counts as unset.
    pub fn from_env(model: impl Into<String>) -> Self {
        let mut adapter = Anthropic::new(model);
        adapter
            .http
            .read_env("ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY");
        adapter
    }

    http_setters! {
        /// The API's root, without the version: `https://api.anthropic.com`. Requests go to
        /// `{base_url}/v1/messages`.
        base_url;
        /// Sent as `x-api-key`. Without one no such header is sent (a gateway that adds it).
        api_key;
        header: "`anthropic-beta`";
        body_field: "`top_k` or `metadata`";
    }

    /// The `anthropic-version` header ([`DEFAULT_VERSION`] unless set).
    pub fn version(mut self, version: impl Into<String>) -> Self {
        self.version = version.into();
        self
    }

    /// The most tokens an answer may have ([`DEFAULT_MAX_TOKENS`] unless set).
    pub fn max_tokens(mut self, max_tokens: u32) -> Self {
        self.max_tokens = max_tokens;
        self
    }

    /// The request body for `request`.
    fn body(&self, request: &ModelRequest<'_>) -> Value {
        let mut body = Map::new();
        body.insert("model".into(), json!(self.model));
        body.insert("max_tokens".into(), json!(self.max_tokens));
        let system: Vec<&str> = request
            .messages
            .iter()
            .filter_map(|m| match m {
                ChatMessage::System { text } => Some(text.as_str()),
                _ => None,
            })
            .collect();
        if !system.is_empty() {
            body.insert("system".into(), json!(system.join("\n\n")));
        }
        body.insert("messages".into(), json!(turns(request.messages)));
        if !request.tools.is_empty() {
            body.insert("tools".into(), request.tools.iter().map(tool).collect());
        }
        self.http.finish_body(body)
    }

    /// The `max_tokens` sent: a body field replaces [`max_tokens`](Self::max_tokens).
    fn token_limit(&self) -> u64 {
        self.http
            .body
            .get("max_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(u64::from(self.max_tokens))
    }
}

impl fmt::Debug for Anthropic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("Anthropic");
        debug.field("model", &self.model);
        self.http.debug_fields(&mut debug);
        debug
            .field("version", &self.version)
            .field("max_tokens", &self.max_tokens)
            .finish_non_exhaustive()
    }
}

#[async_trait(?Send)]
impl Model for Anthropic {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        let api = self.http.api("the Anthropic API");
        let body = self.body(&request);
        opens_with_user(&body["messages"])?;
        let mut post = self
            .http
            .post("/v1/messages", &body)?
            .header("anthropic-version", self.version.as_str());
        if let Some(key) = &self.http.api_key {
            let mut value = HeaderValue::from_str(key).map_err(|_| {
                ModelError::fatal("the Anthropic API key is not a valid header value")
            })?;
            value.set_sensitive(true);
            post = post.header("x-api-key", value);
        }
        let answer: Answer = api.send(self.http.with_headers(post)?).await?;
        answer
            .into_response(self.token_limit())
            .map_err(|why| api.unusable(&why))
    }
}

/// The API refuses a conversation that does not open with a user turn (with a 400 that does
/// not say why in terms of the run): fail before sending, saying where the turn comes from.
fn opens_with_user(turns: &Value) -> Result<(), ModelError> {
    let why = match turns.get(0).map(|turn| &turn["role"]) {
        Some(role) if role == "user" => return Ok(()),
        Some(_) => "the run's input opens it with an answer",
        None => "the run's input gave none",
    };
    Err(ModelError::fatal(format!(
        "the Anthropic Messages API needs the conversation to open with a user turn; {why} \
         (a null or empty input gives none) — see Agent::map_input"
    )))
}

fn tool(spec: &ToolSpec) -> Value {
    let mut tool = json!({ "name": spec.name, "input_schema": spec.parameters });
    if !spec.description.is_empty() {
        tool["description"] = json!(spec.description);
    }
    tool
}

/// The conversation after its system messages, as the API's turns: a turn's content blocks in
/// order, and consecutive messages of one role in one turn (the results of one answer's calls
/// are one user turn).
fn turns(messages: &[ChatMessage]) -> Vec<Value> {
    let mut turns: Vec<(&'static str, Vec<Value>)> = Vec::new();
    for message in messages {
        let (role, blocks) = match message {
            ChatMessage::System { .. } => continue,
            ChatMessage::User { text } => ("user", text_block(text).into_iter().collect()),
            ChatMessage::Assistant(response) => {
                let text = response.text.as_deref().and_then(text_block);
                let calls = response.tool_calls.iter().map(|call| {
                    // The API takes an object only; a call whose arguments were not one was
                    // refused, and the result that follows tells the model so.
                    let input = match &call.args {
                        Value::Object(_) => call.args.clone(),
                        _ => json!({}),
                    };
                    json!({ "type": "tool_use", "id": call.id, "name": call.name, "input": input })
                });
                ("assistant", text.into_iter().chain(calls).collect())
            }
            ChatMessage::Tool {
                call_id, result, ..
            } => {
                let mut block = json!({ "type": "tool_result", "tool_use_id": call_id });
                match result {
                    ToolResult::Ok(output) => block["content"] = json!(output.to_string()),
                    ToolResult::Error(error) => {
                        // The API refuses an empty text; a failure is still worth a word.
                        let error = if error.trim().is_empty() {
                            "error"
                        } else {
                            error
                        };
                        block["content"] = json!(error);
                        block["is_error"] = json!(true);
                    }
                }
                ("user", vec![block])
            }
        };
        // The API refuses a turn with no content.
        if blocks.is_empty() {
            continue;
        }
        match turns.last_mut() {
            Some((last, content)) if *last == role => content.extend(blocks),
            _ => turns.push((role, blocks)),
        }
    }
    turns
        .into_iter()
        .map(|(role, content)| json!({ "role": role, "content": content }))
        .collect()
}

/// The API refuses an empty text block.
fn text_block(text: &str) -> Option<Value> {
    (!text.is_empty()).then(|| json!({ "type": "text", "text": text }))
}

/// A message, as much of it as is read.
#[derive(Deserialize)]
struct Answer {
    #[serde(default)]
    model: Option<String>,
    content: Vec<Block>,
    #[serde(default)]
    stop_reason: Option<String>,
    #[serde(default)]
    usage: Option<AnswerUsage>,
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Block {
    Text {
        text: String,
    },
    ToolUse {
        #[serde(default)]
        id: String,
        name: String,
        #[serde(default)]
        input: Value,
    },
    /// Thinking, server tools' blocks, and whatever comes next: not part of the answer.
    #[serde(other)]
    Other,
}

#[derive(Deserialize)]
struct AnswerUsage {
    #[serde(default)]
    input_tokens: u64,
    #[serde(default)]
    output_tokens: u64,
    #[serde(default)]
    cache_creation_input_tokens: Option<u64>,
    #[serde(default)]
    cache_read_input_tokens: Option<u64>,
}

impl Answer {
    /// The answer, or why the model gave none to use (a fatal error: the same request stops
    /// the same way). `limit` is the `max_tokens` sent, which a message about a cut-off answer
    /// names.
    fn into_response(self, limit: u64) -> Result<ModelResponse, String> {
        let mut text = String::new();
        let mut tool_calls = Vec::new();
        for block in self.content {
            match block {
                Block::Text { text: part } => text.push_str(&part),
                Block::ToolUse { id, name, input } => {
                    let args = if input.is_null() { json!({}) } else { input };
                    tool_calls.push(ToolCall { id, name, args });
                }
                Block::Other => {}
            }
        }
        // Other reasons ("end_turn", "tool_use", "stop_sequence", any new one) end a usable
        // answer.
        match self.stop_reason.as_deref() {
            // A cut-off `tool_use` input must never run: no call is returned.
            Some("max_tokens") => {
                return Err(cut_off(Some(("max_tokens", limit)), tool_calls.len()));
            }
            Some("model_context_window_exceeded") => {
                return Err(format!(
                    "the answer was cut off where the conversation filled the model's context \
                     window, so it is incomplete{}",
                    if tool_calls.is_empty() {
                        ""
                    } else {
                        "; its tool calls were not run"
                    }
                ));
            }
            Some("refusal") => {
                let mut why = "the model refused to answer (stop_reason refusal)".to_owned();
                if !text.is_empty() {
                    why.push_str(": ");
                    why.push_str(&excerpt(&text));
                }
                return Err(why);
            }
            Some("pause_turn") => {
                return Err(
                    "the API paused the turn (stop_reason pause_turn), which it does \
                            for server tools; server tools are not supported"
                        .into(),
                );
            }
            _ => {}
        }
        // `input_tokens` leaves out the cached part of the prompt, which `Usage` counts.
        let usage = self.usage.map(|usage| Usage {
            input_tokens: usage.input_tokens
                + usage.cache_creation_input_tokens.unwrap_or(0)
                + usage.cache_read_input_tokens.unwrap_or(0),
            output_tokens: usage.output_tokens,
        });
        Ok(ModelResponse {
            text: (!text.is_empty()).then_some(text),
            tool_calls,
            usage,
            model: self.model,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::RunId;

    #[test]
    fn the_request_has_a_system_prompt_turns_and_tools() {
        let messages = vec![
            ChatMessage::System {
                text: "One.".into(),
            },
            ChatMessage::System {
                text: "Two.".into(),
            },
            ChatMessage::User {
                text: "Weather?".into(),
            },
            ChatMessage::Assistant(ModelResponse {
                text: Some("Looking.".into()),
                ..ModelResponse::calls(vec![
                    ToolCall::new("c1", "weather", json!({"city": "Oslo"})),
                    ToolCall::new("c2", "weather", Value::String("{".into())),
                ])
            }),
            ChatMessage::Tool {
                call_id: "c1".into(),
                name: "weather".into(),
                result: ToolResult::Ok(json!({"sky": "clear"})),
            },
            ChatMessage::Tool {
                call_id: "c2".into(),
                name: "weather".into(),
                result: ToolResult::Error("not JSON".into()),
            },
        ];
        let tools = vec![ToolSpec {
            name: "weather".into(),
            description: String::new(),
            parameters: json!({"type": "object"}),
        }];
        let run_id = RunId::from("r");
        let request = ModelRequest {
            run_id: &run_id,
            step: 3,
            attempt: 1,
            input: &Value::Null,
            messages: &messages,
            tools: &tools,
        };
        assert_eq!(
            Anthropic::new("m").max_tokens(100).body(&request),
            json!({
                "model": "m",
                "max_tokens": 100,
                "system": "One.\n\nTwo.",
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                    {"role": "assistant", "content": [
                        {"type": "text", "text": "Looking."},
                        {"type": "tool_use", "id": "c1", "name": "weather", "input": {"city": "Oslo"}},
                        {"type": "tool_use", "id": "c2", "name": "weather", "input": {}},
                    ]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": "c1", "content": "{\"sky\":\"clear\"}"},
                        {"type": "tool_result", "tool_use_id": "c2", "content": "not JSON", "is_error": true},
                    ]},
                ],
                "tools": [{"name": "weather", "input_schema": {"type": "object"}}],
            })
        );
    }

    #[test]
    fn an_answer_joins_its_text_and_keeps_its_calls_and_usage() {
        let answer: Answer = serde_json::from_value(json!({
            "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test",
            "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"},
                {"type": "text", "text": "Let me "},
                {"type": "text", "text": "look."},
                {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Oslo"}},
                {"type": "tool_use", "id": "t2", "name": "clock"},
            ],
            "stop_reason": "tool_use",
            "usage": {"input_tokens": 10, "output_tokens": 4,
                      "cache_creation_input_tokens": 5, "cache_read_input_tokens": 100},
        }))
        .unwrap();
        assert_eq!(
            answer.into_response(100).unwrap(),
            ModelResponse {
                text: Some("Let me look.".into()),
                tool_calls: vec![
                    ToolCall::new("t1", "weather", json!({"city": "Oslo"})),
                    ToolCall::new("t2", "clock", json!({})),
                ],
                usage: Some(Usage {
                    input_tokens: 115,
                    output_tokens: 4
                }),
                model: Some("claude-test".into()),
            }
        );
        let bare: Answer = serde_json::from_value(json!({"content": []})).unwrap();
        assert_eq!(bare.into_response(100).unwrap(), ModelResponse::default());
    }

    #[test]
    fn a_conversation_must_open_with_a_user_turn() {
        let opening = |messages: Vec<ChatMessage>| {
            let run_id = RunId::from("r");
            let request = ModelRequest {
                run_id: &run_id,
                step: 1,
                attempt: 1,
                input: &Value::Null,
                messages: &messages,
                tools: &[],
            };
            opens_with_user(&Anthropic::new("m").body(&request)["messages"])
        };
        let system = || ChatMessage::System {
            text: "Be brief.".into(),
        };
        let none = opening(vec![system()]).unwrap_err();
        assert!(!none.is_retryable());
        assert!(
            none.message().starts_with(
                "the Anthropic Messages API needs the conversation to open with a user turn; \
                 the run's input gave none"
            ),
            "{}",
            none.message()
        );
        // An empty user text is left out: no turn either.
        let empty = ChatMessage::User { text: "".into() };
        assert!(opening(vec![system(), empty]).is_err());
        let answer = ChatMessage::Assistant(ModelResponse::answer("Hi."));
        assert!(
            opening(vec![answer])
                .unwrap_err()
                .message()
                .contains("opens it with an answer")
        );
        let user = ChatMessage::User { text: "Hi".into() };
        assert_eq!(opening(vec![system(), user]), Ok(()));
    }

    #[test]
    fn an_empty_failure_is_sent_as_a_word() {
        let turns = turns(&[ChatMessage::Tool {
            call_id: "c1".into(),
            name: "f".into(),
            result: ToolResult::Error(String::new()),
        }]);
        assert_eq!(
            turns[0]["content"][0],
            json!({"type": "tool_result", "tool_use_id": "c1", "content": "error", "is_error": true})
        );
    }

    #[test]
    fn debug_shows_no_key_header_value_or_password() {
        let adapter = Anthropic::new("m")
            .base_url("https://bob:pw-9d2e@gateway.example.com")
            .api_key("sk-ant-key-5a7b")
            .header("X-Gateway-Token", "tok-3c8f");
        let shown = format!("{adapter:?}");
        for secret in ["sk-ant-key-5a7b", "tok-3c8f", "pw-9d2e", "bob"] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
        assert!(shown.contains("X-Gateway-Token"), "{shown}");
    }

    fn stopped(stop_reason: &str, content: Value) -> String {
        let answer: Answer =
            serde_json::from_value(json!({"content": content, "stop_reason": stop_reason}))
                .unwrap();
        answer.into_response(256).unwrap_err()
    }

    #[test]
    fn an_answer_that_stopped_without_an_answer_to_use_is_an_error() {
        let cut = json!([
            {"type": "text", "text": "Let me"},
            {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Os"}},
        ]);
        assert_eq!(
            stopped("max_tokens", cut),
            "the answer was cut off at the token limit (max_tokens 256), so it is incomplete; \
             its tool call was not run: raise the limit, or ask for a shorter answer"
        );
        assert_eq!(
            stopped("refusal", json!([{"type": "text", "text": "I won't."}])),
            "the model refused to answer (stop_reason refusal): I won't."
        );
        assert!(
            stopped("pause_turn", json!([])).contains("server tools are not supported"),
            "pause_turn"
        );
        let unknown: Answer = serde_json::from_value(json!({
            "content": [{"type": "text", "text": "hi"}], "stop_reason": "something_new"}))
        .unwrap();
        assert_eq!(
            unknown.into_response(256).unwrap(),
            ModelResponse::answer("hi")
        );
        let limit = |adapter: Anthropic| adapter.token_limit();
        assert_eq!(limit(Anthropic::new("m")), u64::from(DEFAULT_MAX_TOKENS));
        assert_eq!(limit(Anthropic::new("m").body_field("max_tokens", 9)), 9);
    }
}
