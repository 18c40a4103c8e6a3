//! agentrt over HTTP, for actix-web applications: the runs and their events, the event
//! stream, approvals, answers to runs' questions, events delivered to runs, cancel and fork,
//! schedules, health and readiness, and the operator console at `/ui`, mounted onto the
//! application's own `App` in one line.
//!
//! ```no_run
//! use actix_web::{App, HttpServer};
//! use agentrt::{Store, web::Api};
//!
//! # async fn run() -> std::io::Result<()> {
//! let store = Store::open("agentrt.db").map_err(std::io::Error::other)?;
//! let api = Api::new(store)
//!     .token("alice", "a-long-random-token")
//!     .map_err(std::io::Error::other)?;
//! HttpServer::new(move || App::new().service(api.scope("/agentrt")))
//!     .bind("127.0.0.1:8080")?
//!     .run()
//!     .await
//! # }
//! ```
//!
//! With [`Api::supervisor`], starts and resumes go through the application's supervisor; an
//! API without one reads, records decisions and cancels, and a supervisor with
//! [`Config::watch`](crate::Config::watch) acts on them wherever it runs. `docs/operate.md`
//! describes every route, its errors, the tokens and the console.

mod auth;
mod error;
pub(crate) mod metrics;
mod routes;
mod schedules;
mod stream;
mod ui;
mod waits;

use std::{
    net::{SocketAddr, ToSocketAddrs},
    sync::Arc,
    time::Duration,
};

use actix::Addr;
use actix_web::{
    App, HttpServer,
    dev::{HttpServiceFactory, ServerHandle},
    web::{self, Data},
};

pub use auth::{LOCAL_OPERATOR, MIN_TOKEN_LEN, token_digest};
pub use error::ApiError;

use crate::{Drain, Store, Supervisor};

/// The OpenAPI document of the routes, served at `/openapi.json`.
pub(crate) const OPENAPI: &str = include_str!("openapi.json");

/// The largest request body taken: decisions, cancels and starts are small.
pub const MAX_BODY: usize = 256 * 1024;

/// What every route reads.
pub(crate) struct Shared {
    store: Store,
    supervisor: Option<Addr<Supervisor>>,
    tokens: auth::Tokens,
    reads_need_token: bool,
    keep_alive: Duration,
    hub: Arc<stream::Hub>,
}

/// agentrt's HTTP API and console over one store, to mount on an actix-web `App` with
/// [`Api::scope`]. Cheap to clone: an `HttpServer` builds an `App` per worker.
#[derive(Clone)]
pub struct Api {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Api")
            .field("store", &self.shared.store)
            .field("executes", &self.shared.supervisor.is_some())
            .field("tokens", &self.shared.tokens)
            .field("reads_need_token", &self.shared.reads_need_token)
            .finish_non_exhaustive()
    }
}

/// The API's streams, as counters: see [`Api::stats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Event streams open now (run streams and `/stream`).
    pub open_streams: usize,
    /// The store reads the streams have made: one per stream after each commit.
    pub store_reads: u64,
    /// The checks for commits made so far: at most one per commit this process makes, and
    /// one per check period, only while a stream is open.
    pub commit_checks: u64,
    /// Whether the check for commits runs: only while a stream is open.
    pub checking: bool,
}

/// How often the streams check for commits made by other processes (this process's own
/// commits wake them at once).
pub const DEFAULT_CHECK_EVERY: Duration = Duration::from_millis(100);

/// The keep-alive comment's period on an idle stream.
pub const DEFAULT_KEEP_ALIVE: Duration = Duration::from_secs(5);

impl Api {
    /// The API over `store`: no tokens (so it answers only loopback connections), no
    /// supervisor (so it reads, decides and cancels, and starts nothing).
    pub fn new(store: Store) -> Api {
        Api::from_parts(
            store,
            None,
            auth::Tokens::default(),
            false,
            DEFAULT_KEEP_ALIVE,
            DEFAULT_CHECK_EVERY,
        )
    }

