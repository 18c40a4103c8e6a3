//! The SQLite backend behind the storage boundary.

use std::{any::Any, sync::Arc};

use rusqlite::config::DbConfig;

use super::error::Db;
use super::{
    database::Sqlite,
    open::user_version,
    sql::{self, Sql},
    watcher::{SqlitePulse, SqliteWatcher},
    writer,
};
use crate::{
    clock::Clock,
    error::Result,
    store::{
        Health, SCHEMA_VERSION, SchemaStatus, Space,
        backend::{Backend, MoveObserver, Reads, Session, Tx, Watcher},
        model::Now,
        moves,
        pulse::{Bell, Pulse},
    },
};

impl Backend for Sqlite {
    fn describe(&self) -> String {
        match &self.path {
            Some(path) => format!("sqlite:{}", path.display()),
            None => "sqlite::memory:".into(),
        }
    }

    fn schema_version(&self) -> Result<u32> {
        user_version(&self.inspection()).db()
    }

    fn read(&self, read: &mut (dyn FnMut(&mut dyn Reads) -> Result<()> + Send)) -> Result<()> {
        super::sql::in_snapshot(&self.inspection(), |sql| read(sql))?;
        // The connection is released: the sync holds nobody up. A reader must not act on a
        // move that a power loss would undo.
        self.sync_after_read()
    }

    fn transact(
        &self,
        clock: &dyn Clock,
        apply: &mut (dyn FnMut(&mut dyn Tx, &mut Now<'_>) -> Result<()> + Send),
    ) -> Result<()> {
        writer::transact(self, clock, apply)
    }

    fn session(
        self: Arc<Self>,
        clock: Arc<dyn Clock>,
        observer: Option<Arc<dyn MoveObserver>>,
        // Its groups have committed when `Writer::commit` returns: the store actor rings.
        _: Arc<Bell>,
    ) -> Result<Session> {
        writer::session(self, clock, observer)
    }

    fn watcher(self: Arc<Self>) -> Result<Box<dyn Watcher>> {
        Ok(Box::new(SqliteWatcher::open(self)?))
    }

    fn pulse(self: Arc<Self>) -> Result<Box<dyn Pulse>> {
        Ok(Box::new(SqlitePulse::open(self)?))
    }

    fn health(&self) -> Result<Health> {
        // What this store's writers commit with (the inspection connection, which never writes,
        // keeps SQLite's default).
        health(&self.inspection(), self.options.synchronous.as_str(), None)
    }

    fn reclaim(&self) -> Result<Space> {
        self.reclaim_space()
    }

    fn vacuum(&self) -> Result<Space> {
        self.vacuum_all()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The health report read through `conn`: `synchronous` as the store's writers commit with it,
/// and the journal mode as given, else as `conn` reports it.
pub(super) fn health(
    conn: &rusqlite::Connection,
    synchronous: &str,
    journal_mode: Option<&str>,
) -> Result<Health> {
    let pragma = |name: &str| -> Result<String> {
        conn.pragma_query_value(None, name, |row| row.get::<_, rusqlite::types::Value>(0))
            .map(|value| match value {
                rusqlite::types::Value::Integer(n) => n.to_string(),
                rusqlite::types::Value::Text(text) => text,
                other => format!("{other:?}"),
            })
            .db()
    };
    let mut settings = Vec::new();
    for name in [
        "journal_mode",
        "synchronous",
        "foreign_keys",
        "trusted_schema",
        "busy_timeout",
    ] {
        let value = match (name, journal_mode) {
            ("synchronous", _) => synchronous.to_owned(),
            ("journal_mode", Some(mode)) => mode.to_owned(),
            _ => pragma(name)?,
        };
        settings.push((name.to_owned(), value));
    }
    // Whether the file gives a purge's space back to the disk, and the space it holds free.
    // `freelist_count` first: it reads the file's header in a transaction, which refreshes
    // what `auto_vacuum` answers from (another connection's vacuum may have switched it).
    let freelist_count = pragma("freelist_count")?;
    let auto_vacuum = match pragma("auto_vacuum")?.as_str() {
        "0" => "none",
        "1" => "full",
        "2" => "incremental",
        _ => "unknown",
    };
    settings.push(("auto_vacuum".to_owned(), auto_vacuum.to_owned()));
    settings.push(("freelist_count".to_owned(), freelist_count));
    let defensive = conn.db_config(DbConfig::SQLITE_DBCONFIG_DEFENSIVE).db()?;
    settings.push((
        "defensive".to_owned(),
        if defensive { "1" } else { "0" }.into(),
    ));
    let (stale_leases, running_without_lease) = moves::lease_report(&mut Sql::of(conn))?;
    Ok(Health {
        schema: SchemaStatus {
            found: user_version(conn).db()?,
            supported: SCHEMA_VERSION,
        },
        settings,
        integrity: sql::integrity_check(conn)?,
        stale_leases,
        running_without_lease,
    })
}
