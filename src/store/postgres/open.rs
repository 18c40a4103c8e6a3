//! Opening a PostgreSQL store: the connection, the schema's version, and the migrations.

use std::sync::{Arc, Mutex};

use super::{
    Options, Postgres,
    conn::{self, Conn, Pg},
};
use crate::{
    error::{Error, Result},
    store::{SchemaStatus, Store},
};

/// The schema version this build writes (the same on either backend).
pub use crate::store::SCHEMA_VERSION;

/// The migrations, by the version each brings the database to: an empty schema goes straight
/// to the first version PostgreSQL was supported at.
const MIGRATIONS: &[(u32, &str)] = &[
    (
        10,
        include_str!("../../../migrations/postgres/0010_schema.sql"),
    ),
    (
        11,
        include_str!("../../../migrations/postgres/0011_handover.sql"),
    ),
    (
        12,
        include_str!("../../../migrations/postgres/0012_waits.sql"),
    ),
    (
        13,
        include_str!("../../../migrations/postgres/0013_events_by_append.sql"),
    ),
    (
        14,
        include_str!("../../../migrations/postgres/0014_guarded_pipelines.sql"),
    ),
    (
        15,
        include_str!("../../../migrations/postgres/0015_run_keys.sql"),
    ),
    (
        16,
        include_str!("../../../migrations/postgres/0016_json_unchecked.sql"),
    ),
];

/// How many migrations opening a schema at version `found` applies: an empty schema (0) goes
/// to the first version PostgreSQL was supported at in one, then one per version after it.
pub fn migrations_pending(found: u32) -> u32 {
    MIGRATIONS
        .iter()
        .filter(|(version, _)| *version > found)
        .count() as u32
}

/// The longest schema name a store may live in: its change feed's channel is `agentrt_` and
/// the name.
const MAX_SCHEMA_NAME: usize = 55;

/// What records each migration applied: by whom (the server process) and when.
const HISTORY: &str = "CREATE TABLE IF NOT EXISTS agentrt_migrations (
    version    INTEGER     NOT NULL PRIMARY KEY,
    applied_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    backend    INTEGER     NOT NULL DEFAULT pg_backend_pid()
)";

/// A first connection to `url`: the driver's configuration, the URL as shown, the connection,
/// and the schema its tables are in (`None`: no schema of the `search_path` exists).
fn connect(
    url: &str,
    options: &Options,
) -> Result<(tokio_postgres::Config, String, Conn, Option<String>)> {
    let config = conn::config(url, options)?;
    let shown = conn::shown(url);
    let mut conn = Conn::open(&config, options).map_err(|err| unreachable(&shown, err))?;
    let schema = conn
        .client()
        .query_one("SELECT current_schema()", &[])
        .pg()?
        .get(0);
    Ok((config, shown, conn, schema))
}

pub(super) fn open(options: Options, url: &str) -> Result<Store> {
    // A store may be opened on an actix arbiter, which the driver cannot block.
    conn::off_runtime(|| open_here(options, url))
}

fn open_here(options: Options, url: &str) -> Result<Store> {
    let (config, shown, mut conn, schema) = connect(url, &options)?;
    let schema = schema.ok_or_else(|| {
        Error::InvalidInput(format!(
            "{shown}: no schema of the connection's search_path exists; create it first"
        ))
    })?;
    // The change feed's channel is named after the schema, and a channel name has at most 63
    // bytes.
    if schema.len() > MAX_SCHEMA_NAME {
        return Err(Error::InvalidInput(format!(
            "{shown}: the schema name {schema:?} is longer than {MAX_SCHEMA_NAME} bytes"
        )));
    }
    let found = version(&mut conn, &schema)?;
    let path = || std::path::PathBuf::from(&shown);
    if found > SCHEMA_VERSION {
        return Err(Error::SchemaTooNew {
            path: path(),
            found,
            supported: SCHEMA_VERSION,
        });
    }
    if found < SCHEMA_VERSION {
        if !options.migrate {
            return Err(if found == 0 {
                Error::NoDatabase { path: path() }
            } else {
                Error::SchemaOutdated {
                    path: path(),
                    found,
                    supported: SCHEMA_VERSION,
                }
            });
        }
        migrate(&mut conn, &schema, &shown)?;
    }
    let backend = Postgres {
        options,
        config,
        shown,
        schema,
        idle: Mutex::new(vec![conn]),
        stopped: Default::default(),
    };
    Ok(Store::from_backend(Arc::new(backend)))
}

