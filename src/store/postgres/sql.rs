//! All of the PostgreSQL backend's SQL: the primitives of the moves, the reads, the lease's
//! single-statement writes, and the change feed, each in a transaction of one connection.

use postgres::{Row, types::ToSql};
use serde_json::Value;

use super::{
    held::{self, Held, NewEvent, NewStep, StepMove, Tables, Touch},
    link::{Link, Owned},
};
use crate::{
    error::{Error, Result},
    schedule::Missed,
    store::{
        backend::{
            Change, ChangeKind, LeaseWrites, NewRun, Purged, Reads, RunUpdate, StepUpdate, Tx,
        },
        listing::ListQuery,
        model::{ApprovalRow, LeaseRow, ScheduleRow, StepRow, WaitRow, from_millis},
        moves::FIRST_TOKEN,
    },
    types::{
        Approval, ApprovalReason, Delivery, Event, EventKind, Run, RunId, RunState, StepKind,
        StepState, ToolCall, WaitKind,
    },
};

type Params<'p> = [&'p (dyn ToSql + Sync)];

/// A transaction seen through the backend's primitives. In a move's transaction (`lock`), a
/// read of a run's row locks it until the commit, so that the move writes on what it read
/// while writers of other connections wait; an inspection's reads lock nothing.
pub(super) struct PgTx<'a> {
    pub link: &'a mut dyn Link,
    pub lock: bool,
    /// The last reading `lease_wall` answered (without the tests' shift).
    last_wall: Option<i64>,
    /// The writes held back to be sent together, on a link that pipelines.
    held: Option<Held>,
    /// The runs whose rows the group locked before its first move.
    group: Option<Group>,
    /// The reading the next `lease_wall` answers: the group's, for a run it locked.
    locked_at: Option<i64>,
    /// A key found taken inside a savepoint rolled back is the refusal of what it held only.
    conflicts_refuse: bool,
}

/// The rows a group locked, and what it read as it locked them.
struct Group {
    /// The runs of its moves, sorted.
    runs: Vec<String>,
    /// Those of them that exist (found, or inserted since), sorted; `None` when the lock was
    /// sent without waiting for its answer.
    existing: Option<Vec<String>>,
    /// The server's clock, as read once the rows were held (when the lock was waited for).
    wall: Option<i64>,
}

impl Group {
    /// Whether the group knows `run_id` does not exist, without reading it.
    fn knows_absent(&self, run_id: &str) -> bool {
        let find = |ids: &[String]| ids.binary_search_by(|id| id.as_str().cmp(run_id)).is_ok();
        self.existing
            .as_ref()
            .is_some_and(|existing| find(&self.runs) && !find(existing))
    }

    fn locked(&self, run_id: &str) -> bool {
        self.runs
            .binary_search_by(|id| id.as_str().cmp(run_id))
            .is_ok()
    }
}

impl<'a> PgTx<'a> {
    pub(super) fn new(link: &'a mut dyn Link, lock: bool) -> Self {
        let held = link.pipelines().then(Held::default);
        PgTx {
            link,
            lock,
            last_wall: None,
            held,
            group: None,
            locked_at: None,
            conflicts_refuse: false,
        }
    }

    /// Makes a key found taken inside a savepoint that is then rolled back the refusal of what
    /// the savepoint held, not of the transaction: see
    /// [`forgive_key_taken`](super::conn::forgive_key_taken).
    pub(super) fn conflicts_refuse(mut self, on: bool) -> Self {
        self.conflicts_refuse = on;
        self
    }

    /// Locks the rows of `runs` (sorted, each once) in the order of their ids, as a renewal
    /// locks them, and reads the server's clock once they are held: a move of one of them then
    /// needs no lock and no reading of its own to start a side effect, since nothing can have
    /// moved the run meanwhile and its guard compares with the clock again as it is written.
    pub(super) fn lock_group(&mut self, runs: Vec<String>) -> Result<()> {
        // The clock is read by the outer query, once the inner one has locked every row.
        let rows = self.rows_on(
            Tables::RUNS,
            "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::int8, ids
             FROM (SELECT array_agg(id) AS ids FROM
                       (SELECT id FROM runs WHERE id = ANY($1::text[]) ORDER BY id FOR UPDATE)
                   AS locked) AS found",
            &[&runs],
        )?;
        let wall = get::<i64>(&rows[0], 0)?;
        let mut existing = get::<Option<Vec<String>>>(&rows[0], 1)?.unwrap_or_default();
        existing.sort();
        self.group = Some(Group {
            runs,
            existing: Some(existing),
            wall: Some(wall),
        });
        Ok(())
    }

    /// Locks the rows of `runs` (sorted, each once) as [`PgTx::lock_group`] does, without
    /// waiting for the lock's answer: for a group of moves that need neither the clock nor to
    /// know which runs exist (a guard that compares the lease with the clock reads the
    /// server's own as it runs, after the lock, which was sent first).
    pub(super) fn lock_group_behind(&mut self, runs: Vec<String>) -> Result<()> {
        self.write(
            Tables::NONE,
            "SELECT 1 FROM runs WHERE id = ANY($1::text[]) ORDER BY id FOR UPDATE",
            vec![Box::new(runs.clone()) as Owned],
            None,
        )?;
        self.group = Some(Group {
            runs,
            existing: None,
            wall: None,
        });
        Ok(())
    }

    /// Sends every write held back: the group's moves are all applied.
    pub(super) fn send_held(&mut self) -> Result<()> {
        self.send(Tables::ALL)
    }

    /// Sends the writes held back on `tables`.
    fn send(&mut self, tables: Tables) -> Result<()> {
        let Some(held) = &mut self.held else {
            return Ok(());
        };
        for batch in held.take(tables) {
            let statement = self.link.statement(&batch.sql)?;
            if !self.link.check(&statement, batch.params, batch.counts)? {
                return Err(Error::CommitFailed(
                    "a write held back was refused; the group is applied again".into(),
                ));
            }
        }
        Ok(())
    }
}

/// Owned parameters for [`Link::write`].
macro_rules! owned {
    ($($param:expr),* $(,)?) => {
        vec![$(Box::new($param) as Owned),*]
    };
}

const RUN_COLUMNS: &str = "id, agent, input, state, output, error, created_at, updated_at";

const FINISHED: &str = "state IN ('SUCCEEDED', 'FAILED', 'CANCELLED')";

/// The server's clock in milliseconds since the Unix epoch: read when the statement runs, not
/// when its transaction began.
const SERVER_NOW: &str = "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::int8";

