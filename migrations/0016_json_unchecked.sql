-- The event log and the steps without a json_valid CHECK on their JSON columns (an event's
-- payload; a step's arguments, result and progress). Each check parsed the text again on the
-- writer, several times a step, where the text was made by serde_json on the run's thread: the
-- store writes no JSON it did not make, and every read parses what it reads, refusing text that
-- does not parse. The runs' inputs and the waits' details and results, written once a run or a
-- wait, keep theirs.
--
-- Both tables are copied (SQLite cannot drop a CHECK in place), with the same rows, keys and
-- other constraints. Applied with foreign keys off (steps and events refer to runs; approvals
-- and waits to steps) and checked before it commits. Their triggers and indexes are made again
-- after, as they were.
DROP TRIGGER events_are_append_only_update;
DROP TRIGGER events_of_unfinished_runs_are_kept;
DROP TRIGGER steps_of_unfinished_runs_are_kept;

CREATE TABLE events_v16 (
    id      INTEGER PRIMARY KEY,
    run_key INTEGER NOT NULL REFERENCES runs (key),
    seq     INTEGER NOT NULL CHECK (seq >= 1),
    kind    TEXT    NOT NULL,
    at      INTEGER NOT NULL, -- milliseconds since the Unix epoch, from Config::clock
    step    INTEGER,
    payload TEXT    NOT NULL  -- JSON
) STRICT;
INSERT INTO events_v16 (id, run_key, seq, kind, at, step, payload)
    SELECT id, run_key, seq, kind, at, step, payload FROM events ORDER BY id;
DROP TABLE events;
ALTER TABLE events_v16 RENAME TO events;
CREATE UNIQUE INDEX events_of_run ON events (run_key, seq);

CREATE TABLE steps_v16 (
    run_id      TEXT    NOT NULL REFERENCES runs (id),
    step        INTEGER NOT NULL CHECK (step >= 1),
    kind        TEXT    NOT NULL CHECK (kind = 'model' OR kind = 'tool'),
    state       TEXT    NOT NULL CHECK (state = 'pending' OR state = 'waiting'
                    OR state = 'in_flight' OR state = 'interrupted' OR state = 'finished'),
    attempt     INTEGER NOT NULL DEFAULT 0 CHECK (attempt >= 0), -- attempts started so far
    call_id     TEXT,   -- tool steps: the call's id, unique within the run (kept by the loop)
    tool        TEXT,   -- tool steps: the tool's name as the model asked for it
    args        TEXT,   -- JSON
    result      TEXT,   -- JSON
    waiting_for TEXT    CHECK (waiting_for = 'policy' OR waiting_for = 'reconcile'),
    progress    TEXT,   -- JSON: the last heartbeat kept of the step's call
    PRIMARY KEY (run_id, step)
) STRICT, WITHOUT ROWID;
INSERT INTO steps_v16 (run_id, step, kind, state, attempt, call_id, tool, args, result,
                       waiting_for, progress)
    SELECT run_id, step, kind, state, attempt, call_id, tool, args, result, waiting_for, progress
    FROM steps;
DROP TABLE steps;
ALTER TABLE steps_v16 RENAME TO steps;
CREATE UNIQUE INDEX steps_waiting_call ON steps (run_id, call_id) WHERE state = 'waiting';

CREATE TRIGGER events_are_append_only_update BEFORE UPDATE ON events
BEGIN
    SELECT RAISE(ABORT, 'events are append-only');
END;
CREATE TRIGGER events_of_unfinished_runs_are_kept BEFORE DELETE ON events
WHEN NOT EXISTS (SELECT 1 FROM runs WHERE key = OLD.run_key
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
