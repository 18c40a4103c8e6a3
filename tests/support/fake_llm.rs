//! A model API stand-in for the adapters' tests: a scripted HTTP/1.1 server on 127.0.0.1 that
//! records every request and answers each with the next scripted reply (or closes the
//! connection, hangs, or sends a broken body), and a run driven against it through a real
//! supervisor.

use std::{
    collections::VecDeque,
    io::{BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use super::ask;
use agentrt::{
    Agent, Config, Event, EventKind, ModelPolicy, RunReply, StartRun, Tool, ToolContext, ToolError,
    async_trait, testkit::TempStore,
};
use serde_json::{Value, json};

/// What the server does with one request.
pub enum Reply {
    /// Answers with this status, these headers and this JSON body, then closes.
    Json {
        status: u16,
        headers: Vec<(String, String)>,
        body: Value,
    },
    /// Writes these bytes as they are, then closes.
    Raw(Vec<u8>),
    /// Closes the connection without answering.
    Close,
    /// Keeps the connection open and never answers.
    Hang,
}

impl Reply {
    /// A 200 with `body`.
    pub fn ok(body: Value) -> Self {
        Reply::status(200, body)
    }

    /// `status` with `body`.
    pub fn status(status: u16, body: Value) -> Self {
        Reply::Json {
            status,
            headers: Vec::new(),
            body,
        }
    }

    /// Adds a header to a JSON reply.
    pub fn header(mut self, name: &str, value: &str) -> Self {
        if let Reply::Json { headers, .. } = &mut self {
            headers.push((name.to_owned(), value.to_owned()));
        }
        self
    }

    /// A 200 whose body is not JSON.
    pub fn malformed() -> Self {
        let body = "this is not JSON";
        Reply::Raw(
            format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
                 Connection: close\r\n\r\n{body}",
                body.len()
            )
            .into_bytes(),
        )
    }

    /// A 200 that promises a longer body than it sends before closing.
    pub fn truncated() -> Self {
        Reply::Raw(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 400\r\n\
              Connection: close\r\n\r\n{\"choices\": [{\"mess"
                .to_vec(),
        )
    }
}

/// One request as the server read it.
#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    pub path: String,
    /// Names in lower case, in the order sent.
    pub headers: Vec<(String, String)>,
    /// The body as JSON (`null` if it was not JSON).
    pub body: Value,
    /// When its head had been read.
    pub at: Instant,
}

impl Request {
    /// The value of header `name` (any case), if sent.
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Default)]
struct Shared {
    script: Mutex<VecDeque<Reply>>,
    requests: Mutex<Vec<Request>>,
    stop: AtomicBool,
}

/// The server: it answers requests in order from its script, one connection each, and stops
/// when dropped. A request beyond the script gets a 400 that says so.
pub struct FakeLlm {
    addr: SocketAddr,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl FakeLlm {
    /// Starts a server on 127.0.0.1, on a port of the system's choosing.
    pub fn start(script: Vec<Reply>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a port on 127.0.0.1");
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            script: Mutex::new(script.into()),
            ..Shared::default()
        });
        let serving = shared.clone();
        let thread = std::thread::spawn(move || serve(listener, &serving));
        FakeLlm {
            addr,
            shared,
            thread: Some(thread),
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The requests so far, in order.
    pub fn requests(&self) -> Vec<Request> {
        self.shared.requests.lock().unwrap().clone()
    }
}

impl Drop for FakeLlm {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wakes the accept so that the thread sees the flag.
        let _ = TcpStream::connect(self.addr);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn serve(listener: TcpListener, shared: &Shared) {
    // Hung connections stay open until the server stops.
    let mut hung = Vec::new();
    for stream in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        let Ok(mut stream) = stream else { continue };
        // A client that connects and sends nothing does not stall the server for long.
        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
        let Some(request) = read_request(&stream) else {
            continue;
        };
        shared.requests.lock().unwrap().push(request);
        let reply = shared.script.lock().unwrap().pop_front().unwrap_or_else(|| {
            Reply::status(
                400,
                json!({"error": {"message": "the fake server has no reply scripted for this request"}}),
            )
        });
        match reply {
            Reply::Json {
                status,
                headers,
                body,
            } => {
                let body = body.to_string();
                let mut head = format!(
                    "HTTP/1.1 {status} {}\r\nContent-Type: application/json\r\n\
                     Content-Length: {}\r\nConnection: close\r\n",
                    reason(status),
                    body.len()
                );
                for (name, value) in headers {
                    head.push_str(&format!("{name}: {value}\r\n"));
                }
                head.push_str("\r\n");
                let _ = stream.write_all(head.as_bytes());
                let _ = stream.write_all(body.as_bytes());
            }
            Reply::Raw(bytes) => {
                let _ = stream.write_all(&bytes);
            }
            Reply::Close => {}
            Reply::Hang => hung.push(stream),
        }
        // Dropping the stream closes the connection (a hung one was kept).
    }
}

fn read_request(stream: &TcpStream) -> Option<Request> {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next()?.to_owned(), parts.next()?.to_owned());
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).ok()?;
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        let (name, value) = line.split_once(':')?;
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_owned()));
    }
    let at = Instant::now();
    let length: usize = headers
        .iter()
        .find(|(name, _)| name == "content-length")
        .and_then(|(_, value)| value.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0; length];
    reader.read_exact(&mut body).ok()?;
    Some(Request {
        method,
        path,
        headers,
        body: serde_json::from_slice(&body).unwrap_or(Value::Null),
        at,
    })
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Whatever",
    }
}

