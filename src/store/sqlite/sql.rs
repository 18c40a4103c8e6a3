//! All of the SQLite backend's SQL: the primitives of the moves, the reads, and the lease's
//! single-statement writes, on one connection (a transaction's, or one outside any).

use std::borrow::Cow;

use rusqlite::{Connection, OptionalExtension, Row, params};
use serde_json::Value;

use super::{
    error::Db,
    held::{EventInsert, Held, HeldMove, HeldTouch, StepInsert},
    keys::RunKeys,
};
use crate::{
    error::{Error, Result},
    schedule::Missed,
    store::{
        backend::{
            Change, ChangeKind, LeaseWrites, NewRun, Purged, Reads, RunUpdate, StepUpdate, Tx,
        },
        listing::ListQuery,
        model::{ApprovalRow, LeaseRow, Rendered, ScheduleRow, StepRow, WaitRow, from_millis},
        moves::FIRST_TOKEN,
    },
    types::{
        Approval, ApprovalReason, Delivery, Event, EventKind, Run, RunId, RunState, StepKind,
        StepState, ToolCall, WaitKind,
    },
};

/// A connection seen through the backend's primitives. A transaction derefs to its
/// connection, so the same statements serve inside a move and outside. A group's transaction
/// on the writer, as first applied, also has the writer's memo: the runs' keys, and the writes
/// its moves hold back.
pub(crate) struct Sql<'c>(pub &'c Connection, pub Option<&'c mut RunKeys>);

impl<'c> Sql<'c> {
    /// `conn`, without the memo of keys.
    pub(crate) fn of(conn: &'c Connection) -> Self {
        Sql(conn, None)
    }

    /// The writes held back, when this is a group's transaction as first applied.
    fn held(&mut self) -> Option<&mut Held> {
        self.1.as_deref_mut().map(|memo| &mut memo.held)
    }

    /// Sends the writes held back, if any (see [`Held`]). Unless all of them stand, the group
    /// is marked refused, so that it cannot commit as applied even if the error is caught.
    fn flush_held(&mut self) -> Result<()> {
        self.flush(true)
    }

    /// Sends what is held (the events too if `events`), noting a refusal as `flush_held` does.
    fn flush(&mut self, events: bool) -> Result<()> {
        let (touch_held, steps, events) = match self.held() {
            Some(held) if held.any_of_moves() || (events && held.any()) => {
                let (touch, steps) = held.take_of_moves();
                let events = if events {
                    held.take_events()
                } else {
                    Vec::new()
                };
                (touch, steps, events)
            }
            _ => return Ok(()),
        };
        let conn = self.0;
        let sent = (|| {
            let mut stood = true;
            if let Some(held) = touch_held {
                stood = send_touch(conn, &held)?;
            }
            for step in steps {
                insert_step_row(conn, &step)?;
            }
            insert_events(conn, &events)?;
            Ok(stood)
        })();
        if !matches!(sent, Ok(true))
            && let Some(held) = self.held()
        {
            held.refused();
        }
        sent.map(drop)
    }

    /// Sends `events`, taken from those held, noting a refusal as `flush_held` does.
    fn send_events(&mut self, events: &[EventInsert]) -> Result<()> {
        let sent = insert_events(self.0, events);
        if sent.is_err()
            && let Some(held) = self.held()
        {
            held.refused();
        }
        sent
    }

    /// Sends the writes a move (or pair) held to its end; whether every write the group held
    /// so far stood.
    pub(crate) fn move_stood(&mut self) -> Result<bool> {
        self.flush(false)?;
        Ok(self.held().is_none_or(|held| held.stood()))
    }

    /// Sends every write held back, the events too; whether every write the group held stood.
    pub(crate) fn held_stood(&mut self) -> Result<bool> {
        self.flush_held()?;
        Ok(self.held().is_none_or(|held| held.stood()))
    }
}

/// Runs `read` in one read transaction on `conn`, so that its statements see one snapshot: a
/// run's row and its steps as one commit left them, never a row from before another writer's
/// commit beside steps from after it.
pub(super) fn in_snapshot<R>(
    conn: &Connection,
    read: impl FnOnce(&mut Sql<'_>) -> Result<R>,
) -> Result<R> {
    let tx = conn.unchecked_transaction().db()?;
    let value = read(&mut Sql::of(&tx))?;
    tx.commit().db()?;
    Ok(value)
}

/// Stamps a RUNNING run under `owner`'s lease of token `token` as moved at `at` (see
/// [`Tx::touch_run`]); whether the guard matched.
fn touch(
    conn: &Connection,
    run_id: &RunId,
    at: i64,
    owner: &str,
    token: u64,
    unexpired_at: Option<i64>,
) -> Result<bool> {
    let changed = conn
        .prepare_cached(
            "UPDATE runs SET updated_at = ?2
             WHERE id = ?1 AND state = 'RUNNING' AND lease_owner = ?3 AND lease_epoch = ?5
               AND (?4 IS NULL OR lease_expires_at > ?4)",
        )
        .db()?
        .execute(params![
            run_id.as_str(),
            at,
            owner,
            unexpired_at,
            token as i64
        ])
        .db()?;
    Ok(changed == 1)
}

/// Sends a touch that was held back; whether its guard matched.
fn send_touch(conn: &Connection, held: &HeldTouch) -> Result<bool> {
    touch(
        conn,
        &held.run_id,
        held.at,
        &held.owner,
        held.token,
        held.unexpired_at,
    )
}

/// A tool call's columns of its step: its id, its tool, and its arguments' JSON.
fn call_columns(call: &ToolCall) -> (String, String, String) {
    (call.id.clone(), call.name.clone(), call.args.to_string())
}

/// The number of the last event of the run of key `key`; 0 when it has none.
fn last_event(conn: &Connection, key: i64) -> Result<i64> {
    conn.prepare_cached("SELECT COALESCE(MAX(seq), 0) FROM events WHERE run_key = ?1")
        .db()?
        .query_row([key], |row| row.get(0))
        .db()
}

/// Inserts `step`, as it is held.
fn insert_step_row(conn: &Connection, step: &StepInsert) -> Result<()> {
    let call = step.call.as_ref();
    conn.prepare_cached(
        "INSERT INTO steps (run_id, step, kind, state, attempt, call_id, tool, args, result,
                            waiting_for)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
    )
    .db()?
    .execute(params![
        step.run_id.as_str(),
        step.step,
        step.kind.as_str(),
        step.state.as_str(),
        step.attempt,
        call.map(|(id, _, _)| id),
        call.map(|(_, tool, _)| tool),
        call.map(|(_, _, args)| args),
        step.result,
        step.waiting_for.map(ApprovalReason::as_str),
    ])
    .db()?;
    Ok(())
}

/// How many events one statement appends at most, and the sizes it cuts a batch into: each
/// size is one prepared statement, so that a batch of any length takes a few.
const EVENT_ROWS: [usize; 4] = [64, 16, 4, 1];

/// The statements that append `EVENT_ROWS[i]` events each.
static EVENT_INSERTS: std::sync::LazyLock<[String; 4]> = std::sync::LazyLock::new(|| {
    EVENT_ROWS.map(|rows| {
        let values = vec!["(?, ?, ?, ?, ?, ?)"; rows].join(", ");
        format!("INSERT INTO events (run_key, seq, kind, at, step, payload) VALUES {values}")
    })
});

