-- Each run gets an integer key, and its events refer to it by that key instead of its text id
-- (which stays the public id, unique). An index entry of the event log is then about 10 bytes
-- instead of about 50: the index splits a page a fifth as often as the log grows, and its
-- comparisons are of integers. The key is the run's rowid so far, kept as an INTEGER PRIMARY
-- KEY (VACUUM may renumber a plain rowid) with AUTOINCREMENT: a purged run's key is never
-- given to another run, so a key the writer remembers can only be of the run it was.
--
-- Both tables are copied (SQLite cannot change a key in place), with the same rows and
-- constraints. Applied with foreign keys off (other tables refer to runs) and checked before it
-- commits. Every trigger that names runs is made again after, as it was (a rename checks
-- them, and would find runs gone); the events' delete guard now finds its run by key.
DROP TRIGGER unfinished_runs_are_kept;
DROP TRIGGER run_changes_cancelled;
DROP TRIGGER events_are_append_only_update;
DROP TRIGGER events_of_unfinished_runs_are_kept;
DROP TRIGGER steps_of_unfinished_runs_are_kept;
DROP TRIGGER approvals_of_unfinished_runs_are_kept;
DROP TRIGGER run_changes_decided;

CREATE TABLE runs_v15 (
    key              INTEGER PRIMARY KEY AUTOINCREMENT,
    id               TEXT    NOT NULL UNIQUE,
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
INSERT INTO runs_v15 (key, id, agent, input, state, output, error, created_at, updated_at,
                      lease_owner, lease_expires_at, lease_epoch)
    SELECT rowid, id, agent, input, state, output, error, created_at, updated_at,
           lease_owner, lease_expires_at, lease_epoch FROM runs;

CREATE TABLE events_v15 (
    id      INTEGER PRIMARY KEY,
    run_key INTEGER NOT NULL REFERENCES runs_v15 (key),
    seq     INTEGER NOT NULL CHECK (seq >= 1),
    kind    TEXT    NOT NULL,
    at      INTEGER NOT NULL, -- milliseconds since the Unix epoch, from Config::clock
    step    INTEGER,
    payload TEXT    NOT NULL CHECK (json_valid(payload))
) STRICT;
-- An event whose run does not exist (written with foreign keys off) gets a key no run has, so
-- that the check before the commit stops the migration instead of the copy dropping it.
INSERT INTO events_v15 (id, run_key, seq, kind, at, step, payload)
    SELECT events.id, COALESCE(runs_v15.key, -events.id), seq, kind, at, step, payload
    FROM events LEFT JOIN runs_v15 ON runs_v15.id = events.run_id ORDER BY events.id;
DROP TABLE events;
DROP TABLE runs;
ALTER TABLE runs_v15 RENAME TO runs;
ALTER TABLE events_v15 RENAME TO events;
CREATE UNIQUE INDEX events_of_run ON events (run_key, seq);

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
CREATE TRIGGER run_changes_cancelled AFTER UPDATE OF state ON runs
WHEN NEW.state = 'CANCELLED' AND OLD.state <> 'CANCELLED'
BEGIN
    INSERT INTO run_changes (run_id, agent, kind) VALUES (NEW.id, NEW.agent, 'cancelled');
END;
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
CREATE TRIGGER approvals_of_unfinished_runs_are_kept BEFORE DELETE ON approvals
WHEN NOT EXISTS (SELECT 1 FROM runs WHERE id = OLD.run_id
                 AND (state = 'SUCCEEDED' OR state = 'FAILED' OR state = 'CANCELLED'))
BEGIN
    SELECT RAISE(ABORT, 'the approvals of a run that has not finished cannot be deleted');
END;
CREATE TRIGGER run_changes_decided AFTER INSERT ON approvals
BEGIN
    INSERT INTO run_changes (run_id, agent, kind)
    SELECT id, agent, 'decided' FROM runs WHERE id = NEW.run_id;
END;
