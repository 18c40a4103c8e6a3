//! The settings both HTTP adapters take alike (where to send, the key, the temperature, the
//! headers and body fields added to every request, the client's connection settings), held in
//! one [`HttpOptions`] and given to each adapter as builder methods by [`http_setters!`], so
//! that they are written and documented once.

use std::fmt;

use reqwest::RequestBuilder;
use serde_json::{Map, Value, json};

use super::http::{Api, LazyClient, header, shown_url};
use crate::agent::ModelError;

/// What an adapter sends every request with, beside what its API asks for.
#[derive(Clone)]
pub(crate) struct HttpOptions {
    /// The API's root, without a trailing `/`.
    pub(crate) base_url: String,
    pub(crate) api_key: Option<String>,
    pub(crate) temperature: Option<f64>,
    /// Sent with every request, after the adapter's own headers.
    headers: Vec<(String, String)>,
    /// Added to every body, replacing a field of the adapter's.
    pub(crate) body: Map<String, Value>,
    pub(crate) client: LazyClient,
}

impl HttpOptions {
    pub(crate) fn new(base_url: &str) -> Self {
        HttpOptions {
            base_url: base_url.to_owned(),
            api_key: None,
            temperature: None,
            headers: Vec::new(),
            body: Map::new(),
            client: LazyClient::new(),
        }
    }

    pub(crate) fn set_base_url(&mut self, url: String) {
        self.base_url = url.trim_end_matches('/').to_owned();
        self.client.set_base_url(&self.base_url);
    }

    /// The base URL and the key the variables `url` and `key` name, where they are set and
    /// not blank, without the blanks around them (a key pasted with its newline).
    pub(crate) fn read_env(&mut self, url: &str, key: &str) {
        if let Some(url) = non_empty_var(url) {
            self.set_base_url(url);
        }
        if let Some(key) = non_empty_var(key) {
            self.api_key = Some(key);
        }
    }

    pub(crate) fn add_header(&mut self, name: String, value: String) {
        self.headers.push((name, value));
    }

    /// Who is called, for the messages of its errors, which never repeat the key.
    pub(crate) fn api(&self, name: &'static str) -> Api<'_> {
        Api {
            name,
            secret: self.api_key.as_deref(),
            base_url: &self.base_url,
        }
    }

    /// A POST of `body` as JSON to `{base_url}{path}`, to which the adapter adds its own
    /// headers before [`with_headers`](Self::with_headers) adds the configured ones.
    pub(crate) fn post(&self, path: &str, body: &Value) -> Result<RequestBuilder, ModelError> {
        let body = serde_json::to_vec(body).expect("a request body serializes");
        Ok(self
            .client
            .get()?
            .post(format!("{}{path}", self.base_url))
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body))
    }

    /// `request` with the configured headers, their values marked sensitive.
    pub(crate) fn with_headers(
        &self,
        mut request: RequestBuilder,
    ) -> Result<RequestBuilder, ModelError> {
        for (name, value) in &self.headers {
            let (name, value) = header(name, value)?;
            request = request.header(name, value);
        }
        Ok(request)
    }

    /// The adapter's `body` with the temperature, if set, and then the configured fields,
    /// which replace any of the adapter's.
    pub(crate) fn finish_body(&self, mut body: Map<String, Value>) -> Value {
        if let Some(temperature) = self.temperature {
            body.insert("temperature".into(), json!(temperature));
        }
        body.extend(self.body.clone());
        Value::Object(body)
    }

    /// The options in an adapter's `Debug`: no key, no header value (it may be a token), and
    /// no password or query of the base URL.
    pub(crate) fn debug_fields(&self, f: &mut fmt::DebugStruct<'_, '_>) {
        f.field("base_url", &shown_url(&self.base_url))
            .field("api_key", &self.api_key.as_ref().map(|_| "[redacted]"))
            .field(
                "headers",
                &self
                    .headers
                    .iter()
                    .map(|(name, _)| name)
                    .collect::<Vec<_>>(),
            )
            .field("temperature", &self.temperature);
    }
}

/// A variable's value without the blanks around it, if any: an empty variable counts as unset.
fn non_empty_var(name: &str) -> Option<String> {
    std::env::var(name)
        .ok()
        .map(|value| value.trim().to_owned())
        .filter(|value| !value.is_empty())
}

/// The builder methods of the settings in [`HttpOptions`], for an adapter whose `http` field
/// holds them. The adapter says what its base URL includes and how its key is sent, and names
/// examples of headers and body fields; the rest of each method's documentation is here.
macro_rules! http_setters {
    (
        $(#[$base_url:meta])*
        base_url;
        $(#[$api_key:meta])*
        api_key;
        header: $header_examples:literal;
        body_field: $body_examples:literal;
    ) => {
        $(#[$base_url])*
        ///
        /// A loopback host (`localhost`, `127.0.0.1`, `[::1]`) is always called directly, never
        /// through a proxy that `HTTP_PROXY`, `HTTPS_PROXY` or `ALL_PROXY` names.
        pub fn base_url(mut self, url: impl Into<String>) -> Self {
            self.http.set_base_url(url.into());
            self
        }

        $(#[$api_key])*
        pub fn api_key(mut self, key: impl Into<String>) -> Self {
            self.http.api_key = Some(key.into());
            self
        }

        /// The sampling temperature (left to the server unless set).
        pub fn temperature(mut self, temperature: f64) -> Self {
            self.http.temperature = Some(temperature);
            self
        }

        #[doc = concat!("A header sent with every request, such as ", $header_examples, ".")]
        pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
            self.http.add_header(name.into(), value.into());
            self
        }

        #[doc = concat!(
            "A field added to every request's body, such as ",
            $body_examples,
            "; it replaces a field the adapter would have sent."
        )]
        pub fn body_field(
            mut self,
            name: impl Into<String>,
            value: impl Into<::serde_json::Value>,
        ) -> Self {
            self.http.body.insert(name.into(), value.into());
            self
        }

        /// Calls the server directly, whatever proxy `HTTP_PROXY`, `HTTPS_PROXY` or `ALL_PROXY`
        /// names (`NO_PROXY` does the same for the hosts it lists). Implied for a loopback base
        /// URL.
        pub fn no_proxy(mut self) -> Self {
            self.http.client.set_no_proxy();
            self
        }

        /// How long opening a connection may take (10 s by default). The whole attempt's
        /// timeout is the agent's [`ModelPolicy`](crate::ModelPolicy).
        pub fn connect_timeout(mut self, timeout: ::std::time::Duration) -> Self {
            self.http.client.set_connect_timeout(timeout);
            self
        }
    };
}

pub(crate) use http_setters;
