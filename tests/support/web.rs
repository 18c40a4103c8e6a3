//! Helpers of the web API's tests: a server on 127.0.0.1 in the test's actix system, a JSON
//! client, and a raw event-stream reader.

use std::{future::Future, net::SocketAddr, time::Duration};

use super::supervise;
use actix_web::{App, HttpServer, dev::ServerHandle};
use agentrt::{
    Agent, Config, ModelResponse, RequireApprovalFor, RunId, Store, Supervisor, ToolCall,
    testkit::{RecordingTool, ScriptedModel},
    web::Api,
};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Where the API is mounted in these tests: a prefix, as an application would have.
pub const PREFIX: &str = "/ops";

/// A token of the operator these tests name.
pub const ALICE: &str = "alice-token-0123456789";

/// Serves `api` under [`PREFIX`] on a free port of 127.0.0.1, in the current actix system.
pub async fn serve(api: Api) -> (SocketAddr, ServerHandle) {
    let server = HttpServer::new(move || App::new().service(api.scope(PREFIX)))
        .workers(1)
        .disable_signals()
        .bind("127.0.0.1:0")
        .unwrap();
    let addr = server.addrs()[0];
    let server = server.run();
    let handle = server.handle();
    actix_rt::spawn(server);
    (addr, handle)
}

/// A supervisor of one agent over `store`, and the API over it (as `shape` makes it, given
/// one with the supervisor), served.
pub async fn serve_supervised(
    store: &Store,
    name: &str,
    agent: Agent,
    shape: impl FnOnce(Api) -> Api,
) -> (SocketAddr, actix::Addr<Supervisor>, Api) {
    let supervisor = supervise(store.clone(), Config::default(), name, agent);
    let api = shape(Api::new(store.clone()).supervisor(supervisor.clone()));
    let (addr, server) = serve(api.clone()).await;
    // The server lives as long as the test's system.
    std::mem::forget(server);
    (addr, supervisor, api)
}

/// An agent whose model calls `transfer` (which needs an approval), then answers.
pub fn paying_agent(transfer: &RecordingTool) -> Agent {
    let model = ScriptedModel::new(vec![
        ModelResponse::calls(vec![ToolCall::new(
            "pay-1",
            "transfer",
            json!({"amount": 100, "to": "ada"}),
        )]),
        ModelResponse::answer("paid"),
    ]);
    Agent::new(model)
        .tool(transfer.clone())
        .policy(RequireApprovalFor::tools(["transfer"]))
}

/// A JSON client of one server.
pub struct Client {
    pub base: String,
    pub token: Option<String>,
    http: awc::Client,
}

impl Client {
    pub fn new(addr: SocketAddr, token: Option<&str>) -> Client {
        Client {
            base: format!("http://{addr}{PREFIX}"),
            token: token.map(str::to_owned),
            http: awc::Client::builder()
                .timeout(Duration::from_secs(30))
                .finish(),
        }
    }

    fn authorized(&self, request: awc::ClientRequest) -> awc::ClientRequest {
        match &self.token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    }

    /// A GET: the status and the body as JSON (or as a JSON string when it is not JSON).
    pub async fn get(&self, path: &str) -> (u16, Value) {
        let request = self.authorized(self.http.get(format!("{}{path}", self.base)));
        let mut response = request.send().await.unwrap();
        let body = response.body().limit(1 << 24).await.unwrap();
        (response.status().as_u16(), parse(&body))
    }

    /// A GET's body as text.
    pub async fn get_text(&self, path: &str) -> (u16, String) {
        let request = self.authorized(self.http.get(format!("{}{path}", self.base)));
        let mut response = request.send().await.unwrap();
        let body = response.body().limit(1 << 24).await.unwrap();
        (
            response.status().as_u16(),
            String::from_utf8_lossy(&body).into_owned(),
        )
    }

