//! Which writer connection (lane) commits a move.
//!
//! A run's moves go to one lane for as long as any of them is unanswered, so that they commit
//! in the order they were sent (a lane commits its queue in order). A run with none unanswered
//! may go to any lane: to the first while that one is keeping up, and to the least loaded lane
//! otherwise. The first lane is not keeping up when many moves are unanswered on it, or when it
//! has answered none for a while (a group waiting for a lock another connection holds); a lane
//! whose thread is gone takes no more runs.
//!
//! Why not spread the runs over every lane at once: each lane commits its own groups, and each
//! commit waits for the server's log flush. One lane gathers what queues behind its commit into
//! the next group, so a second lane only pays off once one lane's groups are large (a process
//! with hundreds of runs at once). Below that, a second lane halves the groups and doubles the
//! flushes, and replicas on one server pay for every process's flushes together.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard, mpsc},
    time::{Duration, Instant},
};

use crate::{
    clock::Clock,
    store::backend::{Durability, GroupFailure, Isolation, MoveInfo, Pending, Router, Tx},
    types::RunId,
};

/// The moves unanswered on the first lane from which a run with nothing unanswered goes to the
/// least loaded lane instead. Above what 50 runs at once make (where one lane measured as fast
/// as two), below what a thousand make (where two measured about 1.6 times one).
pub(super) const SPILL_AT: usize = 100;

/// How long the first lane may have moves unanswered without answering any before new runs go
/// to the others: far longer than a group's commit takes here, far shorter than a lock wait
/// that stalls a supervisor.
const STALLED: Duration = Duration::from_millis(200);

/// A lane's queue: batches of moves, committed in order by the lane's thread.
pub(super) type Lane = mpsc::Sender<Vec<Box<dyn Pending>>>;

/// The lanes of a supervisor, and what each has unanswered.
pub(super) struct Lanes {
    lanes: Vec<Lane>,
    load: Arc<Mutex<Load>>,
}

struct Load {
    /// Per run with a move unanswered: its lane, and how many.
    runs: HashMap<RunId, (usize, usize)>,
    lanes: Vec<LaneLoad>,
    spill_at: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LaneLoad {
    unanswered: usize,
    /// When it last answered a move, or was given one with none unanswered.
    progressed: Instant,
    /// Its thread is gone.
    dead: bool,
}

impl Load {
    fn new(lanes: usize, spill_at: usize) -> Self {
        let lane = LaneLoad {
            unanswered: 0,
            progressed: Instant::now(),
            dead: false,
        };
        Load {
            runs: HashMap::new(),
            lanes: vec![lane; lanes],
            spill_at,
        }
    }

    fn lane_for(&mut self, run_id: &RunId, now: Instant) -> usize {
        let lane = match self.runs.get_mut(run_id) {
            Some((lane, count)) => {
                *count += 1;
                *lane
            }
            None => {
                let lane = self.choose(now);
                self.runs.insert(run_id.clone(), (lane, 1));
                lane
            }
        };
        let load = &mut self.lanes[lane];
        if load.unanswered == 0 {
            load.progressed = now;
        }
        load.unanswered += 1;
        lane
    }

    /// The lane for a run with nothing unanswered.
    fn choose(&self, now: Instant) -> usize {
        let first = &self.lanes[0];
        let keeping_up = !first.dead
            && first.unanswered < self.spill_at
            && (first.unanswered == 0 || now.duration_since(first.progressed) < STALLED);
        if keeping_up {
            return 0;
        }
        (0..self.lanes.len())
            .filter(|&lane| !self.lanes[lane].dead)
            .min_by_key(|&lane| (self.lanes[lane].unanswered, lane))
            .unwrap_or(0)
    }

    fn answered(&mut self, run_id: &RunId, lane: usize, now: Instant) {
        let load = &mut self.lanes[lane];
        debug_assert!(
            load.unanswered > 0,
            "lane {lane} answered more than it was given"
        );
        load.unanswered -= 1;
        load.progressed = now;
        if let Some((_, count)) = self.runs.get_mut(run_id) {
            *count -= 1;
            if *count == 0 {
                self.runs.remove(run_id);
            }
        }
    }
}

impl Lanes {
    /// Lanes over `lanes`' queues (at least one), spilling from the first at `spill_at` moves
    /// unanswered ([`SPILL_AT`] but in tests).
    pub(super) fn new(lanes: Vec<Lane>, spill_at: usize) -> Self {
        let load = Load::new(lanes.len(), spill_at.max(1));
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
        let lane = self.load().lane_for(&run_id, Instant::now());
        let counted = OnLane {
            pending: Some(pending),
            run_id,
            lane,
            load: self.load.clone(),
        };
        (lane, Box::new(counted))
    }

