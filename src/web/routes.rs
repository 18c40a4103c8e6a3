//! The routes: each reads the store off the async workers, or asks the supervisor.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use actix_web::{
    HttpRequest, HttpResponse,
    http::{StatusCode, header},
    web::{self, Data, Json, Path, Query},
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::{
    Shared,
    auth::{Caller, Reader, Writer},
    error::ApiError,
    stream,
};
use crate::{
    Approval, ApprovalReason, CancelRun, EventKind, Lease, PendingCall, RecordApproval, ResumeRun,
    Run, RunId, RunPage, RunQuery, RunState, RunUsage, SCHEMA_VERSION, SpawnRun, Store, Wait,
};

/// The routes of the scope, each with the methods it answers; any other method is a 405.
pub(crate) fn configure(cfg: &mut web::ServiceConfig) {
    cfg.service(resource("/health").get(health))
        .service(resource("/ready").get(ready))
        .service(resource("/openapi.json").get(openapi))
        .service(resource("/metrics").get(super::metrics::scrape))
        .service(resource("/whoami").get(whoami))
        .service(resource("/stream").get(changes))
        .service(resource("/approvals").get(approvals))
        .service(resource("/waits").get(super::waits::list))
        .service(resource("/runs").get(list_runs).post(start_run))
        .service(resource("/runs/{id}").get(get_run))
        .service(
            resource("/runs/{id}/events")
                .get(events)
                .post(super::waits::deliver),
        )
        .service(resource("/runs/{id}/events/stream").get(event_stream))
        .service(resource("/runs/{id}/calls/{call}/approve").post(approve))
        .service(resource("/runs/{id}/calls/{call}/deny").post(deny))
        .service(resource("/runs/{id}/calls/{call}/answer").post(super::waits::answer))
        .service(resource("/runs/{id}/resume").post(resume))
        .service(resource("/runs/{id}/cancel").post(cancel))
        .service(resource("/runs/{id}/fork").post(fork))
        .configure(super::schedules::configure)
        .configure(super::ui::configure);
}

/// A 405 for a route asked with a method it does not answer.
async fn method_not_allowed() -> Result<HttpResponse, ApiError> {
    Err(ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "this route does not answer that method",
    ))
}

/// A 404 for a path no route has.
pub(crate) async fn no_route(req: HttpRequest) -> Result<HttpResponse, ApiError> {
    Err(ApiError::not_found(format!(
        "no route here: {}",
        req.path()
    )))
}

/// A route whose other methods are answered with a JSON 405.
pub(super) fn resource(path: &str) -> actix_web::Resource {
    web::resource(path).default_service(web::to(method_not_allowed))
}

/// Runs a blocking store read off the async workers.
pub(super) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> crate::Result<T> + Send + 'static,
) -> Result<T, ApiError> {
    web::block(f)
        .await
        .map_err(|err| ApiError::internal(err.to_string()))?
        .map_err(ApiError::from)
}

/// A run id from a path: text of 1 to [`RunId::MAX_LEN`] bytes, none of them a control
/// character. Lighter than [`new_run_id`]: a run made before that check reads as it is.
pub(super) fn run_id(text: &str) -> Result<RunId, ApiError> {
    if text.is_empty() || text.len() > RunId::MAX_LEN || text.chars().any(char::is_control) {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_run_id",
            format!(
                "a run id is 1 to {} bytes of text with no control characters; this one is {} \
                 bytes",
                RunId::MAX_LEN,
                text.len()
            ),
        ));
    }
    Ok(RunId::from(text))
}

/// The id of a run to make (a start's, a fork's): one [`RunId::check`] takes.
fn new_run_id(text: &str) -> Result<RunId, ApiError> {
    let id = RunId::from(text);
    match id.check() {
        Ok(()) => Ok(id),
        Err(err) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_run_id",
            match err {
                crate::Error::InvalidInput(why) => why,
                other => other.to_string(),
            },
        )),
    }
}

