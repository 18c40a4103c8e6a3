//! The HTTP face of an agentrt supervisor, for `examples/service.rs` and its test: routes,
//! JSON bodies, and the server-sent event stream.

use std::time::Duration;

use actix::{Actor, Addr, Context, Handler};
use actix_web::{HttpResponse, ResponseError, http::StatusCode, web};
use agentrt::{
    Approval, CancelRun, Error, Lease, LeaseLost, PendingCall, RecordApproval, ResumeRun, Run,
    RunId, RunState, StartRun, Store, Supervisor,
};
use futures_util::stream;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// What every handler needs.
#[derive(Clone)]
pub struct AppState {
    pub supervisor: Addr<Supervisor>,
    pub store: Store,
}

/// Mounts the routes.
pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.app_data(web::JsonConfig::default().error_handler(|err, _| {
        // Malformed JSON: a 400 with a JSON body, like every other error.
        ApiError(
            StatusCode::BAD_REQUEST,
            format!("malformed request body: {err}"),
        )
        .into()
    }))
    .route("/runs", web::post().to(start_run))
    .route("/runs/{id}", web::get().to(get_run))
    .route("/runs/{id}/events", web::get().to(events))
    .route("/runs/{id}/approvals/{call}", web::post().to(decide))
    .route("/runs/{id}/resume", web::post().to(resume))
    .route("/runs/{id}/cancel", web::post().to(cancel));
}

/// An error as the API answers it: a status and `{"error": "..."}`.
#[derive(Debug)]
pub struct ApiError(StatusCode, String);

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.1)
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.0
    }

    fn error_response(&self) -> HttpResponse {
        HttpResponse::build(self.0).json(json!({ "error": self.1 }))
    }
}

impl From<Error> for ApiError {
    fn from(err: Error) -> Self {
        let status = match &err {
            _ if err.is_not_found() => StatusCode::NOT_FOUND,
            Error::UnknownAgent(_) | Error::InvalidInput(_) => StatusCode::UNPROCESSABLE_ENTITY,
            _ if err.is_run_state() => StatusCode::CONFLICT,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError(status, err.to_string())
    }
}

impl From<actix::MailboxError> for ApiError {
    fn from(err: actix::MailboxError) -> Self {
        ApiError(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the supervisor is not running: {err}"),
        )
    }
}

/// Runs a blocking store read off the async workers.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> agentrt::Result<T> + Send + 'static,
) -> Result<T, ApiError> {
    web::block(f)
        .await
        .map_err(|err| ApiError(StatusCode::INTERNAL_SERVER_ERROR, err.to_string()))?
        .map_err(ApiError::from)
}

// Response bodies are agentrt's own types in their documented JSON shape (times in
// milliseconds since the Unix epoch), with what a route adds beside them.

/// `GET /runs/{id}`: the run, its lease and the calls waiting for an approval.
#[derive(Serialize)]
struct Shown {
    #[serde(flatten)]
    run: Run,
    lease: Option<Lease>,
    pending_calls: Vec<PendingCall>,
}

/// `POST /runs/{id}/cancel`.
#[derive(Serialize)]
struct Cancelled {
    run_id: RunId,
    state: RunState,
}

#[derive(Deserialize)]
pub struct StartBody {
    agent: String,
    #[serde(default)]
    input: Value,
    run_id: Option<String>,
}

async fn start_run(
    state: web::Data<AppState>,
    body: web::Json<StartBody>,
) -> Result<HttpResponse, ApiError> {
    let body = body.into_inner();
    let mut start = StartRun::new(body.agent, body.input);
    if let Some(run_id) = body.run_id {
        start = start.with_id(run_id);
    }
    let reply = state.supervisor.send(start).await??;
    Ok(HttpResponse::Ok().json(reply))
}

async fn get_run(
    state: web::Data<AppState>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let (store, run_id) = (state.store.clone(), RunId::from(id.into_inner()));
    let shown = blocking(move || {
        Ok(Shown {
            run: store.run(&run_id)?,
            lease: store.lease(&run_id)?,
            pending_calls: store.pending_calls(&run_id)?,
        })
    })
    .await?;
    Ok(HttpResponse::Ok().json(shown))
}