// Each statement first sends the writes held back on the tables it reads or writes (on all of
// them unless it says which).
impl PgTx<'_> {
    fn rows(&mut self, sql: &str, params: &Params<'_>) -> Result<Vec<Row>> {
        self.rows_on(Tables::ALL, sql, params)
    }

    fn rows_on(&mut self, tables: Tables, sql: &str, params: &Params<'_>) -> Result<Vec<Row>> {
        self.send(tables)?;
        let statement = self.link.statement(sql)?;
        self.link.query(&statement, params)
    }

    fn row(&mut self, sql: &str, params: &Params<'_>) -> Result<Option<Row>> {
        self.row_on(Tables::ALL, sql, params)
    }

    fn row_on(&mut self, tables: Tables, sql: &str, params: &Params<'_>) -> Result<Option<Row>> {
        Ok(self.rows_on(tables, sql, params)?.into_iter().next())
    }

    fn execute(&mut self, sql: &str, params: &Params<'_>) -> Result<u64> {
        self.send(Tables::ALL)?;
        let statement = self.link.statement(sql)?;
        self.link.execute(&statement, params)
    }

    /// A write the link may send without waiting: whether it changed `expect` rows. On a link
    /// that pipelines, a write that expects a count is guarded on the server, as held writes
    /// are, so that the lane may send its `COMMIT` before the answer.
    fn write(
        &mut self,
        tables: Tables,
        sql: &str,
        params: Vec<Owned>,
        expect: Option<u64>,
    ) -> Result<bool> {
        self.send(tables)?;
        if let (true, Some(rows)) = (self.link.pipelines(), expect) {
            let batch = held::guarded_write(sql, params, rows);
            let statement = self.link.statement(&batch.sql)?;
            return self.link.check(&statement, batch.params, batch.counts);
        }
        let statement = self.link.statement(sql)?;
        self.link.write(&statement, params, expect)
    }

    fn simple(&mut self, sql: &str) -> Result<()> {
        self.send(Tables::ALL)?;
        self.link.batch(sql)
    }

    fn locking(&self, sql: &str) -> String {
        if self.lock {
            format!("{sql} FOR UPDATE")
        } else {
            sql.to_owned()
        }
    }

    fn count(&mut self, table: &str, ids: &[&str]) -> Result<u64> {
        let sql = format!(
            "SELECT count(*) FROM {table} WHERE run_id IN
                 (SELECT id FROM runs WHERE id = ANY($1::text[]) AND {FINISHED})"
        );
        let row = self.rows(&sql, &[&ids])?;
        Ok(get::<i64>(&row[0], 0)? as u64)
    }

    fn delete(&mut self, table: &str, ids: &[&str]) -> Result<u64> {
        let sql = format!(
            "DELETE FROM {table} WHERE run_id IN
                 (SELECT id FROM runs WHERE id = ANY($1::text[]) AND {FINISHED})"
        );
        self.execute(&sql, &[&ids])
    }
}

fn get<'r, T: postgres::types::FromSql<'r>>(row: &'r Row, index: usize) -> Result<T> {
    row.try_get(index)
        .map_err(|err| Error::Corrupt(format!("column {index}: {err}")))
}

fn run_from_row(row: &Row) -> Result<Run> {
    let state: String = get(row, 3)?;
    Ok(Run {
        id: RunId::from(get::<String>(row, 0)?),
        agent: get(row, 1)?,
        input: get(row, 2)?,
        state: state.parse().map_err(Error::Corrupt)?,
        output: get(row, 4)?,
        error: get(row, 5)?,
        created_at: from_millis(get(row, 6)?),
        updated_at: from_millis(get(row, 7)?),
    })
}

fn event_from_row(run_id: &RunId, row: &Row) -> Result<Event> {
    Ok(Event {
        run_id: run_id.clone(),
        seq: get::<i64>(row, 0)? as u64,
        kind: get::<String>(row, 1)?.parse().map_err(Error::Corrupt)?,
        at: from_millis(get(row, 2)?),
        step: get::<Option<i32>>(row, 3)?.map(|step| step as u32),
        payload: get(row, 4)?,
    })
}

fn unleased_row(row: &Row) -> Result<(RunId, LeaseRow)> {
    let lease = LeaseRow {
        state: RunState::Running,
        owner: get(row, 1)?,
        expires_at: get(row, 2)?,
        epoch: get::<i64>(row, 3)? as u64,
    };
    Ok((RunId::from(get::<String>(row, 0)?), lease))
}

fn ids_of(ids: &[RunId]) -> Vec<&str> {
    ids.iter().map(RunId::as_str).collect()
}

/// Those of `ids` found in `found`, in the order of `ids`.
fn in_order(ids: &[RunId], found: Vec<String>) -> Vec<RunId> {
    let found: std::collections::HashSet<String> = found.into_iter().collect();
    ids.iter()
        .filter(|id| found.contains(id.as_str()))
        .cloned()
        .collect()
}

impl PgTx<'_> {
    /// Stamps a RUNNING run under `owner`'s lease of fencing token `token` as moved at `at`, if
    /// the lease expires after `unexpired_at` and `beyond` milliseconds after the server's
    /// clock as the statement runs (each bound when given).
    fn touch(
        &mut self,
        run_id: &RunId,
        at: i64,
        owner: &str,
        token: u64,
        unexpired_at: Option<i64>,
        beyond: Option<i64>,
    ) -> Result<bool> {
        if let Some(held) = &mut self.held {
            let touch = Touch {
                run_id: run_id.as_str().to_owned(),
                at,
                owner: owner.to_owned(),
                unexpired_at,
                token: token as i64,
                beyond,
            };
            if let Err(touch) = held.touch(touch) {
                self.send(Tables::RUNS)?;
                let held = self.held.as_mut().expect("held writes");
                held.touch(touch)
                    .ok()
                    .expect("no touch held after sending them");
            }
            return Ok(true);
        }
        self.write(
            Tables::RUNS,
            "UPDATE runs SET updated_at = $2
             WHERE id = $1 AND state = 'RUNNING' AND lease_owner = $3 AND lease_epoch = $5
               AND ($4::int8 IS NULL OR lease_expires_at > $4::int8)
               AND ($6::int8 IS NULL OR lease_expires_at >
                    floor(extract(epoch FROM clock_timestamp()) * 1000)::int8 + $6::int8)",
            owned![
                run_id.as_str().to_owned(),
                at,
                owner.to_owned(),
                unexpired_at,
                token as i64,
                beyond,
            ],
            Some(1),
        )
    }
}

