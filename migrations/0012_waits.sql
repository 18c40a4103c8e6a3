-- Runs that wait for something other than an approval: a person's answer, an external event, a
-- timer, or a child run. The run's state says which; its one wait is a row of `waits`, and it
-- holds no lease while it waits.
--
-- The runs table is copied to widen its state's CHECK (SQLite cannot change one in place),
-- spelled as comparisons, which SQLite checks without building a list. Same columns, rows
-- and keys. Applied with foreign keys off (steps and events refer to runs) and checked before
-- it commits. The triggers that name runs are dropped first and made again after, as they
-- were.
DROP TRIGGER unfinished_runs_are_kept;
DROP TRIGGER run_changes_cancelled;
DROP TRIGGER run_changes_decided;
DROP TRIGGER run_changes_released;
DROP TRIGGER events_of_unfinished_runs_are_kept;
DROP TRIGGER steps_of_unfinished_runs_are_kept;
DROP TRIGGER approvals_of_unfinished_runs_are_kept;

CREATE TABLE runs_v12 (
    id               TEXT    NOT NULL PRIMARY KEY,
    agent            TEXT    NOT NULL,
    input            TEXT    NOT NULL CHECK (json_valid(input)),
    state            TEXT    NOT NULL CHECK (state = 'RUNNING' OR state = 'WAITING_FOR_APPROVAL'
                         OR state = 'WAITING_FOR_ANSWER' OR state = 'WAITING_FOR_EVENT'
                         OR state = 'WAITING_FOR_TIMER' OR state = 'WAITING_FOR_CHILD'
                         OR state = 'SUCCEEDED' OR state = 'FAILED' OR state = 'CANCELLED'),
    output           TEXT,
    error            TEXT,
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL,
    lease_owner      TEXT,
    lease_expires_at INTEGER,
    lease_epoch      INTEGER NOT NULL DEFAULT 0 CHECK (lease_epoch >= 0)
) STRICT;
INSERT INTO runs_v12 (id, agent, input, state, output, error, created_at, updated_at,
                      lease_owner, lease_expires_at, lease_epoch)
    SELECT id, agent, input, state, output, error, created_at, updated_at,
           lease_owner, lease_expires_at, lease_epoch FROM runs;
DROP TABLE runs;
ALTER TABLE runs_v12 RENAME TO runs;

CREATE INDEX runs_by_state ON runs (state, created_at, id);
CREATE INDEX runs_by_lease_owner ON runs (lease_owner) WHERE lease_owner IS NOT NULL;
CREATE INDEX runs_finished ON runs (updated_at, id)
    WHERE state = 'SUCCEEDED' OR state = 'FAILED' OR state = 'CANCELLED';
CREATE INDEX runs_by_created ON runs (created_at, id);
CREATE INDEX runs_by_agent ON runs (agent, created_at, id);

CREATE TRIGGER unfinished_runs_are_kept BEFORE DELETE ON runs
WHEN NOT (OLD.state = 'SUCCEEDED' OR OLD.state = 'FAILED' OR OLD.state = 'CANCELLED')
BEGIN
    SELECT RAISE(ABORT, 'a run that has not finished cannot be deleted');
END;

CREATE TRIGGER events_of_unfinished_runs_are_kept BEFORE DELETE ON events
WHEN NOT EXISTS (SELECT 1 FROM runs WHERE id = OLD.run_id
                 AND (state = 'SUCCEEDED' OR state = 'FAILED' OR state = 'CANCELLED'))
BEGIN
    SELECT RAISE(ABORT, 'events are append-only while their run has not finished');
END;

CREATE TRIGGER steps_of_unfinished_runs_are_kept BEFORE DELETE ON steps
WHEN NOT EXISTS (SELECT 1 FROM runs WHERE id = OLD.run_id
                 AND (state = 'SUCCEEDED' OR state = 'FAILED' OR state = 'CANCELLED'))
BEGIN
    SELECT RAISE(ABORT, 'the steps of a run that has not finished cannot be deleted');
END;

CREATE TRIGGER approvals_of_unfinished_runs_are_kept BEFORE DELETE ON approvals
WHEN NOT EXISTS (SELECT 1 FROM runs WHERE id = OLD.run_id
                 AND (state = 'SUCCEEDED' OR state = 'FAILED' OR state = 'CANCELLED'))
BEGIN
    SELECT RAISE(ABORT, 'the approvals of a run that has not finished cannot be deleted');
END;

-- The change feed learns a fourth kind: a wait woken (its answer, event or child's end
-- recorded), which a replica with the run's agent acts on at once.
DROP TRIGGER run_changes_trimmed;
CREATE TABLE run_changes_v12 (
    id     INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT    NOT NULL,
    agent  TEXT    NOT NULL,
    kind   TEXT    NOT NULL CHECK (kind = 'decided' OR kind = 'cancelled' OR kind = 'released'
                                   OR kind = 'woken')
) STRICT;
INSERT INTO run_changes_v12 (id, run_id, agent, kind)
    SELECT id, run_id, agent, kind FROM run_changes;
DROP TABLE run_changes;
ALTER TABLE run_changes_v12 RENAME TO run_changes;

