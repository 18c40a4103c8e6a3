-- The same steps table without its UNIQUE (run_id, call_id) constraint. Its index took a page
-- of every group commit for each tool step inserted, a fifth of the pages written with many
-- concurrent runs, and only one statement used it: finding the call an operator decides on,
-- which is always a call that waits. A partial index of the waiting calls now serves that
-- lookup, and keeps the guarantee it needs: no two waiting calls of a run share an id. The
-- loop still gives every call of a run its own id (it reads them all when it resumes). Same
-- columns, rows, keys and references; applied with foreign keys off (the approvals table
-- refers to steps), and checked before it commits.
CREATE TABLE steps_new (
    run_id      TEXT    NOT NULL REFERENCES runs (id),
    step        INTEGER NOT NULL CHECK (step >= 1),
    kind        TEXT    NOT NULL CHECK (kind = 'model' OR kind = 'tool'),
    state       TEXT    NOT NULL CHECK (state = 'pending' OR state = 'waiting'
                    OR state = 'in_flight' OR state = 'interrupted' OR state = 'finished'),
    attempt     INTEGER NOT NULL DEFAULT 0 CHECK (attempt >= 0), -- attempts started so far
    call_id     TEXT,   -- tool steps: the call's id, unique within the run (kept by the loop)
    tool        TEXT,   -- tool steps: the tool's name as the model asked for it
    args        TEXT    CHECK (args IS NULL OR json_valid(args)),
    result      TEXT    CHECK (result IS NULL OR json_valid(result)),
    waiting_for TEXT    CHECK (waiting_for = 'policy' OR waiting_for = 'reconcile'),
    PRIMARY KEY (run_id, step)
) STRICT, WITHOUT ROWID;

INSERT INTO steps_new (run_id, step, kind, state, attempt, call_id, tool, args, result, waiting_for)
SELECT run_id, step, kind, state, attempt, call_id, tool, args, result, waiting_for FROM steps;

DROP TABLE steps;

ALTER TABLE steps_new RENAME TO steps;

-- RecordApproval and approve RUN CALL: find the waiting call by its id. A step enters this
-- index only while it waits, so writing any other step touches it not at all.
CREATE UNIQUE INDEX steps_waiting_call ON steps (run_id, call_id) WHERE state = 'waiting';
