//! The writes a pipelining lane holds back while it applies a group, sent together as one
//! statement (each kind a part of it) instead of one per move: the runs' touches, the steps
//! inserted, the steps moved, and the events appended. The server's work for a statement is mostly its own (planning,
//! locking the tables, starting the executor), not its rows', so a group of many moves costs
//! a few statements more than one move does.
//!
//! A held write is sent before any statement that could see it (one on its table, or any
//! statement not known to leave it alone) and before the commit, so that every statement sees
//! what the moves before it wrote. Two writes of one row are never held together: the second
//! sends the first.
//!
//! Every such statement is guarded on the server: it fails, aborting its transaction, unless
//! each part changed the rows its moves expected. A lane may then send its `COMMIT` behind
//! writes not yet answered, since a write that did not stand rolls the whole group back.

use std::borrow::Cow;

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

/// One statement to send: its SQL, its parameters, and the counts it answers (the rows each
/// of its parts changed) when it stands; it fails on the server otherwise.
pub(super) struct Batch {
    pub sql: String,
    pub params: Vec<Owned>,
    pub counts: Vec<i64>,
}

/// One kind of held writes, or one write of a move's.
struct Part {
    sql: Cow<'static, str>,
    params: Vec<Owned>,
    rows: usize,
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
    /// Set by a move of the step held with its insert.
    pub result: Option<Value>,
    pub waiting_for: Option<&'static str>,
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

// The state's test is written so that no plan reads the runs by the index of their states
// (which a plan made while the table has no statistics would, and then read every running run
// for each touch): each row is found by its id.
const TOUCHES: &str = "UPDATE runs SET updated_at = t.at
     FROM unnest($1::text[], $2::int8[], $3::text[], $4::int8[], $5::int8[], $6::int8[])
          AS t (id, at, owner, unexpired_at, token, beyond)
     WHERE runs.id = t.id AND (runs.state = 'RUNNING') IS TRUE AND runs.lease_owner = t.owner
       AND runs.lease_epoch = t.token
       AND (t.unexpired_at IS NULL OR runs.lease_expires_at > t.unexpired_at)
       AND (t.beyond IS NULL OR runs.lease_expires_at >
            floor(extract(epoch FROM clock_timestamp()) * 1000)::int8 + t.beyond)";

const NEW_STEPS: &str =
    "INSERT INTO steps (run_id, step, kind, state, attempt, call_id, tool, args, result,
                        waiting_for)
     SELECT * FROM unnest($1::text[], $2::int4[], $3::text[], $4::text[], $5::int4[],
                          $6::text[], $7::text[], $8::json[], $9::json[], $10::text[])";

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

    /// Holds `moved`; a move of a step this group inserts, from the state and attempt it is
    /// inserted with, is made in the insert instead (no other transaction can see that row).
    pub(super) fn move_step(&mut self, moved: StepMove) {
        let inserted = self.new_steps.iter_mut().find(|new| {
            new.run_id == moved.run_id
                && new.step == moved.step
                && new.state == moved.from
                && new.attempt == moved.attempt
        });
        match inserted {
            Some(new) => {
                new.state = moved.to;
                new.attempt += moved.starts;
                if moved.result.is_some() {
                    new.result = moved.result;
                }
                new.waiting_for = moved.waiting_for;
            }
            None => self.step_moves.push(moved),
        }
    }

    pub(super) fn append(&mut self, event: NewEvent) {
        self.events.push(event);
    }

    /// The statements that send what is held on `tables`, leaving nothing of them held: one
    /// statement for all of it, each kind a part of its own, except that steps inserted are
    /// sent first when a held move is of one of them (the parts of one statement do not see
    /// each other's rows).
    pub(super) fn take(&mut self, tables: Tables) -> Vec<Batch> {
        let mut parts = Vec::new();
        let mut first = None;
        if tables.has(Tables::RUNS) && !self.touches.is_empty() {
            parts.push(touches(std::mem::take(&mut self.touches)));
        }
        if tables.has(Tables::STEPS) {
            if !self.new_steps.is_empty() {
                let moved_new = self.step_moves.iter().any(|moved| {
                    self.new_steps
                        .iter()
                        .any(|new| new.run_id == moved.run_id && new.step == moved.step)
                });
                let part = new_steps(std::mem::take(&mut self.new_steps));
                if moved_new {
                    first = Some(part);
                } else {
                    parts.push(part);
                }
            }
            if !self.step_moves.is_empty() {
                parts.push(step_moves(std::mem::take(&mut self.step_moves)));
            }
        }
        if tables.has(Tables::EVENTS) && !self.events.is_empty() {
            parts.push(new_events(std::mem::take(&mut self.events)));
        }
        let mut batches: Vec<Batch> = first.into_iter().map(|part| guarded(vec![part])).collect();
        if !parts.is_empty() {
            batches.push(guarded(parts));
        }
        batches
    }
}

