//! What the HTTP adapters share: the client, one request per attempt, and how an answer that
//! is not a success becomes a [`ModelError`] the run's model policy acts on.
//!
//! The classification (`docs/models.md`, "Adapters"): a rate limit (429), a request timeout
//! (408), a conflict (409), any 5xx (Anthropic's 529 "overloaded" included), a connection that
//! could not be made, timed out, or closed before or during the answer, and a 2xx whose body is
//! cut off or is not the API's JSON are retryable; every other status is fatal (a 400, 401,
//! 403, 404, 422 will not change by asking again).

use std::{
    error::Error as StdError,
    net::IpAddr,
    sync::OnceLock,
    time::{Duration, SystemTime},
};

use reqwest::{
    RequestBuilder, StatusCode,
    header::{HeaderMap, HeaderName, HeaderValue, LOCATION, RETRY_AFTER},
};
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::agent::ModelError;

/// How long a connection may take to open, unless the adapter is told otherwise.
pub(crate) const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The largest answer read: a model's JSON answer is a few kilobytes; more is a server
/// gone wrong, which must not fill the memory.
const MAX_ANSWER_BYTES: usize = 32 << 20;

/// How much of an error's body is read: enough for its message.
const MAX_ERROR_BYTES: usize = 64 << 10;

/// The most characters of a server's error message an error repeats.
const MAX_SERVER_MESSAGE: usize = 500;

/// An HTTP client built at the first request, with the settings the adapter has by then.
///
/// Built late so that a client that cannot be built (no TLS roots) fails the run with a
/// message instead of a constructor panicking, and so that the adapter's setters need not
/// rebuild it.
#[derive(Debug, Clone)]
pub(crate) struct LazyClient {
    connect_timeout: Duration,
    /// The adapter was told to use no proxy.
    no_proxy: bool,
    /// The base URL's host is this machine: no proxy either, whatever the environment says.
    loopback: bool,
    /// Stands in for a proxy the environment names, which the tests cannot set without
    /// touching every test's environment.
    #[cfg(test)]
    proxy: Option<String>,
    client: OnceLock<reqwest::Client>,
}

impl LazyClient {
    pub(crate) fn new() -> Self {
        LazyClient {
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            no_proxy: false,
            loopback: false,
            #[cfg(test)]
            proxy: None,
            client: OnceLock::new(),
        }
    }

    pub(crate) fn set_connect_timeout(&mut self, timeout: Duration) {
        self.connect_timeout = timeout;
        self.client = OnceLock::new();
    }

    /// Tells the client where it sends: a loopback host goes without a proxy.
    pub(crate) fn set_base_url(&mut self, url: &str) {
        self.loopback = is_loopback(url);
        self.client = OnceLock::new();
    }

    pub(crate) fn set_no_proxy(&mut self) {
        self.no_proxy = true;
        self.client = OnceLock::new();
    }

    #[cfg(test)]
    pub(crate) fn set_test_proxy(&mut self, url: &str) {
        self.proxy = Some(url.to_owned());
        self.client = OnceLock::new();
    }

