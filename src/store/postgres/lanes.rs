//! Which writer connection (lane) commits a move.
//!
//! A run's moves go to one lane for as long as any of them is unanswered, so that they commit
//! in the order they were sent (a lane commits its queue in order). A run with none unanswered
//! may go to any lane: to the first while its backlog is short, and to the least loaded once
//! it is not.
//!
//! Why not spread the runs over every lane at once: each lane commits its own groups, and each
//! commit waits for the server's log flush. One lane gathers what queues behind its commit into
//! the next group, so a second lane only pays off once one lane's groups are large (a process
//! with hundreds of runs at once). Below that, a second lane halves the groups and doubles the
//! flushes, and replicas on one server pay for every process's flushes together.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard, mpsc},
};

use crate::{
    clock::Clock,
    store::backend::{Durability, GroupFailure, Isolation, MoveInfo, Pending, Router, Tx},
    types::RunId,
};

/// The first lane's backlog (moves unanswered) from which a run with nothing unanswered goes
/// to the least loaded lane instead. Above what 50 runs at once make (where one lane measured
/// as fast as two), below what hundreds do (where two measured about 1.6 times one).
pub(super) const SPILL_AT: usize = 100;

/// A lane's queue: batches of moves, committed in order by the lane's thread.
pub(super) type Lane = mpsc::Sender<Vec<Box<dyn Pending>>>;

/// The lanes of a supervisor, and what each has unanswered.
pub(super) struct Lanes {
    lanes: Vec<Lane>,
    load: Arc<Mutex<Load>>,
}

#[derive(Default)]
struct Load {
    /// Per run with a move unanswered: its lane, and how many.
    runs: HashMap<RunId, (usize, usize)>,
    /// Per lane: its moves unanswered.
    unanswered: Vec<usize>,
}

impl Load {
    fn lane_for(&mut self, run_id: &RunId) -> usize {
        if let Some((lane, count)) = self.runs.get_mut(run_id) {
            *count += 1;
            self.unanswered[*lane] += 1;
            return *lane;
        }
        let lane = if self.unanswered[0] < SPILL_AT {
            0
        } else {
            (0..self.unanswered.len())
                .min_by_key(|&lane| self.unanswered[lane])
                .unwrap_or(0)
        };
        self.runs.insert(run_id.clone(), (lane, 1));
        self.unanswered[lane] += 1;
        lane
    }

    fn answered(&mut self, run_id: &RunId, lane: usize) {
        self.unanswered[lane] = self.unanswered[lane].saturating_sub(1);
        if let Some((_, count)) = self.runs.get_mut(run_id) {
            *count -= 1;
            if *count == 0 {
                self.runs.remove(run_id);
            }
        }
    }
}

impl Lanes {
    /// Lanes over `lanes`' queues (at least one).
    pub(super) fn new(lanes: Vec<Lane>) -> Self {
        let load = Load {
            runs: HashMap::new(),
            unanswered: vec![0; lanes.len()],
        };
        Lanes {
            lanes,
            load: Arc::new(Mutex::new(load)),
        }
    }

    fn load(&self) -> MutexGuard<'_, Load> {
        lock(&self.load)
    }

    /// How many lanes there are.
    pub(super) fn len(&self) -> usize {
        self.lanes.len()
    }

    /// Chooses `pending`'s lane, and counts it there until it is answered.
    pub(super) fn assign(&self, pending: Box<dyn Pending>) -> (usize, Box<dyn Pending>) {
        let Some(run_id) = pending.infos().first().map(|info| info.run_id.clone()) else {
            return (0, pending);
        };
        let lane = self.load().lane_for(&run_id);
        let counted = OnLane {
            pending: Some(pending),
            run_id,
            lane,
            load: self.load.clone(),
        };
        (lane, Box::new(counted))
    }

    /// Queues `moves` on lane `lane`; if its thread died (it panicked), their callers are
    /// told so.
    pub(super) fn send(&self, lane: usize, moves: Vec<Box<dyn Pending>>) {
        if let Err(mpsc::SendError(moves)) = self.lanes[lane].send(moves) {
            let failure = GroupFailure::Commit("the writer thread is gone".into());
            moves
                .into_iter()
                .for_each(|pending| pending.answer(Some(&failure)));
        }
    }
}