/// The schema version of the store at `url`, as found and as this build writes it, read on a
/// read-only connection: nothing is migrated or written.
pub fn schema_status(url: &str) -> Result<SchemaStatus> {
    let options = Options::new().read_only(true);
    let config = conn::config(url, &options)?;
    let shown = conn::shown(url);
    let mut conn = Conn::open(&config, &options).map_err(|err| unreachable(&shown, err))?;
    let schema: Option<String> = conn
        .client()
        .query_one("SELECT current_schema()", &[])
        .pg()?
        .get(0);
    let found = match schema {
        Some(schema) => version(&mut conn, &schema)?,
        None => 0,
    };
    Ok(SchemaStatus {
        found,
        supported: SCHEMA_VERSION,
    })
}

/// The error of a server that could not be reached, or refused the connection.
pub(super) fn unreachable(shown: &str, err: Error) -> Error {
    match err {
        Error::Database(err) => {
            // The driver's error says "error connecting to server"; its sources say why.
            let mut why = err.to_string();
            let mut source = std::error::Error::source(&err).and_then(std::error::Error::source);
            while let Some(cause) = source {
                why = format!("{why}: {cause}");
                source = cause.source();
            }
            Error::ServerUnreachable {
                location: shown.to_owned(),
                why,
            }
        }
        err => err,
    }
}

/// The version of the schema's tables: 0 when agentrt has not migrated it yet. Reads only.
pub(super) fn version(conn: &mut Conn, schema: &str) -> Result<u32> {
    let table = format!("{}.agentrt_migrations", quote(schema));
    let exists: bool = conn
        .client()
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table])
        .pg()?
        .get(0);
    if !exists {
        return Ok(0);
    }
    let version: Option<i32> = conn
        .client()
        .query_one("SELECT max(version) FROM agentrt_migrations", &[])
        .pg()?
        .get(0);
    Ok(version.unwrap_or(0).max(0) as u32)
}

/// `name` as a quoted identifier.
pub(super) fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Applies the missing migrations under a session advisory lock of the schema's: of two
/// processes opening an empty database at once, the second waits for the first and finds
/// the schema current.
fn migrate(conn: &mut Conn, schema: &str, shown: &str) -> Result<()> {
    let key = format!("agentrt:migrate:{schema}");
    conn.client()
        .execute("SELECT pg_advisory_lock(hashtext($1))", &[&key])
        .pg()?;
    let migrated = (|| {
        let found = version(conn, schema)?;
        if found > SCHEMA_VERSION {
            return Err(Error::SchemaTooNew {
                path: shown.into(),
                found,
                supported: SCHEMA_VERSION,
            });
        }
        for (version, sql) in MIGRATIONS.iter().filter(|(version, _)| *version > found) {
            let failed = |err: postgres::Error| {
                Error::Migration(format!("to version {version} of {shown}: {err}"))
            };
            let mut tx = conn.client().transaction().map_err(failed)?;
            tx.batch_execute(HISTORY).map_err(failed)?;
            tx.batch_execute(sql).map_err(failed)?;
            tx.execute(
                "INSERT INTO agentrt_migrations (version) VALUES ($1)",
                &[&(*version as i32)],
            )
            .map_err(failed)?;
            tx.commit().map_err(failed)?;
        }
        Ok(())
    })();
    let unlocked = conn
        .client()
        .execute("SELECT pg_advisory_unlock(hashtext($1))", &[&key])
        .pg();
    migrated?;
    unlocked.map(drop)
}
