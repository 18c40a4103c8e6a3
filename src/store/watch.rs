//! A move's answer, watched for a moment before its caller's thread sleeps.
//!
//! A lone run waits for each of its moves' answers in turn, and a thread that slept through
//! the wait must be woken when the answer comes: a system call on the writer's side, and on
//! this side the kernel's wake-up and the event loop's turn, tens of microseconds in series
//! with every commit. An answer taken while its caller watches wakes no one. The caller therefore keeps polling its answer for up to
//! [`Config::answer_watch`](crate::Config::answer_watch) before it sleeps, as the store's writer
//! watches for the next move after a commit. The thread goes on serving its other tasks
//! meanwhile (the watching task only asks to be polled again), and only a thread with one
//! answer awaited watches: with several runs waiting on it, one of their answers wakes it soon
//! enough, and the watch would only burn the time they could use.

use std::{
    cell::Cell,
    future::Future,
    pin::pin,
    rc::Rc,
    task::{Context, Poll, Waker},
    time::{Duration, Instant},
};

thread_local! {
    /// The answers awaited on this thread, watched or not.
    static AWAITED: Rc<Cell<usize>> = Rc::default();
}

/// One answer counted among those awaited on its thread, until dropped.
struct Awaited(Rc<Cell<usize>>);

impl Awaited {
    fn count() -> Self {
        // A thread whose locals are being destroyed has no count left: the answer then counts
        // alone, and at worst is watched.
        let count = AWAITED.try_with(Rc::clone).unwrap_or_default();
        count.set(count.get() + 1);
        Awaited(count)
    }

    /// Whether this is the only answer its thread awaits.
    fn alone(&self) -> bool {
        self.0.get() == 1
    }
}

impl Drop for Awaited {
    fn drop(&mut self) {
        self.0.set(self.0.get() - 1);
    }
}

/// `answer`, polled without sleeping for up to `watch` while it is the only answer its thread
/// awaits, then awaited as usual.
pub(crate) async fn watched<T>(answer: impl Future<Output = T>, watch: Duration) -> T {
    let mut answer = pin!(answer);
    let awaited = Awaited::count();
    if !watch.is_zero() && awaited.alone() {
        let until = Instant::now() + watch;
        let early = std::future::poll_fn(|cx| {
            // Polled with a waker that does nothing: the writer's answer then wakes no one.
            if let Poll::Ready(value) = answer
                .as_mut()
                .poll(&mut Context::from_waker(Waker::noop()))
            {
                return Poll::Ready(Some(value));
            }
            if !awaited.alone() || Instant::now() >= until {
                return Poll::Ready(None);
            }
            cx.waker().wake_by_ref();
            Poll::Pending
        })
        .await;
        if let Some(value) = early {
            return value;
        }
    }
    // Polled again with the task's own waker, which replaces the one that did nothing.
    answer.await
}

#[cfg(test)]
mod tests {
    use std::{
        sync::{
            Arc,
            atomic::{AtomicUsize, Ordering},
        },
        task::Wake,
    };

    use super::*;
    use tokio::sync::oneshot;

    /// How long a test waits for what should take milliseconds before it fails instead of
    /// hanging.
    const WITHIN: Duration = Duration::from_secs(30);

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
    }

    /// Counts its wakes.
    #[derive(Default)]
    struct Wakes(AtomicUsize);

    impl Wake for Wakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Polls `watched(answer, watch)` once, answers it with 7, and tells how many wakes the
    /// answer itself made, and what the next poll gave.
    fn wakes_by_the_answer(watch: Duration) -> (usize, Poll<u8>) {
        let (reply, answer) = oneshot::channel();
        let wakes = Arc::new(Wakes::default());
        let waker = Waker::from(wakes.clone());
        let mut cx = Context::from_waker(&waker);
        let mut watching = Box::pin(watched(answer, watch));
        assert!(watching.as_mut().poll(&mut cx).is_pending());
        let before = wakes.0.load(Ordering::SeqCst);
        reply.send(7).unwrap();
        let by_answer = wakes.0.load(Ordering::SeqCst) - before;
        let next = watching.as_mut().poll(&mut cx).map(Result::unwrap);
        (by_answer, next)
    }

    #[test]
    fn an_answer_that_comes_during_the_watch_wakes_no_one_and_is_taken_at_the_next_poll() {
        assert_eq!(
            wakes_by_the_answer(Duration::from_secs(3600)),
            (0, Poll::Ready(7))
        );
        // Without a watch the answer wakes its caller, as any answer does.
        assert_eq!(wakes_by_the_answer(Duration::ZERO), (1, Poll::Ready(7)));
    }

    /// Awaits `watched` of an answer that another thread sends `after`, within the test's
    /// patience.
    fn answered_from_another_thread(after: Duration, watch: Duration) -> u8 {
        let (reply, answer) = oneshot::channel();
        let sender = std::thread::spawn(move || {
            std::thread::sleep(after);
            reply.send(7).unwrap();
        });
        let got = runtime()
            .block_on(async { tokio::time::timeout(WITHIN, watched(answer, watch)).await });
        sender.join().unwrap();
        got.expect("answered within the test's patience").unwrap()
    }

    #[test]
    fn an_answer_sent_from_another_thread_during_the_watch_is_taken() {
        let got = answered_from_another_thread(Duration::from_millis(5), Duration::from_secs(10));
        assert_eq!(got, 7);
    }

    #[test]
    fn an_answer_after_the_watch_wakes_the_sleeping_caller() {
        let got =
            answered_from_another_thread(Duration::from_millis(50), Duration::from_micros(100));
        assert_eq!(got, 7);
    }

    #[test]
    fn a_second_answer_awaited_on_the_thread_ends_the_watch_and_both_are_taken() {
        let ((first_reply, first), (second_reply, second)) =
            (oneshot::channel(), oneshot::channel());
        let local = tokio::task::LocalSet::new();
        let both = local.block_on(&runtime(), async move {
            let a = tokio::task::spawn_local(watched(first, Duration::from_secs(3600)));
            // The first watches: the second's wait ends its watch, or this would spin an hour.
            tokio::task::yield_now().await;
            let b = tokio::task::spawn_local(watched(second, Duration::from_secs(3600)));
            tokio::task::yield_now().await;
            AWAITED.with(|count| assert_eq!(count.get(), 2));
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                first_reply.send(1).unwrap();
                second_reply.send(2).unwrap();
            });
            tokio::time::timeout(WITHIN, async { (a.await.unwrap(), b.await.unwrap()) }).await
        });
        let (a, b) = both.expect("both answered within the test's patience");
        assert_eq!((a.unwrap(), b.unwrap()), (1, 2));
        AWAITED.with(|count| assert_eq!(count.get(), 0));
    }

    #[test]
    fn a_watch_dropped_midway_leaves_the_count_as_it_was() {
        let (_reply, answer) = oneshot::channel::<u8>();
        let rt = runtime();
        rt.block_on(async {
            let watching = watched(answer, Duration::from_secs(3600));
            let timed_out = tokio::time::timeout(Duration::from_millis(5), watching).await;
            assert!(timed_out.is_err());
        });
        AWAITED.with(|count| assert_eq!(count.get(), 0));
    }
}
