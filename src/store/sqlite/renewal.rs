//! Lease renewal on SQLite: a connection of the keeper's own, so that the application holding
//! the store's other connections, or a busy writer, cannot starve it.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use rusqlite::{Connection, OpenFlags};

use super::error::{Db, take_io_error};
use super::{
    Sqlite,
    failure::IoFailure,
    open::{Role, configure, open_writing},
    sql::Sql,
};
use crate::{
    error::Result,
    store::{backend::Renewer, model::Renewal, moves},
    types::RunId,
};

/// Set while the keeper waits for the write lock to renew: the supervisor's writer holds back
/// its next commit meanwhile, since back-to-back commits would otherwise leave the lock free
/// for too short a time for the renewal to ever get it.
#[derive(Clone, Default)]
pub(super) struct RenewalPending(Arc<AtomicBool>);

impl RenewalPending {
    fn announce(&self, pending: bool) {
        self.0.store(pending, Ordering::SeqCst);
    }

    /// Called by the writer before a commit: waits (briefly) for a pending renewal.
    pub(super) fn yield_to_renewal(&self) {
        let deadline = Instant::now() + Duration::from_millis(20);
        while self.0.load(Ordering::SeqCst) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

/// The keeper's connection to a database file.
pub(super) struct SqliteRenewer {
    conn: Connection,
    pending: RenewalPending,
    /// The store's: a renewal is refused once any of its connections met an I/O error, and
    /// one that meets one refuses every later write of the store.
    failure: Arc<IoFailure>,
}

impl Drop for SqliteRenewer {
    fn drop(&mut self) {
        super::failure::keep_log_on_close(&self.failure, &self.conn);
    }
}

impl SqliteRenewer {
    /// A connection of its own, hardened like every other; `None` in memory, where the writer's
    /// connection is the whole database and renewals go through it.
    pub(super) fn open(store: &Sqlite, pending: RenewalPending) -> Result<Option<Self>> {
        let Some(path) = &store.path else {
            return Ok(None);
        };
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        // It waits for no lock: `renew` retries in short naps instead, announcing itself.
        let options = store.options.clone().busy_timeout(Duration::ZERO);
        let conn = open_writing(path, flags, &options).db()?;
        configure(&conn, &options, true, Role::Renewal)?;
        Ok(Some(SqliteRenewer {
            conn,
            pending,
            failure: store.failure.clone(),
        }))
    }
}

impl Renewer for SqliteRenewer {
    /// One renewal: retried in short naps until `patience` has passed, while `pending` holds
    /// back the writer's next commit.
    fn renew(
        &mut self,
        owner: &str,
        held: &[(RunId, u64)],
        ttl: Duration,
        patience: Duration,
    ) -> Result<Renewal> {
        self.failure.refuse_if_failed()?;
        take_io_error();
        self.pending.announce(true);
        let deadline = Instant::now() + patience;
        let renewal = loop {
            match moves::renew(&mut Sql::of(&self.conn), owner, held, ttl) {
                Err(err) if err.is_busy() && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_micros(200))
                }
                other => break other,
            }
        };
        self.pending.announce(false);
        let renewal = super::failure::of_unknown_fate("a lease renewal", renewal);
        self.failure.fail_if_noted("a lease renewal");
        renewal
    }
}

#[cfg(test)]
impl SqliteRenewer {
    pub(super) fn connection(&self) -> &Connection {
        &self.conn
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use super::*;
    use crate::{
        clock::SystemClock,
        store::{
            Store,
            model::{Grant, Holder},
            moves::FIRST_TOKEN,
        },
    };

    #[test]
    fn a_renewal_gets_the_write_lock_from_a_writer_committing_back_to_back() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("db.sqlite")).unwrap();
        let holder = Holder {
            owner: "me/000000000001".into(),
            ttl: Duration::from_millis(300),
            margin: Duration::ZERO,
        };
        let grant = Grant::new(holder.clone());
        let run_id = RunId::from("r");
        let create = moves::CreateRun {
            by: moves::Leased::new(&run_id, &grant),
            agent: "a".into(),
            input: serde_json::json!({}),
            trace: None,
        };
        store.apply(&SystemClock, create).unwrap();

        // A writer that commits back to back, yielding only as the supervisor's writer does.
        let pending = RenewalPending::default();
        let (writer, yielding) = (store.clone(), pending.clone());
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let (id, owner) = (run_id.clone(), holder.owner.clone());
        let busy = std::thread::spawn(move || {
            while !stopped.load(Ordering::SeqCst) {
                yielding.yield_to_renewal();
                writer
                    .transact(&SystemClock, |tx, now| {
                        tx.touch_run(&id, now.millis(), &owner, FIRST_TOKEN, None)
                    })
                    .unwrap();
            }
        });
        let sqlite = Sqlite::of(&store).unwrap();
        let mut renewer = SqliteRenewer::open(sqlite, pending).unwrap().unwrap();
        for _ in 0..20 {
            let renewal = renewer
                .renew(
                    &holder.owner,
                    &[(run_id.clone(), FIRST_TOKEN)],
                    holder.ttl,
                    Duration::from_millis(100),
                )
                .unwrap();
            assert_eq!(renewal.renewed, std::slice::from_ref(&run_id));
        }
        stop.store(true, Ordering::SeqCst);
        busy.join().unwrap();
    }
}