impl Reads for PgTx<'_> {
    fn lease_wall(&mut self) -> Result<i64> {
        let wall = match self.locked_at.take() {
            Some(wall) => wall,
            None => get::<i64>(&self.rows_on(Tables::NONE, SERVER_NOW, &[])?[0], 0)?,
        };
        self.last_wall = Some(wall);
        Ok(wall + crate::clock::wall_shift())
    }

    fn lease_row(&mut self, run_id: &RunId) -> Result<Option<LeaseRow>> {
        if self
            .group
            .as_ref()
            .is_some_and(|group| group.knows_absent(run_id.as_str()))
        {
            return Ok(None);
        }
        let sql = self.locking(
            "SELECT state, lease_owner, lease_expires_at, lease_epoch FROM runs WHERE id = $1",
        );
        let Some(row) = self.row_on(Tables::RUNS, &sql, &[&run_id.as_str()])? else {
            return Ok(None);
        };
        Ok(Some(LeaseRow {
            state: get::<String>(&row, 0)?.parse().map_err(Error::Corrupt)?,
            owner: get(&row, 1)?,
            expires_at: get(&row, 2)?,
            epoch: get::<i64>(&row, 3)? as u64,
        }))
    }

    fn run(&mut self, run_id: &RunId) -> Result<Option<Run>> {
        let sql = self.locking(&format!("SELECT {RUN_COLUMNS} FROM runs WHERE id = $1"));
        self.row_on(Tables::RUNS, &sql, &[&run_id.as_str()])?
            .as_ref()
            .map(run_from_row)
            .transpose()
    }

    fn runs(&mut self, state: Option<RunState>) -> Result<Vec<Run>> {
        let rows = match state {
            Some(state) => self.rows(
                &format!("SELECT {RUN_COLUMNS} FROM runs WHERE state = $1 ORDER BY created_at, id"),
                &[&state.as_str()],
            )?,
            None => self.rows(
                &format!("SELECT {RUN_COLUMNS} FROM runs ORDER BY created_at, id"),
                &[],
            )?,
        };
        rows.iter().map(run_from_row).collect()
    }

    fn count_by_state(&mut self) -> Result<Vec<(RunState, u64)>> {
        let rows = self.rows("SELECT state, count(*) FROM runs GROUP BY state", &[])?;
        rows.iter()
            .map(|row| {
                let state = get::<String>(row, 0)?.parse().map_err(Error::Corrupt)?;
                Ok((state, get::<i64>(row, 1)? as u64))
            })
            .collect()
    }

    fn events_after(&mut self, run_id: &RunId, after: u64) -> Result<Vec<Event>> {
        let rows = self.rows(
            "SELECT seq, kind, at, step, payload FROM events
             WHERE run_id = $1 AND seq > $2 ORDER BY seq",
            // Past the largest seq (the moves refuse it): nothing, rather than a wrap round.
            &[&run_id.as_str(), &i64::try_from(after).unwrap_or(i64::MAX)],
        )?;
        rows.iter().map(|row| event_from_row(run_id, row)).collect()
    }

    fn last_event(&mut self, run_id: &RunId) -> Result<Option<Event>> {
        let rows = self.rows(
            "SELECT seq, kind, at, step, payload FROM events
             WHERE run_id = $1 ORDER BY seq DESC LIMIT 1",
            &[&run_id.as_str()],
        )?;
        rows.first()
            .map(|row| event_from_row(run_id, row))
            .transpose()
    }

    #[cfg(feature = "otel")]
    fn first_event(&mut self, run_id: &RunId) -> Result<Option<Event>> {
        let rows = self.rows(
            "SELECT seq, kind, at, step, payload FROM events
             WHERE run_id = $1 ORDER BY seq LIMIT 1",
            &[&run_id.as_str()],
        )?;
        rows.first()
            .map(|row| event_from_row(run_id, row))
            .transpose()
    }

    fn steps(&mut self, run_id: &RunId) -> Result<Vec<StepRow>> {
        let rows = self.rows(
            "SELECT step, kind, state, attempt, call_id, tool, args, result, waiting_for,
                    progress
             FROM steps WHERE run_id = $1 ORDER BY step",
            &[&run_id.as_str()],
        )?;
        rows.iter()
            .map(|row| {
                let call = match get::<Option<String>>(row, 4)? {
                    Some(id) => Some(ToolCall {
                        id,
                        name: get::<Option<String>>(row, 5)?.unwrap_or_default(),
                        args: get::<Option<Value>>(row, 6)?.unwrap_or(Value::Null),
                    }),
                    None => None,
                };
                Ok(StepRow {
                    step: get::<i32>(row, 0)? as u32,
                    kind: StepKind::parse(&get::<String>(row, 1)?)?,
                    state: StepState::parse(&get::<String>(row, 2)?)?,
                    attempt: get::<i32>(row, 3)? as u32,
                    call,
                    result: get(row, 7)?,
                    waiting_for: match get::<Option<String>>(row, 8)?.as_deref() {
                        Some("policy") => Some(ApprovalReason::Policy),
                        Some("reconcile") => Some(ApprovalReason::Reconcile),
                        _ => None,
                    },
                    progress: get(row, 9)?,
                })
            })
            .collect()
    }

    fn approval(&mut self, run_id: &RunId, step: u32, attempt: u32) -> Result<Option<ApprovalRow>> {
        let row = self.row(
            "SELECT approved, decided_by, note FROM approvals
             WHERE run_id = $1 AND step = $2 AND attempt = $3",
            &[&run_id.as_str(), &(step as i32), &(attempt as i32)],
        )?;
        row.map(|row| {
            Ok(ApprovalRow {
                approved: get(&row, 0)?,
                by: get(&row, 1)?,
                note: get(&row, 2)?,
            })
        })
        .transpose()
    }

    fn unleased_runs(&mut self, wall: i64) -> Result<Vec<(RunId, LeaseRow)>> {
        let rows = self.rows(
            "SELECT id, lease_owner, lease_expires_at, lease_epoch FROM runs
             WHERE state = 'RUNNING' AND (lease_owner IS NULL OR lease_expires_at <= $1)
             ORDER BY id",
            &[&wall],
        )?;
        rows.iter().map(unleased_row).collect()
    }

    fn recoverable_runs(
        &mut self,
        wall: i64,
        agents: &[&str],
        executed: bool,
        limit: usize,
    ) -> Result<Vec<(RunId, LeaseRow)>> {
        let rows = self.rows(
            "SELECT id, lease_owner, lease_expires_at, lease_epoch FROM runs
             WHERE state = 'RUNNING' AND (lease_owner IS NULL OR lease_expires_at <= $1)
               AND agent = ANY($2::text[]) AND (lease_epoch > 0) = $3
             ORDER BY created_at, id
             LIMIT $4",
            &[&wall, &agents, &executed, &(limit as i64)],
        )?;
        rows.iter().map(unleased_row).collect()
    }

    fn list_runs(&mut self, query: &ListQuery<'_>) -> Result<Vec<Run>> {
        let (after_at, after_id) = match &query.after {
            Some((at, id)) => (*at, id.as_str().to_owned()),
            None => (i64::MIN, String::new()),
        };
        let since = query.since.unwrap_or(i64::MIN);
        let limit = query.limit as i64;
        let mut sql = format!(
            "SELECT {RUN_COLUMNS} FROM runs
             WHERE (created_at, id) > ($1::int8, $2::text) AND created_at >= $3::int8"
        );
        let agent = query.agent;
        let state = query.state.map(RunState::as_str);
        let mut params: Vec<&(dyn ToSql + Sync)> = vec![&after_at, &after_id, &since, &limit];
        if let Some(agent) = &agent {
            params.push(agent);
            sql.push_str(&format!(" AND agent = ${}", params.len()));
        }
        if let Some(state) = &state {
            params.push(state);
            sql.push_str(&format!(" AND state = ${}", params.len()));
        }
        sql.push_str(" ORDER BY created_at, id LIMIT $4");
        let rows = self.rows(&sql, &params)?;
        rows.iter().map(run_from_row).collect()
    }

    fn finished_runs(
        &mut self,
        before: i64,
        after: Option<(i64, &RunId)>,
        limit: usize,
    ) -> Result<Vec<(RunId, i64)>> {
        let (after_at, after_id) = after.map_or((i64::MIN, ""), |(at, id)| (at, id.as_str()));
        let rows = self.rows(
            &format!(
                "SELECT id, updated_at FROM runs
                 WHERE {FINISHED} AND updated_at < $1 AND (updated_at, id) > ($2::int8, $3::text)
                 ORDER BY updated_at, id LIMIT $4"
            ),
            &[&before, &after_at, &after_id, &(limit as i64)],
        )?;
        rows.iter()
            .map(|row| Ok((RunId::from(get::<String>(row, 0)?), get(row, 1)?)))
            .collect()
    }

    fn purge_counts(&mut self, ids: &[RunId]) -> Result<Purged> {
        let names = ids_of(ids);
        let rows = self.rows(
            &format!("SELECT id FROM runs WHERE id = ANY($1::text[]) AND {FINISHED}"),
            &[&names],
        )?;
        let found: Vec<String> = rows.iter().map(|row| get(row, 0)).collect::<Result<_>>()?;
        Ok(Purged {
            runs: found.len() as u64,
            ids: in_order(ids, found),
            steps: self.count("steps", &names)?,
            events: self.count("events", &names)?,
            approvals: self.count("approvals", &names)?,
        })
    }

    fn wait(&mut self, run_id: &RunId) -> Result<Option<WaitRow>> {
        let rows = self.rows(
            &format!("SELECT {WAIT_COLUMNS} {WAIT_FROM} WHERE waits.run_id = $1"),
            &[&run_id.as_str()],
        )?;
        rows.first().map(|row| wait_from_row(row, 0)).transpose()
    }

    fn ready_waits(
        &mut self,
        until: i64,
        agents: &[&str],
        after: Option<(i64, &RunId)>,
        limit: usize,
    ) -> Result<Vec<(RunId, i64)>> {
        // A range of waits_ready per agent, up to `until`: the waits not due cost nothing.
        let agents: Vec<&str> = agents.to_vec();
        let (since, id) = after.map_or((i64::MIN, ""), |(since, id)| (since, id.as_str()));
        let rows = self.rows(
            "SELECT found.run_id, found.ready_at FROM unnest($4::text[]) AS a(name)
             CROSS JOIN LATERAL (SELECT run_id, ready_at FROM waits
                                 WHERE agent = a.name AND ready_at IS NOT NULL
                                   AND ready_at <= $1 AND (ready_at, run_id) > ($2::int8, $3::text)
                                 ORDER BY ready_at, run_id LIMIT $5) AS found
             ORDER BY found.ready_at, found.run_id LIMIT $5",
            &[&until, &since, &id, &agents, &(limit as i64)],
        )?;
        rows.iter()
            .map(|row| Ok((RunId::from(get::<String>(row, 0)?), get(row, 1)?)))
            .collect()
    }

    fn next_ready_at(&mut self, after: i64, agents: &[&str]) -> Result<Option<i64>> {
        let agents: Vec<&str> = agents.to_vec();
        let rows = self.rows(
            "SELECT min(next) FROM unnest($2::text[]) AS a(name)
             CROSS JOIN LATERAL (SELECT min(ready_at) AS next FROM waits
                                 WHERE agent = a.name AND ready_at IS NOT NULL
                                   AND ready_at > $1) AS found",
            &[&after, &agents],
        )?;
        rows.first().map_or(Ok(None), |row| get(row, 0))
    }

    fn list_waits(
        &mut self,
        kind: Option<WaitKind>,
        after: Option<(i64, &RunId)>,
        limit: usize,
    ) -> Result<Vec<(RunId, WaitRow)>> {
        let (since, id) = after.map_or((i64::MIN, ""), |(since, id)| (since, id.as_str()));
        let rows = self.rows(
            &format!(
                "SELECT {WAIT_COLUMNS}, waits.run_id {WAIT_FROM}
                 WHERE (waits.since, waits.run_id) > ($1::int8, $2::text)
                   AND ($3::text IS NULL OR waits.kind = $3)
                 ORDER BY waits.since, waits.run_id LIMIT $4"
            ),
            &[&since, &id, &kind.map(WaitKind::as_str), &(limit as i64)],
        )?;
        rows.iter()
            .map(|row| Ok((RunId::from(get::<String>(row, 9)?), wait_from_row(row, 0)?)))
            .collect()
    }

    fn schedule(&mut self, name: &str) -> Result<Option<ScheduleRow>> {
        let sql = self.locking(&format!(
            "SELECT {SCHEDULE_COLUMNS} FROM schedules WHERE name = $1"
        ));
        self.row(&sql, &[&name])?
            .as_ref()
            .map(schedule_from_row)
            .transpose()
    }

    fn schedules(&mut self) -> Result<Vec<ScheduleRow>> {
        let rows = self.rows(
            &format!("SELECT {SCHEDULE_COLUMNS} FROM schedules ORDER BY name"),
            &[],
        )?;
        rows.iter().map(schedule_from_row).collect()
    }

    fn due_schedules(
        &mut self,
        until: i64,
        agents: &[&str],
        limit: usize,
    ) -> Result<Vec<ScheduleRow>> {
        // A range of schedules_due per agent, up to `until`: the schedules not due, and those
        // of other agents, cost nothing.
        let agents: Vec<&str> = agents.to_vec();
        let rows = self.rows(
            &format!(
                "SELECT {SCHEDULE_COLUMNS} FROM unnest($2::text[]) AS a(wanted)
                 CROSS JOIN LATERAL (SELECT * FROM schedules
                                     WHERE agent = a.wanted AND NOT paused AND next_at <= $1
                                     ORDER BY next_at LIMIT $3) AS found
                 ORDER BY next_at LIMIT $3"
            ),
            &[&until, &agents, &(limit as i64)],
        )?;
        rows.iter().map(schedule_from_row).collect()
    }

    fn next_scheduled_at(&mut self, after: i64, agents: &[&str]) -> Result<Option<i64>> {
        let agents: Vec<&str> = agents.to_vec();
        let rows = self.rows(
            "SELECT min(next) FROM unnest($2::text[]) AS a(name)
             CROSS JOIN LATERAL (SELECT min(next_at) AS next FROM schedules
                                 WHERE agent = a.name AND NOT paused AND next_at > $1) AS found",
            &[&after, &agents],
        )?;
        rows.first().map_or(Ok(None), |row| get(row, 0))
    }
}

