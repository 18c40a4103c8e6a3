//! The lease outside the moves: the renewal, one write for every run a supervisor holds.

use std::collections::HashSet;

use crate::{
    error::Result,
    store::{backend::LeaseWrites, model::Renewal},
    types::RunId,
};

/// Renews, in one write outside any transaction, `owner`'s unexpired leases on `held` (each
/// run with the fencing token its lease was acquired with): compare-and-set on the owner and
/// the token. The rows of runs that were not renewed are read afterwards, which happens only
/// when a lease was lost.
pub(crate) fn renew(
    conn: &mut dyn LeaseWrites,
    owner: &str,
    held: &[(RunId, u64)],
    ttl: std::time::Duration,
) -> Result<Renewal> {
    let wall = conn.lease_wall()?;
    let expires_at = wall + ttl.as_millis() as i64;
    let renewed = conn.renew_leases(owner, held, wall, expires_at)?;
    let mut missing = Vec::new();
    if renewed.len() < held.len() {
        let renewed: HashSet<&RunId> = renewed.iter().collect();
        for (run_id, _) in held.iter().filter(|(id, _)| !renewed.contains(id)) {
            missing.push((run_id.clone(), conn.lease_row(run_id)?));
        }
    }
    Ok(Renewal {
        expires_at,
        renewed,
        missing,
    })
}
