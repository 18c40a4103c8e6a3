//! Telling readers that something was committed: the bell this process's commits ring, and
//! the pulse a reader checks for commits made anywhere (another process, another host).
// Only the web API reads the bell and the pulse; the backends provide them whatever the features.
#![cfg_attr(not(feature = "web"), allow(dead_code))]

use std::{
    sync::{
        Condvar, Mutex,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use crate::error::Result;

/// Rung after every batch of moves committed through one store handle (and its clones) in
/// this process, so that a reader waiting for news wakes at once instead of at its next check. Ringing
/// costs two atomic operations when nobody waits.
#[derive(Default)]
pub(crate) struct Bell {
    rung: AtomicU64,
    waiters: AtomicUsize,
    lock: Mutex<()>,
    woken: Condvar,
}

impl Bell {
    /// How often the bell has rung.
    pub(crate) fn rung(&self) -> u64 {
        self.rung.load(Ordering::SeqCst)
    }

    pub(crate) fn ring(&self) {
        self.rung.fetch_add(1, Ordering::SeqCst);
        // A waiter counts itself before it reads `rung`: either it sees this ring, or this
        // sees it waiting and wakes it under the lock it waits with.
        if self.waiters.load(Ordering::SeqCst) > 0 {
            let _held = self.lock.lock().unwrap_or_else(|p| p.into_inner());
            self.woken.notify_all();
        }
    }

    /// Waits until the bell has rung past `seen`, or `timeout` has passed.
    pub(crate) fn wait(&self, seen: u64, timeout: Duration) {
        let held = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.waiters.fetch_add(1, Ordering::SeqCst);
        if self.rung.load(Ordering::SeqCst) == seen {
            let _ = self
                .woken
                .wait_timeout(held, timeout)
                .unwrap_or_else(|p| p.into_inner());
        }
        self.waiters.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A reader's check for commits made to the database by anyone: a marker that changes
/// whenever something is committed, cheap to read whatever the size of the database.
pub(crate) trait Pulse: Send {
    /// The marker now. Two equal markers mean nothing was committed between the reads; a
    /// changed one means something probably was (a backend may change it more often).
    fn marker(&mut self) -> Result<String>;
}

#[cfg(test)]
mod tests {
    use std::{sync::Arc, thread, time::Duration};

    use super::Bell;

    #[test]
    fn a_ring_wakes_a_waiter_and_a_ring_before_the_wait_is_not_missed() {
        let bell = Arc::new(Bell::default());
        let seen = bell.rung();
        bell.ring();
        // Rung already: returns at once however long the timeout.
        bell.wait(seen, Duration::from_secs(60));
        let seen = bell.rung();
        let ringer = {
            let bell = bell.clone();
            thread::spawn(move || {
                while bell.waiters.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                    thread::yield_now();
                }
                bell.ring();
            })
        };
        bell.wait(seen, Duration::from_secs(60));
        ringer.join().unwrap();
        assert_eq!(bell.rung(), seen + 1);
    }
}