    pub(crate) fn get(&self) -> Result<&reqwest::Client, ModelError> {
        if let Some(client) = self.client.get() {
            return Ok(client);
        }
        let mut builder = reqwest::Client::builder()
            .user_agent(concat!("agentrt/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(self.connect_timeout)
            // The run loop retries, each attempt in the log: the client must not resend on
            // its own.
            .retry(reqwest::retry::never())
            // A redirected API call is a base URL to correct; following it would hide that.
            .redirect(reqwest::redirect::Policy::none());
        #[cfg(test)]
        if let Some(proxy) = &self.proxy {
            builder = builder.proxy(reqwest::Proxy::all(proxy).expect("a proxy URL"));
        }
        // reqwest takes HTTP_PROXY, HTTPS_PROXY and ALL_PROXY for every host, loopback
        // included (only NO_PROXY exempts one): a local server would be asked through a proxy
        // that cannot reach it.
        if self.no_proxy || self.loopback {
            builder = builder.no_proxy();
        }
        let built = builder.build().map_err(|err| {
            ModelError::fatal(format!("the HTTP client cannot be built: {}", chain(&err)))
        })?;
        Ok(self.client.get_or_init(|| built))
    }
}

/// The body of `response`, read by chunks, or `None` once it is larger than `cap` bytes (by
/// its `Content-Length`, before reading, or as it comes).
async fn read_capped(
    response: &mut reqwest::Response,
    cap: usize,
) -> Result<Option<Vec<u8>>, reqwest::Error> {
    if response
        .content_length()
        .is_some_and(|length| length > cap as u64)
    {
        return Ok(None);
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        if body.len() + chunk.len() > cap {
            return Ok(None);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Some(body))
}

/// The first `cap` bytes of `response`'s body at most, or what came before an error.
async fn read_start(response: &mut reqwest::Response, cap: usize) -> Vec<u8> {
    let mut body = Vec::new();
    while body.len() < cap {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                let room = cap - body.len();
                body.extend_from_slice(&chunk[..chunk.len().min(room)]);
            }
            _ => break,
        }
    }
    body
}

/// `url`'s scheme, host and port, for a message: none of its user, password, path or query.
fn origin(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(url) if url.has_host() => url.origin().ascii_serialization(),
        _ => "the base URL is not a URL".to_owned(),
    }
}

/// `url` for a `Debug`: its user and password, and its query, as `[redacted]`.
pub(crate) fn shown_url(url: &str) -> String {
    let Ok(mut parsed) = reqwest::Url::parse(url) else {
        return url.to_owned();
    };
    let hidden = !parsed.username().is_empty() || parsed.password().is_some();
    let query = parsed.query().is_some();
    if !hidden && !query {
        return url.to_owned();
    }
    let _ = parsed.set_username("");
    let _ = parsed.set_password(None);
    parsed.set_query(None);
    let mut shown = parsed.to_string();
    if hidden {
        let after_scheme = parsed.scheme().len() + "://".len();
        shown.insert_str(after_scheme, "[redacted]@");
    }
    if query {
        shown.push_str("?[redacted]");
    }
    shown
}

/// A header from the adapter's settings, its value marked sensitive (a `Debug` of the request
/// shows no value). An invalid one fails the run, naming only the header.
pub(crate) fn header(name: &str, value: &str) -> Result<(HeaderName, HeaderValue), ModelError> {
    let header = HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| ModelError::fatal(format!("{name:?} is not a valid header name")))?;
    let mut value = HeaderValue::from_str(value).map_err(|_| {
        ModelError::fatal(format!(
            "the value of the header {header} is not a valid header value"
        ))
    })?;
    value.set_sensitive(true);
    Ok((header, value))
}

/// Whether `url`'s host is this machine: `localhost`, or a loopback address.
fn is_loopback(url: &str) -> bool {
    let Some(host) = reqwest::Url::parse(url)
        .ok()
        .and_then(|url| url.host_str().map(str::to_owned))
    else {
        return false;
    };
    // An IPv6 host keeps its brackets.
    match host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
    {
        Ok(IpAddr::V4(ip)) => ip.is_loopback(),
        Ok(IpAddr::V6(ip)) => {
            ip.is_loopback() || ip.to_ipv4_mapped().is_some_and(|ip| ip.is_loopback())
        }
        Err(_) => host.trim_end_matches('.').eq_ignore_ascii_case("localhost"),
    }
}

/// Who is called, for error messages, and the secret no message may repeat.
pub(crate) struct Api<'a> {
    /// Names the server in messages: "the chat completions server", "the Anthropic API".
    pub(crate) name: &'static str,
    /// The API key, if any.
    pub(crate) secret: Option<&'a str>,
    /// The base URL, of which a message names the scheme and host only: a URL may hold a
    /// password or a token.
    pub(crate) base_url: &'a str,
}

