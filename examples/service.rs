//! An actix-web service embedding agentrt: the supervisor executes the runs, and
//! `agentrt::web` serves the API and the operator console at http://127.0.0.1:8080/agentrt/ui/.
//!
//! ```text
//! RUST_LOG=info cargo run --features web --example service
//! curl -s localhost:8080/agentrt/runs -H 'content-type: application/json' \
//!      -d '{"agent": "support", "input": {"customer": "ada"}, "run_id": "r1"}'
//! curl -s -X POST localhost:8080/agentrt/runs/r1/calls/email-1/approve
//! curl -sN localhost:8080/agentrt/runs/r1/events/stream
//! ```

#[path = "support/quickstart_agent.rs"]
mod quickstart_agent;

use actix_web::{App, HttpServer};
use agentrt::{Config, Drain, Recovery, Store, Supervisor, Watch, web::Api};

#[actix_web::main]
async fn main() -> std::io::Result<()> {
    tracing_subscriber::fmt().with_env_filter("info").init();
    let store = Store::open("agentrt-service.db").map_err(std::io::Error::other)?;
    // Recovery takes over the runs a dead process left; the watch acts on decisions made
    // elsewhere (another replica's console, `agentrt approve`).
    let config = Config::default()
        .recovery(Recovery::default())
        .watch(Watch::default());
    let supervisor = Supervisor::builder(store.clone())
        .config(config)
        .agent("support", quickstart_agent::agent())
        .start()
        .map_err(std::io::Error::other)?;
    // Without tokens it answers loopback connections only; `.token("alice", TOKEN)` opens it.
    let api = Api::new(store).supervisor(supervisor.clone());
    let server = HttpServer::new(move || App::new().service(api.scope("/agentrt")))
        .disable_signals()
        .bind("127.0.0.1:8080")?
        .run();
    // A deploy's SIGTERM hands every run over to the other replicas, then stops the server.
    agentrt::web::stop_on_signal(supervisor, Drain::default(), server.handle());
    server.await
}
