//! The lease waits: a move that starts a side effect needs the start margin left by the
//! lease's deadline, and waits for the renewal that gives it back.

use futures_util::FutureExt;

use super::run_loop::RunLoop;
use crate::{
    error::{Error, Result},
    types::LeaseLostReason,
};

impl RunLoop {
    /// Waits until the lease has the start margin left by its deadline: at once when it has,
    /// else for the renewals that give it back. `LeaseLost` when the deadline passes first;
    /// returns early when the keeper reports the lease lost (the loop then stops).
    pub(super) async fn wait_for_margin(&self) -> Result<()> {
        loop {
            let seen = self.grant().renewals();
            if self.grant().has_margin() || self.cancellation().is_cancelled() || self.draining() {
                return Ok(());
            }
            self.wait_for_renewal(seen).await?;
        }
    }

    /// Waits for a renewal after the `seen`-th (at once if one came already); `LeaseLost` when
    /// the deadline passes first. Returns early when the cancellation signal fires, or a drain
    /// starts.
    pub(super) async fn wait_for_renewal(&self, seen: u64) -> Result<()> {
        let grant = &self.grant();
        let renewal = grant.renewal();
        let mut renewal = std::pin::pin!(renewal);
        renewal.as_mut().enable();
        if grant.renewed_since(seen) || self.cancellation().is_cancelled() {
            return Ok(());
        }
        let left = grant.remaining();
        if left.is_zero() {
            return Err(Error::LeaseLost {
                run_id: self.run_id().clone(),
                reason: LeaseLostReason::Expired,
            });
        }
        tracing::debug!(?left, "short of the start margin; waiting for a renewal");
        futures_util::select_biased! {
            () = renewal.fuse() => Ok(()),
            () = self.cancellation().cancelled().fuse() => Ok(()),
            () = self.drained().fuse() => Ok(()),
            () = actix_rt::time::sleep(left).fuse() => Ok(()),
        }
    }

    /// A start's result: `None` when it was refused for want of the margin (see
    /// [`short_of_margin`](Self::short_of_margin)), once the next renewal came: the loop then
    /// plans it again.
    pub(super) async fn unless_short<T>(&self, started: Result<T>) -> Result<Option<T>> {
        let seen = self.grant().renewals();
        match started {
            Err(err) if self.short_of_margin(&err) => {
                self.wait_for_renewal(seen).await.map(|()| None)
            }
            started => started.map(Some),
        }
    }

    /// Whether a start was refused for want of the margin while the lease is still held by its
    /// deadline: the margin ran short, or the stored expiry disagrees (the wall clock moved).
    /// The loop waits for a renewal, which gives the margin back or finds the lease lost.
    pub(super) fn short_of_margin(&self, err: &Error) -> bool {
        matches!(
            err,
            Error::LeaseLost {
                reason: LeaseLostReason::Expired,
                ..
            }
        ) && !self.cancellation().is_cancelled()
            && !self.grant().remaining().is_zero()
    }
}