    fn from_parts(
        store: Store,
        supervisor: Option<Addr<Supervisor>>,
        tokens: auth::Tokens,
        reads_need_token: bool,
        keep_alive: Duration,
        check_every: Duration,
    ) -> Api {
        metrics::install();
        let hub = stream::Hub::new(store.clone(), check_every);
        Api {
            shared: Arc::new(Shared {
                store,
                supervisor,
                tokens,
                reads_need_token,
                keep_alive,
                hub,
            }),
        }
    }

    /// Rebuilds with one part changed (the builder runs before the API serves).
    fn with(self, change: impl FnOnce(&mut Parts)) -> Api {
        let shared = &self.shared;
        let mut parts = Parts {
            store: shared.store.clone(),
            supervisor: shared.supervisor.clone(),
            tokens: shared.tokens.clone(),
            reads_need_token: shared.reads_need_token,
            keep_alive: shared.keep_alive,
            check_every: shared.hub.every(),
        };
        change(&mut parts);
        Api::from_parts(
            parts.store,
            parts.supervisor,
            parts.tokens,
            parts.reads_need_token,
            parts.keep_alive,
            parts.check_every,
        )
    }

    /// Starts, resumes and cancels go through `supervisor`, which executes the runs (its
    /// agents' runs: a decision on another agent's run is recorded, and left to a supervisor
    /// that has that agent).
    pub fn supervisor(self, supervisor: Addr<Supervisor>) -> Api {
        self.with(|parts| parts.supervisor = Some(supervisor))
    }

    /// An operator's bearer token: kept as its SHA-256 digest. Once any token is configured,
    /// every write needs one, and a decision is recorded under its operator's name. A token
    /// shorter than [`MIN_TOKEN_LEN`] bytes, or with spaces, is
    /// [`Error::InvalidInput`](crate::Error::InvalidInput): an unset variable read as `""`
    /// would otherwise open the API to anyone.
    pub fn token(self, operator: impl Into<String>, token: &str) -> crate::Result<Api> {
        auth::check_token(token)?;
        let digest = auth::parse_digest(&token_digest(token)).expect("a digest parses");
        let operator = operator.into();
        Ok(self.with(|parts| parts.tokens.add(operator, digest)))
    }

    /// An operator's token given by its SHA-256 digest in hex ([`token_digest`], or
    /// `agentrt token`), so that the configuration holds no token. A digest that is not 64 hex
    /// digits is [`Error::InvalidInput`](crate::Error::InvalidInput).
    pub fn token_digest(self, operator: impl Into<String>, digest: &str) -> crate::Result<Api> {
        let digest = auth::parse_digest(digest).ok_or_else(|| {
            crate::Error::InvalidInput(
                "a token digest is the token's SHA-256 in 64 hex digits".into(),
            )
        })?;
        let operator = operator.into();
        Ok(self.with(|parts| parts.tokens.add(operator, digest)))
    }

    /// Whether reads need a token too (off by default: writes always do, once tokens are
    /// configured).
    pub fn tokens_for_reads(self, required: bool) -> Api {
        self.with(|parts| parts.reads_need_token = required)
    }

    /// The keep-alive comment's period on an idle stream ([`DEFAULT_KEEP_ALIVE`]); at least
    /// 10 ms.
    pub fn keep_alive(self, every: Duration) -> Api {
        self.with(|parts| parts.keep_alive = every.max(Duration::from_millis(10)))
    }

    /// How often the streams check for commits made by other processes
    /// ([`DEFAULT_CHECK_EVERY`]); at least 1 ms.
    pub fn check_every(self, every: Duration) -> Api {
        self.with(|parts| parts.check_every = every.max(Duration::from_millis(1)))
    }

    /// Whether operators' tokens are configured.
    pub fn has_tokens(&self) -> bool {
        !self.shared.tokens.is_empty()
    }

    /// What the streams cost now.
    pub fn stats(&self) -> Stats {
        use std::sync::atomic::Ordering::SeqCst;
        let counters = &self.shared.hub.counters;
        Stats {
            open_streams: counters.open_streams.load(SeqCst),
            store_reads: counters.store_reads.load(SeqCst),
            commit_checks: counters.checks.load(SeqCst),
            checking: self.shared.hub.checking(),
        }
    }

