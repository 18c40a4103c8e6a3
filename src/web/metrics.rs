//! `GET /metrics`: the runtime's metrics in Prometheus text format.
//!
//! The counters and histograms are recorded through the `metrics` facade (see
//! `src/metrics.rs`) into a Prometheus recorder installed here once per process; the runs by
//! state are read from the store at each scrape. An application that installed a recorder
//! of its own first keeps it: the counters go there, and the scrape answers with the store's
//! gauges and a comment saying so.

use std::{fmt::Write, sync::OnceLock, time::Duration};

use actix_web::{
    HttpRequest, HttpResponse,
    web::{self, Data},
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use super::{Shared, auth, error::ApiError};
use crate::{error::Result, metrics, store::Store};

/// The media type of Prometheus' text format.
const TEXT_FORMAT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// How often the recorder's histograms are folded and trimmed between scrapes, so that a
/// process nobody scrapes does not keep every observation.
const UPKEEP_PERIOD: Duration = Duration::from_secs(5);

/// The comment a scrape carries when the application's own recorder holds the counters.
pub(crate) const FOREIGN_RECORDER: &str = "# agentrt: another metrics recorder was installed \
     first; the counters and histograms go to the application's recorder, only the gauges read \
     from the store are here.";

/// The recorder's handle; `None` when another recorder was installed first.
static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs the Prometheus recorder as the process's global one, once; later calls, and a
/// process whose application installed a recorder first, change nothing.
pub(crate) fn install() {
    HANDLE.get_or_init(|| {
        let recorder = builder().build_recorder();
        let handle = recorder.handle();
        if ::metrics::set_global_recorder(recorder).is_err() {
            tracing::info!("a metrics recorder is installed already: agentrt's metrics go to it");
            return None;
        }
        metrics::describe();
        let upkeep = handle.clone();
        let spawned = std::thread::Builder::new()
            .name("agentrt-metrics".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(UPKEEP_PERIOD);
                    upkeep.run_upkeep();
                }
            });
        if let Err(err) = spawned {
            // The scrapes still do the upkeep; only a process never scraped grows.
            tracing::warn!(%err, "could not start the metrics upkeep thread");
        }
        Some(handle)
    });
}

/// A builder with the histograms' buckets: Prometheus histograms rather than the exporter's
/// default summaries, so that they can be summed across processes.
fn builder() -> PrometheusBuilder {
    let buckets = [
        (metrics::STEP_DURATION, metrics::STEP_BUCKETS),
        (metrics::COMMIT_DURATION, metrics::COMMIT_BUCKETS),
        (metrics::COMMIT_MOVES, metrics::MOVES_BUCKETS),
    ];
    buckets
        .into_iter()
        .fold(PrometheusBuilder::new(), |builder, (name, buckets)| {
            builder
                .set_buckets_for_metric(Matcher::Full(name.to_owned()), buckets)
                .expect("the buckets are not empty")
        })
}

/// The text of a scrape: the recorder's metrics, then the runs by state read from `store`.
/// Blocks on the store.
pub(crate) fn render(store: &Store) -> Result<String> {
    let counts = store.count_by_state()?;
    let mut text = match HANDLE.get() {
        Some(Some(handle)) => {
            metrics::refresh_queued();
            handle.render()
        }
        Some(None) => format!("{FOREIGN_RECORDER}\n"),
        None => String::new(),
    };
    let name = metrics::RUNS;
    let _ = writeln!(text, "# HELP {name} Runs in the store, by state.");
    let _ = writeln!(text, "# TYPE {name} gauge");
    for (state, count) in counts {
        let _ = writeln!(text, "{name}{{state=\"{}\"}} {count}", state.as_str());
    }
    Ok(text)
}

/// `GET /metrics`: a read, so it needs a token only where reads do.
pub(crate) async fn scrape(
    shared: Data<Shared>,
    req: HttpRequest,
) -> Result<HttpResponse, ApiError> {
    auth::judge(&shared.tokens, shared.reads_need_token, &req, false)?;
    let store = shared.store.clone();
    let text = web::block(move || render(&store))
        .await
        .map_err(|err| ApiError::internal(err.to_string()))??;
    Ok(HttpResponse::Ok().content_type(TEXT_FORMAT).body(text))
}
