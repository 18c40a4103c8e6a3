//! The writes a pipelining lane holds back while it applies a group, sent as one statement per
//! kind instead of one per move: the runs' touches, the steps inserted, the steps moved, and
//! the events appended. The server's work for a statement is mostly its own (planning,
//! locking the tables, starting the executor), not its rows', so a group of many moves costs
//! a few statements more than one move does.
//!
//! A held write is sent before any statement that could see it (one on its table, or any
//! statement not known to leave it alone) and before the commit, so that every statement sees
//! what the moves before it wrote. Two writes of one row are never held together: the second
//! sends the first.

use serde_json::Value;

use super::link::Owned;

/// Tables, as the set a statement reads or writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Tables(u8);

impl Tables {
    pub const NONE: Tables = Tables(0);
    pub const RUNS: Tables = Tables(1);
    pub const STEPS: Tables = Tables(2);
    pub const EVENTS: Tables = Tables(4);
    pub const ALL: Tables = Tables(7);

    fn has(self, other: Tables) -> bool {
        self.0 & other.0 != 0
    }
}

/// One statement to send: its SQL, its parameters, and how many rows it must change.
pub(super) struct Batch {
    pub sql: &'static str,
    pub params: Vec<Owned>,
    pub expect: Option<u64>,
}

/// A touch of a run's row: the lease guard of a move that holds the run.
pub(super) struct Touch {
    pub run_id: String,
    pub at: i64,
    pub owner: String,
    pub unexpired_at: Option<i64>,
    pub token: i64,
    pub beyond: Option<i64>,
}

/// A step inserted.
pub(super) struct NewStep {
    pub run_id: String,
    pub step: i32,
    pub kind: &'static str,
    pub state: &'static str,
    pub attempt: i32,
    pub call_id: Option<String>,
    pub tool: Option<String>,
    pub args: Option<Value>,
}

/// A step moved from the state and attempt its executor saw.
pub(super) struct StepMove {
    pub run_id: String,
    pub step: i32,
    pub from: &'static str,
    pub attempt: i32,
    pub to: &'static str,
    pub starts: i32,
    pub result: Option<Value>,
    pub waiting_for: Option<&'static str>,
}

/// An event appended.
pub(super) struct NewEvent {
    pub run_id: String,
    pub kind: &'static str,
    pub at: i64,
    pub step: Option<i32>,
    pub payload: Value,
}

const TOUCHES: &str = "UPDATE runs SET updated_at = t.at
     FROM unnest($1::text[], $2::int8[], $3::text[], $4::int8[], $5::int8[], $6::int8[])
          AS t (id, at, owner, unexpired_at, token, beyond)
     WHERE runs.id = t.id AND runs.state = 'RUNNING' AND runs.lease_owner = t.owner
       AND runs.lease_epoch = t.token
       AND (t.unexpired_at IS NULL OR runs.lease_expires_at > t.unexpired_at)
       AND (t.beyond IS NULL OR runs.lease_expires_at >
            floor(extract(epoch FROM clock_timestamp()) * 1000)::int8 + t.beyond)";

const NEW_STEPS: &str =
    "INSERT INTO steps (run_id, step, kind, state, attempt, call_id, tool, args)
     SELECT * FROM unnest($1::text[], $2::int4[], $3::text[], $4::text[], $5::int4[],
                          $6::text[], $7::text[], $8::json[])";

const STEP_MOVES: &str = "UPDATE steps SET state = m.to_state, attempt = steps.attempt + m.starts,
                        result = COALESCE(m.result, steps.result), waiting_for = m.waiting_for
     FROM unnest($1::text[], $2::int4[], $3::text[], $4::int4[], $5::text[], $6::int4[],
                 $7::json[], $8::text[])
          AS m (run_id, step, from_state, attempt, to_state, starts, result, waiting_for)
     WHERE steps.run_id = m.run_id AND steps.step = m.step AND steps.state = m.from_state
       AND steps.attempt = m.attempt";

// Each run's events are numbered after its last, in the order they were appended.
const NEW_EVENTS: &str = "INSERT INTO events (run_id, seq, kind, at, step, payload)
     SELECT e.run_id,
            COALESCE((SELECT max(seq) FROM events WHERE events.run_id = e.run_id), 0)
                + row_number() OVER (PARTITION BY e.run_id ORDER BY e.ord),
            e.kind, e.at, e.step, e.payload
     FROM unnest($1::text[], $2::text[], $3::int8[], $4::int4[], $5::json[])
          WITH ORDINALITY AS e (run_id, kind, at, step, payload, ord)";

/// The writes held back, by kind.
#[derive(Default)]
pub(super) struct Held {
    touches: Vec<Touch>,
    new_steps: Vec<NewStep>,
    step_moves: Vec<StepMove>,
    events: Vec<NewEvent>,
}

impl Held {
    /// Holds `touch`, or makes it one with the touch of its run already held under the same
    /// lease (the second move of a pair): its guard then asks what both ask, on a row nothing
    /// else wrote meanwhile (a write of the runs sends the touches first). False when a touch
    /// of the run under another lease is held: it is to be sent first.
    pub(super) fn touch(&mut self, touch: Touch) -> std::result::Result<(), Touch> {
        let Some(held) = self
            .touches
            .iter_mut()
            .find(|held| held.run_id == touch.run_id)
        else {
            self.touches.push(touch);
            return Ok(());
        };
        if held.owner != touch.owner || held.token != touch.token {
            return Err(touch);
        }
        held.at = held.at.max(touch.at);
        held.unexpired_at = stricter(held.unexpired_at, touch.unexpired_at);
        held.beyond = stricter(held.beyond, touch.beyond);
        Ok(())
    }