impl Api<'_> {
    /// Sends `request` once and reads a 2xx answer as `T`. Anything else is the error that the
    /// model policy retries or fails the run with.
    pub(crate) async fn send<T: DeserializeOwned>(
        &self,
        request: RequestBuilder,
    ) -> Result<T, ModelError> {
        let mut response = request.send().await.map_err(|err| self.transport(err))?;
        let status = response.status();
        if status.is_success() {
            let body = match read_capped(&mut response, MAX_ANSWER_BYTES).await {
                Ok(Some(body)) => body,
                // Not a model's answer, and asking again brings the same.
                Ok(None) => {
                    return Err(self.unusable(&format!(
                        "the answer is larger than {} MiB",
                        MAX_ANSWER_BYTES >> 20
                    )));
                }
                Err(err) => {
                    let err = err.without_url();
                    return Err(self.retryable(format!("the answer was cut off: {}", chain(&err))));
                }
            };
            return serde_json::from_slice(&body).map_err(|err| self.malformed(&err, &body));
        }
        let retry_after = retry_after(response.headers(), SystemTime::now());
        let location = response
            .headers()
            .get(LOCATION)
            .and_then(|to| to.to_str().ok())
            .map(str::to_owned);
        // The body only adds the server's words: an error reading it changes nothing, and
        // its start is all a message needs.
        let body = read_start(&mut response, MAX_ERROR_BYTES).await;
        Err(self.refused(status, &body, location, retry_after))
    }

    /// A 2xx whose body is not the API's answer. Retried: the server accepted the request, so
    /// the body was damaged on the way (a proxy, a dropped connection) or by a server in
    /// trouble, and asking again is the only remedy; the policy bounds how often.
    pub(crate) fn malformed(&self, why: &dyn std::fmt::Display, body: &[u8]) -> ModelError {
        let mut message = format!("the answer is not the API's JSON ({why})");
        if let Some(said) = server_message(body) {
            message.push_str("; the server said: ");
            message.push_str(&said);
        }
        self.retryable(message)
    }

    /// A fatal error about an answer the API gave but that cannot be used (cut off at the
    /// token limit, refused, filtered).
    pub(crate) fn unusable(&self, message: &str) -> ModelError {
        ModelError::fatal(self.redact(format!("{}: {message}", self.name)))
    }

    fn retryable(&self, message: String) -> ModelError {
        ModelError::retryable(self.redact(format!("{}: {message}", self.name)))
    }

    fn transport(&self, err: reqwest::Error) -> ModelError {
        // reqwest's message ends with the whole URL, query included.
        let err = err.without_url();
        let text = chain(&err);
        let origin = origin(self.base_url);
        if err.is_builder() {
            // A base URL or a header value that cannot be sent: no attempt will do better.
            return ModelError::fatal(self.redact(format!(
                "{}: the request cannot be sent ({origin}): {text}",
                self.name
            )));
        }
        // A certificate that does not verify, or a host name that does not resolve, fails
        // every attempt alike, but reqwest tells them from passing failures (a handshake cut
        // off, a resolver timing out) only by their text: they are retried, within the policy.
        let what = if err.is_timeout() {
            "timed out"
        } else if err.is_connect() {
            "could not connect"
        } else {
            "the connection failed"
        };
        self.retryable(format!("{what} ({origin}): {text}"))
    }

    fn refused(
        &self,
        status: StatusCode,
        body: &[u8],
        location: Option<String>,
        retry_after: Option<Duration>,
    ) -> ModelError {
        let mut message = format!("{} answered {}", self.name, status_text(status));
        let said = server_message(body);
        if status.is_redirection() {
            // The fix is in the adapter's settings, whatever the server's page says.
            match location {
                Some(to) => message.push_str(&format!(
                    ", redirecting to {}: set the base URL to that",
                    shown_url(&to)
                )),
                None => message.push_str(": a redirect, which is not followed: check the base URL"),
            }
            if let Some(said) = said {
                message.push_str(&format!(" (the server said: {said})"));
            }
        } else if let Some(said) = said {
            message.push_str(": ");
            message.push_str(&said);
        }
        let message = self.redact(message);
        if !is_retryable(status, body) {
            return ModelError::fatal(message);
        }
        let error = ModelError::retryable(message);
        match retry_after {
            Some(after) => error.retry_after(after),
            None => error,
        }
    }

    fn redact(&self, message: String) -> String {
        // A base URL's password is a secret too (sent as basic authentication).
        let password = reqwest::Url::parse(self.base_url)
            .ok()
            .and_then(|url| url.password().map(str::to_owned));
        let mut message = message;
        for secret in [self.secret, password.as_deref()].into_iter().flatten() {
            if !secret.is_empty() && message.contains(secret) {
                message = message.replace(secret, "[redacted]");
            }
        }
        message
    }
}

