//! The drain's step: the run is handed over at a step boundary, its lease released for another
//! replica to take up at once.

use super::run_loop::RunLoop;
use crate::{
    error::{Error, Result},
    store::moves::HandOver,
};

impl RunLoop {
    /// Releases the run for another replica (`run.released`) and ends the call with
    /// [`Error::HandedOver`]. Called only with nothing in flight but, at most, a model call,
    /// which is abandoned: it goes back to pending for the next owner.
    pub(super) async fn hand_over<T>(&self) -> Result<T> {
        let released = self.commit(HandOver { by: self.leased() }).await?;
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
