//! The PostgreSQL backend behind the storage boundary.

use std::{any::Any, sync::Arc};

use super::{
    Postgres, SCHEMA_VERSION,
    conn::{Conn, Pg, off_runtime, take_noted},
    open::version,
    watcher::{PgPulse, PgWatcher},
    writer::{self, read_on},
};
use crate::{
    clock::Clock,
    error::Result,
    store::{
        Health, SchemaStatus, Space,
        backend::{Backend, MoveObserver, Reads, Session, Tx, Watcher},
        model::Now,
        moves,
        pulse::{Bell, Pulse},
    },
};

/// The tables and triggers the schema holds: what the integrity check looks for.
const TABLES: &[&str] = &[
    "runs",
    "steps",
    "events",
    "approvals",
    "run_changes",
    "run_changes_head",
    "waits",
    "inbox",
    "schedules",
];
const TRIGGERS: &[&str] = &[
    "events_are_append_only_update",
    "events_of_unfinished_runs_are_kept",
    "steps_of_unfinished_runs_are_kept",
    "approvals_of_unfinished_runs_are_kept",
    "unfinished_runs_are_kept",
    "run_changes_decided",
    "run_changes_cancelled",
    "run_changes_released",
    "run_changes_woken",
];

impl Backend for Postgres {
    fn describe(&self) -> String {
        format!("postgres:{}", self.shown)
    }

    fn schema_version(&self) -> Result<u32> {
        off_runtime(|| {
            let mut conn = self.connection()?;
            let found = version(&mut conn, &self.schema);
            self.give_back(conn);
            found
        })
    }

    fn read(&self, read: &mut (dyn FnMut(&mut dyn Reads) -> Result<()> + Send)) -> Result<()> {
        off_runtime(|| self.read_snapshot(read))
    }