/// Whether an answer with `status` (not a success) is worth another attempt.
pub(crate) fn is_retryable(status: StatusCode, body: &[u8]) -> bool {
    match status.as_u16() {
        // OpenAI's "out of credit" is a 429 that no wait mends.
        429 => error_code(body).as_deref() != Some("insufficient_quota"),
        408 | 409 => true,
        // 529 is Anthropic's "overloaded".
        500..=599 => true,
        _ => false,
    }
}

/// How long the server asked to wait: `retry-after-ms` (milliseconds, which OpenAI sends
/// beside the coarser header), else `Retry-After` in seconds or as an HTTP date (a date
/// already past asks for no wait).
pub(crate) fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|value| value.to_str().ok())
            .map(str::trim)
    };
    let seconds = |text: &str| {
        text.parse::<f64>()
            .ok()
            .filter(|s| *s >= 0.0)
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
    };
    if let Some(after) = header("retry-after-ms").and_then(seconds) {
        return Some(after / 1000);
    }
    let value = header(RETRY_AFTER.as_str())?;
    if let Some(after) = seconds(value) {
        return Some(after);
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// The message of a JSON error body, in the shapes servers use: `{"error": {"message": ..}}`
/// (OpenAI, Anthropic, llama.cpp), `{"error": ".."}` (Ollama), `{"message": ..}` (vLLM),
/// `{"detail": ..}`.
pub(crate) fn server_message(body: &[u8]) -> Option<String> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let said = value
        .pointer("/error/message")
        .or_else(|| value.get("error"))
        .or_else(|| value.get("message"))
        .or_else(|| value.get("detail"))?
        .as_str()?
        .trim();
    if said.is_empty() {
        return None;
    }
    Some(excerpt(said))
}

/// Why an answer that stopped at the token limit is an error: its text is incomplete, and a
/// tool call in it may have lost the end of its arguments, which must never run. `limit` is
/// the setting sent (its name and value), when one was.
pub(crate) fn cut_off(limit: Option<(&str, u64)>, calls: usize) -> String {
    let mut message = match limit {
        Some((name, limit)) => format!(
            "the answer was cut off at the token limit ({name} {limit}), so it is incomplete"
        ),
        None => "the answer was cut off at the server's token limit, so it is incomplete".into(),
    };
    match calls {
        0 => {}
        1 => message.push_str("; its tool call was not run"),
        n => message.push_str(&format!("; its {n} tool calls were not run")),
    }
    message.push_str(": raise the limit, or ask for a shorter answer");
    message
}

/// `text` cut to [`MAX_SERVER_MESSAGE`] characters, for an error that repeats it.
pub(crate) fn excerpt(text: &str) -> String {
    match text.char_indices().nth(MAX_SERVER_MESSAGE) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text.to_owned(),
    }
}

fn error_code(body: &[u8]) -> Option<String> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let error = value.get("error")?;
    // Some servers send `"code": null` beside the `type` that says it.
    error
        .get("code")
        .filter(|code| code.is_string())
        .or_else(|| error.get("type"))?
        .as_str()
        .map(str::to_owned)
}

fn status_text(status: StatusCode) -> String {
    match status.canonical_reason() {
        Some(reason) => format!("{} {reason}", status.as_u16()),
        None => status.as_u16().to_string(),
    }
}

