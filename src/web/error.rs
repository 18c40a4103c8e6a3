//! The API's errors: a status, a stable code, and a message for people.

use actix_web::{
    HttpResponse, ResponseError,
    error::{JsonPayloadError, QueryPayloadError},
    http::{StatusCode, header},
};
use serde_json::json;

use crate::Error;

/// An error as every route answers it: the status, and
/// `{"error": {"code": CODE, "message": MESSAGE}}`. The codes are stable; the messages are
/// for people and may change. A `401` also carries `WWW-Authenticate: Bearer`.
///
/// ```text
/// HTTP/1.1 409 Conflict
/// content-type: application/json
///
/// {"error": {"code": "run_leased", "message": "run order-17 is leased by ..."}}
/// ```
///
/// A route of the application's own that returns `Result<_, ApiError>` answers in the same
/// shape: `?` converts an [`Error`] (`not_found`, `run_state`, `run_leased`, `run_exists`,
/// `unknown_agent`, `invalid_input`, `unavailable`; any other is `internal`, its details
/// logged and not answered) and an `actix::MailboxError` (`unavailable`). `docs/operate.md`,
/// "Errors", lists every code with its status and when it is answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
        }
    }

    /// The stable code (`"not_found"`, `"unauthorized"`, ...): `docs/operate.md`, "Errors",
    /// lists them.
    pub fn code(&self) -> &'static str {
        self.code
    }

    /// The HTTP status it is answered with.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    pub(crate) fn unauthorized(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }

    pub(crate) fn forbidden(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::FORBIDDEN, "forbidden", message)
    }

    pub(crate) fn not_found(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    pub(crate) fn invalid_query(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_query", message)
    }

    pub(crate) fn no_supervisor(what: &str) -> Self {
        ApiError::new(
            StatusCode::CONFLICT,
            "no_supervisor",
            format!(
                "{what} needs a supervisor in this process, and this API has none: \
                 start it from the application that executes the agent"
            ),
        )
    }

    pub(crate) fn internal(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.code)
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse {
        let mut response = HttpResponse::build(self.status);
        if self.status == StatusCode::UNAUTHORIZED {
            response.insert_header((header::WWW_AUTHENTICATE, "Bearer realm=\"agentrt\""));
        }
        response.json(json!({ "error": { "code": self.code, "message": self.message } }))
    }
}

impl From<Error> for ApiError {
    fn from(err: Error) -> Self {
        let (status, code) = match &err {
            _ if err.is_not_found() => (StatusCode::NOT_FOUND, "not_found"),
            Error::UnknownAgent(_) => (StatusCode::UNPROCESSABLE_ENTITY, "unknown_agent"),
            Error::InvalidInput(_) => (StatusCode::UNPROCESSABLE_ENTITY, "invalid_input"),
            Error::RunLeased { .. } => (StatusCode::CONFLICT, "run_leased"),
            Error::RunExists(_) => (StatusCode::CONFLICT, "run_exists"),
            Error::Draining => (StatusCode::SERVICE_UNAVAILABLE, "draining"),
            Error::HandedOver { .. } => (StatusCode::SERVICE_UNAVAILABLE, "handed_over"),
            _ if err.is_run_state() => (StatusCode::CONFLICT, "run_state"),
            Error::Database(_)
            | Error::StoreUnavailable
            | Error::ServerUnreachable { .. }
            | Error::CommitFailed(_)
            | Error::CommitUnknown(_) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            _ => {
                // What went wrong is for the operator's log, not for the caller.
                tracing::error!(error = %err, "the web API failed a request");
                return ApiError::internal("the request failed inside agentrt: see its log");
            }
        };
        ApiError::new(status, code, err.to_string())
    }
}

impl From<actix::MailboxError> for ApiError {
    fn from(err: actix::MailboxError) -> Self {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            format!("the supervisor is not running: {err}"),
        )
    }
}

/// A JSON body the API could not take.
pub(crate) fn json_error(err: JsonPayloadError) -> ApiError {
    match err {
        JsonPayloadError::OverflowKnownLength { length, limit } => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("the body is {length} bytes; at most {limit} are taken"),
        ),
        JsonPayloadError::Overflow { limit } => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("the body is larger than the {limit} bytes taken"),
        ),
        JsonPayloadError::ContentType => ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "the body must be JSON, sent with `content-type: application/json`",
        ),
        JsonPayloadError::Deserialize(err) if err.is_data() => ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_body",
            format!("the body is JSON, but not what this route takes: {err}"),
        ),
        err => ApiError::new(
            StatusCode::BAD_REQUEST,
            "malformed_json",
            format!("the body is not JSON: {err}"),
        ),
    }
}

/// A query string the API could not take.
pub(crate) fn query_error(err: QueryPayloadError) -> ApiError {
    ApiError::invalid_query(format!(
        "the query string is not one this route takes: {err}"
    ))
}

/// Gives an error answered by actix-web itself (a body over the limit before a route read
/// it, a path it could not match) the API's JSON shape; the routes' own errors pass as they
/// are.
pub(crate) fn as_json<B>(
    res: actix_web::dev::ServiceResponse<B>,
) -> actix_web::Result<actix_web::middleware::ErrorHandlerResponse<B>> {
    use actix_web::middleware::ErrorHandlerResponse;
    let is_json = res
        .response()
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|value| value.as_bytes().starts_with(b"application/json"));
    if is_json {
        return Ok(ErrorHandlerResponse::Response(res.map_into_left_body()));
    }
    let status = res.status();
    let code = match status {
        StatusCode::PAYLOAD_TOO_LARGE => "payload_too_large",
        StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported_media_type",
        StatusCode::NOT_FOUND => "not_found",
        StatusCode::METHOD_NOT_ALLOWED => "method_not_allowed",
        StatusCode::UNAUTHORIZED => "unauthorized",
        StatusCode::FORBIDDEN => "forbidden",
        StatusCode::SERVICE_UNAVAILABLE => "unavailable",
        status if status.is_client_error() => "bad_request",
        _ => "internal",
    };
    let message = status
        .canonical_reason()
        .unwrap_or("the request failed")
        .to_owned();
    let response = ApiError::new(status, code, message).error_response();
    let (req, _) = res.into_parts();
    let res = actix_web::dev::ServiceResponse::new(req, response).map_into_right_body();
    Ok(ErrorHandlerResponse::Response(res))
}