impl Router for Lanes {
    fn route(&self, pending: Box<dyn Pending>) {
        let (lane, pending) = self.assign(pending);
        self.send(lane, vec![pending]);
    }
}

fn lock(load: &Mutex<Load>) -> MutexGuard<'_, Load> {
    load.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A move counted on its lane until it is answered (or dropped unanswered, should its lane's
/// thread panic).
struct OnLane {
    pending: Option<Box<dyn Pending>>,
    run_id: RunId,
    lane: usize,
    load: Arc<Mutex<Load>>,
}

impl OnLane {
    fn inner(&self) -> &dyn Pending {
        self.pending.as_deref().expect("answered once")
    }
}

impl Drop for OnLane {
    fn drop(&mut self) {
        lock(&self.load).answered(&self.run_id, self.lane);
    }
}

impl Pending for OnLane {
    fn infos(&self) -> &[MoveInfo] {
        self.inner().infos()
    }

    fn applied(&self) -> &[MoveInfo] {
        self.inner().applied()
    }

    fn refused(&self) -> bool {
        self.inner().refused()
    }

    fn durability(&self) -> Durability {
        self.inner().durability()
    }

    fn apply(&mut self, tx: &mut dyn Tx, clock: &dyn Clock, isolation: Isolation) -> bool {
        let pending = self.pending.as_mut().expect("answered once");
        pending.apply(tx, clock, isolation)
    }

    fn answer(mut self: Box<Self>, failed: Option<&GroupFailure>) {
        // Answered before the count goes down: the run's next move, sent once its caller
        // hears, may still find this lane counted, and goes to it (which is in order).
        if let Some(pending) = self.pending.take() {
            pending.answer(failed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(id: &str) -> RunId {
        RunId::from(id)
    }

    fn load(lanes: usize) -> Load {
        Load {
            runs: HashMap::new(),
            unanswered: vec![0; lanes],
        }
    }

    #[test]
    fn a_run_stays_on_its_lane_while_a_move_of_it_is_unanswered() {
        let mut load = load(2);
        for n in 0..SPILL_AT {
            assert_eq!(
                load.lane_for(&run(&format!("r{n}"))),
                0,
                "the first lane first"
            );
        }
        assert_eq!(
            load.lane_for(&run("late")),
            1,
            "the first lane's backlog is long"
        );
        assert_eq!(
            load.lane_for(&run("r0")),
            0,
            "r0 has a move unanswered there"
        );
        load.answered(&run("late"), 1);
        assert_eq!(load.lane_for(&run("late")), 1, "the least loaded lane");
        load.answered(&run("r0"), 0);
        assert_eq!(
            load.lane_for(&run("r0")),
            0,
            "r0 still has a move unanswered there"
        );
    }

    #[test]
    fn past_the_first_lanes_backlog_runs_go_to_the_least_loaded_lane() {
        let mut load = load(3);
        for n in 0..SPILL_AT {
            load.lane_for(&run(&format!("r{n}")));
        }
        let lanes: Vec<usize> = ["a", "b", "c"]
            .iter()
            .map(|id| load.lane_for(&run(id)))
            .collect();
        assert_eq!(lanes, vec![1, 2, 1]);
        load.answered(&run("r0"), 0);
        assert_eq!(
            load.lane_for(&run("d")),
            0,
            "the first lane's backlog is short again"
        );
    }

    #[test]
    fn one_lane_takes_every_run() {
        let mut load = load(1);
        for n in 0..SPILL_AT * 2 {
            assert_eq!(load.lane_for(&run(&format!("r{n}"))), 0);
        }
    }

    #[test]
    fn an_answered_run_leaves_no_entry() {
        let mut load = load(2);
        load.lane_for(&run("a"));
        load.answered(&run("a"), 0);
        assert!(load.runs.is_empty());
        assert_eq!(load.unanswered, vec![0, 0]);
    }
}
