//! Operators and their bearer tokens: kept as SHA-256 digests, never as the tokens.

use std::{
    future::{Ready, ready},
    net::SocketAddr,
};

use actix_web::{FromRequest, HttpRequest, dev::Payload, http::header};
use sha2::{Digest, Sha256};

use super::error::ApiError;

/// The operator recorded for a decision made without tokens, which only a loopback
/// connection may make.
pub const LOCAL_OPERATOR: &str = "local";

/// The configured tokens: each the SHA-256 digest of a token, and the operator it names.
#[derive(Clone, Default)]
pub(crate) struct Tokens {
    digests: Vec<([u8; 32], String)>,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The operators, never the digests.
        let operators: Vec<&str> = self.digests.iter().map(|(_, op)| op.as_str()).collect();
        f.debug_struct("Tokens")
            .field("operators", &operators)
            .finish()
    }
}

/// The SHA-256 digest of a token, in lowercase hex: what a token file keeps.
pub fn token_digest(token: &str) -> String {
    hex(&Sha256::digest(token.as_bytes()).into())
}

fn hex(bytes: &[u8; 32]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses a digest written as 64 hex digits.
pub(crate) fn parse_digest(text: &str) -> Option<[u8; 32]> {
    let text = text.trim();
    if text.len() != 64 || !text.is_ascii() {
        return None;
    }
    let mut digest = [0u8; 32];
    for (i, byte) in digest.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(digest)
}

impl Tokens {
    pub(crate) fn add(&mut self, operator: String, digest: [u8; 32]) {
        self.digests.push((digest, operator));
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.digests.is_empty()
    }

    /// The operator whose token this is. Every digest is compared, in constant time each,
    /// so the answer's timing tells nothing of which one matched or how far.
    fn operator(&self, token: &str) -> Option<&str> {
        let presented: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let mut found = None;
        for (digest, operator) in &self.digests {
            let same = digest
                .iter()
                .zip(presented.iter())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0;
            if same && found.is_none() {
                found = Some(operator.as_str());
            }
        }
        found
    }
}

/// Who made a request, as the API judged it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Caller {
    /// A configured token's operator.
    Operator(String),
    /// No token: a loopback connection to an API that has none configured.
    Local,
    /// No token, or none that is needed here.
    Anonymous,
}

impl Caller {
    /// The name a decision is recorded under.
    pub(crate) fn name(&self) -> Option<&str> {
        match self {
            Caller::Operator(name) => Some(name),
            Caller::Local => Some(LOCAL_OPERATOR),
            Caller::Anonymous => None,
        }
    }
}

fn is_loopback(addr: Option<SocketAddr>) -> bool {
    addr.is_some_and(|addr| addr.ip().is_loopback())
}

/// Whether a `Host` (or an `Origin`'s authority) names this machine by a loopback name.
fn is_loopback_host(authority: &str) -> bool {
    let host = match authority.strip_prefix('[') {
        // `[::1]:8080`
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => authority
            .rsplit_once(':')
            .map_or(authority, |(host, _)| host),
    };
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The headers a proxy adds: a request through one is not a local caller's, whatever its peer.
const FORWARDED: [&str; 4] = ["forwarded", "x-forwarded-for", "x-real-ip", "via"];

/// Refuses, for an API without tokens, what does not come from a program on this machine: a
/// connection that is not loopback, a request through a proxy, and a browser's request made
/// by a page of another site (named by `Origin` or `Sec-Fetch-Site`), or sent to a name that
/// is not loopback (a rebound DNS name): any page the operator opens could send those.
fn refuse_unless_local(req: &HttpRequest) -> Result<(), ApiError> {
    let network = || {
        ApiError::forbidden(
            "this API has no tokens configured, so it answers only programs on this machine              over loopback: configure operators' tokens to serve it on a network or behind a              proxy",
        )
    };
    if !(is_loopback(Some(req.app_config().local_addr())) && is_loopback(req.peer_addr())) {
        return Err(network());
    }
    let headers = req.headers();
    if FORWARDED.iter().any(|name| headers.contains_key(*name)) {
        return Err(network());
    }
    let text = |name: header::HeaderName| headers.get(name).and_then(|v| v.to_str().ok());
    if !text(header::HOST).is_some_and(is_loopback_host) {
        return Err(ApiError::forbidden(
            "this API has no tokens configured, so it answers only requests to 127.0.0.1,              [::1] or localhost",
        ));
    }
    let origin_elsewhere = text(header::ORIGIN).is_some_and(|origin| {
        let authority = origin.split_once("://").map_or("", |(_, rest)| rest);
        origin == "null" || !is_loopback_host(authority) || Some(authority) != text(header::HOST)
    });
    let cross_site = headers
        .get("sec-fetch-site")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"cross-site"));
    if origin_elsewhere || cross_site {
        return Err(ApiError::forbidden(
            "this API has no tokens configured, and this request comes from a page of another              site: configure operators' tokens to use it from a browser elsewhere",
        ));
    }
    Ok(())
}

/// The token of an `Authorization: Bearer TOKEN` header (the scheme in any case), if any.
fn presented(req: &HttpRequest) -> Result<Option<&str>, ApiError> {
    let Some(value) = req.headers().get(header::AUTHORIZATION) else {
        return Ok(None);
    };
    let malformed = || {
        ApiError::unauthorized(
            "the Authorization header must be `Bearer TOKEN`, with an operator's token",
        )
    };
    let (scheme, token) = value
        .to_str()
        .ok()
        .and_then(|v| v.split_once(' '))
        .ok_or_else(malformed)?;
    if !scheme.eq_ignore_ascii_case("bearer") || token.is_empty() {
        return Err(malformed());
    }
    Ok(Some(token))
}