    /// A POST of `body` as JSON.
    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let request = self.authorized(self.http.post(format!("{}{path}", self.base)));
        let mut response = request.send_json(&body).await.unwrap();
        let body = response.body().await.unwrap();
        (response.status().as_u16(), parse(&body))
    }

    /// A POST of raw bytes with a content type.
    pub async fn post_raw(&self, path: &str, content_type: &str, body: Vec<u8>) -> (u16, Value) {
        let request = self
            .authorized(self.http.post(format!("{}{path}", self.base)))
            .insert_header(("content-type", content_type));
        let mut response = request.send_body(body).await.unwrap();
        let body = response.body().await.unwrap();
        (response.status().as_u16(), parse(&body))
    }

    /// A request with another method.
    pub async fn request(&self, method: &str, path: &str) -> (u16, Value) {
        let method = actix_web::http::Method::from_bytes(method.as_bytes()).unwrap();
        let request = self.authorized(self.http.request(method, format!("{}{path}", self.base)));
        let mut response = request.send().await.unwrap();
        let body = response.body().await.unwrap();
        (response.status().as_u16(), parse(&body))
    }

    /// Waits until the run is in `state`, reading it over HTTP.
    pub async fn wait_state(&self, run_id: &str, state: &str) -> Value {
        wait_until(|| async {
            let (status, run) = self.get(&format!("/runs/{run_id}")).await;
            (status == 200 && run["state"] == state).then_some(run)
        })
        .await
    }
}

fn parse(body: &[u8]) -> Value {
    serde_json::from_slice(body)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(body).into_owned()))
}

/// The code of an error body.
pub fn code(body: &Value) -> &str {
    body["error"]["code"]
        .as_str()
        .unwrap_or_else(|| panic!("not an error body: {body}"))
}

/// Waits until `check` gives a value, checking again every few milliseconds (for at most a
/// minute, so that a broken build fails instead of hanging).
pub async fn wait_until<T, F, Fut>(mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the condition never held"
        );
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until the store shows the run in `state`.
pub async fn wait_store_state(store: &Store, run_id: &RunId, state: agentrt::RunState) {
    wait_until(|| async {
        let store = store.clone();
        let run_id = run_id.clone();
        let found = actix_web::web::block(move || store.run(&run_id).map(|run| run.state))
            .await
            .unwrap();
        (found.ok() == Some(state)).then_some(())
    })
    .await
}

/// A raw client of an event stream: the response's text as it comes, over a socket this test
/// holds and can close.
pub struct EventStream {
    socket: actix_rt::net::TcpStream,
    pub text: String,
}

impl EventStream {
    /// Opens `path` (under the prefix) with extra header lines.
    pub async fn open(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> EventStream {
        let mut socket = actix_rt::net::TcpStream::connect(addr).await.unwrap();
        let mut request = format!(
            "GET {PREFIX}{path} HTTP/1.1\r\nhost: {addr}\r\naccept: text/event-stream\r\nconnection: close\r\n"
        );
        for (name, value) in headers {
            request.push_str(&format!("{name}: {value}\r\n"));
        }
        request.push_str("\r\n");
        socket.write_all(request.as_bytes()).await.unwrap();
        EventStream {
            socket,
            text: String::new(),
        }
    }

    /// Reads until the text holds `needle` (from its start); false if the server closed the
    /// stream first.
    pub async fn read_until(&mut self, needle: &str) -> bool {
        let mut buf = [0u8; 8192];
        while !self.text.contains(needle) {
            let read = tokio::time::timeout(Duration::from_secs(60), self.socket.read(&mut buf))
                .await
                .expect("the stream sent nothing for a minute")
                .unwrap();
            if read == 0 {
                return self.text.contains(needle);
            }
            self.text.push_str(&String::from_utf8_lossy(&buf[..read]));
        }
        true
    }

    /// Reads what comes next; false if the server closed the stream.
    pub async fn read_more(&mut self) -> bool {
        let mut buf = [0u8; 8192];
        let read = tokio::time::timeout(Duration::from_secs(60), self.socket.read(&mut buf))
            .await
            .expect("the stream sent nothing for a minute")
            .unwrap();
        self.text.push_str(&String::from_utf8_lossy(&buf[..read]));
        read > 0
    }

    /// Reads to the end of the response (the server closed it).
    pub async fn read_to_end(&mut self) {
        let mut rest = Vec::new();
        tokio::time::timeout(Duration::from_secs(60), self.socket.read_to_end(&mut rest))
            .await
            .expect("the stream did not end within a minute")
            .unwrap();
        self.text.push_str(&String::from_utf8_lossy(&rest));
    }

    /// The `id:` lines seen, in order.
    pub fn ids(&self) -> Vec<u64> {
        self.text
            .lines()
            .filter_map(|line| line.strip_prefix("id: "))
            .map(|id| id.trim().parse().unwrap())
            .collect()
    }

    /// The `event:` lines seen, in order.
    pub fn events(&self) -> Vec<String> {
        self.text
            .lines()
            .filter_map(|line| line.strip_prefix("event: "))
            .map(str::to_owned)
            .collect()
    }
}