/// One write of a move's (an `INSERT`, `UPDATE` or `DELETE`), guarded as held writes are: the
/// statement fails unless it changed `rows` rows.
pub(super) fn guarded_write(sql: &str, params: Vec<Owned>, rows: u64) -> Batch {
    debug_assert!(
        ["INSERT", "UPDATE", "DELETE"]
            .iter()
            .any(|verb| sql.trim_start().to_ascii_uppercase().starts_with(verb)),
        "only a data-modifying statement can be a part: {sql}"
    );
    guarded(vec![Part {
        sql: Cow::Owned(sql.to_owned()),
        params,
        rows: rows as usize,
    }])
}

/// Parts as one statement, each a data-modifying `WITH` query, answering the rows each changed;
/// `agentrt_expect` (schema 14) fails the statement unless each changed what its moves expected.
/// (`OFFSET 0` keeps the counts a subquery of their own: flattened, each would be counted once
/// per place it is used, which made a small group's statement a fifth slower.)
fn guarded(parts: Vec<Part>) -> Batch {
    let mut queries = Vec::new();
    let mut changed = Vec::new();
    let mut columns = Vec::new();
    let mut params = Vec::new();
    let mut counts = Vec::new();
    for (index, part) in parts.into_iter().enumerate() {
        // A part counts the rows it returns: one that returns none of its own returns one per
        // row it changed.
        let returns_rows = part
            .sql
            .split_whitespace()
            .any(|word| word.eq_ignore_ascii_case("RETURNING"));
        let returning = if returns_rows { "" } else { " RETURNING 1" };
        queries.push(format!(
            "part{index} AS ({}{returning})",
            renumbered(&part.sql, params.len())
        ));
        changed.push(format!("(SELECT count(*) FROM part{index})"));
        columns.push(format!("changed[{}]", index + 1));
        params.extend(part.params);
        counts.push(part.rows as i64);
    }
    let expected = params.len() + 1;
    params.push(Box::new(counts.clone()));
    Batch {
        sql: format!(
            "WITH {} SELECT {} FROM (SELECT ARRAY[{}] AS changed OFFSET 0) AS group_writes
             WHERE agentrt_expect(changed, ${expected}::int8[])",
            queries.join(", "),
            columns.join(", "),
            changed.join(", ")
        ),
        params,
        counts,
    }
}

/// `sql` with each parameter `$n` made `$(n + by)`.
fn renumbered(sql: &str, by: usize) -> String {
    let mut out = String::with_capacity(sql.len() + 8);
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        out.push(c);
        if c != '$' {
            continue;
        }
        let mut digits = String::new();
        while let Some(d) = chars.peek().filter(|d| d.is_ascii_digit()) {
            digits.push(*d);
            chars.next();
        }
        match digits.parse::<usize>() {
            Ok(n) => out.push_str(&(n + by).to_string()),
            Err(_) => out.push_str(&digits),
        }
    }
    out
}

/// The later of two bounds a lease must outlast, either of them absent.
fn stricter(a: Option<i64>, b: Option<i64>) -> Option<i64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

fn touches(touches: Vec<Touch>) -> Part {
    let rows = touches.len();
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
    Part {
        sql: Cow::Borrowed(TOUCHES),
        params: vec![
            Box::new(ids),
            Box::new(ats),
            Box::new(owners),
            Box::new(unexpired),
            Box::new(tokens),
            Box::new(beyond),
        ],
        rows,
    }
}

fn new_steps(steps: Vec<NewStep>) -> Part {
    let rows = steps.len();
    let (mut runs, mut numbers, mut kinds, mut states) = (vec![], vec![], vec![], vec![]);
    let (mut attempts, mut calls, mut tools, mut args) = (vec![], vec![], vec![], vec![]);
    let (mut results, mut waiting) = (vec![], vec![]);
    for step in steps {
        runs.push(step.run_id);
        numbers.push(step.step);
        kinds.push(step.kind);
        states.push(step.state);
        attempts.push(step.attempt);
        calls.push(step.call_id);
        tools.push(step.tool);
        args.push(step.args);
        results.push(step.result);
        waiting.push(step.waiting_for);
    }
    Part {
        sql: Cow::Borrowed(NEW_STEPS),
        params: vec![
            Box::new(runs),
            Box::new(numbers),
            Box::new(kinds),
            Box::new(states),
            Box::new(attempts),
            Box::new(calls),
            Box::new(tools),
            Box::new(args),
            Box::new(results),
            Box::new(waiting),
        ],
        rows,
    }
}

fn step_moves(moves: Vec<StepMove>) -> Part {
    let rows = moves.len();
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
    Part {
        sql: Cow::Borrowed(STEP_MOVES),
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
        rows,
    }
}

