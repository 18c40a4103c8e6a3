//! The injectable clock that stamps events and run rows.

use std::time::{Duration, SystemTime};

/// The source of the times written to events and run rows.
///
/// agentrt reads it once per committed move (every event of one move carries the same time),
/// and only then: the number and order of readings in an ordinary run is part of the contract,
/// so a consumer's deterministic clock stamps the same times on every replay.
pub trait Clock: Send + Sync + 'static {
    /// The current time.
    fn now(&self) -> SystemTime;
}

/// The system's wall clock: the default.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> SystemTime {
        SystemTime::now()
    }
}

impl<F> Clock for F
where
    F: Fn() -> SystemTime + Send + Sync + 'static,
{
    fn now(&self) -> SystemTime {
        self()
    }
}

/// A time as milliseconds since the Unix epoch (negative before it): how times are stored and
/// shown in JSON.
pub(crate) fn to_millis(time: SystemTime) -> i64 {
    match time.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(after) => after.as_millis() as i64,
        Err(before) => -(before.duration().as_millis() as i64),
    }
}

/// The time `millis` milliseconds after the Unix epoch.
pub(crate) fn from_millis(millis: i64) -> SystemTime {
    let magnitude = Duration::from_millis(millis.unsigned_abs());
    if millis >= 0 {
        SystemTime::UNIX_EPOCH + magnitude
    } else {
        SystemTime::UNIX_EPOCH - magnitude
    }
}

/// How far tests moved the wall clock that leases are read from, in milliseconds: for every
/// thread (see [`testkit::WallClockShift`](crate::testkit::WallClockShift)), plus this
/// thread's own (the crate's unit tests, which run side by side).
#[cfg(any(test, feature = "testkit"))]
pub(crate) static WALL_SHIFT: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);

#[cfg(any(test, feature = "testkit"))]
thread_local! {
    pub(crate) static THREAD_WALL_SHIFT: std::cell::Cell<i64> = const { std::cell::Cell::new(0) };
}

#[cfg(any(test, feature = "testkit"))]
pub(crate) fn wall_shift() -> i64 {
    WALL_SHIFT.load(std::sync::atomic::Ordering::SeqCst) + THREAD_WALL_SHIFT.get()
}

#[cfg(not(any(test, feature = "testkit")))]
#[inline(always)]
pub(crate) fn wall_shift() -> i64 {
    0
}
