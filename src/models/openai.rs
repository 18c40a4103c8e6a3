//! The Chat Completions API (`POST {base_url}/chat/completions`): OpenAI's, and that of the
//! servers that speak it (llama.cpp's `llama-server`, vLLM, Ollama, and the gateways that
//! front them).

use std::fmt;

use async_trait::async_trait;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::http::{cut_off, excerpt};
use super::options::{HttpOptions, http_setters};
use crate::agent::{Model, ModelError, ModelRequest};
use crate::types::{ChatMessage, ModelResponse, ToolCall, ToolResult, ToolSpec, Usage};

/// Where [`OpenAi`] sends its requests unless told otherwise.
pub const DEFAULT_BASE_URL: &str = "https://api.openai.com/v1";

/// A model behind the Chat Completions API.
///
/// ```no_run
/// use std::time::Duration;
/// use agentrt::models::openai::OpenAi;
///
/// // OpenAI itself.
/// let hosted = OpenAi::new("gpt-4o-mini").api_key(std::env::var("OPENAI_API_KEY").unwrap());
/// // Ollama on this machine: no key.
/// let local = OpenAi::new("llama3.1")
///     .base_url("http://localhost:11434/v1")
///     .temperature(0.2)
///     .max_tokens(1024)
///     .connect_timeout(Duration::from_secs(2));
/// // Whatever OPENAI_BASE_URL and OPENAI_API_KEY say.
/// let configured = OpenAi::from_env("gpt-4o-mini");
/// ```
///
/// Each [`complete`](Model::complete) makes one request: the conversation as `messages`,
/// and the agent's tools as `tools` (with `tool_choice: "auto"`) when it has any. See
/// `docs/models.md` for how answers are read and which failures are retried.
#[derive(Clone)]
pub struct OpenAi {
    model: String,
    max_tokens: Option<u32>,
    http: HttpOptions,
}

impl OpenAi {
    /// The model named `model` on OpenAI's API, with no key (set one with
    /// [`api_key`](Self::api_key), or use [`from_env`](Self::from_env)).
    pub fn new(model: impl Into<String>) -> Self {
        OpenAi {
            model: model.into(),
            max_tokens: None,
            http: HttpOptions::new(DEFAULT_BASE_URL),
        }
    }

    /// The model named `model`, at `OPENAI_BASE_URL` (else [`DEFAULT_BASE_URL`]) with the key
    /// `OPENAI_API_KEY` (else none), each without surrounding blanks. An empty variable
    /// counts as unset.
    pub fn from_env(model: impl Into<String>) -> Self {
        let mut adapter = OpenAi::new(model);
        adapter.http.read_env("OPENAI_BASE_URL", "OPENAI_API_KEY");
        adapter
    }

    http_setters! {
        /// The API's root, up to and including its version: `https://api.openai.com/v1`,
        /// `http://localhost:11434/v1`. Requests go to `{base_url}/chat/completions`.
        base_url;
        /// Sent as `Authorization: Bearer KEY`. Without one no such header is sent, as a local
        /// server wants.
        api_key;
        header: "`OpenAI-Organization` or a gateway's own";
        body_field: "`top_p`, `seed` or `max_completion_tokens`";
    }

    /// The most tokens an answer may have, sent as `max_tokens` (left to the server unless
    /// set). For OpenAI's reasoning models, which want `max_completion_tokens`, set that with
    /// [`body_field`](Self::body_field) instead.
    pub fn max_tokens(mut self, max_tokens: u32) -> Self {
        self.max_tokens = Some(max_tokens);
        self
    }

    /// The request body for `request`.
    fn body(&self, request: &ModelRequest<'_>) -> Value {
        let mut body = Map::new();
        body.insert("model".into(), json!(self.model));
        body.insert(
            "messages".into(),
            request.messages.iter().map(message).collect(),
        );
        if !request.tools.is_empty() {
            body.insert("tools".into(), request.tools.iter().map(tool).collect());
            body.insert("tool_choice".into(), json!("auto"));
        }
        if let Some(max_tokens) = self.max_tokens {
            body.insert("max_tokens".into(), json!(max_tokens));
        }
        self.http.finish_body(body)
    }

