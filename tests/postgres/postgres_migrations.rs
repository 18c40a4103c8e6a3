//! Opening a PostgreSQL store: processes starting together on an empty database migrate it
//! once; a database of a newer schema, an unreachable server and a malformed URL are refused,
//! and nothing is written.

#![cfg(feature = "postgres")]

use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::Stdio,
    time::{Duration, Instant},
};

use agentrt::{
    Error, SCHEMA_VERSION, Store,
    postgres::Options,
    testkit::postgres::{Schema, server},
};

use crate::support::child;

const URL: &str = "AGENTRT_MIGRATE_URL";
const GO: &str = "AGENTRT_MIGRATE_GO";

/// The child's side: says it is ready, waits for the parent's go, and opens the store, so that
/// all the children open it within a millisecond or so of each other.
#[test]
#[ignore = "the child process of two_processes_opening_an_empty_database_at_once_migrate_it_once"]
fn child_opens_the_store_on_go() {
    let url = std::env::var(URL).expect("run by the parent test");
    let go = std::env::var(GO).unwrap();
    println!("READY");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !Path::new(&go).exists() {
        assert!(Instant::now() < deadline, "the parent never said go");
        std::thread::sleep(Duration::from_micros(200));
    }
    match Store::connect(&url) {
        Ok(store) => println!("OPENED {}", store.schema_version().unwrap()),
        Err(err) => println!("FAILED {err}"),
    }
}

#[test]
fn two_processes_opening_an_empty_database_at_once_migrate_it_once() {
    let Some(server) = server() else { return };
    let schema = Schema::new(&server);
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let mut children: Vec<_> = (0..4)
        .map(|_| {
            child::test(module_path!(), "child_opens_the_store_on_go")
                .env(URL, schema.url())
                .env(GO, &go)
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut outputs: Vec<_> = children
        .iter_mut()
        .map(|child| BufReader::new(child.stdout.take().unwrap()).lines())
        .collect();
    let said = |lines: &mut std::io::Lines<BufReader<std::process::ChildStdout>>, word: &str| {
        lines
            .map_while(Result::ok)
            .find_map(|line| {
                line.split_once(word)
                    .map(|(_, rest)| rest.trim().to_owned())
            })
            .unwrap_or_else(|| panic!("a child did not say {word}"))
    };
    for lines in &mut outputs {
        said(lines, "READY");
    }
    std::fs::write(&go, b"").unwrap();
    for lines in &mut outputs {
        assert_eq!(said(lines, "OPENED"), SCHEMA_VERSION.to_string());
    }
    for child in &mut children {
        assert!(child.wait().unwrap().success());
    }
    // One migration recorded per version, by one server process.
    let rows = schema
        .client()
        .query("SELECT version, backend FROM agentrt_migrations", &[])
        .unwrap();
    let versions: Vec<i32> = rows.iter().map(|row| row.get(0)).collect();
    assert_eq!(versions, (10..=SCHEMA_VERSION as i32).collect::<Vec<_>>());
}

/// Every table of the schema with its rows, as text: what "unchanged" is compared on.
fn everything(schema: &Schema) -> Vec<String> {
    let mut client = schema.client();
    let tables: Vec<String> = client
        .query(
            "SELECT tablename::text FROM pg_tables WHERE schemaname = $1 ORDER BY 1",
            &[&schema.name()],
        )
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    tables
        .iter()
        .map(|table| {
            let rows: String = client
                .query_one(
                    &format!(
                        "SELECT coalesce(string_agg(t::text, '|' ORDER BY t::text), '') FROM {table} t"
                    ),
                    &[],
                )
                .unwrap()
                .get(0);
            format!("{table}: {rows}")
        })
        .collect()
}

#[test]
fn a_database_of_a_newer_schema_is_refused_and_left_unchanged() {
    let Some(server) = server() else { return };
    let schema = Schema::new(&server);
    let store = Store::connect(&schema.url()).unwrap();
    store
        .fork(&agentrt::RunId::from("none"), 1, None)
        .unwrap_err();
    drop(store);
    schema
        .client()
        .execute(
            "INSERT INTO agentrt_migrations (version) VALUES ($1)",
            &[&(SCHEMA_VERSION as i32 + 1)],
        )
        .unwrap();
    let before = everything(&schema);
    for options in [Options::new(), Options::new().read_only(true)] {
        let err = options.open(&schema.url()).unwrap_err();
        assert!(
            matches!(err, Error::SchemaTooNew { found, supported, .. }
                if found == SCHEMA_VERSION + 1 && supported == SCHEMA_VERSION),
            "{err}"
        );
        assert!(err.to_string().contains("left unchanged"), "{err}");
    }
    assert_eq!(everything(&schema), before);
}

#[test]
fn an_empty_database_opened_for_reading_only_is_refused_and_left_empty() {
    let Some(server) = server() else { return };
    let schema = Schema::new(&server);
    let err = Options::new()
        .read_only(true)
        .open(&schema.url())
        .unwrap_err();
    assert!(matches!(err, Error::NoDatabase { .. }), "{err}");
    assert!(everything(&schema).is_empty());
}

#[test]
fn a_server_that_does_not_answer_and_a_malformed_url_are_clear_errors() {
    // Port 9 on loopback: nothing listens there.
    let err = Options::new()
        .connect_timeout(Duration::from_secs(2))
        .open("postgres://agentrt:secret@127.0.0.1:9/agents")
        .unwrap_err();
    assert!(matches!(err, Error::ServerUnreachable { .. }), "{err}");
    let message = err.to_string();
    assert!(message.contains("127.0.0.1:9"), "{message}");
    assert!(message.contains("nothing was written"), "{message}");
    assert!(
        !message.contains("secret"),
        "the password is not shown: {message}"
    );

    let err = Store::connect("postgres://127.0.0.1:5432/db?sslmode=sometimes").unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err}");
}
