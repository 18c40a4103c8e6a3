-- The event log as SQLite appends fastest: each new row at the end of the table, under a rowid
-- in the order it was written (the events copied here come first, by run), and a run's events
-- found by a unique index of (run, sequence)
-- whose entries are small. Keyed by run and sequence, as before, a row was inserted wherever
-- its run's events were, splitting full pages across the whole table and keeping each active
-- run's page in the cache.
--
-- No trigger fires on an insert any more: the change feed's `released` change is written by the
-- store with the `run.released` event. A trigger made every insert of an event a statement
-- that may write several rows, which SQLite journals apart in case it fails halfway.
--
-- The table is copied (SQLite cannot change a table's key in place), with the same columns,
-- rows and constraints. Applied with foreign keys off (events refer to runs) and checked before
-- it commits. Its other triggers are made again after, as they were.
DROP TRIGGER events_are_append_only_update;
DROP TRIGGER events_of_unfinished_runs_are_kept;
DROP TRIGGER run_changes_released;

CREATE TABLE events_v13 (
    id      INTEGER PRIMARY KEY,
    run_id  TEXT    NOT NULL REFERENCES runs (id),
    seq     INTEGER NOT NULL CHECK (seq >= 1),
    kind    TEXT    NOT NULL,
    at      INTEGER NOT NULL, -- milliseconds since the Unix epoch, from Config::clock
    step    INTEGER,
    payload TEXT    NOT NULL CHECK (json_valid(payload))
) STRICT;
INSERT INTO events_v13 (run_id, seq, kind, at, step, payload)
    SELECT run_id, seq, kind, at, step, payload FROM events;
DROP TABLE events;
ALTER TABLE events_v13 RENAME TO events;
CREATE UNIQUE INDEX events_of_run ON events (run_id, seq);

CREATE TRIGGER events_are_append_only_update BEFORE UPDATE ON events
BEGIN
    SELECT RAISE(ABORT, 'events are append-only');
END;

CREATE TRIGGER events_of_unfinished_runs_are_kept BEFORE DELETE ON events
WHEN NOT EXISTS (SELECT 1 FROM runs WHERE id = OLD.run_id
                 AND (state = 'SUCCEEDED' OR state = 'FAILED' OR state = 'CANCELLED'))
BEGIN
    SELECT RAISE(ABORT, 'events are append-only while their run has not finished');
END;