    /// Whether a move of step `step` of `run_id` is held.
    pub(super) fn moves_step(&self, run_id: &str, step: i32) -> bool {
        self.step_moves
            .iter()
            .any(|moved| moved.run_id == run_id && moved.step == step)
    }

    pub(super) fn insert_step(&mut self, step: NewStep) {
        self.new_steps.push(step);
    }

    pub(super) fn move_step(&mut self, moved: StepMove) {
        self.step_moves.push(moved);
    }

    pub(super) fn append(&mut self, event: NewEvent) {
        self.events.push(event);
    }

    /// The statements that send what is held on `tables`, in an order that keeps each
    /// statement's view (a step is inserted before it is moved), leaving nothing of those
    /// tables held.
    pub(super) fn take(&mut self, tables: Tables) -> Vec<Batch> {
        let mut batches = Vec::new();
        if tables.has(Tables::RUNS) && !self.touches.is_empty() {
            batches.push(touches(std::mem::take(&mut self.touches)));
        }
        if tables.has(Tables::STEPS) {
            if !self.new_steps.is_empty() {
                batches.push(new_steps(std::mem::take(&mut self.new_steps)));
            }
            if !self.step_moves.is_empty() {
                batches.push(step_moves(std::mem::take(&mut self.step_moves)));
            }
        }
        if tables.has(Tables::EVENTS) && !self.events.is_empty() {
            batches.push(new_events(std::mem::take(&mut self.events)));
        }
        batches
    }
}

/// The later of two bounds a lease must outlast, either of them absent.
fn stricter(a: Option<i64>, b: Option<i64>) -> Option<i64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

/// The rows a batch of `n` must change.
fn all(n: usize) -> Option<u64> {
    Some(n as u64)
}

fn touches(touches: Vec<Touch>) -> Batch {
    let expect = all(touches.len());
    let (mut ids, mut ats, mut owners, mut unexpired, mut tokens, mut beyond) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    for touch in touches {
        ids.push(touch.run_id);
        ats.push(touch.at);
        owners.push(touch.owner);
        unexpired.push(touch.unexpired_at);
        tokens.push(touch.token);
        beyond.push(touch.beyond);
    }
    Batch {
        sql: TOUCHES,
        params: vec![
            Box::new(ids),
            Box::new(ats),
            Box::new(owners),
            Box::new(unexpired),
            Box::new(tokens),
            Box::new(beyond),
        ],
        expect,
    }
}

fn new_steps(steps: Vec<NewStep>) -> Batch {
    let expect = all(steps.len());
    let (mut runs, mut numbers, mut kinds, mut states) = (vec![], vec![], vec![], vec![]);
    let (mut attempts, mut calls, mut tools, mut args) = (vec![], vec![], vec![], vec![]);
    for step in steps {
        runs.push(step.run_id);
        numbers.push(step.step);
        kinds.push(step.kind);
        states.push(step.state);
        attempts.push(step.attempt);
        calls.push(step.call_id);
        tools.push(step.tool);
        args.push(step.args);
    }
    Batch {
        sql: NEW_STEPS,
        params: vec![
            Box::new(runs),
            Box::new(numbers),
            Box::new(kinds),
            Box::new(states),
            Box::new(attempts),
            Box::new(calls),
            Box::new(tools),
            Box::new(args),
        ],
        expect,
    }
}

fn step_moves(moves: Vec<StepMove>) -> Batch {
    let expect = all(moves.len());
    let (mut runs, mut numbers, mut froms, mut attempts) = (vec![], vec![], vec![], vec![]);
    let (mut tos, mut starts, mut results, mut waiting) = (vec![], vec![], vec![], vec![]);
    for moved in moves {
        runs.push(moved.run_id);
        numbers.push(moved.step);
        froms.push(moved.from);
        attempts.push(moved.attempt);
        tos.push(moved.to);
        starts.push(moved.starts);
        results.push(moved.result);
        waiting.push(moved.waiting_for);
    }
    Batch {
        sql: STEP_MOVES,
        params: vec![
            Box::new(runs),
            Box::new(numbers),
            Box::new(froms),
            Box::new(attempts),
            Box::new(tos),
            Box::new(starts),
            Box::new(results),
            Box::new(waiting),
        ],
        expect,
    }
}

fn new_events(events: Vec<NewEvent>) -> Batch {
    let expect = all(events.len());
    let (mut runs, mut kinds, mut ats, mut steps, mut payloads) =
        (vec![], vec![], vec![], vec![], vec![]);
    for event in events {
        runs.push(event.run_id);
        kinds.push(event.kind);
        ats.push(event.at);
        steps.push(event.step);
        payloads.push(event.payload);
    }
    Batch {
        sql: NEW_EVENTS,
        params: vec![
            Box::new(runs),
            Box::new(kinds),
            Box::new(ats),
            Box::new(steps),
            Box::new(payloads),
        ],
        expect,
    }
}