/// A schedule's columns, as [`schedule_from_row`] reads them.
const SCHEDULE_COLUMNS: &str =
    "name, agent, input, cron, catch_up, paused, next_at, created_at, updated_at";

fn schedule_from_row(row: &Row) -> Result<ScheduleRow> {
    Ok(ScheduleRow {
        name: get(row, 0)?,
        agent: get(row, 1)?,
        input: get(row, 2)?,
        cron: get(row, 3)?,
        missed: if get(row, 4)? {
            Missed::CatchUp
        } else {
            Missed::Skip
        },
        paused: get(row, 5)?,
        next_at: get(row, 6)?,
        created_at: get(row, 7)?,
        updated_at: get(row, 8)?,
    })
}

/// A wait's columns, with its call's id, as [`wait_from_row`] reads them.
const WAIT_COLUMNS: &str = "waits.step, steps.call_id, waits.kind, waits.key, waits.detail,
     waits.since, waits.due_at, waits.ready_at, waits.result";

const WAIT_FROM: &str = "FROM waits
     JOIN steps ON steps.run_id = waits.run_id AND steps.step = waits.step";

/// A wait from [`WAIT_COLUMNS`], starting at column `at`.
fn wait_from_row(row: &Row, at: usize) -> Result<WaitRow> {
    Ok(WaitRow {
        step: get::<i32>(row, at)? as u32,
        call_id: get::<Option<String>>(row, at + 1)?.unwrap_or_default(),
        kind: WaitKind::parse(&get::<String>(row, at + 2)?)?,
        key: get(row, at + 3)?,
        detail: get(row, at + 4)?,
        since: get(row, at + 5)?,
        due_at: get(row, at + 6)?,
        ready_at: get(row, at + 7)?,
        result: get(row, at + 8)?,
    })
}