/// Appends `events`, as they are held, a statement for up to 64 of them.
fn insert_events(conn: &Connection, mut events: &[EventInsert]) -> Result<()> {
    while !events.is_empty() {
        let size = EVENT_ROWS
            .iter()
            .position(|&rows| rows <= events.len())
            .unwrap_or(EVENT_ROWS.len() - 1);
        let (batch, rest) = events.split_at(EVENT_ROWS[size]);
        let mut insert = conn.prepare_cached(&EVENT_INSERTS[size]).db()?;
        for (i, event) in batch.iter().enumerate() {
            let first = 6 * i + 1;
            insert.raw_bind_parameter(first, event.key).db()?;
            insert.raw_bind_parameter(first + 1, event.seq).db()?;
            insert
                .raw_bind_parameter(first + 2, event.kind.as_str())
                .db()?;
            insert.raw_bind_parameter(first + 3, event.at).db()?;
            insert.raw_bind_parameter(first + 4, event.step).db()?;
            insert.raw_bind_parameter(first + 5, &event.payload).db()?;
        }
        insert.raw_execute().db()?;
        events = rest;
    }
    Ok(())
}

/// The step and attempt count of a run's call that waits for a decision, found through the
/// index of waiting calls (`steps_waiting_call`): the literal state is what lets SQLite use
/// it.
pub(crate) const WAITING_CALL: &str = "SELECT step, attempt FROM steps
     WHERE run_id = ?1 AND call_id = ?2 AND state = 'waiting'";

const RUN_COLUMNS: &str = "id, agent, input, state, output, error, created_at, updated_at";

/// A finished run, spelled as the partial index `runs_finished` spells it: a query that
/// repeats it word for word may use that index.
const FINISHED: &str = "(state = 'SUCCEEDED' OR state = 'FAILED' OR state = 'CANCELLED')";

/// Column `column` of the runs (their `id` or `key`) of a purge's batch that have finished,
/// from the JSON array of ids in `?1`: the guard every delete of a purge repeats, in its own
/// statement.
fn finished_of_batch(column: &str) -> String {
    format!(
        "SELECT {column} FROM runs WHERE id IN (SELECT value FROM json_each(?1)) AND {FINISHED}"
    )
}

/// How `table`'s rows name their run: their column, and the runs' column it holds (the event
/// log the run's integer key, the other tables its id).
fn run_reference(table: &str) -> (&'static str, &'static str) {
    if table == "events" {
        ("run_key", "key")
    } else {
        ("run_id", "id")
    }
}

/// A page of runs after (`?1`, `?2`) created at `?3` or later, at most `?4`, of agent `?5`
/// and in state `?5` or `?6` when asked for: one statement per combination of filters, each a
/// range of one index (`runs_by_agent`, `runs_by_state` or `runs_by_created`).
pub(crate) fn list_runs_sql(agent: bool, state: bool) -> String {
    let mut sql = format!(
        "SELECT {RUN_COLUMNS} FROM runs WHERE (created_at, id) > (?1, ?2) AND created_at >= ?3"
    );
    let mut next = 5;
    if agent {
        sql.push_str(&format!(" AND agent = ?{next}"));
        next += 1;
    }
    if state {
        sql.push_str(&format!(" AND state = ?{next}"));
    }
    sql.push_str(" ORDER BY created_at, id LIMIT ?4");
    sql
}

/// The finished runs whose last move came before `?1`, after (`?2`, `?3`), at most `?4`.
/// SQLite would rather read `runs_by_state` (the three states) and sort: the partial index of
/// finished runs is named, and its WHERE clause repeated word for word, which SQLite needs to
/// use it (naming an index it cannot use fails the statement).
pub(crate) fn finished_runs_sql() -> String {
    format!(
        "SELECT id, updated_at FROM runs INDEXED BY runs_finished
         WHERE {FINISHED} AND updated_at < ?1 AND (updated_at, id) > (?2, ?3)
         ORDER BY updated_at, id LIMIT ?4"
    )
}

/// The ids as the JSON array the purge's statements read.
fn json_ids(ids: &[RunId]) -> String {
    serde_json::to_string(&ids.iter().map(RunId::as_str).collect::<Vec<_>>())
        .expect("ids serialize")
}

/// Those of `ids` found in `found`, in the order of `ids`.
fn in_order(ids: &[RunId], found: Vec<String>) -> Vec<RunId> {
    let found: std::collections::HashSet<String> = found.into_iter().collect();
    ids.iter()
        .filter(|id| found.contains(id.as_str()))
        .cloned()
        .collect()
}

fn parse_json(text: String, what: &str) -> rusqlite::Result<Value> {
    serde_json::from_str(&text).map_err(|err| {
        rusqlite::Error::FromSqlConversionFailure(
            0,
            rusqlite::types::Type::Text,
            format!("{what}: {err}").into(),
        )
    })
}

fn run_from_row(row: &Row<'_>) -> rusqlite::Result<Run> {
    let state: String = row.get(3)?;
    Ok(Run {
        id: RunId::from(row.get::<_, String>(0)?),
        agent: row.get(1)?,
        input: parse_json(row.get(2)?, "run input")?,
        state: state.parse().map_err(|err: String| {
            rusqlite::Error::FromSqlConversionFailure(3, rusqlite::types::Type::Text, err.into())
        })?,
        output: row.get(4)?,
        error: row.get(5)?,
        created_at: from_millis(row.get(6)?),
        updated_at: from_millis(row.get(7)?),
    })
}

/// An agent's (`?1`) waits ready by `?2` after (`?3`, `?4`), the first `?5` by when they
/// became ready: a range of `waits_ready`.
pub(crate) const READY_WAITS: &str = "SELECT run_id, ready_at FROM waits
     WHERE agent = ?1 AND ready_at IS NOT NULL AND ready_at <= ?2
       AND (ready_at, run_id) > (?3, ?4)
     ORDER BY ready_at, run_id LIMIT ?5";

/// When an agent's (`?1`) next wait becomes ready after `?2`: one seek of `waits_ready`.
pub(crate) const NEXT_READY: &str = "SELECT min(ready_at) FROM waits
     WHERE agent = ?1 AND ready_at IS NOT NULL AND ready_at > ?2";

/// A wait's columns, with its call's id, as [`wait_from_row`] reads them.
const WAIT_COLUMNS: &str = "waits.step, steps.call_id, waits.kind, waits.key, waits.detail,
     waits.since, waits.due_at, waits.ready_at, waits.result";

const WAIT_SELECT: &str = "SELECT waits.step, steps.call_id, waits.kind, waits.key, waits.detail,
     waits.since, waits.due_at, waits.ready_at, waits.result FROM waits
     JOIN steps ON steps.run_id = waits.run_id AND steps.step = waits.step";

/// A wait from [`WAIT_COLUMNS`], starting at column `at`.
fn wait_from_row(row: &Row<'_>, at: usize) -> rusqlite::Result<WaitRow> {
    let kind: String = row.get(at + 2)?;
    Ok(WaitRow {
        step: row.get(at)?,
        call_id: row.get::<_, Option<String>>(at + 1)?.unwrap_or_default(),
        kind: WaitKind::parse(&kind).map_err(|err| {
            rusqlite::Error::FromSqlConversionFailure(
                at + 2,
                rusqlite::types::Type::Text,
                err.to_string().into(),
            )
        })?,
        key: row.get(at + 3)?,
        detail: parse_json(row.get(at + 4)?, "wait detail")?,
        since: row.get(at + 5)?,
        due_at: row.get(at + 6)?,
        ready_at: row.get(at + 7)?,
        result: row
            .get::<_, Option<String>>(at + 8)?
            .map(|text| parse_json(text, "wait result"))
            .transpose()?,
    })
}

fn event_from_row(run_id: &RunId, row: &Row<'_>) -> rusqlite::Result<Event> {
    let kind: String = row.get(1)?;
    Ok(Event {
        run_id: run_id.clone(),
        seq: row.get::<_, i64>(0)? as u64,
        kind: kind.parse().map_err(|err: String| {
            rusqlite::Error::FromSqlConversionFailure(1, rusqlite::types::Type::Text, err.into())
        })?,
        at: from_millis(row.get(2)?),
        step: row.get(3)?,
        payload: parse_json(row.get(4)?, "event payload")?,
    })
}