/// Judges a request: `write` for a route that changes something. Tokens configured, a write
/// (or any request when reads need one too) needs a valid one, and a token presented on a
/// read is checked too. None configured, only local callers are served (see
/// [`refuse_unless_local`]).
pub(crate) fn judge(
    tokens: &Tokens,
    reads_need_token: bool,
    req: &HttpRequest,
    write: bool,
) -> Result<Caller, ApiError> {
    if tokens.is_empty() {
        refuse_unless_local(req)?;
        return Ok(Caller::Local);
    }
    match presented(req)? {
        Some(token) => match tokens.operator(token) {
            Some(operator) => Ok(Caller::Operator(operator.to_owned())),
            None => Err(ApiError::unauthorized(
                "the bearer token is not one of this API's",
            )),
        },
        None if write || reads_need_token => Err(ApiError::unauthorized(
            "this route needs an operator's token: send `Authorization: Bearer TOKEN`",
        )),
        None => Ok(Caller::Anonymous),
    }
}

/// The shortest token taken: a guessable one protects nothing.
pub const MIN_TOKEN_LEN: usize = 16;

/// Checks a token an operator is configured with.
pub(crate) fn check_token(token: &str) -> crate::Result<()> {
    if token.len() < MIN_TOKEN_LEN || token.trim() != token || token.contains(char::is_whitespace) {
        return Err(crate::Error::InvalidInput(format!(
            "an operator's token is at least {MIN_TOKEN_LEN} bytes with no spaces              (`agentrt token` makes one)"
        )));
    }
    Ok(())
}

fn shared(req: &HttpRequest) -> Result<&super::Shared, ApiError> {
    req.app_data::<actix_web::web::Data<super::Shared>>()
        .map(|data| &***data)
        .ok_or_else(|| ApiError::internal("the API's state is not mounted on this scope"))
}

/// The caller of a read route, judged before anything of the request is read.
pub(crate) struct Reader(#[allow(dead_code)] pub Caller);

impl FromRequest for Reader {
    type Error = ApiError;
    type Future = Ready<Result<Self, ApiError>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(shared(req).and_then(|shared| {
            judge(&shared.tokens, shared.reads_need_token, req, false).map(Reader)
        }))
    }
}

/// The operator of a write route: the token's, never a field of the body. An extractor, so
/// that it is judged before the body is read: a caller without a token learns nothing of what
/// the route takes.
pub(crate) struct Writer(pub String);

impl FromRequest for Writer {
    type Error = ApiError;
    type Future = Ready<Result<Self, ApiError>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(shared(req).and_then(|shared| {
            let caller = judge(&shared.tokens, shared.reads_need_token, req, true)?;
            caller
                .name()
                .map(|name| Writer(name.to_owned()))
                .ok_or_else(|| ApiError::unauthorized("this route needs an operator's token"))
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_found_by_its_digest_and_only_by_it() {
        let mut tokens = Tokens::default();
        tokens.add(
            "alice".into(),
            parse_digest(&token_digest("s3cret")).unwrap(),
        );
        tokens.add("bob".into(), parse_digest(&token_digest("other")).unwrap());
        assert_eq!(tokens.operator("s3cret"), Some("alice"));
        assert_eq!(tokens.operator("other"), Some("bob"));
        assert_eq!(tokens.operator("s3cret "), None);
        assert_eq!(tokens.operator(""), None);
        assert!(!format!("{tokens:?}").contains(&token_digest("s3cret")));
    }

    #[test]
    fn without_tokens_only_a_loopback_peer_naming_a_loopback_host_is_served() {
        use actix_web::test::TestRequest;
        let tokens = Tokens::default();
        let judged = |peer: &str, host: &str| {
            let req = TestRequest::default()
                .peer_addr(peer.parse().unwrap())
                .insert_header(("host", host))
                .to_http_request();
            judge(&tokens, false, &req, true).map_err(|err| err.code())
        };
        assert_eq!(
            judged("127.0.0.1:5000", "127.0.0.1:8080"),
            Ok(Caller::Local)
        );
        assert_eq!(judged("[::1]:5000", "[::1]:8080"), Ok(Caller::Local));
        assert_eq!(judged("127.0.0.1:5000", "localhost"), Ok(Caller::Local));
        assert_eq!(judged("192.0.2.1:5000", "127.0.0.1:8080"), Err("forbidden"));
        assert_eq!(judged("10.0.0.2:5000", "localhost:8080"), Err("forbidden"));
        assert_eq!(
            judged("127.0.0.1:5000", "agentrt.example"),
            Err("forbidden")
        );
        assert_eq!(
            judged("127.0.0.1:5000", "127.0.0.1.example:80"),
            Err("forbidden")
        );
    }

    #[test]
    fn a_digest_is_64_hex_digits() {
        let digest = token_digest("x");
        assert_eq!(digest.len(), 64);
        assert_eq!(hex(&parse_digest(&digest).unwrap()), digest);
        assert!(parse_digest("abc").is_none());
        assert!(parse_digest(&"zz".repeat(32)).is_none());
        assert!(parse_digest(&"é".repeat(32)).is_none());
    }
}
