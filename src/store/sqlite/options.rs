//! The SQLite backend's knobs.

use std::time::Duration;

/// SQLite's `synchronous` setting: how hard a commit waits for the disk. JSON: `"NORMAL"`,
/// `"FULL"` or `"EXTRA"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Synchronous {
    /// A commit survives a crash of the process, not necessarily of the machine.
    Normal,
    /// A commit survives a power loss (the default).
    #[default]
    Full,
    /// As `Full`, and the directory is synced too.
    Extra,
}

impl Synchronous {
    /// The value of SQLite's `synchronous` pragma: `NORMAL`, `FULL` or `EXTRA`.
    pub fn as_str(self) -> &'static str {
        match self {
            Synchronous::Normal => "NORMAL",
            Synchronous::Full => "FULL",
            Synchronous::Extra => "EXTRA",
        }
    }
}

/// The watch for the next move after a commit when [`Options::commit_spin`] is not set: 50 µs.
pub const DEFAULT_COMMIT_SPIN: Duration = Duration::from_micros(50);

/// The most moves (or pairs) a group commit holds when [`Options::max_group`] is not set.
pub const DEFAULT_MAX_GROUP: usize = 200;

/// How a store opens an SQLite database, and how its supervisors write to it.
///
/// ```no_run
/// use agentrt::sqlite::{Options, Synchronous};
///
/// let store = Options::new()
///     .synchronous(Synchronous::Normal)
///     .open("agentrt.db")?;
/// # Ok::<(), agentrt::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Options {
    pub(super) synchronous: Synchronous,
    pub(super) busy_timeout: Duration,
    pub(super) create: bool,
    pub(super) migrate: bool,
    pub(super) group_commit: bool,
    pub(super) max_group: usize,
    pub(super) commit_spin: Duration,
    pub(super) log_vfs: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            synchronous: Synchronous::Full,
            busy_timeout: Duration::from_secs(5),
            create: true,
            migrate: true,
            group_commit: true,
            max_group: DEFAULT_MAX_GROUP,
            commit_spin: DEFAULT_COMMIT_SPIN,
            log_vfs: true,
        }
    }
}

impl Options {
    /// The defaults: `synchronous=FULL`, a 5 s busy timeout, create and migrate, group commit,
    /// a [`DEFAULT_COMMIT_SPIN`] watch, the log-gathering VFS where it is supported.
    pub fn new() -> Self {
        Options::default()
    }

    /// For operator tools: open only an existing database of the current schema, creating and
    /// migrating nothing.
    pub fn existing_only() -> Self {
        Options::default().create(false).migrate(false)
    }

    /// Durability of commits; default [`Synchronous::Full`].
    pub fn synchronous(mut self, synchronous: Synchronous) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// How long a statement waits for another connection's lock before failing; default 5 s.
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// Create the file when it is missing (default true); when false a missing file is
    /// [`Error::NoDatabase`](crate::Error::NoDatabase) and nothing is created.
    pub fn create(mut self, create: bool) -> Self {
        self.create = create;
        self
    }

    /// Apply the migrations the database lacks (default true); when false an older database is
    /// [`Error::SchemaOutdated`](crate::Error::SchemaOutdated) and is left as it is.
    pub fn migrate(mut self, migrate: bool) -> Self {
        self.migrate = migrate;
        self
    }

    /// Commit the moves that arrive together (from different runs) in one transaction, up to
    /// [`max_group`](Self::max_group) of them, each in a savepoint of its own and each caller
    /// answered after the commit (default true). Off, every move is a transaction and a commit
    /// of its own.
    pub fn group_commit(mut self, on: bool) -> Self {
        self.group_commit = on;
        self
    }

    /// The most moves one group commit holds, a pair of one run's moves committed together
    /// counting as one (default [`DEFAULT_MAX_GROUP`]; at least 1): more that wait are
    /// committed in the groups after it, in order. A group's moves are answered together,
    /// after its sync, so their runs' next moves arrive together too; groups of bounded size
    /// answer the first runs of a crowd while the writer applies the rest, and the runs that
    /// started together spread out instead of moving in one wave. Applied where a group's sync
    /// is left to the log-sync thread (`FULL`, on Unix) or not made (`NORMAL`, or a database
    /// in memory); at `EXTRA`,
    /// where each group syncs in its commit, groups stay unbounded. No effect without
    /// [`group_commit`](Self::group_commit).
    pub fn max_group(mut self, moves: usize) -> Self {
        self.max_group = moves.max(1);
        self
    }

    /// How long a supervisor's writer keeps watching for the next move after a commit before
    /// it parks its thread (default [`DEFAULT_COMMIT_SPIN`]; zero parks at once). A run's loop
    /// sends its next move a few microseconds after its reply; catching it without a thread
    /// wake-up makes a lone run faster, for at most this much CPU per commit. A model
    /// reservation answered once written (see `docs/runs.md`) shares its sync with the
    /// model's answer only if that answer arrives within this watch; after it, the writer
    /// syncs the reservation alone.
    pub fn commit_spin(mut self, spin: Duration) -> Self {
        self.commit_spin = spin;
        self
    }

    /// Write a commit's log frames in one system call per 124 KiB, through agentrt's VFS
    /// (default true). It is used on Unix with the SQLite release it was written for (3.53,
    /// which rusqlite's `bundled` feature builds); with another, SQLite's default VFS is used
    /// and a warning says so, once per process; on other platforms, SQLite's default VFS. Off,
    /// SQLite's default VFS writes the log, and the VFS is not even registered.
    pub fn log_vfs(mut self, on: bool) -> Self {
        self.log_vfs = on;
        self
    }
}