/// A schedule's columns, as [`schedule_from_row`] reads them.
const SCHEDULE_COLUMNS: &str =
    "name, agent, input, cron, catch_up, paused, next_at, created_at, updated_at";

/// An agent's (`?1`) schedules not paused whose next occurrence is at or before `?2`, at most
/// `?3`: a range of `schedules_due`, whose condition it repeats word for word.
pub(crate) fn due_schedules_sql() -> String {
    format!(
        "SELECT {SCHEDULE_COLUMNS} FROM schedules
         WHERE agent = ?1 AND paused = 0 AND next_at <= ?2
         ORDER BY next_at LIMIT ?3"
    )
}

/// The earliest next occurrence after `?2` of an agent's (`?1`) schedules not paused: one seek
/// of `schedules_due`.
pub(crate) const NEXT_SCHEDULED_AT: &str = "SELECT min(next_at) FROM schedules
     WHERE agent = ?1 AND paused = 0 AND next_at > ?2";

fn schedule_from_row(row: &Row<'_>) -> rusqlite::Result<ScheduleRow> {
    Ok(ScheduleRow {
        name: row.get(0)?,
        agent: row.get(1)?,
        input: parse_json(row.get(2)?, "schedule input")?,
        cron: row.get(3)?,
        missed: if row.get(4)? {
            Missed::CatchUp
        } else {
            Missed::Skip
        },
        paused: row.get(5)?,
        next_at: row.get(6)?,
        created_at: row.get(7)?,
        updated_at: row.get(8)?,
    })
}

