//! The writer's memo of the runs it moves: their integer keys and the number of their last
//! events, remembered from one group commit to the next, so that appending a run's event needs
//! no lookup of its key by its text id nor of its last number; and, within a group, the writes
//! held back ([`Held`]).
//!
//! A key is never given to two runs (the runs table's keys are AUTOINCREMENT), so a remembered
//! key can only be stale by naming a run that is gone (purged, perhaps made again under a new
//! key): the event log's foreign key then refuses the append, and the group is applied again
//! move by move, without the memo, which forgets every key. The memo also forgets every key when
//! a transaction it was used in does not commit as first applied, or never ends (a panic): a
//! key it learnt there may be of a run whose insert was rolled back, and a rolled-back insert's
//! key is given again, when another connection committed (another process
//! may have purged a run), and before the writer writes outside a group (a purge of its own).
//!
//! Only the writer appends events through the memo, and every other connection's commit clears
//! it, so a remembered number is the run's last. Were it not, the event log's unique index
//! would refuse the append, and the group would be applied again without the memo.

use std::collections::HashMap;

use super::held::Held;
use crate::types::RunId;

/// How many runs the memo remembers at most; past that it starts again from nothing.
const MAX_RUNS: usize = 100_000;

/// See the module's documentation.
#[derive(Debug, Default)]
pub(crate) struct RunKeys {
    /// Each run's key, and the number of its last event when known.
    keys: HashMap<RunId, (i64, Option<i64>)>,
    /// The writes held back in the group in progress.
    pub(crate) held: Held,
    /// The database's `data_version` when a group last began: another connection's commit
    /// changes it.
    data_version: Option<i64>,
    /// A group began and has not been settled: should it never be (a panic in the middle of
    /// it), the next group forgets every key, as for a rollback.
    open: bool,
}

impl RunKeys {
    /// A group's transaction begins on a database whose `data_version` is `version`.
    pub(crate) fn begin(&mut self, version: i64) {
        self.held = Held::default();
        if self.open || self.data_version != Some(version) {
            self.keys.clear();
            self.data_version = Some(version);
        }
        self.open = true;
    }

    /// The group's transaction committed as first applied: what it learnt stands.
    pub(crate) fn committed(&mut self) {
        self.open = false;
    }

    /// Forgets every key (and settles the group in progress, if any: it did not commit).
    pub(crate) fn forget_all(&mut self) {
        self.keys.clear();
        self.held = Held::default();
        self.open = false;
    }

    /// The key of `run_id`, as last seen.
    pub(crate) fn get(&self, run_id: &RunId) -> Option<i64> {
        self.keys.get(run_id).map(|(key, _)| *key)
    }

    /// The number of `run_id`'s last event, as last appended.
    pub(crate) fn last_event(&self, run_id: &RunId) -> Option<i64> {
        self.keys.get(run_id).and_then(|(_, last)| *last)
    }

    /// `run_id`, of key `key`, has appended its event numbered `seq`.
    pub(crate) fn appended(&mut self, run_id: &RunId, key: i64, seq: i64) {
        self.remember(run_id, (key, Some(seq)));
    }

    fn remember(&mut self, run_id: &RunId, known: (i64, Option<i64>)) {
        if let Some(entry) = self.keys.get_mut(run_id) {
            *entry = known;
            return;
        }
        if self.keys.len() >= MAX_RUNS {
            self.keys.clear();
        }
        self.keys.insert(run_id.clone(), known);
    }

    /// `run_id`'s key is `key`.
    pub(crate) fn note(&mut self, run_id: &RunId, key: i64) {
        self.remember(run_id, (key, None));
    }

    /// `run_id` left RUNNING: it is unlikely to move again soon.
    pub(crate) fn forget(&mut self, run_id: &RunId) {
        self.keys.remove(run_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_never_settled_leaves_no_key_behind() {
        let (mut keys, run) = (RunKeys::default(), RunId::from("a"));
        keys.begin(1);
        keys.note(&run, 7);
        // It panicked: neither committed nor forgotten.
        keys.begin(1);
        assert_eq!(keys.get(&run), None);
        keys.note(&run, 8);
        keys.committed();
        keys.begin(1);
        assert_eq!(keys.get(&run), Some(8));
    }

    #[test]
    fn another_connections_commit_forgets_every_key() {
        let (mut keys, run) = (RunKeys::default(), RunId::from("a"));
        keys.begin(1);
        keys.note(&run, 7);
        keys.committed();
        keys.begin(1);
        assert_eq!(keys.get(&run), Some(7));
        keys.committed();
        keys.begin(2);
        assert_eq!(keys.get(&run), None);
    }

    #[test]
    fn an_event_number_is_remembered_with_its_key_and_forgotten_with_it() {
        let (mut keys, run) = (RunKeys::default(), RunId::from("a"));
        keys.begin(1);
        keys.note(&run, 7);
        assert_eq!(keys.last_event(&run), None);
        keys.appended(&run, 7, 3);
        keys.committed();
        keys.begin(1);
        assert_eq!((keys.get(&run), keys.last_event(&run)), (Some(7), Some(3)));
        keys.forget(&run);
        assert_eq!(keys.last_event(&run), None);
        keys.appended(&run, 7, 4);
        keys.committed();
        keys.begin(2);
        assert_eq!(keys.last_event(&run), None);
    }
}
