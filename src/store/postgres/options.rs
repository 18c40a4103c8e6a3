//! How a PostgreSQL store is opened.

use std::time::Duration;

use crate::error::Result;
use crate::store::Store;

/// The writer connections a supervisor commits through, unless told otherwise.
pub const DEFAULT_WRITERS: usize = 2;

/// The moves unanswered on a supervisor's first writer connection from which new runs go to
/// the others, unless told otherwise ([`Options::spill_at`]).
pub const DEFAULT_SPILL_AT: usize = super::lanes::SPILL_AT;

/// How to open a PostgreSQL store: `Options::new().open(url)`.
///
/// The URL is libpq's (`postgres://user:password@host:port/database?options`), as the
/// `postgres` crate reads it; a `search_path` given in its `options` parameter
/// (`?options=-csearch_path%3Dagents`) puts the store's tables in that schema, which must
/// exist.
#[derive(Debug, Clone)]
pub struct Options {
    pub(super) writers: usize,
    pub(super) group_commit: bool,
    pub(super) pipeline: bool,
    pub(super) migrate: bool,
    pub(super) read_only: bool,
    pub(super) connect_timeout: Duration,
    pub(super) network_timeout: Duration,
    pub(super) idle_in_transaction: Duration,
    /// The moves unanswered on a supervisor's first lane from which new runs go to others.
    pub(super) spill_at: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            writers: DEFAULT_WRITERS,
            group_commit: true,
            pipeline: true,
            migrate: true,
            read_only: false,
            connect_timeout: Duration::from_secs(5),
            network_timeout: Duration::from_secs(10),
            idle_in_transaction: Duration::from_secs(10),
            spill_at: DEFAULT_SPILL_AT,
        }
    }
}

impl Options {
    /// The defaults: [`DEFAULT_WRITERS`] writer connections with group commit, the database
    /// migrated at open.
    pub fn new() -> Self {
        Options::default()
    }

    /// How many connections a supervisor's moves may commit over (at least 1). A run's moves
    /// go through one of them while any of its moves is unanswered, so they commit in order.
    /// The first connection takes every run until its backlog is long (a process with hundreds
    /// of runs at once); the others then take the runs that come, in parallel.
    pub fn writers(mut self, writers: usize) -> Self {
        self.writers = writers.max(1);
        self
    }

    /// From how many moves unanswered on the first writer connection a run with none of its own
    /// unanswered goes to the least loaded connection instead ([`DEFAULT_SPILL_AT`] unless told
    /// otherwise; at least 1). One connection gathers larger groups, and replicas sharing a
    /// server commit most together when each uses one; a process alone on its server commits
    /// more with a lower bound, since its connections' groups then run on the server's cores at
    /// once. At 50 runs of 20 steps on the same host, 25 made one process commit about 1.45
    /// times as many moves a second as the default, and four replicas about as many.
    pub fn spill_at(mut self, moves: usize) -> Self {
        self.spill_at = moves.max(1);
        self
    }

    /// Whether a writer connection commits every move that queued behind its last commit in
    /// one transaction (the default), or each move in a transaction of its own.
    pub fn group_commit(mut self, on: bool) -> Self {
        self.group_commit = on;
        self
    }

    /// Whether a writer connection sends the writes of a transaction whose answers its moves
    /// do not need (the steps and events they insert, the guarded touches that must change one
    /// row) without waiting for each, so that it waits only where a move reads and at the
    /// commit (the default); or sends each statement once the one before it is answered. A
    /// write found refused at the next wait rolls the transaction back and applies it again
    /// statement by statement: the outcome is the same either way.
    pub fn pipeline(mut self, on: bool) -> Self {
        self.pipeline = on;
        self
    }

    /// Whether an empty or older database is migrated at open (the default), or refused
    /// unchanged.
    pub fn migrate(mut self, migrate: bool) -> Self {
        self.migrate = migrate;
        self
    }

    /// Opens the store for reading only: nothing is migrated, and every connection's
    /// transactions are read-only, so that nothing is written, whatever is asked.
    pub fn read_only(mut self, read_only: bool) -> Self {
        self.read_only = read_only;
        if read_only {
            self.migrate = false;
        }
        self
    }

    /// How long a connection may take to open (5 s by default).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// How long sent data may stay unacknowledged by the server before the connection is
    /// given up (10 s by default; the socket's `TCP_USER_TIMEOUT`, with keep-alives at a
    /// third of it): what bounds a call across a network that went away.
    pub fn network_timeout(mut self, timeout: Duration) -> Self {
        self.network_timeout = timeout.max(Duration::from_millis(100));
        self
    }

    /// How long the server keeps a session that sits idle inside a transaction (10 s by
    /// default): the row locks of a host that stalled or was cut off mid-transaction are
    /// freed after it, so that the other hosts can take its runs over.
    pub fn idle_in_transaction_timeout(mut self, timeout: Duration) -> Self {
        self.idle_in_transaction = timeout.max(Duration::from_millis(1));
        self
    }

    /// Opens (and, unless told otherwise, migrates) the store at `url`.
    ///
    /// A database whose schema is newer than this build's is refused unchanged
    /// ([`Error::SchemaTooNew`](crate::Error::SchemaTooNew)); an older one, with migrating
    /// off, too ([`Error::SchemaOutdated`](crate::Error::SchemaOutdated)). Two processes
    /// opening an empty database at once migrate it once.
    pub fn open(self, url: &str) -> Result<Store> {
        super::open::open(self, url)
    }
}