impl Reads for Sql<'_> {
    fn list_runs(&mut self, query: &ListQuery<'_>) -> Result<Vec<Run>> {
        self.flush_held()?;
        use rusqlite::types::Value as Param;
        let (after_at, after_id) = match &query.after {
            Some((at, id)) => (*at, id.as_str().to_owned()),
            None => (i64::MIN, String::new()),
        };
        let mut params = vec![
            Param::Integer(after_at),
            Param::Text(after_id),
            Param::Integer(query.since.unwrap_or(i64::MIN)),
            Param::Integer(query.limit as i64),
        ];
        params.extend(query.agent.map(|agent| Param::Text(agent.to_owned())));
        params.extend(
            query
                .state
                .map(|state| Param::Text(state.as_str().to_owned())),
        );
        self.0
            .prepare_cached(&list_runs_sql(query.agent.is_some(), query.state.is_some()))
            .db()?
            .query_map(rusqlite::params_from_iter(params), run_from_row)
            .db()?
            .collect::<rusqlite::Result<_>>()
            .db()
    }

    fn finished_runs(
        &mut self,
        before: i64,
        after: Option<(i64, &RunId)>,
        limit: usize,
    ) -> Result<Vec<(RunId, i64)>> {
        self.flush_held()?;
        let (after_at, after_id) = after.map_or((i64::MIN, ""), |(at, id)| (at, id.as_str()));
        self.0
            .prepare_cached(&finished_runs_sql())
            .db()?
            .query_map(params![before, after_at, after_id, limit as i64], |row| {
                Ok((RunId::from(row.get::<_, String>(0)?), row.get(1)?))
            })
            .db()?
            .collect::<rusqlite::Result<_>>()
            .db()
    }

    fn purge_counts(&mut self, ids: &[RunId]) -> Result<Purged> {
        self.flush_held()?;
        let json = json_ids(ids);
        let found: Vec<String> = self
            .0
            .prepare_cached(&finished_of_batch("id"))
            .db()?
            .query_map([&json], |row| row.get(0))
            .db()?
            .collect::<rusqlite::Result<_>>()
            .db()?;
        Ok(Purged {
            runs: found.len() as u64,
            ids: in_order(ids, found),
            steps: self.count("steps", &json)?,
            events: self.count("events", &json)?,
            approvals: self.count("approvals", &json)?,
        })
    }

    fn wait(&mut self, run_id: &RunId) -> Result<Option<WaitRow>> {
        self.flush_held()?;
        self.0
            .prepare_cached(&format!("{WAIT_SELECT} WHERE waits.run_id = ?1"))
            .db()?
            .query_row([run_id.as_str()], |row| wait_from_row(row, 0))
            .optional()
            .db()
    }

    fn ready_waits(
        &mut self,
        until: i64,
        agents: &[&str],
        after: Option<(i64, &RunId)>,
        limit: usize,
    ) -> Result<Vec<(RunId, i64)>> {
        self.flush_held()?;
        // A range of waits_ready per agent, up to `until`, after the page before's last: the
        // waits not due cost nothing.
        let (since, id) = after.map_or((i64::MIN, ""), |(since, id)| (since, id.as_str()));
        let mut ready = Vec::new();
        let mut stmt = self.0.prepare_cached(READY_WAITS).db()?;
        for agent in agents {
            let rows = stmt
                .query_map(params![agent, until, since, id, limit as i64], |row| {
                    Ok((row.get::<_, i64>(1)?, row.get::<_, String>(0)?))
                })
                .db()?
                .collect::<rusqlite::Result<Vec<_>>>()
                .db()?;
            ready.extend(rows);
        }
        ready.sort();
        ready.truncate(limit);
        Ok(ready
            .into_iter()
            .map(|(at, id)| (RunId::from(id), at))
            .collect())
    }

    fn next_ready_at(&mut self, after: i64, agents: &[&str]) -> Result<Option<i64>> {
        self.flush_held()?;
        let mut stmt = self.0.prepare_cached(NEXT_READY).db()?;
        let mut next: Option<i64> = None;
        for agent in agents {
            let at: Option<i64> = stmt
                .query_row(params![agent, after], |row| row.get(0))
                .db()?;
            next = match (next, at) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        Ok(next)
    }

    fn list_waits(
        &mut self,
        kind: Option<WaitKind>,
        after: Option<(i64, &RunId)>,
        limit: usize,
    ) -> Result<Vec<(RunId, WaitRow)>> {
        self.flush_held()?;
        let (since, id) = after.map_or((i64::MIN, ""), |(since, id)| (since, id.as_str()));
        self.0
            .prepare_cached(&format!(
                "SELECT waits.run_id, {WAIT_COLUMNS} FROM waits
                 JOIN steps ON steps.run_id = waits.run_id AND steps.step = waits.step
                 WHERE (waits.since, waits.run_id) > (?1, ?2) AND (?3 IS NULL OR waits.kind = ?3)
                 ORDER BY waits.since, waits.run_id LIMIT ?4"
            ))
            .db()?
            .query_map(
                params![since, id, kind.map(WaitKind::as_str), limit as i64],
                |row| {
                    Ok((
                        RunId::from(row.get::<_, String>(0)?),
                        wait_from_row(row, 1)?,
                    ))
                },
            )
            .db()?
            .collect::<rusqlite::Result<_>>()
            .db()
    }

    fn schedule(&mut self, name: &str) -> Result<Option<ScheduleRow>> {
        self.flush_held()?;
        self.0
            .prepare_cached(&format!(
                "SELECT {SCHEDULE_COLUMNS} FROM schedules WHERE name = ?1"
            ))
            .db()?
            .query_row([name], schedule_from_row)
            .optional()
            .db()
    }

    fn schedules(&mut self) -> Result<Vec<ScheduleRow>> {
        self.flush_held()?;
        self.0
            .prepare_cached(&format!(
                "SELECT {SCHEDULE_COLUMNS} FROM schedules ORDER BY name"
            ))
            .db()?
            .query_map([], schedule_from_row)
            .db()?
            .collect::<rusqlite::Result<_>>()
            .db()
    }

    fn due_schedules(
        &mut self,
        until: i64,
        agents: &[&str],
        limit: usize,
    ) -> Result<Vec<ScheduleRow>> {
        self.flush_held()?;
        // A range of schedules_due per agent, up to `until`: the schedules not due, and those
        // of other agents, cost nothing.
        let mut due = Vec::new();
        let mut stmt = self.0.prepare_cached(&due_schedules_sql()).db()?;
        for agent in agents {
            let rows = stmt
                .query_map(params![agent, until, limit as i64], schedule_from_row)
                .db()?
                .collect::<rusqlite::Result<Vec<_>>>()
                .db()?;
            due.extend(rows);
        }
        due.sort_by_key(|row| row.next_at);
        due.truncate(limit);
        Ok(due)
    }

    fn next_scheduled_at(&mut self, after: i64, agents: &[&str]) -> Result<Option<i64>> {
        self.flush_held()?;
        let mut stmt = self.0.prepare_cached(NEXT_SCHEDULED_AT).db()?;
        let mut next: Option<i64> = None;
        for agent in agents {
            let at: Option<i64> = stmt
                .query_row(params![agent, after], |row| row.get(0))
                .db()?;
            next = next.into_iter().chain(at).min();
        }
        Ok(next)
    }

    fn lease_row(&mut self, run_id: &RunId) -> Result<Option<LeaseRow>> {
        self.flush_held()?;
        let row: Option<(String, Option<String>, Option<i64>, i64)> = self
            .0
            .prepare_cached(
                "SELECT state, lease_owner, lease_expires_at, lease_epoch FROM runs WHERE id = ?1",
            )
            .db()?
            .query_row([run_id.as_str()], |row| {
                Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?))
            })
            .optional()
            .db()?;
        row.map(|(state, owner, expires_at, epoch)| {
            Ok(LeaseRow {
                state: state.parse().map_err(Error::Corrupt)?,
                owner,
                expires_at,
                epoch: epoch as u64,
            })
        })
        .transpose()
    }

    fn run(&mut self, run_id: &RunId) -> Result<Option<Run>> {
        self.flush_held()?;
        self.0
            .prepare_cached(&format!("SELECT {RUN_COLUMNS} FROM runs WHERE id = ?1"))
            .db()?
            .query_row([run_id.as_str()], run_from_row)
            .optional()
            .db()
    }

    fn runs(&mut self, state: Option<RunState>) -> Result<Vec<Run>> {
        self.flush_held()?;
        let runs = match state {
            Some(state) => self
                .0
                .prepare_cached(&format!(
                    "SELECT {RUN_COLUMNS} FROM runs WHERE state = ?1 ORDER BY created_at, id"
                ))
                .db()?
                .query_map([state.as_str()], run_from_row)
                .db()?
                .collect::<rusqlite::Result<_>>()
                .db()?,
            None => self
                .0
                .prepare_cached(&format!(
                    "SELECT {RUN_COLUMNS} FROM runs ORDER BY created_at, id"
                ))
                .db()?
                .query_map([], run_from_row)
                .db()?
                .collect::<rusqlite::Result<_>>()
                .db()?,
        };
        Ok(runs)
    }

    fn count_by_state(&mut self) -> Result<Vec<(RunState, u64)>> {
        self.flush_held()?;
        // Counted off `runs_by_state`, which holds every run's state: no row is read.
        self.0
            .prepare_cached("SELECT state, count(*) FROM runs GROUP BY state")
            .db()?
            .query_map([], |row| {
                let state: String = row.get(0)?;
                let state = state.parse().map_err(|err: String| {
                    rusqlite::Error::FromSqlConversionFailure(
                        0,
                        rusqlite::types::Type::Text,
                        err.into(),
                    )
                })?;
                Ok((state, row.get::<_, i64>(1)? as u64))
            })
            .db()?
            .collect::<rusqlite::Result<_>>()
            .db()
    }

    fn events_after(&mut self, run_id: &RunId, after: u64) -> Result<Vec<Event>> {
        self.flush_held()?;
        self.0
            .prepare_cached(
                "SELECT seq, kind, at, step, payload FROM events
                 WHERE run_key = (SELECT key FROM runs WHERE id = ?1) AND seq > ?2
                 ORDER BY seq",
            )
            .db()?
            // Past the largest seq (the moves refuse it): nothing, rather than a wrap round.
            .query_map(
                params![run_id.as_str(), i64::try_from(after).unwrap_or(i64::MAX)],
                |row| event_from_row(run_id, row),
            )
            .db()?
            .collect::<rusqlite::Result<_>>()
            .db()
    }

    fn last_event(&mut self, run_id: &RunId) -> Result<Option<Event>> {
        self.flush_held()?;
        self.0
            .prepare_cached(
                "SELECT seq, kind, at, step, payload FROM events
                 WHERE run_key = (SELECT key FROM runs WHERE id = ?1)
                 ORDER BY seq DESC LIMIT 1",
            )
            .db()?
            .query_row([run_id.as_str()], |row| event_from_row(run_id, row))
            .optional()
            .db()
    }

    #[cfg(feature = "otel")]
    fn first_event(&mut self, run_id: &RunId) -> Result<Option<Event>> {
        self.flush_held()?;
        self.0
            .prepare_cached(
                "SELECT seq, kind, at, step, payload FROM events
                 WHERE run_key = (SELECT key FROM runs WHERE id = ?1)
                 ORDER BY seq LIMIT 1",
            )
            .db()?
            .query_row([run_id.as_str()], |row| event_from_row(run_id, row))
            .optional()
            .db()
    }

    fn steps(&mut self, run_id: &RunId) -> Result<Vec<StepRow>> {
        self.flush_held()?;
        type Columns = (
            u32,
            String,
            String,
            u32,
            Option<ToolCall>,
            Option<String>,
            Option<String>,
            Option<String>,
        );
        let rows: Vec<Columns> = self
            .0
            .prepare_cached(
                "SELECT step, kind, state, attempt, call_id, tool, args, result, waiting_for,
                        progress
                 FROM steps WHERE run_id = ?1 ORDER BY step",
            )
            .db()?
            .query_map([run_id.as_str()], |row| {
                let call = match row.get::<_, Option<String>>(4)? {
                    Some(id) => Some(ToolCall {
                        id,
                        name: row.get::<_, Option<String>>(5)?.unwrap_or_default(),
                        args: parse_json(
                            row.get::<_, Option<String>>(6)?
                                .unwrap_or_else(|| "null".into()),
                            "tool args",
                        )?,
                    }),
                    None => None,
                };
                Ok((
                    row.get(0)?,
                    row.get(1)?,
                    row.get(2)?,
                    row.get(3)?,
                    call,
                    row.get(7)?,
                    row.get(8)?,
                    row.get(9)?,
                ))
            })
            .db()?
            .collect::<rusqlite::Result<_>>()
            .db()?;
        rows.into_iter()
            .map(
                |(step, kind, state, attempt, call, result, waiting_for, progress)| {
                    Ok(StepRow {
                        step,
                        kind: StepKind::parse(&kind)?,
                        state: StepState::parse(&state)?,
                        attempt,
                        call,
                        result: result
                            .map(|text| serde_json::from_str(&text))
                            .transpose()
                            .map_err(|err| Error::Corrupt(format!("step result: {err}")))?,
                        waiting_for: match waiting_for.as_deref() {
                            Some("policy") => Some(ApprovalReason::Policy),
                            Some("reconcile") => Some(ApprovalReason::Reconcile),
                            _ => None,
                        },
                        progress: progress
                            .map(|text| serde_json::from_str(&text))
                            .transpose()
                            .map_err(|err| Error::Corrupt(format!("step progress: {err}")))?,
                    })
                },
            )
            .collect()
    }

    fn approval(&mut self, run_id: &RunId, step: u32, attempt: u32) -> Result<Option<ApprovalRow>> {
        self.flush_held()?;
        self.0
            .prepare_cached(
                "SELECT approved, decided_by, note FROM approvals
                 WHERE run_id = ?1 AND step = ?2 AND attempt = ?3",
            )
            .db()?
            .query_row(params![run_id.as_str(), step, attempt], |row| {
                Ok(ApprovalRow {
                    approved: row.get(0)?,
                    by: row.get(1)?,
                    note: row.get(2)?,
                })
            })
            .optional()
            .db()
    }

    fn unleased_runs(&mut self, wall: i64) -> Result<Vec<(RunId, LeaseRow)>> {
        self.flush_held()?;
        self.0
            .prepare_cached(
                "SELECT id, lease_owner, lease_expires_at, lease_epoch FROM runs
                 WHERE state = 'RUNNING' AND (lease_owner IS NULL OR lease_expires_at <= ?1)
                 ORDER BY id",
            )
            .db()?
            .query_map([wall], unleased_row)
            .db()?
            .collect::<rusqlite::Result<_>>()
            .db()
    }

    fn recoverable_runs(
        &mut self,
        wall: i64,
        agents: &[&str],
        executed: bool,
        limit: usize,
    ) -> Result<Vec<(RunId, LeaseRow)>> {
        self.flush_held()?;
        let agents = serde_json::to_string(agents).expect("names serialize");
        // Walks runs_by_state's RUNNING range in creation order, and stops at `limit`.
        self.0
            .prepare_cached(
                "SELECT id, lease_owner, lease_expires_at, lease_epoch FROM runs
                 WHERE state = 'RUNNING' AND (lease_owner IS NULL OR lease_expires_at <= ?1)
                   AND agent IN (SELECT value FROM json_each(?2))
                   AND (lease_epoch > 0) = ?3
                 ORDER BY created_at, id
                 LIMIT ?4",
            )
            .db()?
            .query_map(params![wall, agents, executed, limit as i64], unleased_row)
            .db()?
            .collect::<rusqlite::Result<_>>()
            .db()
    }
}

