//! The drain's step: the run is handed over at a step boundary, its lease released for another
//! replica to take up at once.

use super::run_loop::RunLoop;
use crate::{
    error::{Error, Result},
    metrics,
    store::moves::HandOver,
};

impl RunLoop {
    /// Releases the run for another replica (`run.released`) and ends the call with
    /// [`Error::HandedOver`]. Called only with nothing in flight but, at most, a model call,
    /// which is abandoned: it goes back to pending for the next owner.
    pub(super) async fn hand_over<T>(&self) -> Result<T> {
        self.hand_over_as(false).await
    }

    /// [`hand_over`](Self::hand_over) during the backoff after a failed model attempt, which
    /// stays counted.
    pub(super) async fn hand_over_backing_off<T>(&self) -> Result<T> {
        self.hand_over_as(true).await
    }

    async fn hand_over_as<T>(&self, backing_off: bool) -> Result<T> {
        // Renewed no more from now: a renewal after the release would find the lease gone
        // (or another owner's) and report it lost.
        self.stop_holding();
        let released = self
            .commit(HandOver {
                by: self.leased(),
                backing_off,
            })
            .await?;
        metrics::handed_over("released");
        let run_id = self.run_id().clone();
        match released.abandoned {
            Some((step, attempt)) => tracing::info!(
                %run_id,
                step,
                attempt,
                "run handed over: the supervisor drains; its model call was abandoned"
            ),
            None => tracing::info!(%run_id, "run handed over: the supervisor drains"),
        }
        Err(Error::HandedOver { run_id })
    }
}
