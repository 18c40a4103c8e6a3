//! The queue that carries moves to a backend's writer: each move waits there, in the order
//! it was submitted, with its caller's answer, until a writer takes a batch and commits it.
//! A supervisor's store actor holds one and drains it (a backend with a router takes the
//! supervisor's moves without it).

use std::{
    collections::VecDeque,
    future::Future,
    sync::{
        Mutex, MutexGuard,
        atomic::{AtomicBool, Ordering},
    },
};

use tokio::sync::oneshot;

use super::{
    backend::{Durability, GroupFailure, Isolation, MoveInfo, Pending, Tx},
    model::Now,
    moves::{Cx, Move},
};
use crate::{
    clock::Clock,
    error::{Error, Result},
};

/// Moves waiting for a writer, in the order they were submitted. A ring, so that a batch taken
/// from its head leaves the rest in place, and its room is kept from one wave of moves to the
/// next instead of grown again.
#[derive(Default)]
pub(crate) struct MoveQueue {
    moves: Mutex<VecDeque<Box<dyn Pending>>>,
    /// A drain was requested and has not taken the queue yet: a move submitted meanwhile needs
    /// no request of its own. At most one request waits, so whatever else the drainer serves
    /// waits for at most one of them.
    drain_requested: AtomicBool,
}

impl MoveQueue {
    fn lock(&self) -> MutexGuard<'_, VecDeque<Box<dyn Pending>>> {
        self.moves
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Queues `mv`. Returns its answer, once it committed (or was refused) with `durability`
    /// (see [`Durability`]), and whether the caller must request a drain (none is waiting).
    pub(crate) fn push<M: Move>(
        &self,
        mv: M,
        durability: Durability,
    ) -> (impl Future<Output = Result<M::Output>> + 'static, bool) {
        let (pending, answer) = pending(mv, durability);
        (answered(answer), self.submit(pending))
    }

    /// Queues `first` and `then` to be committed in one transaction, `then` applied only if
    /// `first` was and `proceed` says so of its result, each all-or-nothing with its own
    /// clock reading: for a move whose successor is known before the commit and no side effect
    /// lies between them. Answered once they committed, with `durability`, with `first`'s
    /// output (an error if it was refused) and `then`'s result (`None` if it was not
    /// attempted). Returns also whether the caller must request a drain.
    pub(crate) fn push_pair<A: Move, B: Move>(
        &self,
        first: A,
        then: B,
        proceed: fn(&A::Output) -> bool,
        durability: Durability,
    ) -> (impl Future<Output = PairResult<A, B>> + 'static, bool) {
        let (pending, answer) = pending_pair(first, then, proceed, durability);
        (answer, self.submit(pending))
    }

    fn submit(&self, pending: Box<dyn Pending>) -> bool {
        self.lock().push_back(pending);
        self.request_drain()
    }

    /// Requests a drain of a batch that was put back; whether the caller must send it (none is
    /// waiting).
    pub(crate) fn request_drain(&self) -> bool {
        !self.drain_requested.swap(true, Ordering::SeqCst)
    }

    /// The drain requested has started: a move submitted after the queue is taken needs a
    /// request of its own.
    pub(crate) fn drain_started(&self) {
        self.drain_requested.store(false, Ordering::SeqCst);
    }

    /// The first `max` entries queued (a move, or a pair), in order, or all of them if fewer.
    pub(crate) fn take(&self, max: usize) -> Vec<Box<dyn Pending>> {
        let mut queue = self.lock();
        let taken = queue.len().min(max);
        queue.drain(..taken).collect()
    }

    /// Puts `batch` back at the head of the queue, in its order.
    pub(crate) fn requeue(&self, batch: Vec<Box<dyn Pending>>) {
        let mut queue = self.lock();
        for pending in batch.into_iter().rev() {
            queue.push_front(pending);
        }
    }

    /// Whether nothing waits.
    pub(crate) fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }
}

/// Two moves ready for a writer as one (see [`MoveQueue::push_pair`]), and the answer their
/// caller waits for.
pub(crate) fn pending_pair<A: Move, B: Move>(
    first: A,
    then: B,
    proceed: fn(&A::Output) -> bool,
    durability: Durability,
) -> (
    Box<dyn Pending>,
    impl Future<Output = PairResult<A, B>> + 'static,
) {
    let (reply, answer) = oneshot::channel();
    let pending = PendingPair {
        infos: [info(&first), info(&then)],
        first,
        then,
        proceed,
        readings: [None; 2],
        result: None,
        reply,
        durability,
    };
    (Box::new(pending), answered(answer))
}