/// A row of `SELECT id, lease_owner, lease_expires_at, lease_epoch` over RUNNING runs: the run
/// and its lease.
fn unleased_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<(RunId, LeaseRow)> {
    let lease = LeaseRow {
        state: RunState::Running,
        owner: row.get(1)?,
        expires_at: row.get(2)?,
        epoch: row.get::<_, i64>(3)? as u64,
    };
    Ok((RunId::from(row.get::<_, String>(0)?), lease))
}

impl Sql<'_> {
    fn count(&self, table: &str, ids: &str) -> Result<u64> {
        let (column, of_runs) = run_reference(table);
        self.0
            .prepare_cached(&format!(
                "SELECT count(*) FROM {table} WHERE {column} IN ({})",
                finished_of_batch(of_runs)
            ))
            .db()?
            .query_row([ids], |row| row.get::<_, i64>(0))
            .db()
            .map(|n| n as u64)
    }

    fn delete(&self, table: &str, ids: &str) -> Result<u64> {
        let (column, of_runs) = run_reference(table);
        self.0
            .prepare_cached(&format!(
                "DELETE FROM {table} WHERE {column} IN ({})",
                finished_of_batch(of_runs)
            ))
            .db()?
            .execute([ids])
            .db()
            .map(|n| n as u64)
    }
}

