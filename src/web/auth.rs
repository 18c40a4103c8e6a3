//! Operators and their bearer tokens: kept as SHA-256 digests, never as the tokens.

use std::net::SocketAddr;

use actix_web::{HttpRequest, http::header};
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

/// Judges a request: `write` for a route that changes something. Tokens configured, a write
/// (or any request when reads need one too) needs a valid one. None configured, only
/// loopback connections to a loopback listener are served: an API without tokens reachable
/// from the network is refused on every route.
pub(crate) fn judge(
    tokens: &Tokens,
    reads_need_token: bool,
    req: &HttpRequest,
    write: bool,
) -> Result<Caller, ApiError> {
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .map(|value| {
            value
                .to_str()
                .ok()
                .and_then(|v| v.strip_prefix("Bearer ").map(str::trim))
                .ok_or_else(|| {
                    ApiError::unauthorized(
                        "the Authorization header must be `Bearer TOKEN`, with an operator's token",
                    )
                })
        })
        .transpose()?;
    if tokens.is_empty() {
        let local =
            is_loopback(Some(req.app_config().local_addr())) && is_loopback(req.peer_addr());
        if !local {
            return Err(ApiError::forbidden(
                "this API has no tokens configured, so it answers only loopback connections: \
                 configure operators' tokens to serve it on a network",
            ));
        }
        return Ok(Caller::Local);
    }
    match presented {
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
    fn a_digest_is_64_hex_digits() {
        let digest = token_digest("x");
        assert_eq!(digest.len(), 64);
        assert_eq!(hex(&parse_digest(&digest).unwrap()), digest);
        assert!(parse_digest("abc").is_none());
        assert!(parse_digest(&"zz".repeat(32)).is_none());
        assert!(parse_digest(&"é".repeat(32)).is_none());
    }
}