async fn health() -> HttpResponse {
    HttpResponse::Ok().json(json!({ "status": "ok" }))
}

async fn ready(shared: Data<Shared>) -> Result<HttpResponse, ApiError> {
    let store = shared.store.clone();
    let version = blocking(move || store.schema_version())
        .await
        .map_err(|err| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "not_ready",
                format!("the store does not answer: {err}"),
            )
        })?;
    if version != SCHEMA_VERSION {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "not_ready",
            format!(
                "the database's schema is version {version}; this build needs {SCHEMA_VERSION}"
            ),
        ));
    }
    Ok(HttpResponse::Ok().json(json!({
        "status": "ready",
        "schema_version": version,
        "backend": shared.store.backend_name(),
    })))
}

async fn openapi() -> HttpResponse {
    HttpResponse::Ok()
        .content_type("application/json")
        .body(super::OPENAPI)
}

async fn whoami(shared: Data<Shared>, Reader(caller): Reader) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(json!({
        "operator": caller.name(),
        "authenticated": matches!(caller, Caller::Operator(_)),
        "tokens": !shared.tokens.is_empty(),
        "reads_need_token": shared.reads_need_token,
        "executes": shared.supervisor.is_some(),
    })))
}

/// `GET /runs`: a page of runs.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    state: Option<RunState>,
    agent: Option<String>,
    /// Milliseconds since the Unix epoch.
    since: Option<u64>,
    limit: Option<usize>,
    after: Option<String>,
}