/// An error with its causes, which name what went wrong ("connection refused") where the
/// error itself says only "error sending request".
fn chain(err: &(dyn StdError + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let said = cause.to_string();
        if !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::{
        io::{Read, Write},
        net::TcpListener,
        sync::{Arc, Mutex},
    };

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, HeaderValue::from_str(value).unwrap());
        }
        map
    }

    /// A server on 127.0.0.1 that answers every request with `reply` and records its request
    /// line; its URL and the lines.
    fn listener(reply: impl Into<String>) -> (String, Arc<Mutex<Vec<String>>>) {
        let reply: String = reply.into();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let lines = Arc::new(Mutex::new(Vec::new()));
        let seen = lines.clone();
        // Left blocked in its accept when the test ends.
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let mut head = Vec::new();
                let mut byte = [0];
                while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).unwrap_or(0) == 1 {
                    head.push(byte[0]);
                }
                let head = String::from_utf8_lossy(&head);
                seen.lock()
                    .unwrap()
                    .push(head.lines().next().unwrap_or("").to_owned());
                let _ = stream.write_all(reply.as_bytes());
            }
        });
        (url, lines)
    }

    const OK: &str = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}";
    const BAD_GATEWAY: &str =
        "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";

    /// Sends one request to `url` with `client` (the GET carries no body: the fake servers
    /// read none).
    fn call(client: &LazyClient, url: &str) -> Result<Value, ModelError> {
        let api = Api {
            name: "the test server",
            secret: None,
            base_url: "http://127.0.0.1",
        };
        actix_rt::System::new().block_on(async {
            let request = client.get()?.get(url);
            api.send::<Value>(request).await
        })
    }

    #[test]
    fn a_loopback_server_is_called_directly_whatever_proxy_is_configured() {
        let (server, to_server) = listener(OK);
        let (proxy, to_proxy) = listener(BAD_GATEWAY);
        let mut client = LazyClient::new();
        client.set_test_proxy(&proxy);
        client.set_base_url(&server);
        assert_eq!(call(&client, &format!("{server}/v1/x")), Ok(json!({})));
        assert_eq!(to_server.lock().unwrap().len(), 1);
        assert!(to_proxy.lock().unwrap().is_empty());

        // Another host goes through the proxy, unless told not to (192.0.2.1 is reserved for
        // examples: nothing answers there).
        let mut remote = LazyClient::new();
        remote.set_test_proxy(&proxy);
        remote.set_connect_timeout(Duration::from_millis(200));
        remote.set_base_url("http://192.0.2.1:9");
        let through = call(&remote, "http://192.0.2.1:9/v1/x").unwrap_err();
        assert!(through.message().contains("502"), "{}", through.message());
        assert_eq!(
            to_proxy.lock().unwrap().as_slice(),
            ["GET http://192.0.2.1:9/v1/x HTTP/1.1"]
        );
        remote.set_no_proxy();
        assert!(call(&remote, "http://192.0.2.1:9/v1/x").is_err());
        assert_eq!(to_proxy.lock().unwrap().len(), 1);
    }

    #[test]
    fn a_url_is_shown_without_its_user_password_or_query() {
        assert_eq!(
            shown_url("https://u:p@gw.example.com:8443/v1"),
            "https://[redacted]@gw.example.com:8443/v1"
        );
        assert_eq!(
            shown_url("https://gw.example.com/v1?key=k"),
            "https://gw.example.com/v1?[redacted]"
        );
        assert_eq!(
            shown_url("http://127.0.0.1:8080/v1"),
            "http://127.0.0.1:8080/v1"
        );
        assert_eq!(
            origin("https://u:p@gw.example.com:8443/v1?key=k"),
            "https://gw.example.com:8443"
        );
        let invalid = header("X-Token", "tok-1\n").unwrap_err();
        assert_eq!(
            invalid.message(),
            "the value of the header x-token is not a valid header value"
        );
        let (_, value) = header("X-Token", "tok-1").unwrap();
        assert!(value.is_sensitive());
        assert!(!format!("{value:?}").contains("tok-1"));
    }

    #[test]
    fn an_answer_larger_than_the_cap_is_fatal_and_an_error_body_is_cut() {
        // Only the length is sent: the answer is refused before its body is read.
        let (big, _) = listener("HTTP/1.1 200 OK\r\nContent-Length: 40000000\r\n\r\n{");
        let error = call(&LazyClient::new(), &big).unwrap_err();
        assert!(!error.is_retryable());
        assert_eq!(
            error.message(),
            "the test server: the answer is larger than 32 MiB"
        );

        // A chunked body, with no length to go by, stops where it passes the cap.
        let chunk = "x".repeat(1000);
        let mut chunked = String::from(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
        );
        for _ in 0..5 {
            chunked.push_str(&format!("{:x}\r\n{chunk}\r\n", chunk.len()));
        }
        chunked.push_str("0\r\n\r\n");
        let (url, _) = listener(chunked.clone());
        let read = |cap: usize| {
            let url = url.clone();
            actix_rt::System::new().block_on(async move {
                let mut response = LazyClient::new()
                    .get()
                    .unwrap()
                    .get(&url)
                    .send()
                    .await
                    .unwrap();
                read_capped(&mut response, cap).await.unwrap()
            })
        };
        assert_eq!(read(4999), None);
        assert_eq!(read(5000).map(|body| body.len()), Some(5000));

        let long = format!(
            r#"{{"error": {{"message": "slow down"}}, "pad": "{}"}}"#,
            "p".repeat(100_000)
        );
        let (limited, _) = listener(format!(
            "HTTP/1.1 500 Internal Server Error\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{long}",
            long.len()
        ));
        let body = actix_rt::System::new().block_on(async {
            let mut response = LazyClient::new()
                .get()
                .unwrap()
                .get(&limited)
                .send()
                .await
                .unwrap();
            read_start(&mut response, MAX_ERROR_BYTES).await
        });
        assert_eq!(body.len(), MAX_ERROR_BYTES);
        assert!(body.starts_with(br#"{"error": {"message": "slow down"}"#));
    }

    #[test]
    fn loopback_hosts_are_recognised() {
        for url in [
            "http://localhost:11434/v1",
            "http://LOCALHOST./v1",
            "http://127.0.0.1:8080/v1",
            "http://127.1.2.3",
            "http://[::1]:8000/v1",
            "https://user:pw@localhost/v1",
        ] {
            assert!(is_loopback(url), "{url}");
        }
        for url in [
            "https://api.openai.com/v1",
            "http://10.0.0.5:8000",
            "http://localhost.example.com",
            "http://[::2]",
            "not a url",
        ] {
            assert!(!is_loopback(url), "{url}");
        }
    }

    #[test]
    fn statuses_are_retryable_or_fatal() {
        for code in [408, 409, 429, 500, 502, 503, 504, 529] {
            let status = StatusCode::from_u16(code).unwrap();
            assert!(is_retryable(status, b""), "{code}");
        }
        for code in [301, 400, 401, 403, 404, 413, 422] {
            let status = StatusCode::from_u16(code).unwrap();
            assert!(!is_retryable(status, b""), "{code}");
        }
        let quota =
            br#"{"error": {"message": "You exceeded your quota", "code": "insufficient_quota"}}"#;
        assert!(!is_retryable(StatusCode::TOO_MANY_REQUESTS, quota));
        let typed = br#"{"error": {"message": "out of credit", "type": "insufficient_quota", "code": null}}"#;
        assert!(!is_retryable(StatusCode::TOO_MANY_REQUESTS, typed));
    }

    #[test]
    fn retry_after_is_read_in_seconds_milliseconds_or_as_a_date() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let read = |pairs: &[(&'static str, &str)]| retry_after(&headers(pairs), now);
        assert_eq!(read(&[("retry-after", "7")]), Some(Duration::from_secs(7)));
        assert_eq!(
            read(&[("retry-after", " 1.5 ")]),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(
            read(&[("retry-after", "3"), ("retry-after-ms", "250")]),
            Some(Duration::from_millis(250))
        );
        let in_ten = httpdate::fmt_http_date(now + Duration::from_secs(10));
        assert_eq!(
            read(&[("retry-after", &in_ten)]),
            Some(Duration::from_secs(10))
        );
        let past = httpdate::fmt_http_date(now - Duration::from_secs(10));
        assert_eq!(read(&[("retry-after", &past)]), Some(Duration::ZERO));
        assert_eq!(read(&[("retry-after", "soon")]), None);
        assert_eq!(read(&[("retry-after", "-3")]), None);
        assert_eq!(read(&[("retry-after", "1e400")]), None);
        assert_eq!(read(&[]), None);
    }

    #[test]
    fn the_server_message_is_found_in_the_usual_shapes() {
        let read = |body: &str| server_message(body.as_bytes());
        assert_eq!(
            read(r#"{"error": {"message": "Invalid key", "type": "auth"}}"#).as_deref(),
            Some("Invalid key")
        );
        assert_eq!(
            read(r#"{"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}"#)
                .as_deref(),
            Some("Overloaded")
        );
        assert_eq!(
            read(r#"{"error": "model not found"}"#).as_deref(),
            Some("model not found")
        );
        assert_eq!(
            read(r#"{"object": "error", "message": "bad"}"#).as_deref(),
            Some("bad")
        );
        assert_eq!(
            read(r#"{"detail": "Not Found"}"#).as_deref(),
            Some("Not Found")
        );
        assert_eq!(read("<html>502</html>"), None);
        assert_eq!(read(r#"{"error": {"code": 5}}"#), None);
        let long = format!(r#"{{"error": "{}"}}"#, "é".repeat(600));
        assert_eq!(read(&long).unwrap().chars().count(), MAX_SERVER_MESSAGE + 3);
    }

    #[test]
    fn a_refusal_names_the_status_and_the_server_message_but_never_the_key() {
        let api = Api {
            name: "the test server",
            secret: Some("sk-secret-1"),
            base_url: "http://127.0.0.1",
        };
        let body = br#"{"error": {"message": "Incorrect API key provided: sk-secret-1"}}"#;
        let error = api.refused(StatusCode::UNAUTHORIZED, body, None, None);
        assert!(!error.is_retryable());
        assert_eq!(
            error.message(),
            "the test server answered 401 Unauthorized: Incorrect API key provided: [redacted]"
        );
        let limited = api.refused(
            StatusCode::TOO_MANY_REQUESTS,
            b"",
            None,
            Some(Duration::from_secs(2)),
        );
        assert!(limited.is_retryable());
        assert_eq!(limited.retry_after_hint(), Some(Duration::from_secs(2)));
        let overloaded = api.refused(StatusCode::from_u16(529).unwrap(), b"", None, None);
        assert!(overloaded.is_retryable());
        assert_eq!(overloaded.message(), "the test server answered 529");
        let moved = api.refused(
            StatusCode::MOVED_PERMANENTLY,
            b"",
            Some("https://api.example.com/v1/chat/completions".into()),
            None,
        );
        assert!(!moved.is_retryable());
        assert!(
            moved
                .message()
                .contains("redirecting to https://api.example.com/v1")
        );
        // The hint stays when the server has words of its own, and without a Location.
        let found = api.refused(
            StatusCode::FOUND,
            br#"{"message": "Moved"}"#,
            Some("https://api.example.com/v1/chat/completions?sig=s".into()),
            None,
        );
        assert_eq!(
            found.message(),
            "the test server answered 302 Found, redirecting to \
             https://api.example.com/v1/chat/completions?[redacted]: set the base URL to that \
             (the server said: Moved)"
        );
        let nowhere = api.refused(StatusCode::TEMPORARY_REDIRECT, b"", None, None);
        assert!(
            nowhere.message().ends_with("check the base URL"),
            "{}",
            nowhere.message()
        );
    }

    #[test]
    fn a_malformed_answer_is_retryable_and_repeats_what_the_server_said() {
        let api = Api {
            name: "the test server",
            secret: None,
            base_url: "http://127.0.0.1",
        };
        let error = api.malformed(&"missing field `choices`", br#"{"error": "busy"}"#);
        assert!(error.is_retryable());
        assert_eq!(
            error.message(),
            "the test server: the answer is not the API's JSON (missing field `choices`); the server said: busy"
        );
    }
}
