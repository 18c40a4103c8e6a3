//! The routes of runs that wait for something other than an approval: a person answers a
//! question, a sender delivers an event, and the inbox lists the waits a page at a time.

use std::time::{Duration, UNIX_EPOCH};

use actix_web::{
    HttpResponse,
    http::StatusCode,
    web::{self, Data, Json, Path, Query},
};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{
    Shared,
    auth::{Reader, Writer},
    error::ApiError,
    routes::{blocking, run_id},
};
use crate::{
    AnswerQuestion, DeliverEvent, MAX_PAGE_LIMIT, ResumeRun, RunId, Store, Wait, WaitKind,
    clock::to_millis,
    types::{Answer, Delivered, Delivery},
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct AnswerBody {
    answer: Value,
}

/// `POST /runs/{id}/calls/{call}/answer`: the answer is the token's operator's, whatever the
/// body says (it may say nothing else). With a supervisor, the run resumes at once; otherwise
/// a supervisor of its agent that watches the store does.
pub(super) async fn answer(
    shared: Data<Shared>,
    Writer(by): Writer,
    path: Path<(String, String)>,
    body: Json<AnswerBody>,
) -> Result<HttpResponse, ApiError> {
    let (id, call_id) = path.into_inner();
    let run_id = run_id(&id)?;
    let answer = Answer {
        run_id: run_id.clone(),
        call_id,
        answer: body.into_inner().answer,
        by,
    };
    let answered = match &shared.supervisor {
        Some(supervisor) => supervisor.send(AnswerQuestion(answer.clone())).await?,
        None => {
            let (store, answer) = (shared.store.clone(), answer.clone());
            web::block(move || store.answer(&answer))
                .await
                .map_err(|err| ApiError::internal(err.to_string()))?
        }
    };
    answered.map_err(|err| match err {
        // The answer itself is wrong (off the question's schema): the caller's to fix.
        crate::Error::InvalidInput(why) => {
            ApiError::new(StatusCode::BAD_REQUEST, "invalid_answer", why)
        }
        other => other.into(),
    })?;
    if let Some(supervisor) = &shared.supervisor {
        supervisor.do_send(ResumeRun::new(run_id));
    }
    tracing::info!(run_id = %answer.run_id, call_id = %answer.call_id, by = %answer.by, "operator answered a run's question");
    Ok(HttpResponse::Ok().json(answer))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct EventBody {
    name: String,
    event_id: String,
    #[serde(default)]
    payload: Value,
}

/// `POST /runs/{id}/events`: delivers an event to the run. With a supervisor, a run it woke
/// resumes at once.
pub(super) async fn deliver(
    shared: Data<Shared>,
    Writer(by): Writer,
    id: Path<String>,
    body: Json<EventBody>,
) -> Result<HttpResponse, ApiError> {
    let run_id = run_id(&id)?;
    let body = body.into_inner();
    for (field, value) in [("name", &body.name), ("event_id", &body.event_id)] {
        if value.trim().is_empty() {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_body",
                format!("an event needs a {field}"),
            ));
        }
    }
    let delivery = Delivery {
        run_id: run_id.clone(),
        name: body.name,
        event_id: body.event_id,
        payload: body.payload,
    };
    let delivered = match &shared.supervisor {
        Some(supervisor) => supervisor.send(DeliverEvent(delivery.clone())).await??,
        None => {
            let (store, delivery) = (shared.store.clone(), delivery.clone());
            blocking(move || store.deliver_event(&delivery)).await?
        }
    };
    if let (Some(supervisor), Delivered::Woke) = (&shared.supervisor, delivered) {
        supervisor.do_send(ResumeRun::new(run_id));
    }
    tracing::info!(run_id = %delivery.run_id, name = %delivery.name, event_id = %delivery.event_id, ?delivered, by = %by, "event delivered to a run");
    Ok(HttpResponse::Ok().json(json!({ "delivered": delivered })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct WaitsQuery {
    kind: Option<WaitKind>,
    limit: Option<usize>,
    after: Option<String>,
}

/// `GET /waits`: a page of waits, longest waiting first.
pub(super) async fn list(
    shared: Data<Shared>,
    _reader: Reader,
    query: Query<WaitsQuery>,
) -> Result<HttpResponse, ApiError> {
    let query = query.into_inner();
    let limit = query.limit.unwrap_or(crate::DEFAULT_PAGE_LIMIT);
    if !(1..=MAX_PAGE_LIMIT).contains(&limit) {
        return Err(ApiError::invalid_query(format!(
            "a page of {limit} waits: give a limit from 1 to {MAX_PAGE_LIMIT}"
        )));
    }
    let after = query.after.as_deref().map(decode).transpose()?;
    let store = shared.store.clone();
    let (waits, more) = blocking(move || page(&store, query.kind, after.as_ref(), limit)).await?;
    let next = more.then(|| encode(waits.last().expect("a full page")));
    Ok(HttpResponse::Ok().json(json!({ "waits": waits, "next": next })))
}

/// The first `limit` waits after `after`, and whether more follow.
fn page(
    store: &Store,
    kind: Option<WaitKind>,
    after: Option<&Wait>,
    limit: usize,
) -> crate::Result<(Vec<Wait>, bool)> {
    let waits = store.waits(kind, after, limit)?;
    let more = match waits.last() {
        Some(last) if waits.len() == limit => !store.waits(kind, Some(last), 1)?.is_empty(),
        _ => false,
    };
    Ok((waits, more))
}

const CURSOR_PREFIX: &str = "w1.";

/// A cursor: a version, the wait's `since` in milliseconds, and its run's id in hex (an id may
/// hold any character): the place the store orders waits by.
fn encode(wait: &Wait) -> String {
    let hex: String = wait
        .run_id
        .as_str()
        .bytes()
        .map(|byte| format!("{byte:02x}"))
        .collect();
    format!("{CURSOR_PREFIX}{}.{hex}", to_millis(wait.since))
}

/// The place a cursor names, as a wait: the store reads its `since` and run id alone.
fn decode(cursor: &str) -> Result<Wait, ApiError> {
    let malformed = || {
        ApiError::invalid_query(format!(
            "{cursor:?} is not a cursor of a page of waits: give back a page's `next` as it was"
        ))
    };
    let (since, hex) = cursor
        .strip_prefix(CURSOR_PREFIX)
        .and_then(|rest| rest.split_once('.'))
        .ok_or_else(malformed)?;
    let since: u64 = since.parse().map_err(|_| malformed())?;
    if hex.len() % 2 != 0 || !hex.is_ascii() {
        return Err(malformed());
    }
    let bytes = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16))
        .collect::<Result<Vec<u8>, _>>()
        .map_err(|_| malformed())?;
    let run_id = String::from_utf8(bytes).map_err(|_| malformed())?;
    Ok(Wait {
        run_id: RunId::from(run_id),
        since: UNIX_EPOCH + Duration::from_millis(since.min(i64::MAX as u64)),
        step: 0,
        call_id: String::new(),
        kind: WaitKind::Answer,
        key: String::new(),
        detail: Value::Null,
        due_at: None,
        woken_at: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_gives_back_its_place() {
        let mut wait = decode("w1.0.").unwrap();
        wait.run_id = RunId::from("a/b c\u{e9}");
        wait.since = UNIX_EPOCH + Duration::from_millis(1_700_000_000_123);
        let back = decode(&encode(&wait)).unwrap();
        assert_eq!((back.run_id, back.since), (wait.run_id, wait.since));
        for bad in [
            "", "w1.", "w1.x.00", "w1.1.0", "w1.1.zz", "r1.1.61", "w1.1.ff",
        ] {
            assert!(decode(bad).is_err(), "{bad:?}");
        }
    }
}