impl Tx for PgTx<'_> {
    fn put_schedule(&mut self, row: &ScheduleRow) -> Result<()> {
        self.execute(
            "INSERT INTO schedules (name, agent, input, cron, catch_up, paused, next_at,
                                    created_at, updated_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
             ON CONFLICT (name) DO UPDATE SET agent = excluded.agent,
                 input = excluded.input, cron = excluded.cron, catch_up = excluded.catch_up,
                 paused = excluded.paused, next_at = excluded.next_at,
                 updated_at = excluded.updated_at",
            &[
                &row.name,
                &row.agent,
                &row.input,
                &row.cron,
                &(row.missed == Missed::CatchUp),
                &row.paused,
                &row.next_at,
                &row.created_at,
                &row.updated_at,
            ],
        )?;
        Ok(())
    }

    fn set_schedule_paused(
        &mut self,
        name: &str,
        paused: bool,
        next_at: Option<i64>,
        at: i64,
    ) -> Result<bool> {
        let changed = self.execute(
            "UPDATE schedules SET paused = $2, next_at = coalesce($3, next_at), updated_at = $4
             WHERE name = $1",
            &[&name, &paused, &next_at, &at],
        )?;
        Ok(changed == 1)
    }

    fn advance_schedule(&mut self, name: &str, from: i64, to: i64, at: i64) -> Result<bool> {
        let changed = self.execute(
            "UPDATE schedules SET next_at = $3, updated_at = $4
             WHERE name = $1 AND next_at = $2 AND NOT paused",
            &[&name, &from, &to, &at],
        )?;
        Ok(changed == 1)
    }

    fn delete_schedule(&mut self, name: &str) -> Result<bool> {
        Ok(self.execute("DELETE FROM schedules WHERE name = $1", &[&name])? == 1)
    }

    fn lock_run(&mut self, run_id: &RunId) -> Result<()> {
        if let Some(group) = &self.group
            && group.locked(run_id.as_str())
        {
            self.locked_at = group.wall;
            return Ok(());
        }
        // Nothing waits for it: the clock is read after it, and the touch that follows
        // refuses a run that is not there. It reads nothing, so the writes held on the runs
        // stay held (a run locked so, outside its group's lock, may then be locked before a
        // held touch of a run whose id sorts first: a deadlock that order could meet is
        // applied again as a conflict).
        self.write(
            Tables::NONE,
            "SELECT 1 FROM runs WHERE id = $1 FOR UPDATE",
            owned![run_id.as_str().to_owned()],
            None,
        )?;
        Ok(())
    }

    fn insert_run(&mut self, run: &NewRun<'_>) -> Result<()> {
        if let Some(existing) = self
            .group
            .as_mut()
            .and_then(|group| group.existing.as_mut())
            && let Err(at) = existing.binary_search_by(|id| id.as_str().cmp(run.run_id.as_str()))
        {
            existing.insert(at, run.run_id.as_str().to_owned());
        }
        let token: i64 = if run.lease.is_some() {
            FIRST_TOKEN as i64
        } else {
            0
        };
        self.write(
            Tables::RUNS,
            "INSERT INTO runs (id, agent, input, state, created_at, updated_at, lease_owner,
                               lease_expires_at, lease_epoch)
             VALUES ($1, $2, $3, 'RUNNING', $4, $4, $5, $6, $7)",
            owned![
                run.run_id.as_str().to_owned(),
                run.agent.to_owned(),
                run.input.clone(),
                run.at,
                run.lease.map(|(owner, _)| owner.to_owned()),
                run.lease.map(|(_, expires_at)| expires_at),
                token,
            ],
            Some(1),
        )?;
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
        // The lease must outlast the server's clock as the statement runs, plus what the move
        // asked beyond its last reading of it: a process that stalled between that reading
        // and this statement is judged by the time after the stall.
        let beyond = unexpired_at
            .zip(self.last_wall)
            .map(|(unexpired_at, wall)| unexpired_at - wall);
        self.touch(run_id, at, owner, token, unexpired_at, beyond)
    }

    fn touch_run_with_margin(
        &mut self,
        run_id: &RunId,
        at: i64,
        owner: &str,
        token: u64,
        margin: i64,
    ) -> Result<bool> {
        let wall_read = self
            .group
            .as_ref()
            .is_some_and(|group| group.wall.is_some() && group.locked(run_id.as_str()));
        if wall_read || self.held.is_none() {
            self.lock_run(run_id)?;
            let unexpired_at = self.lease_wall()? + margin;
            return self.touch_run(run_id, at, owner, token, Some(unexpired_at));
        }
        // On a lane, with no reading of the clock at hand: the run's row is locked by a
        // statement sent before the touch (the group's lock, or its own), and the touch's guard
        // compares the lease with the server's clock as it runs, once that lock is held, so
        // that nothing is waited for before the commit.
        self.lock_run(run_id)?;
        let beyond = margin + crate::clock::wall_shift();
        self.touch(run_id, at, owner, token, None, Some(beyond))
    }

    fn update_run(&mut self, run_id: &RunId, m: &RunUpdate<'_>) -> Result<Option<u64>> {
        const UPDATE: &str = "UPDATE runs SET state = $2, output = $3, error = $4, updated_at = $5,
                             lease_owner = $8::text, lease_expires_at = $9::int8,
                             lease_epoch = lease_epoch
                                 + CASE WHEN $8::text IS NULL THEN 0 ELSE 1 END
             WHERE id = $1 AND state IN ($6, $7)
               AND ($10::text IS NULL OR (lease_owner = $10::text AND lease_epoch = $11::int8))
             RETURNING lease_epoch";
        let (guard_owner, guard_token) =
            m.guard.map(|(owner, token)| (owner, token as i64)).unzip();
        let from = (
            m.from[0].as_str(),
            m.from.get(1).unwrap_or(&m.from[0]).as_str(),
        );
        if let (Some(_), None, Some((_, token))) = (&self.held, m.owner, m.guard) {
            // Under its own lease and taking none, the move leaves the token as it is: the
            // answer is known, and nothing waits for it.
            let params = owned![
                run_id.as_str().to_owned(),
                m.to.as_str(),
                m.output.map(str::to_owned),
                m.error.map(str::to_owned),
                m.at,
                from.0,
                from.1,
                None::<String>,
                m.expires_at,
                guard_owner.map(str::to_owned),
                guard_token,
            ];
            self.write(Tables::RUNS, UPDATE, params, Some(1))?;
            return Ok(Some(token));
        }
        let row = self.row_on(
            Tables::RUNS,
            UPDATE,
            &[
                &run_id.as_str(),
                &m.to.as_str(),
                &m.output,
                &m.error,
                &m.at,
                &from.0,
                &from.1,
                &m.owner,
                &m.expires_at,
                &guard_owner,
                &guard_token,
            ],
        )?;
        row.map(|row| Ok(get::<i64>(&row, 0)? as u64)).transpose()
    }

    fn take_lease(
        &mut self,
        run_id: &RunId,
        at: i64,
        owner: &str,
        expires_at: i64,
        seen: &LeaseRow,
    ) -> Result<bool> {
        let changed = self.execute(
            "UPDATE runs SET lease_owner = $2, lease_expires_at = $3, updated_at = $4,
                             lease_epoch = lease_epoch + 1
             WHERE id = $1 AND state = 'RUNNING'
               AND lease_owner IS NOT DISTINCT FROM $5::text
               AND lease_expires_at IS NOT DISTINCT FROM $6::int8 AND lease_epoch = $7",
            &[
                &run_id.as_str(),
                &owner,
                &expires_at,
                &at,
                &seen.owner,
                &seen.expires_at,
                &(seen.epoch as i64),
            ],
        )?;
        Ok(changed == 1)
    }

    fn touch_waiting(&mut self, run_id: &RunId, at: i64) -> Result<bool> {
        let changed = self.execute(
            "UPDATE runs SET updated_at = $2 WHERE id = $1 AND state = 'WAITING_FOR_APPROVAL'",
            &[&run_id.as_str(), &at],
        )?;
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
        if let Some(held) = &mut self.held {
            held.insert_step(NewStep {
                run_id: run_id.as_str().to_owned(),
                step: step as i32,
                kind: kind.as_str(),
                state: state.as_str(),
                attempt: attempt as i32,
                call_id: call.map(|call| call.id.clone()),
                tool: call.map(|call| call.name.clone()),
                args: call.map(|call| call.args.clone()),
                result: None,
                waiting_for: None,
            });
            return Ok(());
        }
        self.write(
            Tables::STEPS,
            "INSERT INTO steps (run_id, step, kind, state, attempt, call_id, tool, args)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            owned![
                run_id.as_str().to_owned(),
                step as i32,
                kind.as_str(),
                state.as_str(),
                attempt as i32,
                call.map(|call| call.id.clone()),
                call.map(|call| call.name.clone()),
                call.map(|call| call.args.clone()),
            ],
            None,
        )?;
        Ok(())
    }

    fn insert_step_row(&mut self, run_id: &RunId, step: &StepRow) -> Result<()> {
        let call = step.call.as_ref();
        self.execute(
            "INSERT INTO steps (run_id, step, kind, state, attempt, call_id, tool, args, result,
                                waiting_for)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
            &[
                &run_id.as_str(),
                &(step.step as i32),
                &step.kind.as_str(),
                &step.state.as_str(),
                &(step.attempt as i32),
                &call.map(|call| call.id.as_str()),
                &call.map(|call| call.name.as_str()),
                &call.map(|call| &call.args),
                &step.result.as_ref(),
                &step.waiting_for.map(ApprovalReason::as_str),
            ],
        )?;
        Ok(())
    }

    fn update_step(&mut self, run_id: &RunId, step: u32, m: &StepUpdate<'_>) -> Result<bool> {
        if let Some(held) = &self.held {
            if held.moves_step(run_id.as_str(), step as i32) {
                self.send(Tables::STEPS)?;
            }
            let moved = StepMove {
                run_id: run_id.as_str().to_owned(),
                step: step as i32,
                from: m.from.as_str(),
                attempt: m.attempt as i32,
                to: m.to.as_str(),
                starts: i32::from(m.starts),
                result: m.result.cloned(),
                waiting_for: m.waiting_for.map(ApprovalReason::as_str),
            };
            self.held.as_mut().expect("held writes").move_step(moved);
            return Ok(true);
        }
        self.write(
            Tables::STEPS,
            "UPDATE steps SET state = $5, attempt = attempt + $6,
                              result = COALESCE($7, result), waiting_for = $8
             WHERE run_id = $1 AND step = $2 AND state = $3 AND attempt = $4",
            owned![
                run_id.as_str().to_owned(),
                step as i32,
                m.from.as_str(),
                m.attempt as i32,
                m.to.as_str(),
                i32::from(m.starts),
                m.result.cloned(),
                m.waiting_for.map(ApprovalReason::as_str),
            ],
            Some(1),
        )
    }

    fn reset_step(
        &mut self,
        run_id: &RunId,
        step: u32,
        attempt: u32,
        pending_at: u32,
    ) -> Result<bool> {
        self.write(
            Tables::STEPS,
            "UPDATE steps SET state = 'pending', attempt = $4
             WHERE run_id = $1 AND step = $2 AND state = 'in_flight' AND attempt = $3",
            owned![
                run_id.as_str().to_owned(),
                step as i32,
                attempt as i32,
                pending_at as i32,
            ],
            Some(1),
        )
    }

    fn set_progress(
        &mut self,
        run_id: &RunId,
        step: u32,
        attempt: u32,
        progress: &Value,
    ) -> Result<bool> {
        self.write(
            Tables::STEPS,
            "UPDATE steps SET progress = $4
             WHERE run_id = $1 AND step = $2 AND state = 'in_flight' AND attempt = $3",
            owned![
                run_id.as_str().to_owned(),
                step as i32,
                attempt as i32,
                progress.clone(),
            ],
            Some(1),
        )
    }

    fn interrupt_steps(&mut self, run_id: &RunId) -> Result<Vec<(u32, StepKind, u32)>> {
        let rows = self.rows(
            "UPDATE steps SET state = 'interrupted' WHERE run_id = $1 AND state = 'in_flight'
             RETURNING step, kind, attempt",
            &[&run_id.as_str()],
        )?;
        let mut interrupted: Vec<(u32, StepKind, u32)> = rows
            .iter()
            .map(|row| {
                Ok((
                    get::<i32>(row, 0)? as u32,
                    StepKind::parse(&get::<String>(row, 1)?)?,
                    get::<i32>(row, 2)? as u32,
                ))
            })
            .collect::<Result<_>>()?;
        // RETURNING gives no order: the moves take the steps in theirs.
        interrupted.sort_by_key(|(step, _, _)| *step);
        Ok(interrupted)
    }

    fn waiting_call(&mut self, run_id: &RunId, call_id: &str) -> Result<Option<(u32, u32)>> {
        let row = self.row(
            "SELECT step, attempt FROM steps
             WHERE run_id = $1 AND call_id = $2 AND state = 'waiting'",
            &[&run_id.as_str(), &call_id],
        )?;
        row.map(|row| Ok((get::<i32>(&row, 0)? as u32, get::<i32>(&row, 1)? as u32)))
            .transpose()
    }

    fn call_exists(&mut self, run_id: &RunId, call_id: &str) -> Result<bool> {
        let row = self.row(
            "SELECT 1 FROM steps WHERE run_id = $1 AND call_id = $2 LIMIT 1",
            &[&run_id.as_str(), &call_id],
        )?;
        Ok(row.is_some())
    }

    fn insert_approval(
        &mut self,
        step: u32,
        attempt: u32,
        approval: &Approval,
        at: i64,
    ) -> Result<bool> {
        let inserted = self.execute(
            "INSERT INTO approvals (run_id, step, attempt, approved, decided_by, note, at)
             VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT DO NOTHING",
            &[
                &approval.run_id.as_str(),
                &(step as i32),
                &(attempt as i32),
                &approval.approved,
                &approval.by,
                &approval.note,
                &at,
            ],
        )?;
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
        if let Some(held) = &mut self.held {
            held.append(NewEvent {
                run_id: run_id.as_str().to_owned(),
                kind: kind.as_str(),
                at,
                step: step.map(|step| step as i32),
                payload: payload.clone(),
            });
            return Ok(());
        }
        self.write(
            Tables::EVENTS,
            "INSERT INTO events (run_id, seq, kind, at, step, payload)
             VALUES ($1, (SELECT COALESCE(MAX(seq), 0) + 1 FROM events WHERE run_id = $1),
                     $2, $3, $4, $5)",
            owned![
                run_id.as_str().to_owned(),
                kind.as_str(),
                at,
                step.map(|step| step as i32),
                payload.clone(),
            ],
            None,
        )?;
        Ok(())
    }

    fn insert_wait(&mut self, run_id: &RunId, wait: &WaitRow) -> Result<()> {
        self.execute(
            "INSERT INTO waits (run_id, step, agent, kind, key, detail, since, due_at, ready_at,
                                result)
             SELECT $1, $2, agent, $3, $4, $5, $6, $7, $8, $9 FROM runs WHERE id = $1",
            &[
                &run_id.as_str(),
                &(wait.step as i32),
                &wait.kind.as_str(),
                &wait.key,
                &wait.detail,
                &wait.since,
                &wait.due_at,
                &wait.ready_at,
                &wait.result,
            ],
        )?;
        Ok(())
    }

    fn wake_wait(&mut self, run_id: &RunId, step: u32, result: &Value, at: i64) -> Result<bool> {
        let changed = self.execute(
            "UPDATE waits SET result = $3, ready_at = $4
             WHERE run_id = $1 AND step = $2 AND result IS NULL",
            &[&run_id.as_str(), &(step as i32), result, &at],
        )?;
        Ok(changed == 1)
    }

    fn delete_wait(&mut self, run_id: &RunId, step: u32) -> Result<bool> {
        let changed = self.execute(
            "DELETE FROM waits WHERE run_id = $1 AND step = $2",
            &[&run_id.as_str(), &(step as i32)],
        )?;
        Ok(changed == 1)
    }

    fn parent_wait(&mut self, child: &RunId) -> Result<Option<(RunId, u32)>> {
        let row = self.row(
            "SELECT run_id, step FROM waits WHERE key = $1 AND kind = 'child' AND result IS NULL",
            &[&child.as_str()],
        )?;
        row.map(|row| {
            Ok((
                RunId::from(get::<String>(&row, 0)?),
                get::<i32>(&row, 1)? as u32,
            ))
        })
        .transpose()
    }

    fn insert_inbox(&mut self, delivery: &Delivery, at: i64) -> Result<bool> {
        let inserted = self.execute(
            "INSERT INTO inbox (run_id, event_id, name, payload, at)
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
            &[
                &delivery.run_id.as_str(),
                &delivery.event_id,
                &delivery.name,
                &delivery.payload,
                &at,
            ],
        )?;
        Ok(inserted == 1)
    }

    fn take_inbox(
        &mut self,
        run_id: &RunId,
        name: &str,
        step: u32,
    ) -> Result<Option<(String, Value)>> {
        let row = self.row(
            "UPDATE inbox SET step = $3
             WHERE (run_id, event_id) = (SELECT run_id, event_id FROM inbox
                                         WHERE run_id = $1 AND name = $2 AND step IS NULL
                                         ORDER BY at, event_id LIMIT 1)
             RETURNING event_id, payload",
            &[&run_id.as_str(), &name, &(step as i32)],
        )?;
        row.map(|row| Ok((get(&row, 0)?, get(&row, 1)?)))
            .transpose()
    }

    fn mark_inbox(&mut self, run_id: &RunId, event_id: &str, step: u32) -> Result<()> {
        self.execute(
            "UPDATE inbox SET step = $3 WHERE run_id = $1 AND event_id = $2",
            &[&run_id.as_str(), &event_id, &(step as i32)],
        )?;
        Ok(())
    }

    fn delete_finished_runs(&mut self, ids: &[RunId]) -> Result<Purged> {
        let names = ids_of(ids);
        // Children first: approvals and waits refer to steps, steps and events to runs.
        self.delete("waits", &names)?;
        self.delete("inbox", &names)?;
        let approvals = self.delete("approvals", &names)?;
        let steps = self.delete("steps", &names)?;
        let events = self.delete("events", &names)?;
        let rows = self.rows(
            &format!("DELETE FROM runs WHERE id = ANY($1::text[]) AND {FINISHED} RETURNING id"),
            &[&names],
        )?;
        let deleted: Vec<String> = rows.iter().map(|row| get(row, 0)).collect::<Result<_>>()?;
        Ok(Purged {
            runs: deleted.len() as u64,
            ids: in_order(ids, deleted),
            steps,
            events,
            approvals,
        })
    }

    fn savepoint(&mut self, name: &str) -> Result<()> {
        self.simple(&format!("SAVEPOINT {name}"))
    }

    fn rollback_to(&mut self, name: &str) -> Result<()> {
        self.simple(&format!("ROLLBACK TO SAVEPOINT {name}"))?;
        if self.conflicts_refuse {
            super::conn::forgive_key_taken();
        }
        Ok(())
    }

    fn release_savepoint(&mut self, name: &str) -> Result<()> {
        self.simple(&format!("RELEASE SAVEPOINT {name}"))
    }
}

