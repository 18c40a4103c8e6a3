//! An actix-web service embedding an agentrt supervisor: start runs over HTTP, approve their
//! tool calls, resume and cancel them, and tail their events as server-sent events.
//!
//! ```text
//! RUST_LOG=info cargo run --example service            # listens on 127.0.0.1:8080
//! curl -s localhost:8080/runs -H 'content-type: application/json' \
//!      -d '{"agent": "support", "input": {"customer": "ada"}, "run_id": "r1"}'
//! curl -s localhost:8080/runs/r1/approvals/email-1 -H 'content-type: application/json' \
//!      -d '{"approved": true, "by": "ops"}'
//! curl -s -X POST localhost:8080/runs/r1/resume
//! curl -sN localhost:8080/runs/r1/events
//! ```

#[path = "support/quickstart_agent.rs"]
mod quickstart_agent;
#[path = "support/service_app.rs"]
mod service_app;

use actix::Actor;
use actix_web::{App, HttpServer, web};
use agentrt::{Config, Recovery, Store, SubscribeLeaseLost, Supervisor};
use service_app::{AppState, LeaseLostLogger, routes};

#[actix_web::main]
async fn main() -> std::io::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let path = std::env::var("AGENTRT_DB").unwrap_or_else(|_| "agentrt-service.db".into());
    let addr = std::env::var("AGENTRT_ADDR").unwrap_or_else(|_| "127.0.0.1:8080".into());
    let store = Store::open(&path).map_err(std::io::Error::other)?;
    // Recovery takes over, at start and then every 10 s, the runs a dead process left RUNNING.
    let config = Config::default()
        .lease_owner(format!("service@{addr}"))
        .recovery(Recovery::default());
    let supervisor = Supervisor::builder(store.clone())
        .config(config)
        .agent("support", quickstart_agent::agent())
        .start()
        .map_err(std::io::Error::other)?;
    supervisor.do_send(SubscribeLeaseLost(LeaseLostLogger.start().recipient()));

    tracing::info!(%addr, db = %path, "agentrt service listening");
    let state = web::Data::new(AppState { supervisor, store });
    HttpServer::new(move || App::new().app_data(state.clone()).configure(routes))
        .bind(addr)?
        .run()
        .await
}