async fn list_runs(
    shared: Data<Shared>,
    _reader: Reader,
    query: Query<ListQuery>,
) -> Result<Json<RunPage>, ApiError> {
    let query = query.into_inner();
    let mut runs = RunQuery::new();
    if let Some(state) = query.state {
        runs = runs.state(state);
    }
    if let Some(agent) = query.agent {
        runs = runs.agent(agent);
    }
    if let Some(since) = query.since {
        if since > i64::MAX as u64 {
            return Err(ApiError::invalid_query(
                "since is milliseconds since the Unix epoch, at most 2^63 - 1",
            ));
        }
        runs = runs.since(UNIX_EPOCH + Duration::from_millis(since));
    }
    if let Some(limit) = query.limit {
        runs = runs.limit(limit);
    }
    if let Some(after) = query.after {
        runs = runs.after(after);
    }
    let store = shared.store.clone();
    let page = blocking(move || store.list_runs(&runs))
        .await
        .map_err(|err| match err.code() {
            "invalid_input" => ApiError::invalid_query(err.to_string()),
            _ => err,
        })?;
    Ok(Json(page))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StartBody {
    agent: String,
    #[serde(default)]
    input: Value,
    run_id: Option<String>,
}

async fn start_run(
    shared: Data<Shared>,
    _writer: Writer,
    body: Json<StartBody>,
) -> Result<HttpResponse, ApiError> {
    let supervisor = shared
        .supervisor
        .clone()
        .ok_or_else(|| ApiError::no_supervisor("starting a run"))?;
    let body = body.into_inner();
    let mut spawn = SpawnRun::new(body.agent, body.input);
    if let Some(id) = body.run_id {
        spawn = spawn.with_id(new_run_id(&id)?);
    }
    let started = supervisor.send(spawn).await??;
    Ok(HttpResponse::Accepted().json(json!({ "run_id": started })))
}

/// `GET /runs/{id}`: the run, its lease, the calls waiting for an operator, what else it
/// waits for, its usage.
#[derive(Serialize)]
struct Shown {
    #[serde(flatten)]
    run: Run,
    lease: Option<Lease>,
    /// Past its expiry by this host's clock: its holder died or stalled.
    lease_expired: bool,
    pending_calls: Vec<PendingCall>,
    /// What it waits for other than an approval (an answer, an event, a time, a child run).
    wait: Option<Wait>,
    usage: RunUsage,
}

async fn get_run(
    shared: Data<Shared>,
    _reader: Reader,
    id: Path<String>,
) -> Result<Json<Shown>, ApiError> {
    let (store, run_id) = (shared.store.clone(), run_id(&id)?);
    let (run, lease, pending_calls, usage, wait) = blocking(move || {
        let (run, lease, pending_calls, usage) = store.run_shown(&run_id)?;
        let wait = match run.state.waits_for() {
            Some(_) => store.wait(&run_id)?,
            None => None,
        };
        Ok((run, lease, pending_calls, usage, wait))
    })
    .await?;
    let shown = Shown {
        wait,
        lease_expired: lease
            .as_ref()
            .is_some_and(|lease| lease.expires_at <= SystemTime::now()),
        lease,
        pending_calls,
        usage,
        run,
    };
    Ok(Json(shown))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AfterQuery {
    #[serde(default)]
    after: u64,
}

/// An event cursor (`?after=`, `Last-Event-ID`): past the largest seq an event can have it
/// would match nothing, and is most likely a cursor gone wrong.
fn seq_cursor(after: u64, name: &str) -> Result<u64, ApiError> {
    if after > i64::MAX as u64 {
        return Err(ApiError::invalid_query(format!(
            "{name} is an event's seq, at most {} (2^63 - 1); {after} is past every seq",
            i64::MAX
        )));
    }
    Ok(after)
}

async fn events(
    shared: Data<Shared>,
    _reader: Reader,
    id: Path<String>,
    query: Query<AfterQuery>,
) -> Result<HttpResponse, ApiError> {
    let after = seq_cursor(query.after, "after")?;
    let (store, run_id) = (shared.store.clone(), run_id(&id)?);
    let events = blocking(move || {
        // An unknown run is a 404, not an empty list.
        store.run(&run_id)?;
        store.events_after(&run_id, after)
    })
    .await?;
    Ok(HttpResponse::Ok().json(events))
}

/// `GET /runs/{id}/events/stream`: from `Last-Event-ID` when the client reconnects, else from
/// `?after=`.
async fn event_stream(
    shared: Data<Shared>,
    _reader: Reader,
    req: HttpRequest,
    id: Path<String>,
    query: Query<AfterQuery>,
) -> Result<HttpResponse, ApiError> {
    let run_id = run_id(&id)?;
    let reconnect = req.headers().get("last-event-id");
    let after = match reconnect {
        None => seq_cursor(query.after, "after")?,
        Some(value) => value
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .ok_or_else(|| {
                ApiError::invalid_query("Last-Event-ID must be an event's seq, a whole number")
            })
            .and_then(|after| seq_cursor(after, "Last-Event-ID"))?,
    };
    let (store, read_id) = (shared.store.clone(), run_id.clone());
    let (state, missed) = blocking(move || store.state_and_events_after(&read_id, after)).await?;
    // A client reconnecting after the `end` of a finished run: 204 tells an EventSource to stop
    // reconnecting.
    if reconnect.is_some() && state.is_finished() && missed.is_empty() {
        return Ok(HttpResponse::NoContent().finish());
    }
    let events = stream::run_events(&shared.hub, run_id, after, shared.keep_alive);
    Ok(sse(events))
}

async fn changes(shared: Data<Shared>, _reader: Reader) -> Result<HttpResponse, ApiError> {
    Ok(sse(stream::changes(&shared.hub, shared.keep_alive)))
}

fn sse(
    body: impl futures_util::Stream<Item = Result<web::Bytes, actix_web::Error>> + 'static,
) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header((header::CACHE_CONTROL, "no-cache"))
        // Proxies that buffer (nginx) pass each event on at once.
        .insert_header(("x-accel-buffering", "no"))
        .streaming(body)
}

/// A call waiting for an operator, with what the inbox shows of it.
#[derive(Serialize)]
struct Waiting {
    run_id: RunId,
    agent: String,
    step: u32,
    call_id: String,
    tool: String,
    args: Value,
    reason: ApprovalReason,
    /// The policy's reason for asking, from its `policy.decided` event.
    policy_reason: Option<String>,
    /// When the run last moved: since then it waits.
    #[serde(with = "crate::types::millis")]
    waiting_since: SystemTime,
}

/// At most this many waiting runs are listed by `GET /approvals`.
const INBOX_RUNS: usize = 200;

async fn approvals(shared: Data<Shared>, _reader: Reader) -> Result<HttpResponse, ApiError> {
    let store = shared.store.clone();
    let calls = blocking(move || inbox(&store)).await?;
    Ok(HttpResponse::Ok().json(json!({ "calls": calls })))
}

fn inbox(store: &Store) -> crate::Result<Vec<Waiting>> {
    let page = store.list_runs(
        &RunQuery::new()
            .state(RunState::WaitingForApproval)
            .limit(INBOX_RUNS),
    )?;
    let mut calls = Vec::new();
    for run in page.runs {
        let pending = store.pending_calls(&run.id)?;
        if pending.is_empty() {
            continue;
        }
        let events = store.events(&run.id)?;
        for call in pending {
            let policy_reason = events
                .iter()
                .rev()
                .filter(|event| event.kind == EventKind::PolicyDecided)
                .find(|event| event.payload["call_id"] == call.call_id.as_str())
                .and_then(|event| event.payload["reason"].as_str().map(str::to_owned));
            calls.push(Waiting {
                run_id: run.id.clone(),
                agent: run.agent.clone(),
                step: call.step,
                call_id: call.call_id,
                tool: call.tool,
                args: call.args,
                reason: call.reason,
                policy_reason,
                waiting_since: run.updated_at,
            });
        }
    }
    Ok(calls)
}

/// A body that may be left out (a decision needs no note): empty, or JSON of `T`.
fn optional_body<T: serde::de::DeserializeOwned + Default>(
    req: &HttpRequest,
    body: &[u8],
) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    let json = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.starts_with("application/json"));
    if !json {
        return Err(super::error::json_error(
            actix_web::error::JsonPayloadError::ContentType,
        ));
    }
    serde_json::from_slice(body).map_err(|err| {
        super::error::json_error(actix_web::error::JsonPayloadError::Deserialize(err))
    })
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct DecisionBody {
    note: Option<String>,
}

