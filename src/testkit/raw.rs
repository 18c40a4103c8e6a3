//! A test's own access to a [`TempStore`]'s database, beside agentrt's, on either backend:
//! its rows as text, a statement of its own, and a lock that blocks every write.

use std::{collections::BTreeMap, sync::mpsc, thread::JoinHandle, time::Duration};

use super::TempStore;

/// The tables that hold a run's rows, each with the column naming the run.
const RUN_TABLES: [(&str, &str); 4] = [
    ("runs", "id"),
    ("steps", "run_id"),
    ("events", "run_id"),
    ("approvals", "run_id"),
];

/// How long a [`TempStore::block_writes`] waits for a writer in the middle of a transaction.
const PATIENCE: Duration = Duration::from_secs(10);

/// A connection of a test's own to the database, outside agentrt.
enum Raw {
    Sqlite(rusqlite::Connection),
    #[cfg(feature = "postgres")]
    Postgres(::postgres::Client),
}

impl TempStore {
    fn raw(&self) -> Raw {
        #[cfg(feature = "postgres")]
        if let Some(schema) = &self.schema {
            // On a thread of its own: the driver blocks on a runtime of its own, which it may
            // not do on an actix thread.
            let url = schema.url();
            return Raw::Postgres(
                std::thread::spawn(move || {
                    ::postgres::Client::connect(&url, ::postgres::NoTls)
                        .expect("the test server answers")
                })
                .join()
                .expect("a connection"),
            );
        }
        Raw::Sqlite(rusqlite::Connection::open(self.path()).expect("the database file opens"))
    }

    /// Every row of run `run_id` in each table that holds some (`runs`, `steps`, `events`,
    /// `approvals`), as text, by table, read by a connection of the test's own: how a test
    /// shows that something left a run's rows as they were, or deleted every one of them. The
    /// text is the backend's own; compare it only with text read from the same store.
    pub fn rows_of(&self, run_id: &str) -> BTreeMap<&'static str, Vec<String>> {
        let run_id = run_id.to_owned();
        off_actix(self.raw(), move |raw| {
            let mut all = BTreeMap::new();
            for (table, column) in RUN_TABLES {
                let mut found = match raw {
                    Raw::Sqlite(conn) => {
                        // SQLite's event log names its run by the run's integer key.
                        let run = match table {
                            "events" => "run_key = (SELECT key FROM runs WHERE id = ?1)".into(),
                            _ => format!("{column} = ?1"),
                        };
                        let mut statement = conn
                            .prepare(&format!("SELECT * FROM {table} WHERE {run}"))
                            .expect("a query of the table");
                        let width = statement.column_count();
                        statement
                            .query_map([&run_id], |row| {
                                Ok((0..width)
                                    .map(|i| format!("{:?}", row.get_ref(i).unwrap()))
                                    .collect::<Vec<_>>()
                                    .join("|"))
                            })
                            .expect("the rows")
                            .collect::<rusqlite::Result<Vec<_>>>()
                            .expect("the rows")
                    }
                    #[cfg(feature = "postgres")]
                    Raw::Postgres(client) => client
                        .query(
                            &format!(
                                "SELECT row_to_json(t)::text FROM {table} t WHERE {column} = $1"
                            ),
                            &[&run_id],
                        )
                        .expect("the rows")
                        .iter()
                        .map(|row| row.get(0))
                        .collect(),
                };
                found.sort();
                all.insert(table, found);
            }
            all
        })
    }

    /// The condition that picks run `run_id`'s rows of `table` in a test's own SQL: SQLite's
    /// event log names its run by the run's integer key, every other table (and PostgreSQL's
    /// log) by its id.
    pub fn of_run(&self, table: &str, run_id: &str) -> String {
        #[cfg(feature = "postgres")]
        let sqlite = self.schema.is_none();
        #[cfg(not(feature = "postgres"))]
        let sqlite = true;
        match table {
            "events" if sqlite => format!("run_key = (SELECT key FROM runs WHERE id = '{run_id}')"),
            "runs" => format!("id = '{run_id}'"),
            _ => format!("run_id = '{run_id}'"),
        }
    }

    /// Runs `sql`, one statement, on a connection of the test's own, outside agentrt, as an
    /// operator's SQL would: the number of rows it changed, or the database's error as text.
    /// How a test shows what the schema's own guards refuse.
    pub fn execute(&self, sql: &str) -> Result<u64, String> {
        let sql = sql.to_owned();
        off_actix(self.raw(), move |raw| match raw {
            Raw::Sqlite(conn) => conn
                .execute(&sql, [])
                .map(|changed| changed as u64)
                .map_err(|err| err.to_string()),
            #[cfg(feature = "postgres")]
            Raw::Postgres(client) => client.execute(&sql, &[]).map_err(|err| {
                // The message the server gave, past the driver's "db error".
                match err.as_db_error() {
                    Some(db) => db.message().to_owned(),
                    None => err.to_string(),
                }
            }),
        })
    }

    /// Blocks every write to the database, as a writer elsewhere holding it would, until the
    /// block is dropped; reads go on. Waits for a writer in the middle of a transaction to
    /// finish first. On SQLite it holds the write lock (`BEGIN IMMEDIATE`); on PostgreSQL, an
    /// `EXCLUSIVE` lock of every table of the store's schema.
    pub fn block_writes(&self) -> WriteBlock {
        WriteBlock::take(self.raw(), Some(PATIENCE))
            .expect("the database's writes are blocked within the patience")
    }

    /// [`TempStore::block_writes`], if no writer is in the middle of a transaction now; `None`
    /// at once otherwise. How a test stops a process where it holds no lock of the database.
    pub fn try_block_writes(&self) -> Option<WriteBlock> {
        WriteBlock::take(self.raw(), None)
    }
}