#[derive(Deserialize)]
pub struct EventsQuery {
    #[serde(default)]
    after: u64,
}

/// Server-sent events tailing the run's log from `?after=SEQ`: each event is sent with its
/// sequence number as the SSE id, so a client reconnects with `after` set to the last id it
/// saw. The stream ends once the run has finished and nothing new came.
async fn events(
    state: web::Data<AppState>,
    id: web::Path<String>,
    query: web::Query<EventsQuery>,
) -> Result<HttpResponse, ApiError> {
    let (store, run_id) = (state.store.clone(), RunId::from(id.into_inner()));
    {
        // An unknown run is a 404 before the stream starts.
        let (store, run_id) = (store.clone(), run_id.clone());
        blocking(move || store.run(&run_id)).await?;
    }
    let tail = stream::unfold(
        (store, run_id, query.after, false),
        |(store, run_id, after, done)| async move {
            if done {
                return None;
            }
            loop {
                let (reader, id) = (store.clone(), run_id.clone());
                let polled = web::block(move || {
                    Ok::<_, Error>((reader.events_after(&id, after)?, reader.run(&id)?.state))
                })
                .await;
                let (events, state) = match polled {
                    Ok(Ok(polled)) => polled,
                    _ => return None,
                };
                if let Some(last) = events.last().map(|event| event.seq) {
                    let mut chunk = String::new();
                    for event in &events {
                        let data = serde_json::to_string(event).expect("an event serializes");
                        chunk.push_str(&format!(
                            "id: {}\nevent: {}\ndata: {data}\n\n",
                            event.seq, event.kind
                        ));
                    }
                    return Some((
                        Ok::<_, actix_web::Error>(web::Bytes::from(chunk)),
                        (store, run_id, last, false),
                    ));
                }
                if state.is_finished() {
                    return None;
                }
                actix_rt::time::sleep(Duration::from_millis(100)).await;
            }
        },
    );
    Ok(HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header(("cache-control", "no-cache"))
        .streaming(tail))
}

#[derive(Deserialize)]
pub struct DecisionBody {
    approved: bool,
    by: String,
    note: Option<String>,
}

async fn decide(
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
    body: web::Json<DecisionBody>,
) -> Result<HttpResponse, ApiError> {
    let (run_id, call_id) = path.into_inner();
    let body = body.into_inner();
    let mut approval = if body.approved {
        Approval::approve(run_id, call_id, body.by)
    } else {
        Approval::deny(run_id, call_id, body.by)
    };
    approval.note = body.note;
    state
        .supervisor
        .send(RecordApproval(approval.clone()))
        .await??;
    Ok(HttpResponse::Ok().json(approval))
}

async fn resume(
    state: web::Data<AppState>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let reply = state
        .supervisor
        .send(ResumeRun::new(id.into_inner()))
        .await??;
    Ok(HttpResponse::Ok().json(reply))
}

#[derive(Deserialize)]
pub struct CancelBody {
    reason: String,
}

async fn cancel(
    state: web::Data<AppState>,
    id: web::Path<String>,
    body: web::Json<CancelBody>,
) -> Result<HttpResponse, ApiError> {
    let run_id = RunId::from(id.into_inner());
    state
        .supervisor
        .send(CancelRun::new(run_id.clone(), body.into_inner().reason))
        .await??;
    Ok(HttpResponse::Ok().json(Cancelled {
        run_id,
        state: RunState::Cancelled,
    }))
}

/// Logs every lease this process loses.
pub struct LeaseLostLogger;

impl Actor for LeaseLostLogger {
    type Context = Context<Self>;
}

impl Handler<LeaseLost> for LeaseLostLogger {
    type Result = ();

    fn handle(&mut self, lost: LeaseLost, _: &mut Context<Self>) {
        tracing::warn!(run_id = %lost.run_id, owner = %lost.owner, reason = %lost.reason, "lease lost: this process stopped executing the run");
    }
}