async fn approve(
    shared: Data<Shared>,
    Writer(by): Writer,
    req: HttpRequest,
    path: Path<(String, String)>,
    body: web::Bytes,
) -> Result<HttpResponse, ApiError> {
    decide(shared, by, req, path, body, true).await
}

async fn deny(
    shared: Data<Shared>,
    Writer(by): Writer,
    req: HttpRequest,
    path: Path<(String, String)>,
    body: web::Bytes,
) -> Result<HttpResponse, ApiError> {
    decide(shared, by, req, path, body, false).await
}

/// Records the decision under the caller's name; with a supervisor, resumes the run at once
/// (otherwise a watching supervisor elsewhere acts on it).
async fn decide(
    shared: Data<Shared>,
    by: String,
    req: HttpRequest,
    path: Path<(String, String)>,
    body: web::Bytes,
    approved: bool,
) -> Result<HttpResponse, ApiError> {
    let (id, call_id) = path.into_inner();
    let run_id = run_id(&id)?;
    let note = optional_body::<DecisionBody>(&req, &body)?.note;
    let mut approval = if approved {
        Approval::approve(run_id.clone(), call_id, by)
    } else {
        Approval::deny(run_id.clone(), call_id, by)
    };
    approval.note = note.filter(|note| !note.trim().is_empty());
    match &shared.supervisor {
        Some(supervisor) => {
            supervisor.send(RecordApproval(approval.clone())).await??;
            // The resume's result goes to the run's events, which the console follows.
            supervisor.do_send(ResumeRun::new(run_id));
        }
        None => {
            let (store, recorded) = (shared.store.clone(), approval.clone());
            blocking(move || store.record_approval(&recorded)).await?;
        }
    }
    tracing::info!(run_id = %approval.run_id, call_id = %approval.call_id, approved, by = %approval.by, "operator decided a waiting call");
    Ok(HttpResponse::Ok().json(approval))
}