/// Four attempts and short waits, so that the retries of a test take milliseconds; an
/// attempt's timeout long enough that only a server that hangs reaches it.
pub fn fast_policy() -> ModelPolicy {
    ModelPolicy::default()
        .max_attempts(4)
        .backoff(Duration::from_millis(5), Duration::from_millis(20))
        .timeout(Duration::from_secs(20))
}

/// A run of `agent` on `input` through a supervisor on a temporary store, to its end.
pub struct Ran {
    pub reply: RunReply,
    pub events: Vec<Event>,
}

impl Ran {
    /// Runs `agent` on `input` as run `run-1` and reads its events back.
    pub fn of(agent: Agent, input: Value) -> Ran {
        let db = TempStore::new();
        let store = db.open();
        let reply = ask(
            store,
            Config::default(),
            "agent",
            agent,
            StartRun::new("agent", input).with_id("run-1"),
        )
        .unwrap();
        let events = db.open().events(&reply.run_id).unwrap();
        Ran { reply, events }
    }

    /// The payloads of the events of `kind`, in order.
    pub fn payloads(&self, kind: EventKind) -> Vec<Value> {
        self.events
            .iter()
            .filter(|e| e.kind == kind)
            .map(|e| e.payload.clone())
            .collect()
    }

    /// The payload of the event of `kind` at `step`.
    pub fn payload(&self, kind: EventKind, step: u32) -> Value {
        self.events
            .iter()
            .find(|e| e.kind == kind && e.step == Some(step))
            .unwrap_or_else(|| panic!("no {kind} at step {step}"))
            .payload
            .clone()
    }

    /// The attempts of model step `step` as the log has them: `step.model_started` with its
    /// attempt, `step.model_attempt_failed` with its attempt, in order.
    pub fn model_attempts(&self, step: u32) -> Vec<(EventKind, u64)> {
        self.events
            .iter()
            .filter(|e| e.step == Some(step))
            .filter(|e| {
                matches!(
                    e.kind,
                    EventKind::ModelStarted | EventKind::ModelAttemptFailed
                )
            })
            .map(|e| (e.kind, e.payload["attempt"].as_u64().unwrap()))
            .collect()
    }

    /// The errors of the failed attempts, in order.
    pub fn attempt_errors(&self) -> Vec<String> {
        self.payloads(EventKind::ModelAttemptFailed)
            .iter()
            .map(|p| p["error"].as_str().unwrap().to_owned())
            .collect()
    }
}

/// A tool with a description and an argument schema, answering every call with the same
/// output or the same error, and recording the arguments of each call.
#[derive(Clone)]
pub struct SchemaTool {
    name: &'static str,
    description: &'static str,
    parameters: Value,
    answer: Result<Value, String>,
    calls: Arc<Mutex<Vec<Value>>>,
}

impl SchemaTool {
    pub fn new(
        name: &'static str,
        description: &'static str,
        parameters: Value,
        answer: Result<Value, String>,
    ) -> Self {
        SchemaTool {
            name,
            description,
            parameters,
            answer,
            calls: Arc::default(),
        }
    }

    /// The arguments of each call so far.
    pub fn calls(&self) -> Vec<Value> {
        self.calls.lock().unwrap().clone()
    }
}

#[async_trait(?Send)]
impl Tool for SchemaTool {
    fn name(&self) -> &str {
        self.name
    }

    fn description(&self) -> &str {
        self.description
    }

    fn parameters(&self) -> Value {
        self.parameters.clone()
    }

    async fn call(&self, _: &ToolContext, args: &Value) -> Result<Value, ToolError> {
        self.calls.lock().unwrap().push(args.clone());
        self.answer.clone().map_err(ToolError)
    }
}

/// `weather`: `{"city": string}`, answers a forecast.
pub fn weather() -> SchemaTool {
    SchemaTool::new(
        "weather",
        "The weather in a city.",
        json!({
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city's name."}},
            "required": ["city"],
        }),
        Ok(json!({"sky": "clear", "celsius": 18})),
    )
}

/// `notify`: `{"to": string}`, always fails.
pub fn notify() -> SchemaTool {
    SchemaTool::new(
        "notify",
        "Pages someone.",
        json!({"type": "object", "properties": {"to": {"type": "string"}}}),
        Err("the pager is down".into()),
    )
}