impl LeaseWrites for PgTx<'_> {
    fn renew_leases(
        &mut self,
        owner: &str,
        held: &[(RunId, u64)],
        wall: i64,
        expires_at: i64,
    ) -> Result<Vec<RunId>> {
        let ids: Vec<&str> = held.iter().map(|(id, _)| id.as_str()).collect();
        let tokens: Vec<i64> = held.iter().map(|(_, token)| *token as i64).collect();
        let rows = self.rows(
            // The rows are locked in the order of their ids, as a writer's group locks them.
            "UPDATE runs SET lease_expires_at = $3
             WHERE id IN (SELECT id FROM runs
                          WHERE lease_owner = $1 AND state = 'RUNNING' AND lease_expires_at > $2
                            AND (id, lease_epoch) IN
                                (SELECT * FROM unnest($4::text[], $5::int8[]))
                          ORDER BY id FOR UPDATE)
               AND lease_owner = $1 AND state = 'RUNNING' AND lease_expires_at > $2
             RETURNING id",
            &[&owner, &wall, &expires_at, &ids, &tokens],
        )?;
        rows.iter()
            .map(|row| Ok(RunId::from(get::<String>(row, 0)?)))
            .collect()
    }

    fn release_lease(&mut self, run_id: &RunId, owner: &str, token: u64) -> Result<bool> {
        let changed = self.execute(
            "UPDATE runs SET lease_owner = NULL, lease_expires_at = NULL
             WHERE id = $1 AND lease_owner = $2 AND lease_epoch = $3",
            &[&run_id.as_str(), &owner, &(token as i64)],
        )?;
        Ok(changed == 1)
    }
}

