//! How a supervisor behaves: its [`Config`], and the owner it stamps its leases with.

use std::{sync::Arc, time::Duration};

use super::{DEFAULT_MAX_CONCURRENT_RUNS, Recovery, Watch};
use crate::actors::lease_keeper::LeaseKeeper;
use crate::{
    clock::{Clock, SystemClock},
    error::{Error, Result},
    store::backend::MoveObserver,
};

/// The lease TTL when [`Config::lease_ttl`] is not set: 30 s.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(30);

/// How long a thread that hosts runs polls a move's answer before it sleeps, when that is the
/// only answer it awaits, when [`Config::answer_watch`] is not set: 300 µs.
pub const DEFAULT_ANSWER_WATCH: Duration = Duration::from_micros(300);

/// How a supervisor behaves: built from [`Config::default`] with its setters.
///
/// ```
/// use std::time::Duration;
///
/// let config = agentrt::Config::default()
///     .lease_owner("billing@host-3")
///     .lease_ttl(Duration::from_secs(10));
/// # let _ = config;
/// ```
///
/// How the database writes (group commit, the watch for the next move, durability) is the
/// store's business: see [`sqlite::Options`](crate::sqlite::Options).
#[derive(Clone)]
pub struct Config {
    pub(super) clock: Arc<dyn Clock>,
    pub(super) lease_owner: Option<String>,
    pub(super) lease_ttl: Duration,
    pub(super) start_margin: Option<Duration>,
    pub(super) observer: Option<Arc<dyn MoveObserver>>,
    pub(super) recovery: Option<Recovery>,
    pub(super) max_concurrent_runs: usize,
    pub(super) watch: Option<Watch>,
    pub(super) answer_watch: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            clock: Arc::new(SystemClock),
            lease_owner: None,
            lease_ttl: DEFAULT_LEASE_TTL,
            start_margin: None,
            observer: None,
            recovery: None,
            max_concurrent_runs: DEFAULT_MAX_CONCURRENT_RUNS,
            watch: None,
            answer_watch: DEFAULT_ANSWER_WATCH,
        }
    }
}

impl Config {
    /// Uses `clock` to stamp events and run rows; read once per committed move (default: the
    /// system clock). Lease times never read it.
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Names the lease owner for the operator reading a lease (`"billing@host-3"`). The stored
    /// owner is this name, `/`, and a random suffix drawn once per supervisor, so no two
    /// supervisors share an owner; without a name, the suffix alone.
    pub fn lease_owner(mut self, name: impl Into<String>) -> Self {
        self.lease_owner = Some(name.into());
        self
    }