    /// The token limit sent, by the name it was sent under: a body field replaces
    /// [`max_tokens`](Self::max_tokens).
    fn token_limit(&self) -> Option<(&'static str, u64)> {
        ["max_completion_tokens", "max_tokens"]
            .into_iter()
            .find_map(|name| Some((name, self.http.body.get(name)?.as_u64()?)))
            .or(self
                .max_tokens
                .map(|limit| ("max_tokens", u64::from(limit))))
    }
}

impl fmt::Debug for OpenAi {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("OpenAi");
        debug.field("model", &self.model);
        self.http.debug_fields(&mut debug);
        debug
            .field("max_tokens", &self.max_tokens)
            .finish_non_exhaustive()
    }
}

#[async_trait(?Send)]
impl Model for OpenAi {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        let api = self.http.api("the chat completions server");
        let mut post = self.http.post("/chat/completions", &self.body(&request))?;
        if let Some(key) = &self.http.api_key {
            post = post.bearer_auth(key);
        }
        let completion: Completion = api.send(self.http.with_headers(post)?).await?;
        completion
            .into_response(self.token_limit())
            .map_err(|unusable| match unusable {
                Unusable::Malformed(why) => api.malformed(&why, b""),
                Unusable::Stopped(why) => api.unusable(&why),
            })
    }
}

fn tool(spec: &ToolSpec) -> Value {
    let mut function = json!({ "name": spec.name, "parameters": spec.parameters });
    if !spec.description.is_empty() {
        function["description"] = json!(spec.description);
    }
    json!({ "type": "function", "function": function })
}

fn message(message: &ChatMessage) -> Value {
    match message {
        ChatMessage::System { text } => json!({ "role": "system", "content": text }),
        ChatMessage::User { text } => json!({ "role": "user", "content": text }),
        ChatMessage::Assistant(response) => {
            let mut turn = json!({ "role": "assistant", "content": response.text });
            if response.tool_calls.is_empty() {
                // Some servers refuse an assistant turn with neither content nor calls.
                if response.text.is_none() {
                    turn["content"] = json!("");
                }
            } else {
                let calls: Vec<Value> = response.tool_calls.iter().map(call).collect();
                turn["tool_calls"] = json!(calls);
            }
            turn
        }
        ChatMessage::Tool {
            call_id, result, ..
        } => json!({
            "role": "tool",
            "tool_call_id": call_id,
            "content": tool_content(result),
        }),
    }
}

fn call(call: &ToolCall) -> Value {
    // Arguments that were not a JSON object go back as `{}`: servers such as vLLM and SGLang
    // parse every argument of the history (and their chat templates read it as an object),
    // answering a 500 to one that is not. The run loop refused such a call, and the result
    // that follows shows the model what it wrote.
    let arguments = match &call.args {
        Value::Object(_) => call.args.to_string(),
        _ => "{}".to_owned(),
    };
    json!({
        "id": call.id,
        "type": "function",
        "function": { "name": call.name, "arguments": arguments },
    })
}

/// A tool's output as JSON text; a failure as a sentence no output can be mistaken for (an
/// output is JSON, and a JSON string is quoted).
fn tool_content(result: &ToolResult) -> String {
    match result {
        ToolResult::Ok(output) => output.to_string(),
        ToolResult::Error(error) => format!("Error: the tool call failed: {error}"),
    }
}

/// A chat completion, as much of it as is read.
#[derive(Deserialize)]
struct Completion {
    #[serde(default)]
    model: Option<String>,
    choices: Vec<Choice>,
    #[serde(default)]
    usage: Option<CompletionUsage>,
}