fn new_events(events: Vec<NewEvent>) -> Part {
    let rows = events.len();
    let (mut runs, mut kinds, mut ats, mut steps, mut payloads) =
        (vec![], vec![], vec![], vec![], vec![]);
    for event in events {
        runs.push(event.run_id);
        kinds.push(event.kind);
        ats.push(event.at);
        steps.push(event.step);
        payloads.push(event.payload);
    }
    Part {
        sql: Cow::Borrowed(NEW_EVENTS),
        params: vec![
            Box::new(runs),
            Box::new(kinds),
            Box::new(ats),
            Box::new(steps),
            Box::new(payloads),
        ],
        rows,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_are_renumbered_past_the_parts_before() {
        assert_eq!(
            renumbered("a = $1 AND b = $12::int8[] AND c = '$'", 3),
            "a = $4 AND b = $15::int8[] AND c = '$'"
        );
    }

    fn step(run_id: &str, step: i32) -> NewStep {
        NewStep {
            run_id: run_id.into(),
            step,
            kind: "tool",
            state: "pending",
            attempt: 0,
            call_id: None,
            tool: None,
            args: None,
            result: None,
            waiting_for: None,
        }
    }

    fn moved(run_id: &str, step: i32) -> StepMove {
        StepMove {
            run_id: run_id.into(),
            step,
            from: "pending",
            attempt: 0,
            to: "in_flight",
            starts: 1,
            result: None,
            waiting_for: None,
        }
    }

    #[test]
    fn a_step_moved_in_the_group_that_inserted_it_is_inserted_moved() {
        let mut held = Held::default();
        held.insert_step(step("r", 2));
        let mut finished = moved("r", 2);
        (
            finished.from,
            finished.to,
            finished.attempt,
            finished.starts,
        ) = ("in_flight", "finished", 1, 0);
        finished.result = Some(serde_json::json!({"ok": true}));
        held.move_step(moved("r", 2));
        held.move_step(finished);
        assert!(held.step_moves.is_empty());
        let new = &held.new_steps[0];
        assert_eq!((new.state, new.attempt), ("finished", 1));
        assert_eq!(new.result, Some(serde_json::json!({"ok": true})));
        let batches = held.take(Tables::ALL);
        assert_eq!(batches.len(), 1);
        assert!(
            batches[0]
                .sql
                .starts_with("WITH part0 AS (INSERT INTO steps")
        );
        assert_eq!(batches[0].counts, [1]);
    }

    #[test]
    fn a_move_of_a_step_inserted_in_another_state_is_sent_after_the_insert() {
        let mut held = Held::default();
        held.insert_step(step("r", 2));
        let mut stale = moved("r", 2);
        stale.from = "in_flight";
        held.move_step(stale);
        let batches = held.take(Tables::ALL);
        assert_eq!(
            batches.len(),
            2,
            "the server refuses the move, not this side"
        );
        assert!(
            batches[0]
                .sql
                .starts_with("WITH part0 AS (INSERT INTO steps")
        );
        assert!(batches[1].sql.starts_with("WITH part0 AS (UPDATE steps"));
        assert!(held.take(Tables::ALL).is_empty(), "nothing is left held");
    }

    #[test]
    fn kinds_of_other_rows_go_in_one_statement_answering_each_kinds_count() {
        let mut held = Held::default();
        held.insert_step(step("r", 3));
        held.move_step(moved("r", 2));
        held.move_step(moved("s", 2));
        let batches = held.take(Tables::STEPS);
        assert_eq!(batches.len(), 1);
        assert!(
            batches[0]
                .sql
                .starts_with("WITH part0 AS (INSERT INTO steps")
        );
        assert!(batches[0].sql.contains("$11::text[]"), "{}", batches[0].sql);
        assert_eq!(batches[0].counts, [1, 2]);
        assert!(
            batches[0]
                .sql
                .ends_with("WHERE agentrt_expect(changed, $19::int8[])"),
            "the statement fails unless each part changed what it expected: {}",
            batches[0].sql
        );
    }

    #[test]
    fn a_second_touch_of_a_run_under_the_same_lease_asks_what_both_ask() {
        let touch = |at, beyond, token| Touch {
            run_id: "r".into(),
            at,
            owner: "o".into(),
            unexpired_at: None,
            token,
            beyond,
        };
        let mut held = Held::default();
        assert!(held.touch(touch(5, None, 1)).is_ok());
        assert!(held.touch(touch(7, Some(300), 1)).is_ok());
        assert!(held.touch(touch(8, None, 2)).is_err(), "another lease's");
        assert_eq!(held.touches.len(), 1);
        assert_eq!((held.touches[0].at, held.touches[0].beyond), (7, Some(300)));
    }
}