/// A draining supervisor starts nothing: a route that answers before the run executes asks
/// first, and answers 503 `draining` rather than accept what would be dropped.
async fn refuse_if_draining(supervisor: &actix::Addr<crate::Supervisor>) -> Result<(), ApiError> {
    match supervisor.send(crate::actors::supervisor::IsDraining).await {
        Ok(false) => Ok(()),
        Ok(true) => Err(crate::Error::Draining.into()),
        Err(_) => Err(crate::Error::StoreUnavailable.into()),
    }
}

async fn resume(
    shared: Data<Shared>,
    _writer: Writer,
    id: Path<String>,
) -> Result<HttpResponse, ApiError> {
    let supervisor = shared
        .supervisor
        .clone()
        .ok_or_else(|| ApiError::no_supervisor("resuming a run"))?;
    let (store, run_id) = (shared.store.clone(), run_id(&id)?);
    let checked = run_id.clone();
    let run = blocking(move || store.run(&checked)).await?;
    if run.state.is_finished() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "run_state",
            format!(
                "run {run_id} has finished ({}): nothing to resume",
                run.state
            ),
        ));
    }
    refuse_if_draining(&supervisor).await?;
    supervisor.do_send(ResumeRun::new(run_id.clone()));
    Ok(HttpResponse::Accepted().json(json!({ "run_id": run_id })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CancelBody {
    reason: String,
}

async fn cancel(
    shared: Data<Shared>,
    Writer(by): Writer,
    id: Path<String>,
    body: Json<CancelBody>,
) -> Result<HttpResponse, ApiError> {
    let run_id = run_id(&id)?;
    let reason = body.into_inner().reason;
    if reason.trim().is_empty() {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_body",
            "a cancel needs a reason",
        ));
    }
    // The reason keeps who cancelled, as a decision keeps who decided.
    let reason = format!("{reason} (cancelled by {by})");
    match &shared.supervisor {
        Some(supervisor) => {
            supervisor
                .send(CancelRun::new(run_id.clone(), reason))
                .await??
        }
        None => {
            let (store, run_id) = (shared.store.clone(), run_id.clone());
            blocking(move || store.cancel(&run_id, &reason)).await?
        }
    }
    tracing::info!(run_id = %run_id, by = %by, "operator cancelled a run");
    Ok(HttpResponse::Ok().json(json!({ "run_id": run_id, "state": RunState::Cancelled })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ForkBody {
    at: u32,
    new_id: Option<String>,
}

async fn fork(
    shared: Data<Shared>,
    Writer(by): Writer,
    id: Path<String>,
    body: Json<ForkBody>,
) -> Result<HttpResponse, ApiError> {
    let origin = run_id(&id)?;
    let body = body.into_inner();
    let new_id = body.new_id.as_deref().map(new_run_id).transpose()?;
    // Nothing is written for a supervisor that would not execute the fork.
    if let Some(supervisor) = &shared.supervisor {
        refuse_if_draining(supervisor).await?;
    }
    let (store, from) = (shared.store.clone(), origin.clone());
    let forked = blocking(move || store.fork(&from, body.at, new_id)).await?;
    if let Some(supervisor) = &shared.supervisor {
        supervisor.do_send(ResumeRun::new(forked.clone()));
    }
    tracing::info!(run_id = %forked, origin = %origin, at = body.at, by = %by, "operator forked a run");
    Ok(HttpResponse::Created().json(json!({ "run_id": forked })))
}
