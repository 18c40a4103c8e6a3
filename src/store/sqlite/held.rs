//! Writes a group's moves hold back on the writer, so that two writes of one row in a pair of
//! moves become one, and rows of one table go out together: the second move's touch of the run
//! is made one with the first's, a step inserted and then moved is inserted as moved, and the
//! events of the whole group are appended by a few multi-row statements.
//!
//! Only the writes of steps and events go out while writes are held: they do not read the runs
//! table's lease or stamp (an event's insert reads only its run's key), nor the rows of the
//! steps held. Any other statement sends what is held first, as does the end of each move or
//! pair for its touch and steps, and the end of the group for its events (no move reads
//! another's events; a statement that reads events sends them first), which also go out as
//! soon as 64 are held. A held write that does
//! not stand when it is sent (a touch whose guard does not match, an insert a constraint
//! refuses) fails the whole group, which is then applied again move by move without holding
//! anything: the refusal is then the move's own.
//!
//! A move therefore learns of a refusal by its touch only in that second pass: the first goes
//! on as if the touch stood. Moves that act on such a refusal (an outcome recorded late, on a
//! run an operator cancelled) are rare, and cost their group a second pass.

use crate::types::{ApprovalReason, EventKind, RunId, StepKind, StepState};

/// A touch held back: the guard of a move that holds run `run_id` under `owner`'s lease of
/// token `token` (unexpired at `unexpired_at`, if given), and its stamp `at`.
#[derive(Debug)]
pub(crate) struct HeldTouch {
    pub run_id: RunId,
    pub at: i64,
    pub owner: String,
    pub token: u64,
    pub unexpired_at: Option<i64>,
}

/// A step to insert: held back, as any later move of the group left it, or sent at once.
#[derive(Debug)]
pub(crate) struct StepInsert {
    pub run_id: RunId,
    pub step: u32,
    pub kind: StepKind,
    pub state: StepState,
    pub attempt: u32,
    /// The call's id, tool and arguments (JSON), for a tool step.
    pub call: Option<(String, String, String)>,
    /// JSON.
    pub result: Option<String>,
    pub waiting_for: Option<ApprovalReason>,
}

/// What a move of step `step` of run `run_id` asks of it, when its insert is held: from state
/// `from` at attempt `attempt`, to `to`, one attempt more if `starts`, with `result` (JSON) if
/// given.
pub(crate) struct HeldMove<'a> {
    pub from: StepState,
    pub attempt: u32,
    pub to: StepState,
    pub starts: bool,
    pub result: Option<&'a str>,
    pub waiting_for: Option<ApprovalReason>,
    pub run_id: &'a RunId,
    pub step: u32,
}

/// An event to append, held back: of the run of key `key`, numbered `seq`, its payload JSON.
#[derive(Debug)]
pub(crate) struct EventInsert {
    pub key: i64,
    pub seq: i64,
    pub kind: EventKind,
    pub at: i64,
    pub step: Option<u32>,
    pub payload: String,
}

/// The writes held back in a group's transaction.
#[derive(Debug, Default)]
pub(crate) struct Held {
    touch: Option<HeldTouch>,
    steps: Vec<StepInsert>,
    /// Held to the end of the group, not of the move: nothing a later move writes reads them.
    events: Vec<EventInsert>,
    /// A held write sent in this group did not stand.
    refused: bool,
}

impl Held {
    /// Holds `touch` back; a touch of the same run under the same lease is made one with the
    /// touch held (the stricter bound, the stamp of the later move). Answers the touch held before, of
    /// another run or lease, which is to be sent first.
    pub(crate) fn touch(&mut self, touch: HeldTouch) -> Option<HeldTouch> {
        if let Some(held) = &mut self.touch
            && held.run_id == touch.run_id
            && held.owner == touch.owner
            && held.token == touch.token
        {
            held.at = touch.at;
            held.unexpired_at = match (held.unexpired_at, touch.unexpired_at) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            };
            return None;
        }
        self.touch.replace(touch)
    }

    /// Holds the insert of `step`.
    pub(crate) fn insert_step(&mut self, step: StepInsert) {
        self.steps.push(step);
    }

    /// Makes `moved` in the insert of its step, if that is held: whether the step was as the
    /// move expects (as the statement's guard would find it). `None` when the step is not held.
    pub(crate) fn move_step(&mut self, moved: HeldMove<'_>) -> Option<bool> {
        let held = self
            .steps
            .iter_mut()
            .find(|held| held.step == moved.step && held.run_id == *moved.run_id)?;
        if held.state != moved.from || held.attempt != moved.attempt {
            return Some(false);
        }
        held.state = moved.to;
        held.attempt += u32::from(moved.starts);
        if let Some(result) = moved.result {
            held.result = Some(result.to_owned());
        }
        held.waiting_for = moved.waiting_for;
        Some(true)
    }

    /// Holds the append of `event`; answers the events held once there are `batch` of them,
    /// to be sent now (so that what a group holds stays small whatever its size).
    pub(crate) fn append(&mut self, event: EventInsert, batch: usize) -> Option<Vec<EventInsert>> {
        if self.events.capacity() == 0 {
            self.events.reserve_exact(batch);
        }
        self.events.push(event);
        (self.events.len() >= batch).then(|| self.take_events())
    }

    /// The number of the last event held of the run of key `key`, if any is.
    pub(crate) fn last_event(&self, key: i64) -> Option<i64> {
        (self.events.iter().rev())
            .find(|event| event.key == key)
            .map(|event| event.seq)
    }

    /// Whether anything is held.
    pub(crate) fn any(&self) -> bool {
        self.any_of_moves() || !self.events.is_empty()
    }

    /// Whether any write held to the end of its move is held.
    pub(crate) fn any_of_moves(&self) -> bool {
        self.touch.is_some() || !self.steps.is_empty()
    }

    /// The writes held to the end of their move, to be sent now.
    pub(crate) fn take_of_moves(&mut self) -> (Option<HeldTouch>, Vec<StepInsert>) {
        (self.touch.take(), std::mem::take(&mut self.steps))
    }

    /// The events held, to be sent now.
    pub(crate) fn take_events(&mut self) -> Vec<EventInsert> {
        std::mem::take(&mut self.events)
    }

    /// A held write, sent, did not stand: the group must not commit as applied.
    pub(crate) fn refused(&mut self) {
        self.refused = true;
    }

    /// Whether every held write sent in this group stood.
    pub(crate) fn stood(&self) -> bool {
        !self.refused
    }
}