/// A move ready for a writer, and the answer its caller waits for (also for a writer driven
/// outside a store actor: the conformance suite's groups).
pub(crate) fn pending<M: Move>(
    mv: M,
    durability: Durability,
) -> (Box<dyn Pending>, oneshot::Receiver<Result<M::Output>>) {
    let (reply, answer) = oneshot::channel();
    let pending = PendingMove {
        info: info(&mv),
        mv,
        reading: None,
        result: None,
        reply,
        durability,
    };
    (Box::new(pending), answer)
}

fn info<M: Move>(mv: &M) -> MoveInfo {
    MoveInfo {
        kind: mv.kind(),
        run_id: mv.run_id().clone(),
    }
}

/// The answer of a caller, or `StoreUnavailable` when the writer dropped it unanswered (its
/// thread stopped).
pub(crate) async fn answered<R>(answer: oneshot::Receiver<Result<R>>) -> Result<R> {
    answer.await.map_err(|_| Error::StoreUnavailable)?
}

/// Applies `mv` in `tx`, at the time `now` reads.
fn applied<M: Move>(mv: &M, tx: &mut dyn Tx, now: &mut Now<'_>) -> Result<M::Output> {
    mv.apply(&mut Cx::new(tx, now, mv.run_id()))
}

/// A move in the queue, with its caller's answer.
struct PendingMove<M: Move> {
    info: MoveInfo,
    mv: M,
    /// The clock reading of an earlier attempt.
    reading: Option<i64>,
    result: Option<Result<M::Output>>,
    reply: oneshot::Sender<Result<M::Output>>,
    durability: Durability,
}

impl<M: Move> Pending for PendingMove<M> {
    fn infos(&self) -> &[MoveInfo] {
        std::slice::from_ref(&self.info)
    }

    fn applied(&self) -> &[MoveInfo] {
        match self.result {
            Some(Ok(_)) => self.infos(),
            _ => &[],
        }
    }

    fn refused(&self) -> bool {
        matches!(self.result, Some(Err(_)))
    }

    fn durability(&self) -> Durability {
        self.durability
    }

    fn apply(&mut self, tx: &mut dyn Tx, clock: &dyn Clock, _: Isolation) -> bool {
        let mut now = Now::resume(clock, self.reading);
        let result = refused_logged(&self.info, applied(&self.mv, tx, &mut now));
        self.reading = now.reading();
        let applied = result.is_ok();
        self.result = Some(result);
        applied
    }

    fn answer(self: Box<Self>, failed: Option<&GroupFailure>) {
        // The caller may be gone (its system stopped): nobody to answer.
        let _ = self.reply.send(final_result(self.result, failed));
    }
}

/// Two moves of one run committed together; the second applied only if the first was, in a
/// savepoint of its own so that its refusal keeps the first.
struct PendingPair<A: Move, B: Move> {
    infos: [MoveInfo; 2],
    first: A,
    then: B,
    /// Whether `then` is attempted, given `first`'s result.
    proceed: fn(&A::Output) -> bool,
    /// The clock readings of an earlier attempt.
    readings: [Option<i64>; 2],
    result: Option<PairResult<A, B>>,
    reply: oneshot::Sender<PairResult<A, B>>,
    durability: Durability,
}

/// What a pair's caller is answered: `first`'s output, and `then`'s result (`None` if it was
/// not attempted).
pub(crate) type PairResult<A, B> =
    Result<(<A as Move>::Output, Option<Result<<B as Move>::Output>>)>;

impl<A: Move, B: Move> Pending for PendingPair<A, B> {
    fn infos(&self) -> &[MoveInfo] {
        &self.infos
    }

    fn applied(&self) -> &[MoveInfo] {
        match &self.result {
            Some(Ok((_, Some(Ok(_))))) => &self.infos,
            Some(Ok(_)) => &self.infos[..1],
            _ => &[],
        }
    }

    fn refused(&self) -> bool {
        matches!(self.result, Some(Err(_)) | Some(Ok((_, Some(Err(_))))))
    }

    fn durability(&self) -> Durability {
        self.durability
    }

