//! The schedules over HTTP: `GET /schedules` lists them; `POST /schedules/{name}/pause` and
//! `/resume` pause and resume one, with the token rules of every write.

use actix_web::{
    HttpResponse,
    web::{self, Data, Path},
};
use serde_json::json;

use super::{
    Shared,
    auth::{Reader, Writer},
    error::ApiError,
    routes::{blocking, resource},
};

/// The schedules' routes.
pub(crate) fn configure(cfg: &mut web::ServiceConfig) {
    cfg.service(resource("/schedules").get(list))
        .service(resource("/schedules/{name}/pause").post(pause))
        .service(resource("/schedules/{name}/resume").post(resume));
}

/// Every schedule, by name: `{"schedules": [...]}`.
async fn list(shared: Data<Shared>, _reader: Reader) -> Result<HttpResponse, ApiError> {
    let store = shared.store.clone();
    let schedules = blocking(move || store.schedules()).await?;
    Ok(HttpResponse::Ok().json(json!({ "schedules": schedules })))
}

/// Pauses a schedule; answers it as it is now.
async fn pause(
    shared: Data<Shared>,
    Writer(by): Writer,
    name: Path<String>,
) -> Result<HttpResponse, ApiError> {
    let (store, name) = (shared.store.clone(), name.into_inner());
    let schedule = blocking(move || store.pause_schedule(&name)).await?;
    tracing::info!(schedule = %schedule.name, by = %by, "operator paused a schedule");
    Ok(HttpResponse::Ok().json(schedule))
}

/// Resumes a schedule; answers it as it is now, with its next run.
async fn resume(
    shared: Data<Shared>,
    Writer(by): Writer,
    name: Path<String>,
) -> Result<HttpResponse, ApiError> {
    let (store, name) = (shared.store.clone(), name.into_inner());
    let schedule = blocking(move || store.resume_schedule(&name)).await?;
    tracing::info!(schedule = %schedule.name, by = %by, "operator resumed a schedule");
    Ok(HttpResponse::Ok().json(schedule))
}
