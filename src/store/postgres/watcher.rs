//! The change feed, read by a watching supervisor: woken by the server's notifications.

use std::{sync::Arc, time::Duration};

use postgres::fallible_iterator::FallibleIterator;

use super::{
    Postgres,
    conn::{Conn, Pg, take_noted},
    open::quote,
    writer::in_snapshot,
};
use crate::{
    error::Result,
    store::{
        backend::{Changes, Watcher},
        feed::{self, Feed},
        pulse::Pulse,
    },
};

/// A watcher on a connection of its own that listens on the schema's channel, which every
/// change notifies: a poll with nothing notified costs no query, whatever the number of runs.
pub(super) struct PgWatcher {
    store: Arc<Postgres>,
    conn: Option<Conn>,
    cursor: Option<i64>,
}

impl PgWatcher {
    pub(super) fn open(store: Arc<Postgres>) -> Result<Self> {
        let conn = listen(&store)?;
        Ok(PgWatcher {
            store,
            conn: Some(conn),
            cursor: None,
        })
    }

    fn read<R>(&mut self, read: impl FnOnce(&mut dyn Feed) -> Result<R>) -> Result<R> {
        in_snapshot(self.conn()?, |pg| read(pg))
    }

    /// The listening connection, opened again if it broke (changes may have been missed
    /// meanwhile: the next poll reads the feed after its cursor either way).
    fn conn(&mut self) -> Result<&mut Conn> {
        if !self.conn.as_ref().is_some_and(Conn::is_usable) {
            self.conn = None;
            self.conn = Some(listen(&self.store)?);
        }
        Ok(self.conn.as_mut().expect("a listening connection"))
    }
}

/// A connection listening on the store's channel.
fn listen(store: &Postgres) -> Result<Conn> {
    let mut conn = store.connection()?;
    let channel = quote(&format!("agentrt_{}", store.schema));
    conn.client()
        .batch_execute(&format!("LISTEN {channel}"))
        .pg()?;
    Ok(conn)
}

impl Watcher for PgWatcher {
    /// A poll reads the feed's counter row, one row whatever the number of runs, and the feed
    /// after the cursor only when the counter moved.
    fn poll(&mut self) -> Result<Option<Changes>> {
        let Some(cursor) = self.cursor else {
            let (last, decided) = self.read(|feed| feed::start(feed))?;
            self.cursor = Some(last);
            return Ok(Some(decided));
        };
        let read = self.read(|feed| {
            if feed.last_change()? == cursor {
                return Ok(None);
            }
            feed::after(feed, cursor)
        });
        take_noted();
        let Some((last, changes)) = read? else {
            return Ok(None);
        };
        self.cursor = Some(last);
        if changes.changes.is_empty() && !changes.resync {
            return Ok(None);
        }
        Ok(Some(changes))
    }

    /// Sleeps on the listening connection: the notification of a commit that changed the
    /// feed ends the wait at once.
    fn wait(&mut self, period: Duration) {
        let Ok(conn) = self.conn() else {
            std::thread::sleep(period);
            return;
        };
        let mut notifications = conn.client().notifications();
        let woken = matches!(notifications.timeout_iter(period).next(), Ok(Some(_)));
        // The first one wakes the watch; the others it brought along are read with it.
        if woken {
            let mut pending = notifications.iter();
            while let Ok(Some(_)) = pending.next() {}
        }
    }
}

/// The web API's check for commits on PostgreSQL: the server's current snapshot, on a
/// connection of its own. It changes whenever a writing transaction starts or ends on the
/// server (in any database), which makes it a superset of this store's commits, read in one
/// round trip that touches no table.
pub(super) struct PgPulse {
    store: Arc<Postgres>,
    conn: Option<Conn>,
}

impl PgPulse {
    pub(super) fn open(store: Arc<Postgres>) -> Result<Self> {
        let conn = store.connection()?;
        Ok(PgPulse {
            store,
            conn: Some(conn),
        })
    }
}

impl Pulse for PgPulse {
    fn marker(&mut self) -> Result<String> {
        if !self.conn.as_ref().is_some_and(Conn::is_usable) {
            self.conn = None;
            self.conn = Some(self.store.connection()?);
        }
        let conn = self.conn.as_mut().expect("a pulse connection");
        let row = conn
            .client()
            .query_one("SELECT pg_current_snapshot()::text", &[])
            .pg()?;
        Ok(row.get(0))
    }
}