// ---------------------------------------------------------------------------------------------
// The change feed (`run_changes`, filled by triggers), read by the watcher

/// The runs waiting for approval whose waiting call has its decision recorded (for the
/// attempt it would start: the step's attempts plus one, as `moves::load` reads it).
const DECIDED_WAITING: &str = "FROM runs
     JOIN steps ON steps.run_id = runs.id AND steps.state = 'waiting'
     JOIN approvals ON approvals.run_id = steps.run_id AND approvals.step = steps.step
                   AND approvals.attempt = steps.attempt + 1
     WHERE runs.state = 'WAITING_FOR_APPROVAL'";

impl crate::store::feed::Feed for PgTx<'_> {
    /// The counter row's: the id the last change took.
    fn last_change(&mut self) -> Result<i64> {
        let rows = self.rows("SELECT last FROM run_changes_head", &[])?;
        rows.first().map_or(Ok(0), |row| get(row, 0))
    }

    fn changes_after(&mut self, cursor: i64) -> Result<Vec<(i64, Change)>> {
        let rows = self.rows(
            "SELECT id, run_id, agent, kind FROM run_changes WHERE id > $1 ORDER BY id",
            &[&cursor],
        )?;
        rows.iter()
            .map(|row| {
                let kind = match get::<String>(row, 3)?.as_str() {
                    "decided" => ChangeKind::Decided,
                    "cancelled" => ChangeKind::Cancelled,
                    "released" => ChangeKind::Released,
                    "woken" => ChangeKind::Woken,
                    other => return Err(Error::Corrupt(format!("a change of kind {other:?}"))),
                };
                Ok((
                    get(row, 0)?,
                    Change {
                        run_id: RunId::from(get::<String>(row, 1)?),
                        agent: get(row, 2)?,
                        kind,
                    },
                ))
            })
            .collect()
    }

    fn decided_waiting_runs(&mut self) -> Result<Vec<Change>> {
        let rows = self.rows(
            &format!(
                "SELECT runs.id, runs.agent {DECIDED_WAITING} ORDER BY runs.created_at, runs.id"
            ),
            &[],
        )?;
        let mut changes = rows
            .iter()
            .map(|row| {
                Ok(Change {
                    run_id: RunId::from(get::<String>(row, 0)?),
                    agent: get(row, 1)?,
                    kind: ChangeKind::Decided,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        // The waits woken while nobody watched (their answer, event or child's end came): a
        // range of waits_ready (a woken wait is ready from its waking), not a scan of every
        // wait.
        let rows = self.rows(
            "SELECT run_id, agent FROM waits WHERE result IS NOT NULL ORDER BY ready_at",
            &[],
        )?;
        for row in &rows {
            changes.push(Change {
                run_id: RunId::from(get::<String>(row, 0)?),
                agent: get(row, 1)?,
                kind: ChangeKind::Woken,
            });
        }
        Ok(changes)
    }

    fn waits_decided(&mut self, run_id: &RunId) -> Result<bool> {
        let row = self.row(
            &format!("SELECT 1 {DECIDED_WAITING} AND runs.id = $1 LIMIT 1"),
            &[&run_id.as_str()],
        )?;
        Ok(row.is_some())
    }
}