#[derive(Deserialize)]
struct Choice {
    message: AssistantMessage,
    /// Missing with some local servers, read as a normal stop.
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct AssistantMessage {
    #[serde(default)]
    content: Option<Content>,
    #[serde(default)]
    refusal: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<WireCall>>,
}

/// A string, or (some servers) a list of parts of which the text ones are kept.
#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize)]
struct ContentPart {
    #[serde(default)]
    text: Option<String>,
}

/// A tool call as servers send it: `id` and `index` are not always there, and `arguments`
/// is a JSON string, or with some servers the object itself.
#[derive(Deserialize)]
struct WireCall {
    #[serde(default)]
    id: Option<String>,
    function: WireFunction,
}

#[derive(Deserialize)]
struct WireFunction {
    name: String,
    #[serde(default)]
    arguments: Option<Value>,
}

#[derive(Deserialize)]
struct CompletionUsage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
}

/// Why a completion gives no answer.
#[derive(Debug, PartialEq)]
enum Unusable {
    /// It is not the API's answer (retryable, like a body that is not JSON).
    Malformed(&'static str),
    /// The model stopped without an answer to use: cut off, refused, filtered (fatal: the same
    /// request stops the same way).
    Stopped(String),
}

impl Completion {
    /// The answer; `limit` is the token limit sent, which a message about a cut-off answer
    /// names.
    fn into_response(self, limit: Option<(&str, u64)>) -> Result<ModelResponse, Unusable> {
        let choice = self
            .choices
            .into_iter()
            .next()
            .ok_or(Unusable::Malformed("no choices"))?;
        let message = choice.message;
        let text = match message.content {
            Some(Content::Text(text)) => Some(text),
            Some(Content::Parts(parts)) => Some(parts.into_iter().filter_map(|p| p.text).collect()),
            None => None,
        }
        .filter(|text| !text.is_empty());
        let refusal = message.refusal.filter(|refusal| !refusal.trim().is_empty());
        let tool_calls: Vec<ToolCall> = message
            .tool_calls
            .unwrap_or_default()
            .into_iter()
            .map(|call| ToolCall {
                // An empty id is replaced by the run loop with one unique in the run.
                id: call.id.unwrap_or_default(),
                name: call.function.name,
                args: arguments(call.function.arguments),
            })
            .collect();
        // Other reasons ("stop", "tool_calls", a server's own) end a usable answer.
        match choice.finish_reason.as_deref() {
            // The calls' arguments may be cut off too: none is returned, so none runs.
            Some("length") => return Err(Unusable::Stopped(cut_off(limit, tool_calls.len()))),
            Some("content_filter") => {
                let mut why = "the server's content filter withheld the answer \
                               (finish_reason content_filter)"
                    .to_owned();
                if let Some(said) = refusal.as_deref().or(text.as_deref()) {
                    why.push_str(": ");
                    why.push_str(&excerpt(said));
                }
                return Err(Unusable::Stopped(why));
            }
            _ => {}
        }
        if let (None, true, Some(refusal)) = (&text, tool_calls.is_empty(), &refusal) {
            return Err(Unusable::Stopped(format!(
                "the model refused to answer: {}",
                excerpt(refusal)
            )));
        }
        let usage = self.usage.map(|usage| Usage {
            input_tokens: usage.prompt_tokens.unwrap_or(0),
            output_tokens: usage.completion_tokens.unwrap_or(0),
        });
        Ok(ModelResponse {
            text,
            tool_calls,
            usage,
            model: self.model,
        })
    }
}

/// A call's arguments as JSON. Text that is not JSON stays a `Value::String`, which the run
/// loop refuses with a result the model sees; no arguments, or blank ones, are `{}`.
fn arguments(arguments: Option<Value>) -> Value {
    let raw = match arguments {
        None | Some(Value::Null) => return json!({}),
        Some(Value::String(raw)) => raw,
        Some(args) => return args,
    };
    if raw.trim().is_empty() {
        return json!({});
    }
    match serde_json::from_str::<Value>(&raw) {
        // Arguments encoded twice: the object inside.
        Ok(Value::String(inner)) => match serde_json::from_str::<Value>(&inner) {
            Ok(object @ Value::Object(_)) => object,
            _ => Value::String(raw),
        },
        Ok(args) => args,
        Err(_) => Value::String(raw),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::RunId;

    fn read(body: Value) -> ModelResponse {
        try_read(body, None).unwrap()
    }

    fn try_read(body: Value, limit: Option<(&str, u64)>) -> Result<ModelResponse, Unusable> {
        serde_json::from_value::<Completion>(body)
            .unwrap()
            .into_response(limit)
    }

    fn stopped(body: Value, limit: Option<(&str, u64)>) -> String {
        match try_read(body, limit) {
            Err(Unusable::Stopped(why)) => why,
            other => panic!("{:?}", other.map(|_| "an answer")),
        }
    }

    #[test]
    fn the_request_carries_the_conversation_and_the_tools() {
        let messages = vec![
            ChatMessage::System {
                text: "Be brief.".into(),
            },
            ChatMessage::User {
                text: "Weather?".into(),
            },
            ChatMessage::Assistant(ModelResponse::calls(vec![
                ToolCall::new("c1", "weather", json!({"city": "Oslo"})),
                ToolCall::new("c2", "weather", Value::String("{city: Bergen".into())),
            ])),
            ChatMessage::Tool {
                call_id: "c1".into(),
                name: "weather".into(),
                result: ToolResult::Ok(json!({"sky": "clear"})),
            },
            ChatMessage::Tool {
                call_id: "c2".into(),
                name: "weather".into(),
                result: ToolResult::Error("the arguments are not JSON".into()),
            },
        ];
        let tools = vec![ToolSpec {
            name: "weather".into(),
            description: "The weather in a city.".into(),
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
        let body = OpenAi::new("m")
            .temperature(0.5)
            .body_field("seed", 7)
            .body(&request);
        assert_eq!(
            body,
            json!({
                "model": "m",
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": null, "tool_calls": [
                        {"id": "c1", "type": "function",
                         "function": {"name": "weather", "arguments": "{\"city\":\"Oslo\"}"}},
                        {"id": "c2", "type": "function",
                         "function": {"name": "weather", "arguments": "{}"}},
                    ]},
                    {"role": "tool", "tool_call_id": "c1", "content": "{\"sky\":\"clear\"}"},
                    {"role": "tool", "tool_call_id": "c2",
                     "content": "Error: the tool call failed: the arguments are not JSON"},
                ],
                "tools": [{"type": "function", "function": {
                    "name": "weather", "description": "The weather in a city.",
                    "parameters": {"type": "object"}}}],
                "tool_choice": "auto",
                "temperature": 0.5,
                "seed": 7,
            })
        );
    }

    #[test]
    fn an_answer_is_read_with_its_calls_usage_and_model() {
        let response = read(json!({
            "id": "x", "object": "chat.completion", "model": "gpt-test-1",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": "Looking.",
                "tool_calls": [
                    {"index": 0, "id": "a", "type": "function",
                     "function": {"name": "f", "arguments": "{\"x\": 1}"}},
                    {"function": {"name": "g", "arguments": {"y": 2}}},
                    {"id": "c", "function": {"name": "h", "arguments": "{\"z\": "}},
                    {"id": "d", "function": {"name": "i", "arguments": ""}},
                    {"id": "e", "function": {"name": "j", "arguments": "\"{\\\"w\\\": 3}\""}},
                ]}}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15},
        }));
        assert_eq!(response.text.as_deref(), Some("Looking."));
        assert_eq!(response.model.as_deref(), Some("gpt-test-1"));
        assert_eq!(
            response.usage,
            Some(Usage {
                input_tokens: 12,
                output_tokens: 3
            })
        );
        assert_eq!(
            response.tool_calls,
            vec![
                ToolCall::new("a", "f", json!({"x": 1})),
                ToolCall::new("", "g", json!({"y": 2})),
                ToolCall::new("c", "h", Value::String("{\"z\": ".into())),
                ToolCall::new("d", "i", json!({})),
                ToolCall::new("e", "j", json!({"w": 3})),
            ]
        );
    }

    #[test]
    fn variations_of_servers_are_tolerated() {
        let bare = read(json!({"choices": [{"message": {"content": "hi"}}]}));
        assert_eq!(bare, ModelResponse::answer("hi"));
        let parts = read(json!({"choices": [{"message": {
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "tool_calls": null}}]}));
        assert_eq!(parts.text.as_deref(), Some("ab"));
        let empty = read(json!({"choices": [{"message": {"content": ""}}], "usage": null}));
        assert_eq!(empty, ModelResponse::default());
        let unknown = read(json!({"choices": [{"message": {"content": "hi"},
                                               "finish_reason": "eos_token"}]}));
        assert_eq!(unknown, ModelResponse::answer("hi"));
        assert_eq!(
            try_read(json!({"choices": []}), None),
            Err(Unusable::Malformed("no choices"))
        );
    }

    #[test]
    fn an_answer_cut_off_at_the_token_limit_is_an_error_and_its_calls_are_dropped() {
        let cut = json!({"choices": [{"finish_reason": "length", "message": {
        "content": "Let me", "tool_calls": [
            {"id": "a", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
            {"id": "b", "function": {"name": "f", "arguments": "{\"x\": "}},
        ]}}]});
        assert_eq!(
            stopped(cut.clone(), Some(("max_tokens", 64))),
            "the answer was cut off at the token limit (max_tokens 64), so it is incomplete; \
             its 2 tool calls were not run: raise the limit, or ask for a shorter answer"
        );
        assert_eq!(
            stopped(cut, None),
            "the answer was cut off at the server's token limit, so it is incomplete; \
             its 2 tool calls were not run: raise the limit, or ask for a shorter answer"
        );
        let limit = |adapter: OpenAi| adapter.token_limit();
        assert_eq!(limit(OpenAi::new("m")), None);
        assert_eq!(
            limit(OpenAi::new("m").max_tokens(10)),
            Some(("max_tokens", 10))
        );
        assert_eq!(
            limit(
                OpenAi::new("m")
                    .max_tokens(10)
                    .body_field("max_completion_tokens", 99)
            ),
            Some(("max_completion_tokens", 99))
        );
    }

    #[test]
    fn debug_shows_no_key_header_value_or_password() {
        let adapter = OpenAi::new("m")
            .base_url("https://bob:pw-9d2e@gateway.example.com/v1")
            .api_key("sk-key-5a7b")
            .header("X-Gateway-Token", "tok-3c8f");
        let shown = format!("{adapter:?}");
        for secret in ["sk-key-5a7b", "tok-3c8f", "pw-9d2e", "bob"] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
        assert!(
            shown.contains("https://[redacted]@gateway.example.com/v1"),
            "{shown}"
        );
        assert!(shown.contains("X-Gateway-Token"), "{shown}");
    }

    #[test]
    fn a_refusal_or_a_filtered_answer_is_an_error_that_says_so() {
        let refused = json!({"choices": [{"finish_reason": "stop",
            "message": {"content": null, "refusal": "I can't help with that."}}]});
        assert_eq!(
            stopped(refused, None),
            "the model refused to answer: I can't help with that."
        );
        let filtered = json!({"choices": [{"finish_reason": "content_filter",
            "message": {"content": null}}]});
        assert_eq!(
            stopped(filtered, None),
            "the server's content filter withheld the answer (finish_reason content_filter)"
        );
        // A refusal beside an answer leaves the answer.
        let both = read(json!({"choices": [{"message": {"content": "Partly.", "refusal": "no"}}]}));
        assert_eq!(both.text.as_deref(), Some("Partly."));
    }
}