impl Tx for Sql<'_> {
    fn put_schedule(&mut self, row: &ScheduleRow) -> Result<()> {
        self.flush_held()?;
        self.0
            .prepare_cached(
                "INSERT INTO schedules (name, agent, input, cron, catch_up, paused, next_at,
                                        created_at, updated_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)
                 ON CONFLICT (name) DO UPDATE SET agent = excluded.agent,
                     input = excluded.input, cron = excluded.cron,
                     catch_up = excluded.catch_up, paused = excluded.paused,
                     next_at = excluded.next_at, updated_at = excluded.updated_at",
            )
            .db()?
            .execute(params![
                row.name,
                row.agent,
                row.input.to_string(),
                row.cron,
                row.missed == Missed::CatchUp,
                row.paused,
                row.next_at,
                row.created_at,
                row.updated_at,
            ])
            .db()?;
        Ok(())
    }

    fn set_schedule_paused(
        &mut self,
        name: &str,
        paused: bool,
        next_at: Option<i64>,
        at: i64,
    ) -> Result<bool> {
        self.flush_held()?;
        let changed = self
            .0
            .prepare_cached(
                "UPDATE schedules SET paused = ?2, next_at = coalesce(?3, next_at),
                                      updated_at = ?4
                 WHERE name = ?1",
            )
            .db()?
            .execute(params![name, paused, next_at, at])
            .db()?;
        Ok(changed == 1)
    }

    fn advance_schedule(&mut self, name: &str, from: i64, to: i64, at: i64) -> Result<bool> {
        self.flush_held()?;
        let changed = self
            .0
            .prepare_cached(
                "UPDATE schedules SET next_at = ?3, updated_at = ?4
                 WHERE name = ?1 AND next_at = ?2 AND paused = 0",
            )
            .db()?
            .execute(params![name, from, to, at])
            .db()?;
        Ok(changed == 1)
    }

    fn delete_schedule(&mut self, name: &str) -> Result<bool> {
        self.flush_held()?;
        let changed = self
            .0
            .prepare_cached("DELETE FROM schedules WHERE name = ?1")
            .db()?
            .execute([name])
            .db()?;
        Ok(changed == 1)
    }

    fn insert_wait(&mut self, run_id: &RunId, wait: &WaitRow) -> Result<()> {
        self.flush_held()?;
        self.0
            .prepare_cached(
                "INSERT INTO waits (run_id, step, agent, kind, key, detail, since, due_at,
                                    ready_at, result)
                 SELECT ?1, ?2, agent, ?3, ?4, ?5, ?6, ?7, ?8, ?9 FROM runs WHERE id = ?1",
            )
            .db()?
            .execute(params![
                run_id.as_str(),
                wait.step,
                wait.kind.as_str(),
                wait.key,
                wait.detail.to_string(),
                wait.since,
                wait.due_at,
                wait.ready_at,
                wait.result.as_ref().map(Value::to_string),
            ])
            .db()?;
        Ok(())
    }

    fn wake_wait(&mut self, run_id: &RunId, step: u32, result: &Value, at: i64) -> Result<bool> {
        self.flush_held()?;
        let changed = self
            .0
            .prepare_cached(
                "UPDATE waits SET result = ?3, ready_at = ?4
                 WHERE run_id = ?1 AND step = ?2 AND result IS NULL",
            )
            .db()?
            .execute(params![run_id.as_str(), step, result.to_string(), at])
            .db()?;
        Ok(changed == 1)
    }

    fn delete_wait(&mut self, run_id: &RunId, step: u32) -> Result<bool> {
        self.flush_held()?;
        let changed = self
            .0
            .prepare_cached("DELETE FROM waits WHERE run_id = ?1 AND step = ?2")
            .db()?
            .execute(params![run_id.as_str(), step])
            .db()?;
        Ok(changed == 1)
    }

    fn parent_wait(&mut self, child: &RunId) -> Result<Option<(RunId, u32)>> {
        self.flush_held()?;
        self.0
            .prepare_cached(
                "SELECT run_id, step FROM waits
                 WHERE key = ?1 AND kind = 'child' AND result IS NULL",
            )
            .db()?
            .query_row([child.as_str()], |row| {
                Ok((RunId::from(row.get::<_, String>(0)?), row.get(1)?))
            })
            .optional()
            .db()
    }

    fn insert_inbox(&mut self, delivery: &Delivery, at: i64) -> Result<bool> {
        self.flush_held()?;
        let inserted = self
            .0
            .prepare_cached(
                "INSERT INTO inbox (run_id, event_id, name, payload, at)
                 VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT DO NOTHING",
            )
            .db()?
            .execute(params![
                delivery.run_id.as_str(),
                delivery.event_id,
                delivery.name,
                delivery.payload.to_string(),
                at
            ])
            .db()?;
        Ok(inserted == 1)
    }

    fn take_inbox(
        &mut self,
        run_id: &RunId,
        name: &str,
        step: u32,
    ) -> Result<Option<(String, Value)>> {
        self.flush_held()?;
        let kept = self
            .0
            .prepare_cached(
                "SELECT event_id, payload FROM inbox
                 WHERE run_id = ?1 AND name = ?2 AND step IS NULL ORDER BY at, event_id LIMIT 1",
            )
            .db()?
            .query_row(params![run_id.as_str(), name], |row| {
                Ok((
                    row.get::<_, String>(0)?,
                    parse_json(row.get(1)?, "event payload")?,
                ))
            })
            .optional()
            .db()?;
        if let Some((event_id, _)) = &kept {
            self.mark_inbox(run_id, event_id, step)?;
        }
        Ok(kept)
    }

    fn mark_inbox(&mut self, run_id: &RunId, event_id: &str, step: u32) -> Result<()> {
        self.flush_held()?;
        self.0
            .prepare_cached("UPDATE inbox SET step = ?3 WHERE run_id = ?1 AND event_id = ?2")
            .db()?
            .execute(params![run_id.as_str(), event_id, step])
            .db()?;
        Ok(())
    }

    fn delete_finished_runs(&mut self, ids: &[RunId]) -> Result<Purged> {
        self.flush_held()?;
        let json = json_ids(ids);
        // Children first: approvals and waits refer to steps, steps and events to runs.
        self.delete("waits", &json)?;
        self.delete("inbox", &json)?;
        let approvals = self.delete("approvals", &json)?;
        let steps = self.delete("steps", &json)?;
        let events = self.delete("events", &json)?;
        let deleted: Vec<String> = self
            .0
            .prepare_cached(&format!(
                "DELETE FROM runs WHERE id IN (SELECT value FROM json_each(?1)) AND {FINISHED}
                 RETURNING id"
            ))
            .db()?
            .query_map([&json], |row| row.get(0))
            .db()?
            .collect::<rusqlite::Result<_>>()
            .db()?;
        Ok(Purged {
            runs: deleted.len() as u64,
            ids: in_order(ids, deleted),
            steps,
            events,
            approvals,
        })
    }

    fn insert_run(&mut self, run: &NewRun<'_>) -> Result<()> {
        self.flush_held()?;
        self.0
            .prepare_cached(
                "INSERT INTO runs (id, agent, input, state, created_at, updated_at, lease_owner,
                                   lease_expires_at, lease_epoch)
                 VALUES (?1, ?2, ?3, 'RUNNING', ?4, ?4, ?5, ?6, ?7)",
            )
            .db()?
            .execute(params![
                run.run_id.as_str(),
                run.agent,
                run.input.to_string(),
                run.at,
                run.lease.map(|(owner, _)| owner),
                run.lease.map(|(_, expires_at)| expires_at),
                if run.lease.is_some() {
                    FIRST_TOKEN as i64
                } else {
                    0
                },
            ])
            .db()?;
        Ok(())
    }

    fn touch_run(
        &mut self,
        run_id: &RunId,
        at: i64,
        owner: &str,
        token: u64,
        unexpired_at: Option<i64>,
    ) -> Result<bool> {
        let conn = self.0;
        let Some(held) = self.held() else {
            return touch(conn, run_id, at, owner, token, unexpired_at);
        };
        let held_touch = HeldTouch {
            run_id: run_id.clone(),
            at,
            owner: owner.to_owned(),
            token,
            unexpired_at,
        };
        if let Some(before) = held.touch(held_touch) {
            // Of another run or lease: sent first, its refusal the group's.
            if !send_touch(conn, &before)? {
                held.refused();
            }
        }
        Ok(true)
    }

    fn update_run(&mut self, run_id: &RunId, m: &RunUpdate<'_>) -> Result<Option<u64>> {
        self.flush_held()?;
        let (guard_owner, guard_token) =
            m.guard.map(|(owner, token)| (owner, token as i64)).unzip();
        self.0
            .prepare_cached(
                "UPDATE runs SET state = ?2, output = ?3, error = ?4, updated_at = ?5,
                                 lease_owner = ?8, lease_expires_at = ?9,
                                 lease_epoch = lease_epoch + (?8 IS NOT NULL)
                 WHERE id = ?1 AND state IN (?6, ?7)
                   AND (?10 IS NULL OR (lease_owner = ?10 AND lease_epoch = ?11))
                 RETURNING lease_epoch",
            )
            .db()?
            .query_row(
                params![
                    run_id.as_str(),
                    m.to.as_str(),
                    m.output,
                    m.error,
                    m.at,
                    m.from[0].as_str(),
                    m.from.get(1).unwrap_or(&m.from[0]).as_str(),
                    m.owner,
                    m.expires_at,
                    guard_owner,
                    guard_token,
                ],
                |row| row.get::<_, i64>(0).map(|epoch| epoch as u64),
            )
            .optional()
            .db()
    }

    fn take_lease(
        &mut self,
        run_id: &RunId,
        at: i64,
        owner: &str,
        expires_at: i64,
        seen: &LeaseRow,
    ) -> Result<bool> {
        self.flush_held()?;
        let changed = self
            .0
            .prepare_cached(
                "UPDATE runs SET lease_owner = ?2, lease_expires_at = ?3, updated_at = ?4,
                                 lease_epoch = lease_epoch + 1
                 WHERE id = ?1 AND state = 'RUNNING'
                   AND lease_owner IS ?5 AND lease_expires_at IS ?6 AND lease_epoch = ?7",
            )
            .db()?
            .execute(params![
                run_id.as_str(),
                owner,
                expires_at,
                at,
                seen.owner,
                seen.expires_at,
                seen.epoch as i64,
            ])
            .db()?;
        Ok(changed == 1)
    }

    fn touch_waiting(&mut self, run_id: &RunId, at: i64) -> Result<bool> {
        self.flush_held()?;
        let changed = self
            .0
            .prepare_cached(
                "UPDATE runs SET updated_at = ?2 WHERE id = ?1 AND state = 'WAITING_FOR_APPROVAL'",
            )
            .db()?
            .execute(params![run_id.as_str(), at])
            .db()?;
        Ok(changed == 1)
    }

    fn insert_step(
        &mut self,
        run_id: &RunId,
        step: u32,
        kind: StepKind,
        state: StepState,
        attempt: u32,
        call: Option<&ToolCall>,
    ) -> Result<()> {
        let held_step = StepInsert {
            run_id: run_id.clone(),
            step,
            kind,
            state,
            attempt,
            call: call.map(call_columns),
            result: None,
            waiting_for: None,
        };
        match self.held() {
            Some(held) => {
                held.insert_step(held_step);
                Ok(())
            }
            None => insert_step_row(self.0, &held_step),
        }
    }

    fn insert_step_row(&mut self, run_id: &RunId, step: &StepRow) -> Result<()> {
        self.flush_held()?;
        let call = step.call.as_ref();
        let row = StepInsert {
            run_id: run_id.clone(),
            step: step.step,
            kind: step.kind,
            state: step.state,
            attempt: step.attempt,
            call: call.map(call_columns),
            result: step.result.as_ref().map(Value::to_string),
            waiting_for: step.waiting_for,
        };
        insert_step_row(self.0, &row)
    }

    fn update_step(&mut self, run_id: &RunId, step: u32, m: &StepUpdate<'_>) -> Result<bool> {
        let result = match (m.result_text, m.result) {
            (Some(text), _) => Some(Cow::Borrowed(text)),
            (None, result) => result.map(|result| Cow::Owned(result.to_string())),
        };
        if let Some(held) = self.held() {
            let moved = HeldMove {
                from: m.from,
                attempt: m.attempt,
                to: m.to,
                starts: m.starts,
                result: result.as_deref(),
                waiting_for: m.waiting_for,
                run_id,
                step,
            };
            // Sent only when not held: a step's move waits for nothing else held.
            if let Some(stood) = held.move_step(moved) {
                return Ok(stood);
            }
        }
        let changed = self
            .0
            .prepare_cached(
                "UPDATE steps SET state = ?5, attempt = attempt + ?6,
                                  result = COALESCE(?7, result), waiting_for = ?8
                 WHERE run_id = ?1 AND step = ?2 AND state = ?3 AND attempt = ?4",
            )
            .db()?
            .execute(params![
                run_id.as_str(),
                step,
                m.from.as_str(),
                m.attempt,
                m.to.as_str(),
                u32::from(m.starts),
                result,
                m.waiting_for.map(ApprovalReason::as_str),
            ])
            .db()?;
        Ok(changed == 1)
    }

    fn reset_step(
        &mut self,
        run_id: &RunId,
        step: u32,
        attempt: u32,
        pending_at: u32,
    ) -> Result<bool> {
        self.flush_held()?;
        let changed = self
            .0
            .prepare_cached(
                "UPDATE steps SET state = 'pending', attempt = ?4
                 WHERE run_id = ?1 AND step = ?2 AND state = 'in_flight' AND attempt = ?3",
            )
            .db()?
            .execute(params![run_id.as_str(), step, attempt, pending_at])
            .db()?;
        Ok(changed == 1)
    }

    fn set_progress(
        &mut self,
        run_id: &RunId,
        step: u32,
        attempt: u32,
        progress: &Value,
    ) -> Result<bool> {
        self.flush_held()?;
        let changed = self
            .0
            .prepare_cached(
                "UPDATE steps SET progress = ?4
                 WHERE run_id = ?1 AND step = ?2 AND state = 'in_flight' AND attempt = ?3",
            )
            .db()?
            .execute(params![
                run_id.as_str(),
                step,
                attempt,
                progress.to_string()
            ])
            .db()?;
        Ok(changed == 1)
    }

    fn interrupt_steps(&mut self, run_id: &RunId) -> Result<Vec<(u32, StepKind, u32)>> {
        self.flush_held()?;
        let rows: Vec<(u32, String, u32)> = self
            .0
            .prepare_cached(
                "UPDATE steps SET state = 'interrupted' WHERE run_id = ?1 AND state = 'in_flight'
                 RETURNING step, kind, attempt",
            )
            .db()?
            .query_map([run_id.as_str()], |row| {
                Ok((row.get(0)?, row.get(1)?, row.get(2)?))
            })
            .db()?
            .collect::<rusqlite::Result<_>>()
            .db()?;
        rows.into_iter()
            .map(|(step, kind, attempt)| Ok((step, StepKind::parse(&kind)?, attempt)))
            .collect()
    }

    fn waiting_call(&mut self, run_id: &RunId, call_id: &str) -> Result<Option<(u32, u32)>> {
        self.flush_held()?;
        self.0
            .prepare_cached(WAITING_CALL)
            .db()?
            .query_row(params![run_id.as_str(), call_id], |row| {
                Ok((row.get(0)?, row.get(1)?))
            })
            .optional()
            .db()
    }

    fn call_exists(&mut self, run_id: &RunId, call_id: &str) -> Result<bool> {
        self.flush_held()?;
        self.0
            .prepare_cached("SELECT 1 FROM steps WHERE run_id = ?1 AND call_id = ?2")
            .db()?
            .exists(params![run_id.as_str(), call_id])
            .db()
    }

    fn insert_approval(
        &mut self,
        step: u32,
        attempt: u32,
        approval: &Approval,
        at: i64,
    ) -> Result<bool> {
        self.flush_held()?;
        let inserted = self
            .0
            .prepare_cached(
                "INSERT INTO approvals (run_id, step, attempt, approved, decided_by, note, at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) ON CONFLICT DO NOTHING",
            )
            .db()?
            .execute(params![
                approval.run_id.as_str(),
                step,
                attempt,
                approval.approved,
                approval.by,
                approval.note,
                at
            ])
            .db()?;
        Ok(inserted == 1)
    }

    fn append_event(
        &mut self,
        run_id: &RunId,
        kind: EventKind,
        at: i64,
        step: Option<u32>,
        payload: &Value,
    ) -> Result<()> {
        self.append_text(run_id, kind, at, step, &payload.to_string())
    }

    fn append_rendered(
        &mut self,
        run_id: &RunId,
        kind: EventKind,
        at: i64,
        step: Option<u32>,
        payload: &Rendered,
    ) -> Result<()> {
        self.append_text(run_id, kind, at, step, payload.text())
    }

    fn savepoint(&mut self, name: &str) -> Result<()> {
        self.flush_held()?;
        self.0
            .prepare_cached(&format!("SAVEPOINT {name}"))
            .db()?
            .execute([])
            .db()?;
        Ok(())
    }

    fn rollback_to(&mut self, name: &str) -> Result<()> {
        // Only the second attempt of a group, which holds nothing, uses savepoints: writes held
        // and the memo's numbers would not be rolled back with the rest.
        debug_assert!(self.1.is_none(), "a savepoint rolled back with writes held");
        self.0
            .prepare_cached(&format!("ROLLBACK TO {name}"))
            .db()?
            .execute([])
            .db()?;
        Ok(())
    }

    fn release_savepoint(&mut self, name: &str) -> Result<()> {
        self.flush_held()?;
        self.0
            .prepare_cached(&format!("RELEASE {name}"))
            .db()?
            .execute([])
            .db()?;
        Ok(())
    }
}

