//! PostgreSQL for tests: the server named by `AGENTRT_TEST_POSTGRES_URL`, and a schema of its
//! own for each store, dropped with it.

use std::{
    io::Write,
    sync::{
        Once,
        atomic::{AtomicU64, Ordering},
    },
};

/// The variable that names the test server: a URL of a database the tests may create schemas
/// in (`postgres://postgres@127.0.0.1:5432/agentrt_test`).
pub const SERVER_VARIABLE: &str = "AGENTRT_TEST_POSTGRES_URL";

static SKIPPED: Once = Once::new();

/// The test server's URL, if one is named and answers. Without one, says once on this
/// process's standard error (past the test harness's capture) that the PostgreSQL tests are
/// skipped and why; with `CI` set, panics instead, since a CI run must not skip them.
pub fn server() -> Option<String> {
    let why = match std::env::var(SERVER_VARIABLE) {
        Ok(url) if !url.is_empty() => match postgres::Client::connect(&url, postgres::NoTls) {
            Ok(_) => return Some(url),
            Err(err) => format!("the server at {SERVER_VARIABLE} did not answer: {err}"),
        },
        _ => format!("{SERVER_VARIABLE} is not set"),
    };
    if std::env::var_os("CI").is_some() {
        panic!("CI is set, and the PostgreSQL tests cannot run: {why}");
    }
    SKIPPED.call_once(|| {
        let _ = writeln!(
            std::io::stderr(),
            "agentrt: the PostgreSQL tests of this binary were skipped: {why} (set it to a \
             database URL, e.g. postgres://postgres@127.0.0.1:5432/postgres, to run them)"
        );
    });
    None
}

/// A schema of its own on the test server, dropped (with everything in it) when this is.
pub struct Schema {
    server: String,
    name: String,
}

static SCHEMAS: AtomicU64 = AtomicU64::new(0);

impl Schema {
    /// A new, empty schema on the server at `server`.
    pub fn new(server: &str) -> Schema {
        let name = format!(
            "agentrt_t{}_{}_{:x}",
            std::process::id(),
            SCHEMAS.fetch_add(1, Ordering::SeqCst),
            rand::random::<u32>()
        );
        let mut client =
            postgres::Client::connect(server, postgres::NoTls).expect("the test server answers");
        client
            .batch_execute(&format!("CREATE SCHEMA {name}"))
            .expect("a schema is created");
        Schema {
            server: server.to_owned(),
            name,
        }
    }

    /// The schema's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The URL of the server with this schema as the connection's `search_path`.
    pub fn url(&self) -> String {
        let joiner = if self.server.contains('?') { '&' } else { '?' };
        format!(
            "{}{joiner}options=-csearch_path%3D{}",
            self.server, self.name
        )
    }

    /// A connection to the server in this schema, for a test's own statements.
    pub fn client(&self) -> postgres::Client {
        postgres::Client::connect(&self.url(), postgres::NoTls).expect("the test server answers")
    }
}

impl Drop for Schema {
    fn drop(&mut self) {
        if let Ok(mut client) = postgres::Client::connect(&self.server, postgres::NoTls) {
            let _ = client.batch_execute(&format!("DROP SCHEMA IF EXISTS {} CASCADE", self.name));
        }
    }
}
