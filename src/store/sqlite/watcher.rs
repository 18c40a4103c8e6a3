//! The watcher on SQLite: a read-only connection of its own that polls `PRAGMA data_version`
//! (it changes when any other connection, in this process or another, commits) and, when it
//! changed, reads the change feed after its cursor.

use std::sync::Arc;

use rusqlite::{Connection, OpenFlags, config::DbConfig};

use super::error::Db;
use super::{
    database::Sqlite,
    open::{Role, configure},
    sql::Sql,
};
use crate::{
    error::Result,
    store::{
        backend::{Changes, Watcher},
        feed,
        pulse::Pulse,
    },
};

/// Where the watcher reads.
enum Source {
    /// A file store: a connection of the watcher's own, so that neither the application
    /// holding the inspection connection nor a busy writer delays it.
    Own(Connection),
    /// `:memory:`: the one connection, which is the writer's. `data_version` does not change
    /// for a connection's own commits, so every poll reads the feed (a range of its key past
    /// the cursor: nothing when nothing is new).
    Shared(Arc<Sqlite>),
}

/// A supervisor's watcher of an SQLite store.
pub(super) struct SqliteWatcher {
    source: Source,
    /// The id of the last change read; `None` until the first poll succeeded.
    cursor: Option<i64>,
    /// `PRAGMA data_version` as the last poll that read found it (file stores).
    version: Option<i64>,
}

impl Source {
    fn open(store: Arc<Sqlite>) -> Result<Self> {
        Ok(match &store.path {
            None => Source::Shared(store),
            Some(path) => {
                // Read-only, and never the checkpoint the last connection to close a database
                // makes: the watcher writes nothing, and creates nothing the supervisor's own
                // connections have not (they opened the database, its log and its index first).
                let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
                let conn = Connection::open_with_flags(path, flags).db()?;
                configure(&conn, &store.options, true, Role::Reader)?;
                conn.set_db_config(DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, true)
                    .db()?;
                Source::Own(conn)
            }
        })
    }
}

impl SqliteWatcher {
    pub(super) fn open(store: Arc<Sqlite>) -> Result<Self> {
        Ok(SqliteWatcher {
            source: Source::open(store)?,
            cursor: None,
            version: None,
        })
    }

    /// Runs `read` in one read transaction, so that what it reads is one snapshot.
    fn read<R>(&self, read: impl FnOnce(&Connection) -> Result<R>) -> Result<R> {
        let in_snapshot = |conn: &Connection| {
            let tx = conn.unchecked_transaction().db()?;
            let value = read(&tx)?;
            tx.commit().db()?;
            Ok(value)
        };
        match &self.source {
            Source::Own(conn) => in_snapshot(conn),
            Source::Shared(store) => in_snapshot(&store.inspection()),
        }
    }

    /// The connection's `data_version`: `None` for the shared connection, which does not see
    /// its own commits change it.
    fn data_version(&self) -> Result<Option<i64>> {
        match &self.source {
            Source::Own(conn) => conn
                .prepare_cached("PRAGMA data_version")
                .db()?
                .query_row([], |row| row.get(0))
                .db()
                .map(Some),
            Source::Shared(_) => Ok(None),
        }
    }
}

impl Watcher for SqliteWatcher {
    fn poll(&mut self) -> Result<Option<Changes>> {
        // Read before the feed: a commit landing after this changes it again, and the next
        // poll reads what this one missed.
        let version = self.data_version()?;
        let Some(cursor) = self.cursor else {
            let (last, decided) = self.read(|conn| feed::start(&mut Sql::of(conn)))?;
            (self.cursor, self.version) = (Some(last), version);
            return Ok(Some(decided));
        };
        if version.is_some() && version == self.version {
            return Ok(None);
        }
        // None: a commit that recorded no decision and cancelled no run.
        let read = self.read(|conn| feed::after(&mut Sql::of(conn), cursor))?;
        self.version = version;
        let Some((last, changes)) = read else {
            return Ok(None);
        };
        self.cursor = Some(last);
        if changes.changes.is_empty() && !changes.resync {
            return Ok(None);
        }
        Ok(Some(changes))
    }
}

/// The web API's check for commits on SQLite: `PRAGMA data_version` on a read-only connection
/// of its own, which reads nothing of the database file; on `:memory:`, the changes the one
/// connection has made.
pub(super) struct SqlitePulse(Source);

impl SqlitePulse {
    pub(super) fn open(store: Arc<Sqlite>) -> Result<Self> {
        Ok(SqlitePulse(Source::open(store)?))
    }
}

impl Pulse for SqlitePulse {
    fn marker(&mut self) -> Result<String> {
        let (conn, sql) = match &self.0 {
            Source::Own(conn) => (conn, "PRAGMA data_version"),
            Source::Shared(store) => {
                let conn = store.inspection();
                let changes: i64 = conn
                    .prepare_cached("SELECT total_changes()")
                    .db()?
                    .query_row([], |row| row.get(0))
                    .db()?;
                return Ok(changes.to_string());
            }
        };
        let version: i64 = conn
            .prepare_cached(sql)
            .db()?
            .query_row([], |row| row.get(0))
            .db()?;
        Ok(version.to_string())
    }
}