impl Sql<'_> {
    /// Appends an event whose payload is the JSON text `payload`.
    fn append_text(
        &mut self,
        run_id: &RunId,
        kind: EventKind,
        at: i64,
        step: Option<u32>,
        payload: &str,
    ) -> Result<()> {
        let key = match self.1.as_deref().and_then(|keys| keys.get(run_id)) {
            Some(key) => Some(key),
            None => {
                let key = self
                    .0
                    .prepare_cached("SELECT key FROM runs WHERE id = ?1")
                    .db()?
                    .query_row([run_id.as_str()], |row| row.get::<_, i64>(0))
                    .optional()
                    .db()?;
                if let (Some(key), Some(keys)) = (key, self.1.as_deref_mut()) {
                    keys.note(run_id, key);
                }
                key
            }
        };
        // With the memo, the run's next number is known, or read once.
        let next = match (key, self.1.as_deref()) {
            (Some(key), Some(memo)) => match memo.last_event(run_id) {
                Some(last) => Some((key, last + 1)),
                None => {
                    // The run's events still held (appended before the memo forgot it) are
                    // after the last in the table.
                    let stored = last_event(self.0, key)?;
                    Some((key, memo.held.last_event(key).unwrap_or(0).max(stored) + 1))
                }
            },
            _ => None,
        };
        if let Some((key, seq)) = next {
            // Only a group's transaction, as first applied, has the memo, and so holds.
            if let Some(memo) = self.1.as_deref_mut() {
                let event = EventInsert {
                    key,
                    seq,
                    kind,
                    at,
                    step,
                    payload: payload.to_owned(),
                };
                let full = memo.held.append(event, EVENT_ROWS[0]);
                memo.appended(run_id, key, seq);
                if let Some(events) = full {
                    self.send_events(&events)?;
                }
            }
        } else {
            self.0
                .prepare_cached(
                    // A scalar subquery, not INSERT ... SELECT: reading the table being inserted
                    // into would make SQLite stage the row in a temporary table. A run that does
                    // not exist has no key, which the column refuses.
                    "INSERT INTO events (run_key, seq, kind, at, step, payload)
                     VALUES (?1, (SELECT COALESCE(MAX(seq), 0) + 1 FROM events WHERE run_key = ?1),
                             ?2, ?3, ?4, ?5)",
                )
                .db()?
                .execute(params![key, kind.as_str(), at, step, payload])
                .db()?;
        }
        if kind == EventKind::RunFinished
            && let Some(keys) = self.1.as_deref_mut()
        {
            // A finished run moves no more.
            keys.forget(run_id);
        }
        if kind == EventKind::RunReleased {
            // The change feed's: a replica with the run's agent takes it up.
            self.0
                .prepare_cached(
                    "INSERT INTO run_changes (run_id, agent, kind)
                     SELECT id, agent, 'released' FROM runs WHERE id = ?1",
                )
                .db()?
                .execute([run_id.as_str()])
                .db()?;
        }
        Ok(())
    }
}