    /// How long a lease lasts without renewal ([`DEFAULT_LEASE_TTL`]; zero means the default).
    /// It is how long a crashed process blocks the resume of its runs; renewals run every
    /// third of it.
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }

    /// How much of its lease a run must have left for a side effect (a tool call, a model
    /// call) to start: a third of the TTL by default, which a lease renewed on time has. At
    /// most the TTL less a renewal period (two thirds of it); zero asks only that the lease
    /// has not expired.
    ///
    /// The loop judges what is left by its own monotonic clock (the time its last successful
    /// renewal was sent, plus the TTL), and the write that starts the side effect checks it
    /// against the stored expiry too. A loop short of it waits for the next renewal, and stops
    /// with [`Error::LeaseLost`] if none comes before the lease expires: it never starts the
    /// side effect. The margin is the time a process may stall between that write and the
    /// call without another taking the run over; the fencing token
    /// ([`ToolContext::fencing_token`](crate::ToolContext::fencing_token)) covers a longer
    /// stall.
    pub fn start_margin(mut self, margin: Duration) -> Self {
        self.start_margin = Some(margin);
        self
    }

    /// Recovers the runs a dead process left: at start and then periodically, the supervisor
    /// takes over the `RUNNING` runs of its agents whose lease expired or that nobody holds
    /// (see [`Recovery`]), and starts the runs of its agents' schedules. Off by default:
    /// without it, a run is taken over only by a [`ResumeRun`](crate::ResumeRun), and no schedule starts a run.
    pub fn recovery(mut self, recovery: Recovery) -> Self {
        self.recovery = Some(recovery);
        self
    }

    /// How many runs the supervisor executes at once ([`DEFAULT_MAX_CONCURRENT_RUNS`]; at
    /// least 1). Every execution counts: a start, a resume, a fork, a recovery. Past the
    /// limit, a run waits its turn, oldest first: a new run is inserted before it waits,
    /// `RUNNING` and with no lease (its `run.started` says `queued`), so that
    /// [`SpawnRun`](crate::SpawnRun) answers at once and a crash loses nothing: a recovering supervisor (this
    /// one after a restart, or another replica with free slots) takes it over. A resume waits
    /// in the same line. A call that waits for the end ([`StartRun`](crate::StartRun), [`ResumeRun`](crate::ResumeRun)) answers
    /// once the run has had its turn.
    pub fn max_concurrent_runs(mut self, runs: usize) -> Self {
        self.max_concurrent_runs = runs.max(1);
        self
    }

    /// Watches the store for decisions and cancels recorded elsewhere (another process, the
    /// CLI, [`Store::record_approval`](crate::Store::record_approval)): a decided run of one of its agents is resumed, and a
    /// cancelled run it executes has its tool told, within about a poll period (see
    /// [`Watch`]). Off by default: without it, a decision waits for a [`ResumeRun`](crate::ResumeRun), and a
    /// cancel reaches the loop at its next write or lease renewal.
    pub fn watch(mut self, watch: Watch) -> Self {
        self.watch = Some(watch);
        self
    }

    /// How long a run's thread keeps polling for a move's answer before it sleeps
    /// ([`DEFAULT_ANSWER_WATCH`]; zero: it sleeps at once). A thread woken by the answer instead
    /// costs a lone run tens of microseconds per commit, in series with the disk; a thread that
    /// watches goes on serving its other actors meanwhile, and burns at most this long per move
    /// when the answer is slower. Only a thread with a single answer awaited watches: with
    /// several, one of them wakes it soon enough. Set it to zero where the CPU is dearer than a
    /// lone run's latency (a CPU quota that throttles the process, say). On SQLite only, and
    /// with two CPUs or more: PostgreSQL answers after a round trip to its server, which a
    /// watching client would only take CPU from, and with one CPU the watch takes it from the
    /// writer it waits for.
    pub fn answer_watch(mut self, watch: Duration) -> Self {
        self.answer_watch = watch;
        self
    }

    /// Tells `observer` of every move the supervisor commits, before and after;
    /// none by default.
    pub fn observer(mut self, observer: impl MoveObserver) -> Self {
        self.observer = Some(Arc::new(observer));
        self
    }

    /// The lease TTL in force: the one set, or the default for zero.
    pub(crate) fn effective_ttl(&self) -> Duration {
        if self.lease_ttl.is_zero() {
            DEFAULT_LEASE_TTL
        } else {
            self.lease_ttl
        }
    }

    /// The start margin in force: the one set, or a third of the TTL; refused when more than
    /// what a lease renewed on time has left at worst (the TTL less a renewal period), which a
    /// loop could wait for forever.
    pub(crate) fn effective_margin(&self) -> Result<Duration> {
        let ttl = self.effective_ttl();
        let margin = self.start_margin.unwrap_or(ttl / 3);
        let most = ttl - LeaseKeeper::period(ttl);
        if margin > most {
            return Err(Error::InvalidInput(format!(
                "the start margin ({margin:?}) must leave a renewal period of the lease TTL \
                 ({ttl:?}): it can be {most:?} at most"
            )));
        }
        Ok(margin)
    }
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("lease_owner", &self.lease_owner)
            .field("lease_ttl", &self.lease_ttl)
            .field("start_margin", &self.start_margin)
            .field("observer", &self.observer.is_some())
            .field("recovery", &self.recovery)
            .field("max_concurrent_runs", &self.max_concurrent_runs)
            .field("watch", &self.watch)
            .field("answer_watch", &self.answer_watch)
            .finish_non_exhaustive()
    }
}

/// The owner a supervisor stamps its leases with: the configured name, `/`, and 12 random hex
/// characters.
pub(super) fn lease_owner(name: Option<&str>) -> String {
    let suffix = format!("{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff);
    match name {
        Some(name) => format!("{name}/{suffix}"),
        None => suffix,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_owner_is_the_name_a_slash_and_twelve_random_hex_characters() {
        let owner = lease_owner(Some("billing@host-3"));
        let suffix = owner
            .strip_prefix("billing@host-3/")
            .expect("the name comes first");
        assert_eq!(suffix.len(), 12);
        assert!(suffix.chars().all(|c| c.is_ascii_hexdigit()));
        let bare = lease_owner(None);
        assert_eq!(bare.len(), 12);
        assert_ne!(
            lease_owner(Some("x")),
            lease_owner(Some("x")),
            "drawn anew for each supervisor"
        );
    }

    #[test]
    fn a_zero_ttl_means_the_default() {
        assert_eq!(
            Config::default().lease_ttl(Duration::ZERO).effective_ttl(),
            DEFAULT_LEASE_TTL
        );
        assert_eq!(Config::default().effective_ttl(), Duration::from_secs(30));
    }
}