    fn apply(&mut self, tx: &mut dyn Tx, clock: &dyn Clock, isolation: Isolation) -> bool {
        let mut now = Now::resume(clock, self.readings[0]);
        let first = refused_logged(&self.infos[0], applied(&self.first, tx, &mut now));
        self.readings[0] = now.reading();
        let a = match first {
            Ok(a) => a,
            Err(err) => {
                self.result = Some(Err(err));
                return false;
            }
        };
        if !(self.proceed)(&a) {
            self.result = Some(Ok((a, None)));
            return true;
        }
        let mut now = Now::resume(clock, self.readings[1]);
        let then = &self.then;
        let b = match isolation {
            Isolation::Shared => Ok(applied(then, tx, &mut now)),
            Isolation::Savepoint => in_savepoint(tx, |tx| applied(then, tx, &mut now)),
        };
        self.readings[1] = now.reading();
        let b = match b {
            Ok(b) => refused_logged(&self.infos[1], b),
            // The savepoint itself failed: nothing of the pair may stand.
            Err(err) => {
                self.result = Some(Err(err));
                return false;
            }
        };
        // Without a savepoint of its own, a refused second move cannot be rolled back alone:
        // the group is applied again with savepoints.
        let stands = b.is_ok() || isolation == Isolation::Savepoint;
        self.result = Some(Ok((a, Some(b))));
        stands
    }

    fn answer(self: Box<Self>, failed: Option<&GroupFailure>) {
        let _ = self.reply.send(final_result(self.result, failed));
    }
}

/// Runs `f` in a savepoint nested in the move's own: rolled back alone if it is refused. The
/// outer error is the savepoint's own failure, which must fail the whole move.
fn in_savepoint<R>(tx: &mut dyn Tx, f: impl FnOnce(&mut dyn Tx) -> Result<R>) -> Result<Result<R>> {
    tx.savepoint("agentrt_then")?;
    let result = f(tx);
    if result.is_err() {
        tx.rollback_to("agentrt_then")?;
    }
    tx.release_savepoint("agentrt_then")?;
    Ok(result)
}

/// What a caller is answered: its move's refusal, or its result if the group committed (and
/// synced).
fn final_result<R>(result: Option<Result<R>>, failed: Option<&GroupFailure>) -> Result<R> {
    match (result, failed) {
        (Some(Err(err)), _) => Err(err),
        (Some(Ok(value)), None) => Ok(value),
        (_, Some(failure)) => Err(failure.error()),
        (None, None) => Err(Error::CommitFailed("the move was never applied".into())),
    }
}

fn refused_logged<R>(info: &MoveInfo, result: Result<R>) -> Result<R> {
    if let Err(err) = &result {
        tracing::debug!(r#move = %info.kind, run_id = %info.run_id, %err, "move refused");
    }
    result
}

#[cfg(test)]
pub(crate) mod tests {
    use std::time::Duration;

    use serde_json::json;

    use super::*;
    use crate::{
        store::{
            model::{Grant, Holder},
            moves::{CreateRun, Leased},
        },
        types::RunId,
    };

    /// A move that creates run `id` under a lease of its own.
    pub(crate) fn create_run(id: &str) -> CreateRun {
        let grant = Grant::new(Holder {
            owner: "me/000000000001".into(),
            ttl: Duration::from_secs(30),
            margin: Duration::from_secs(10),
        });
        CreateRun {
            by: Leased::new(&RunId::from(id), &grant),
            agent: "a".into(),
            input: json!({}),
            trace: None,
        }
    }

    /// The protocol of a drainer that watches for moves (the store actor after a commit): it
    /// holds the request while it watches, and takes the queue once more after it lets go.
    #[test]
    fn a_move_submitted_while_the_drainer_watches_requests_no_drain_and_is_taken_after() {
        let queue = MoveQueue::default();
        assert!(queue.request_drain(), "nothing requested a drain yet");
        let (_answer, drain) = queue.push(create_run("a"), Durability::Durable);
        assert!(!drain, "a move submitted during the watch sends no drain");
        queue.drain_started();
        assert_eq!(
            queue.take(usize::MAX).len(),
            1,
            "the drainer's last take finds it"
        );
        let (_answer, drain) = queue.push(create_run("b"), Durability::Durable);
        assert!(drain, "a move submitted after the watch requests a drain");
    }
}