    fn transact(
        &self,
        clock: &dyn Clock,
        apply: &mut (dyn FnMut(&mut dyn Tx, &mut Now<'_>) -> Result<()> + Send),
    ) -> Result<()> {
        self.refuse_read_only()?;
        off_runtime(|| writer::transact(self, clock, apply))
    }

    fn session(
        self: Arc<Self>,
        clock: Arc<dyn Clock>,
        observer: Option<Arc<dyn MoveObserver>>,
        bell: Arc<Bell>,
    ) -> Result<Session> {
        self.refuse_read_only()?;
        off_runtime(|| writer::session(self, clock, observer, bell))
    }

    fn watcher(self: Arc<Self>) -> Result<Box<dyn Watcher>> {
        self.refuse_read_only()?;
        // A supervisor starts its watch on an actix arbiter.
        off_runtime(|| Ok(Box::new(PgWatcher::open(self)?) as Box<dyn Watcher>))
    }

    fn pulse(self: Arc<Self>) -> Result<Box<dyn Pulse>> {
        off_runtime(|| Ok(Box::new(PgPulse::open(self)?) as Box<dyn Pulse>))
    }

    fn health(&self) -> Result<Health> {
        off_runtime(|| {
            let mut conn = self.connection()?;
            let report = self.health_on(&mut conn);
            take_noted();
            self.give_back(conn);
            report
        })
    }

    fn reclaim(&self) -> Result<Space> {
        off_runtime(|| self.vacuum_tables("VACUUM (ANALYZE)"))
    }

    fn vacuum(&self) -> Result<Space> {
        off_runtime(|| self.vacuum_tables("VACUUM (FULL, ANALYZE)"))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Postgres {
    fn health_on(&self, conn: &mut Conn) -> Result<Health> {
        let found = version(conn, &self.schema)?;
        let mut settings = Vec::new();
        for name in [
            "server_version",
            "synchronous_commit",
            "fsync",
            "data_checksums",
            "default_transaction_isolation",
            "idle_in_transaction_session_timeout",
        ] {
            let value: String = conn
                .client()
                .query_one("SELECT current_setting($1)", &[&name])
                .pg()?
                .get(0);
            settings.push((name.to_owned(), value));
        }
        settings.push(("schema".to_owned(), self.schema.clone()));
        settings.push(("writers".to_owned(), self.options.writers.to_string()));
        let group_commit = self.options.group_commit.to_string();
        settings.push(("group_commit".to_owned(), group_commit));
        let integrity = self.integrity(conn)?;
        // By the server's clock, in a snapshot of its own.
        let mut leases = None;
        read_on(conn, &mut |reads| {
            leases = Some(moves::lease_report(reads)?);
            Ok(())
        })?;
        let (stale_leases, running_without_lease) = leases.unwrap_or_default();
        Ok(Health {
            schema: SchemaStatus {
                found,
                supported: SCHEMA_VERSION,
            },
            settings,
            integrity,
            stale_leases,
            running_without_lease,
        })
    }

    /// What is missing of the schema's tables and triggers: `["ok"]` when nothing is.
    fn integrity(&self, conn: &mut Conn) -> Result<Vec<String>> {
        let tables: Vec<String> = conn
            .client()
            .query(
                "SELECT tablename::text FROM pg_tables WHERE schemaname = $1",
                &[&self.schema],
            )
            .pg()?
            .iter()
            .map(|row| row.get(0))
            .collect();
        let triggers: Vec<String> = conn
            .client()
            .query(
                "SELECT t.tgname::text FROM pg_trigger t
                 JOIN pg_class c ON c.oid = t.tgrelid
                 JOIN pg_namespace n ON n.oid = c.relnamespace
                 WHERE n.nspname = $1 AND NOT t.tgisinternal AND t.tgenabled <> 'D'",
                &[&self.schema],
            )
            .pg()?
            .iter()
            .map(|row| row.get(0))
            .collect();
        let mut problems: Vec<String> = TABLES
            .iter()
            .filter(|table| !tables.iter().any(|found| found == *table))
            .map(|table| format!("table {table} is missing"))
            .collect();
        problems.extend(
            TRIGGERS
                .iter()
                .filter(|trigger| !triggers.iter().any(|found| found == *trigger))
                .map(|trigger| format!("trigger {trigger} is missing or disabled")),
        );
        if problems.is_empty() {
            problems.push("ok".into());
        }
        Ok(problems)
    }

    /// The bytes the store's tables take, their indexes and TOAST included.
    fn size(&self, conn: &mut Conn) -> Result<u64> {
        let mut bytes = 0i64;
        for table in TABLES {
            let size: i64 = conn
                .client()
                .query_one(
                    "SELECT pg_total_relation_size($1::text::regclass)",
                    &[&table],
                )
                .pg()?
                .get(0);
            bytes += size;
        }
        Ok(bytes.max(0) as u64)
    }

    /// A store opened for reading only refuses every write, before it is tried.
    fn refuse_read_only(&self) -> Result<()> {
        if self.options.read_only {
            return Err(crate::Error::ReadOnly {
                path: self.shown.clone().into(),
                why: "the store was opened for reading only".into(),
            });
        }
        Ok(())
    }

    fn vacuum_tables(&self, command: &str) -> Result<Space> {
        self.refuse_read_only()?;
        let mut conn = self.connection()?;
        let result = (|| {
            let before = self.size(&mut conn)?;
            // One table at a time: each VACUUM locks only its own.
            for table in [
                "approvals",
                "waits",
                "inbox",
                "steps",
                "events",
                "runs",
                "run_changes",
            ] {
                conn.client()
                    .batch_execute(&format!("{command} {table}"))
                    .pg()?;
            }
            let after = self.size(&mut conn)?;
            Ok(Space {
                bytes_before: before,
                bytes_after: after,
                // VACUUM keeps the space of deleted rows for later writes; FULL gives it back.
                free_bytes: 0,
                returns_space: command.contains("FULL"),
            })
        })();
        take_noted();
        self.give_back(conn);
        result
    }
}