    /// Queues `moves` on lane `lane`; if its thread died (it panicked), their callers are
    /// told so, and the lane takes no more runs.
    pub(super) fn send(&self, lane: usize, moves: Vec<Box<dyn Pending>>) {
        if let Err(mpsc::SendError(moves)) = self.lanes[lane].send(moves) {
            self.load().lanes[lane].dead = true;
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
        lock(&self.load).answered(&self.run_id, self.lane, Instant::now());
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
    use std::time::Duration;

    use serde_json::json;
    use tokio::sync::oneshot;

    use super::*;
    use crate::{
        error::Error,
        store::{
            model::{Grant, Holder},
            moves::{CreateRun, Leased},
            queue,
        },
    };

    fn run(id: &str) -> RunId {
        RunId::from(id)
    }

    fn unanswered(load: &Load) -> Vec<usize> {
        load.lanes.iter().map(|lane| lane.unanswered).collect()
    }

    /// Fills the first lane to its spill point with runs `r0`, `r1`, ...
    fn filled(lanes: usize) -> (Load, Instant) {
        let (mut load, now) = (Load::new(lanes, SPILL_AT), Instant::now());
        for n in 0..SPILL_AT {
            assert_eq!(
                load.lane_for(&run(&format!("r{n}")), now),
                0,
                "the first lane first"
            );
        }
        (load, now)
    }

    #[test]
    fn a_run_stays_on_its_lane_while_a_move_of_it_is_unanswered() {
        let (mut load, now) = filled(2);
        assert_eq!(
            load.lane_for(&run("late"), now),
            1,
            "the first lane's backlog is long"
        );
        assert_eq!(
            load.lane_for(&run("r0"), now),
            0,
            "r0 has a move unanswered there"
        );
        assert_eq!(unanswered(&load), vec![SPILL_AT + 1, 1]);
        load.answered(&run("late"), 1, now);
        assert_eq!(load.lane_for(&run("late"), now), 1, "the least loaded lane");
        load.answered(&run("r0"), 0, now);
        assert_eq!(
            load.lane_for(&run("r0"), now),
            0,
            "r0 still has a move unanswered there"
        );
        assert_eq!(unanswered(&load), vec![SPILL_AT + 1, 1]);
    }

    #[test]
    fn past_the_first_lanes_backlog_runs_go_to_the_least_loaded_lane() {
        let (mut load, now) = filled(3);
        let lanes: Vec<usize> = ["a", "b", "c"]
            .iter()
            .map(|id| load.lane_for(&run(id), now))
            .collect();
        assert_eq!(lanes, vec![1, 2, 1]);
        load.answered(&run("r0"), 0, now);
        assert_eq!(
            load.lane_for(&run("d"), now),
            0,
            "the first lane's backlog is short again"
        );
    }

    #[test]
    fn one_lane_takes_every_run() {
        let (mut load, now) = filled(1);
        assert_eq!(load.lane_for(&run("late"), now), 0);
    }

    #[test]
    fn a_first_lane_that_answers_nothing_for_a_while_takes_no_new_run() {
        let (mut load, start) = (Load::new(2, SPILL_AT), Instant::now());
        assert_eq!(load.lane_for(&run("stuck"), start), 0);
        assert_eq!(load.lane_for(&run("soon"), start + STALLED / 2), 0);
        assert_eq!(load.lane_for(&run("later"), start + STALLED), 1, "stalled");
        load.answered(&run("soon"), 0, start + STALLED);
        assert_eq!(
            load.lane_for(&run("after"), start + STALLED),
            0,
            "it answered"
        );
    }

    #[test]
    fn a_lane_whose_thread_is_gone_takes_no_new_run() {
        let (mut load, now) = filled(3);
        load.lanes[1].dead = true;
        assert_eq!(load.lane_for(&run("a"), now), 2);
        let mut load = Load::new(2, SPILL_AT);
        load.lanes[0].dead = true;
        assert_eq!(
            load.lane_for(&run("b"), now),
            1,
            "not the first, though it is idle"
        );
    }

    fn create(
        id: &str,
    ) -> (
        Box<dyn Pending>,
        oneshot::Receiver<crate::error::Result<i64>>,
    ) {
        let grant = Grant::new(Holder {
            owner: "me/000000000001".into(),
            ttl: Duration::from_secs(30),
            margin: Duration::from_secs(10),
        });
        let create = CreateRun {
            by: Leased::new(&run(id), &grant),
            agent: "a".into(),
            input: json!({}),
            trace: None,
        };
        queue::pending(create, Durability::Durable)
    }

    #[test]
    fn a_move_is_counted_on_its_lane_until_answered_or_dropped() {
        let (first, queued) = mpsc::channel();
        let (second, other) = mpsc::channel();
        let lanes = Lanes::new(vec![first, second], 1);
        let (pending, mut answer) = create("a");
        lanes.route(pending);
        assert_eq!(unanswered(&lanes.load()), vec![1, 0]);
        let (pending, _) = create("b");
        lanes.route(pending);
        assert_eq!(unanswered(&lanes.load()), vec![1, 1], "spilled at 1");

        let mut batches = queued.try_iter().collect::<Vec<_>>();
        let answered = batches.remove(0).remove(0);
        answered.answer(Some(&GroupFailure::Commit("no".into())));
        assert!(matches!(answer.try_recv(), Ok(Err(Error::CommitFailed(_)))));
        assert_eq!(unanswered(&lanes.load()), vec![0, 1]);
        assert_eq!(lanes.load().runs.len(), 1, "only b is left");
        drop(other); // b's lane's thread is gone, with b unanswered
        assert_eq!(unanswered(&lanes.load()), vec![0, 0]);
        assert!(lanes.load().runs.is_empty());
    }

    #[test]
    fn a_move_sent_to_a_lane_whose_thread_is_gone_is_answered_and_the_lane_takes_no_more() {
        let (first, gone) = mpsc::channel();
        drop(gone);
        let (second, _queued) = mpsc::channel();
        let lanes = Lanes::new(vec![first, second], SPILL_AT);
        let (pending, mut answer) = create("a");
        lanes.route(pending);
        assert!(matches!(answer.try_recv(), Ok(Err(Error::CommitFailed(_)))));
        assert_eq!(unanswered(&lanes.load()), vec![0, 0]);
        let (pending, _) = create("b");
        lanes.route(pending);
        assert_eq!(unanswered(&lanes.load()), vec![0, 1], "the live lane");
    }
}
