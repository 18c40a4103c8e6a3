-- The append-only event log: per run, a gapless sequence from 1.
CREATE TABLE events (
    run_id  TEXT    NOT NULL REFERENCES runs (id),
    seq     INTEGER NOT NULL CHECK (seq >= 1),
    kind    TEXT    NOT NULL,
    at      INTEGER NOT NULL, -- milliseconds since the Unix epoch, from Config::clock
    step    INTEGER,
    payload TEXT    NOT NULL CHECK (json_valid(payload)),
    PRIMARY KEY (run_id, seq)
) STRICT, WITHOUT ROWID;

-- The log is a record of what happened: nothing rewrites or removes it.
CREATE TRIGGER events_are_append_only_update BEFORE UPDATE ON events
BEGIN
    SELECT RAISE(ABORT, 'events are append-only');
END;
CREATE TRIGGER events_are_append_only_delete BEFORE DELETE ON events
BEGIN
    SELECT RAISE(ABORT, 'events are append-only');
END;