impl LeaseWrites for Sql<'_> {
    fn renew_leases(
        &mut self,
        owner: &str,
        held: &[(RunId, u64)],
        wall: i64,
        expires_at: i64,
    ) -> Result<Vec<RunId>> {
        self.flush_held()?;
        // A row-value IN over the JSON pairs of id and token: SQLite builds one ephemeral index
        // of them per statement, and finds each run by its key.
        let ids = serde_json::to_string(held).expect("ids serialize");
        self.0
            .prepare_cached(
                "UPDATE runs SET lease_expires_at = ?3
                 WHERE lease_owner = ?1 AND state = 'RUNNING' AND lease_expires_at > ?2
                   AND (id, lease_epoch) IN (SELECT value ->> 0, value ->> 1 FROM json_each(?4))
                 RETURNING id",
            )
            .db()?
            .query_map(params![owner, wall, expires_at, ids], |row| {
                row.get::<_, String>(0)
            })
            .db()?
            .map(|id| id.map(RunId::from))
            .collect::<rusqlite::Result<_>>()
            .db()
    }

    fn release_lease(&mut self, run_id: &RunId, owner: &str, token: u64) -> Result<bool> {
        self.flush_held()?;
        let changed = self
            .0
            .prepare_cached(
                "UPDATE runs SET lease_owner = NULL, lease_expires_at = NULL
                 WHERE id = ?1 AND lease_owner = ?2 AND lease_epoch = ?3",
            )
            .db()?
            .execute(params![run_id.as_str(), owner, token as i64])
            .db()?;
        Ok(changed == 1)
    }
}

// ---------------------------------------------------------------------------------------------
// The change feed (`run_changes`, filled by triggers), read by the watcher

impl crate::store::feed::Feed for Sql<'_> {
    /// The largest rowid: one step down the table's tree.
    fn last_change(&mut self) -> Result<i64> {
        self.flush_held()?;
        last_change(self.0)
    }

    /// A range of the primary key, so a poll reads only what is new.
    fn changes_after(&mut self, cursor: i64) -> Result<Vec<(i64, Change)>> {
        self.flush_held()?;
        changes_after(self.0, cursor)
    }

    fn decided_waiting_runs(&mut self) -> Result<Vec<Change>> {
        self.flush_held()?;
        decided_waiting_runs(self.0)
    }

    fn waits_decided(&mut self, run_id: &RunId) -> Result<bool> {
        self.flush_held()?;
        waits_decided(self.0, run_id)
    }
}

fn last_change(conn: &Connection) -> Result<i64> {
    conn.prepare_cached("SELECT COALESCE(MAX(id), 0) FROM run_changes")
        .db()?
        .query_row([], |row| row.get(0))
        .db()
}

fn changes_after(conn: &Connection, cursor: i64) -> Result<Vec<(i64, Change)>> {
    let rows: Vec<(i64, String, String, String)> = conn
        .prepare_cached("SELECT id, run_id, agent, kind FROM run_changes WHERE id > ?1 ORDER BY id")
        .db()?
        .query_map([cursor], |row| {
            Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?))
        })
        .db()?
        .collect::<rusqlite::Result<_>>()
        .db()?;
    rows.into_iter()
        .map(|(id, run_id, agent, kind)| {
            let kind = match kind.as_str() {
                "decided" => ChangeKind::Decided,
                "cancelled" => ChangeKind::Cancelled,
                "released" => ChangeKind::Released,
                "woken" => ChangeKind::Woken,
                other => return Err(Error::Corrupt(format!("a change of kind {other:?}"))),
            };
            let run_id = RunId::from(run_id);
            Ok((
                id,
                Change {
                    run_id,
                    agent,
                    kind,
                },
            ))
        })
        .collect()
}

/// The runs waiting for approval whose waiting call has its decision recorded (for the
/// attempt it would start: the step's attempts plus one, as `moves::load` reads it). Through
/// `runs_by_state` (or the runs' key) to the waiting runs, the partial index of waiting calls
/// (`steps_waiting_call`: the literal state lets SQLite use it) and the approvals' key: what
/// it reads grows with the runs that wait, not with every run.
const DECIDED_WAITING: &str = "FROM runs
     JOIN steps ON steps.run_id = runs.id AND steps.state = 'waiting'
     JOIN approvals ON approvals.run_id = steps.run_id AND approvals.step = steps.step
                   AND approvals.attempt = steps.attempt + 1
     WHERE runs.state = 'WAITING_FOR_APPROVAL'";

/// The waits woken while nobody watched (their answer, event or child's end came): the
/// `waits_woken` index, not a scan of every wait, which a watch's first poll would otherwise
/// make however many runs wait.
pub(crate) const WOKEN_WAITS: &str = "SELECT run_id, agent FROM waits
     WHERE result IS NOT NULL ORDER BY ready_at";

fn decided_waiting_runs(conn: &Connection) -> Result<Vec<Change>> {
    let mut changes: Vec<Change> = conn
        .prepare_cached(&format!(
            "SELECT runs.id, runs.agent {DECIDED_WAITING} ORDER BY runs.created_at, runs.id"
        ))
        .db()?
        .query_map([], |row| {
            Ok(Change {
                run_id: RunId::from(row.get::<_, String>(0)?),
                agent: row.get(1)?,
                kind: ChangeKind::Decided,
            })
        })
        .db()?
        .collect::<rusqlite::Result<_>>()
        .db()?;
    let woken = conn
        .prepare_cached(WOKEN_WAITS)
        .db()?
        .query_map([], |row| {
            Ok(Change {
                run_id: RunId::from(row.get::<_, String>(0)?),
                agent: row.get(1)?,
                kind: ChangeKind::Woken,
            })
        })
        .db()?
        .collect::<rusqlite::Result<Vec<_>>>()
        .db()?;
    changes.extend(woken);
    Ok(changes)
}

fn waits_decided(conn: &Connection, run_id: &RunId) -> Result<bool> {
    conn.prepare_cached(&format!("SELECT 1 {DECIDED_WAITING} AND runs.id = ?1"))
        .db()?
        .exists([run_id.as_str()])
        .db()
}

/// SQLite's `PRAGMA integrity_check`: `["ok"]`, or the problems found.
pub(crate) fn integrity_check(conn: &Connection) -> Result<Vec<String>> {
    conn.prepare("PRAGMA integrity_check")
        .db()?
        .query_map([], |row| row.get(0))
        .db()?
        .collect::<rusqlite::Result<_>>()
        .db()
}
