//! The conformance suite on PostgreSQL, each store in a schema of its own on the test server
//! (skipped, saying so, when none is named).

use std::sync::Mutex;

use super::testing::{Schema, server};
use crate::{
    RunId, Store,
    error::Result,
    store::conformance::{Fixture, conformance_suite},
};

/// Stores in fresh schemas, kept until the fixture is dropped.
struct Server {
    url: Option<String>,
    schemas: Mutex<Vec<Schema>>,
}

impl Server {
    fn new() -> Self {
        Server {
            url: server(),
            schemas: Mutex::new(Vec::new()),
        }
    }

    fn schema(&self) -> String {
        let schema = Schema::new(self.url.as_deref().expect("a test server"));
        let url = schema.url();
        self.schemas.lock().unwrap().push(schema);
        url
    }
}

impl Fixture for Server {
    fn available(&self) -> bool {
        self.url.is_some()
    }

    fn store(&self) -> Store {
        super::Options::new().open(&self.schema()).unwrap()
    }

    fn expire_lease(&self, store: &Store, run_id: &RunId) {
        let backend = store
            .backend()
            .as_any()
            .downcast_ref::<super::Postgres>()
            .unwrap();
        let mut conn = backend.connection().unwrap();
        let changed = conn
            .client()
            .execute(
                "UPDATE runs SET lease_expires_at =
                     floor(extract(epoch FROM clock_timestamp()) * 1000)::int8 - 1
                 WHERE id = $1",
                &[&run_id.as_str()],
            )
            .unwrap();
        assert_eq!(changed, 1);
    }

    fn open_newer_schema(&self) -> Option<Result<Store>> {
        let url = self.schema();
        drop(super::Options::new().open(&url).unwrap());
        let mut client = postgres::Client::connect(&url, postgres::NoTls).unwrap();
        client
            .execute(
                "INSERT INTO agentrt_migrations (version) VALUES ($1)",
                &[&(super::SCHEMA_VERSION as i32 + 1)],
            )
            .unwrap();
        Some(super::Options::new().open(&url))
    }
}

conformance_suite!(on_postgres, Server::new());