    /// The routes and the console under `path` (`"/agentrt"`; `""` for the root), for
    /// `App::service`.
    pub fn scope(&self, path: &str) -> impl HttpServiceFactory + 'static {
        let json = web::JsonConfig::default()
            .limit(MAX_BODY)
            .error_handler(|err, _| error::json_error(err).into());
        let query =
            web::QueryConfig::default().error_handler(|err, _| error::query_error(err).into());
        web::scope(path)
            .wrap(actix_web::middleware::ErrorHandlers::new().default_handler(error::as_json))
            .app_data(Data::from(self.shared.clone()))
            .app_data(json)
            .app_data(query)
            .app_data(web::PayloadConfig::new(MAX_BODY))
            .configure(routes::configure)
            .default_service(web::to(routes::no_route))
    }

    /// Checks that the API may listen on `addrs`: an address that is not loopback needs
    /// operators' tokens. [`serve`] checks it; an application that binds its own server calls
    /// it (the routes refuse a non-loopback connection without tokens either way).
    pub fn check_listen(&self, addrs: &[SocketAddr]) -> crate::Result<()> {
        if let Some(open) = addrs.iter().find(|addr| !addr.ip().is_loopback())
            && !self.has_tokens()
        {
            return Err(crate::Error::InvalidInput(format!(
                "refusing to listen on {open}, which is not a loopback address, without \
                 operators' tokens: configure tokens, or listen on 127.0.0.1"
            )));
        }
        Ok(())
    }
}

/// What [`Api::with`] changes.
struct Parts {
    store: Store,
    supervisor: Option<Addr<Supervisor>>,
    tokens: auth::Tokens,
    reads_need_token: bool,
    keep_alive: Duration,
    check_every: Duration,
}

/// Serves `api` at the root of an HTTP server on `addr` until SIGTERM or SIGINT: refused,
/// before anything listens, for an address that is not loopback when no tokens are
/// configured. At the signal, an API with a supervisor drains it first ([`Drain::default`]:
/// its runs are handed over to the other replicas), then the server stops gracefully, as
/// [`stop_on_signal`] does.
pub async fn serve(api: Api, addr: impl ToSocketAddrs) -> std::io::Result<()> {
    let addrs: Vec<SocketAddr> = addr.to_socket_addrs()?.collect();
    api.check_listen(&addrs).map_err(std::io::Error::other)?;
    let supervisor = api.shared.supervisor.clone();
    // Open streams end at the stop; a request in flight has a few seconds to finish.
    let server = HttpServer::new(move || App::new().service(api.scope("")))
        .disable_signals()
        .shutdown_timeout(5)
        .bind(&addrs[..])?;
    for addr in server.addrs() {
        tracing::info!(%addr, "agentrt API and console listening");
    }
    let server = server.run();
    match supervisor {
        Some(supervisor) => stop_on_signal(supervisor, Drain::default(), server.handle()),
        None => {
            let (signals, handle) = (
                crate::actors::supervisor::Signals::install(),
                server.handle(),
            );
            actix_rt::spawn(async move {
                signals.wait().await;
                handle.stop(true).await;
            });
        }
    }
    server.await
}

/// The one line that makes SIGTERM a deploy in an actix-web service: on SIGTERM or SIGINT,
/// drains `supervisor` (see [`Drain`]: no run is started or resumed meanwhile, and each is
/// handed over at its next step boundary), then stops `server` gracefully. Build the server
/// with `disable_signals()`, so that its own handling does not stop it before the drain
/// ends.
///
/// ```no_run
/// # use actix_web::{App, HttpServer};
/// # use agentrt::{Drain, Supervisor, web::Api};
/// # async fn demo(api: Api, supervisor: actix::Addr<Supervisor>) -> std::io::Result<()> {
/// let server = HttpServer::new(move || App::new().service(api.scope("/agentrt")))
///     .disable_signals()
///     .bind("127.0.0.1:8080")?
///     .run();
/// agentrt::web::stop_on_signal(supervisor, Drain::default(), server.handle());
/// server.await
/// # }
/// ```
pub fn stop_on_signal(supervisor: Addr<Supervisor>, drain: Drain, server: ServerHandle) {
    let drained = crate::drain_on_signal(supervisor, drain);
    actix_rt::spawn(async move {
        drained.await;
        server.stop(true).await;
    });
}