/// Every write to a [`TempStore`] blocked, until dropped ([`TempStore::block_writes`]).
#[must_use = "the writes are blocked until this is dropped"]
pub struct WriteBlock {
    release: Option<mpsc::Sender<()>>,
    holder: Option<JoinHandle<()>>,
}

impl WriteBlock {
    /// Takes the block on a thread of its own, which holds the connection until dropped;
    /// `patience` `None` is not to wait at all.
    fn take(raw: Raw, patience: Option<Duration>) -> Option<WriteBlock> {
        let (taken, took) = mpsc::channel();
        let (release, released) = mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            let Some(mut raw) = lock(raw, patience) else {
                let _ = taken.send(false);
                return;
            };
            let _ = taken.send(true);
            let _ = released.recv();
            unlock(&mut raw);
        });
        if took.recv().unwrap_or(false) {
            Some(WriteBlock {
                release: Some(release),
                holder: Some(holder),
            })
        } else {
            let _ = holder.join();
            None
        }
    }
}

/// Opens a transaction that blocks every write, or `None` if a writer holds the database for
/// longer than `patience` (not at all, for `None`).
fn lock(raw: Raw, patience: Option<Duration>) -> Option<Raw> {
    match raw {
        Raw::Sqlite(conn) => {
            conn.busy_timeout(patience.unwrap_or(Duration::ZERO))
                .expect("a busy timeout");
            conn.execute_batch("BEGIN IMMEDIATE").ok()?;
            Some(Raw::Sqlite(conn))
        }
        #[cfg(feature = "postgres")]
        Raw::Postgres(mut client) => {
            // PostgreSQL's 0 is no timeout: the lock says NOWAIT instead.
            let (wait, nowait) = match patience {
                Some(patience) => (patience.as_millis(), ""),
                None => (0, " NOWAIT"),
            };
            client
                .batch_execute(&format!("BEGIN; SET LOCAL lock_timeout = {wait}"))
                .expect("a transaction");
            let tables: Vec<String> = client
                .query(
                    "SELECT quote_ident(tablename) FROM pg_tables \
                     WHERE schemaname = current_schema() ORDER BY tablename",
                    &[],
                )
                .expect("the schema's tables")
                .iter()
                .map(|row| row.get(0))
                .collect();
            assert!(
                !tables.is_empty(),
                "the store is opened before its writes are blocked"
            );
            client
                .batch_execute(&format!(
                    "LOCK TABLE {} IN EXCLUSIVE MODE{nowait}",
                    tables.join(", ")
                ))
                .ok()?;
            Some(Raw::Postgres(client))
        }
    }
}

fn unlock(raw: &mut Raw) {
    match raw {
        Raw::Sqlite(conn) => conn.execute_batch("ROLLBACK").expect("the block ends"),
        #[cfg(feature = "postgres")]
        Raw::Postgres(client) => client.batch_execute("ROLLBACK").expect("the block ends"),
    }
}

impl Drop for WriteBlock {
    fn drop(&mut self) {
        drop(self.release.take());
        if let Some(holder) = self.holder.take() {
            let _ = holder.join();
        }
    }
}

/// Runs `read` with `raw` on a thread of its own, and drops the connection there.
fn off_actix<R: Send + 'static>(raw: Raw, read: impl FnOnce(&mut Raw) -> R + Send + 'static) -> R {
    std::thread::spawn(move || {
        let mut raw = raw;
        read(&mut raw)
    })
    .join()
    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}