CREATE TRIGGER run_changes_decided AFTER INSERT ON approvals
BEGIN
    INSERT INTO run_changes (run_id, agent, kind)
    SELECT id, agent, 'decided' FROM runs WHERE id = NEW.run_id;
END;

CREATE TRIGGER run_changes_cancelled AFTER UPDATE OF state ON runs
WHEN NEW.state = 'CANCELLED' AND OLD.state <> 'CANCELLED'
BEGIN
    INSERT INTO run_changes (run_id, agent, kind) VALUES (NEW.id, NEW.agent, 'cancelled');
END;

CREATE TRIGGER run_changes_released AFTER INSERT ON events
WHEN NEW.kind = 'run.released'
BEGIN
    INSERT INTO run_changes (run_id, agent, kind)
    SELECT id, agent, 'released' FROM runs WHERE id = NEW.run_id;
END;

CREATE TRIGGER run_changes_trimmed AFTER INSERT ON run_changes
BEGIN
    DELETE FROM run_changes WHERE id <= NEW.id - 1024;
END;

-- A run's one wait: what its waiting tool step waits for. The row lives from the step's wait
-- to the run's resume, which deletes it, so the table holds only the runs that wait.
--   kind  'answer' (a person's answer; key: the call's id), 'event' (key: the event's name),
--         'timer' (key: the reason), 'child' (key: the child run's id).
--   detail  what the wait shows: the question and its answer schema, the timer's reason, the
--         child's agent and task.
--   ready_at  from when the run can go on: a timer's due time; an answer's, event's or child's
--         arrival. NULL while nothing came.
--   result  the tool result it resumes with, once something came; NULL for a timer.
CREATE TABLE waits (
    run_id   TEXT    NOT NULL,
    step     INTEGER NOT NULL,
    agent    TEXT    NOT NULL, -- the run's: the ready waits are read per agent
    kind     TEXT    NOT NULL CHECK (kind = 'answer' OR kind = 'event' OR kind = 'timer'
                                     OR kind = 'child'),
    key      TEXT    NOT NULL,
    detail   TEXT    NOT NULL CHECK (json_valid(detail)),
    since    INTEGER NOT NULL,
    due_at   INTEGER,
    ready_at INTEGER,
    result   TEXT    CHECK (result IS NULL OR json_valid(result)),
    PRIMARY KEY (run_id, step),
    FOREIGN KEY (run_id, step) REFERENCES steps (run_id, step)
) STRICT, WITHOUT ROWID;

-- The ready waits (due timers, and waits woken while nobody watched), read once per pass for
-- each agent of a supervisor: a range of this index up to now, whatever the number of runs
-- that are not due.
CREATE INDEX waits_ready ON waits (agent, ready_at) WHERE ready_at IS NOT NULL;
-- The waits woken (something came), read when a watcher starts or falls behind the feed.
CREATE INDEX waits_woken ON waits (ready_at) WHERE result IS NOT NULL;
-- The waits listed a page at a time, oldest first (the inbox, `agentrt waits`).
CREATE INDEX waits_by_since ON waits (since, run_id);
-- A child's end wakes the parent that waits for it.
CREATE INDEX waits_child ON waits (key) WHERE kind = 'child';

CREATE TRIGGER run_changes_woken AFTER UPDATE OF result ON waits
WHEN NEW.result IS NOT NULL AND OLD.result IS NULL
BEGIN
    INSERT INTO run_changes (run_id, agent, kind) VALUES (NEW.run_id, NEW.agent, 'woken');
END;

-- The events delivered to a run: kept until a wait of the run takes them (step), so that an
-- event that comes before its wait is not lost, and keyed by the sender's event id, so that a
-- delivery sent twice is kept once.
CREATE TABLE inbox (
    run_id   TEXT    NOT NULL REFERENCES runs (id),
    event_id TEXT    NOT NULL,
    name     TEXT    NOT NULL,
    payload  TEXT    NOT NULL CHECK (json_valid(payload)),
    at       INTEGER NOT NULL,
    step     INTEGER, -- the wait that took it; NULL while it is kept
    PRIMARY KEY (run_id, event_id)
) STRICT, WITHOUT ROWID;
CREATE INDEX inbox_kept ON inbox (run_id, name, at) WHERE step IS NULL;

-- Schedules: a run of `agent` with `input` at each occurrence of `cron` (UTC). `next_at` is
-- the next occurrence not started yet; each start advances it with a compare-and-set, and the
-- occurrence's time is in the run's id, so that of several replicas one starts it.
CREATE TABLE schedules (
    name       TEXT    NOT NULL PRIMARY KEY,
    agent      TEXT    NOT NULL,
    input      TEXT    NOT NULL CHECK (json_valid(input)),
    cron       TEXT    NOT NULL,
    catch_up   INTEGER NOT NULL CHECK (catch_up = 0 OR catch_up = 1),
    paused     INTEGER NOT NULL DEFAULT 0 CHECK (paused = 0 OR paused = 1),
    next_at    INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL
) STRICT;
-- The schedules due, read once per pass for each agent of a supervisor with recovery
-- (`due_schedules`), and the next occurrence after now (`next_scheduled_at`): a range of this
-- index, whatever the number of schedules not due or of agents the supervisor lacks.
CREATE INDEX schedules_due ON schedules (agent, next_at) WHERE paused = 0;
