-- The same steps table, with its list CHECK constraints written as comparisons: SQLite builds
-- a temporary table for every `x IN (...)` of five values each time it checks one, which made
-- inserting or moving a step cost nearly twice what it should. Same columns, same rows, same
-- keys; only the way the constraints are spelled changes. Applied with foreign keys off (the
-- approvals table refers to steps), and checked before it commits.
CREATE TABLE steps_new (
    run_id      TEXT    NOT NULL REFERENCES runs (id),
    step        INTEGER NOT NULL CHECK (step >= 1),
    kind        TEXT    NOT NULL CHECK (kind = 'model' OR kind = 'tool'),
    state       TEXT    NOT NULL CHECK (state = 'pending' OR state = 'waiting'
                    OR state = 'in_flight' OR state = 'interrupted' OR state = 'finished'),
    attempt     INTEGER NOT NULL DEFAULT 0 CHECK (attempt >= 0), -- attempts started so far
    call_id     TEXT,   -- tool steps: the call's id, unique within the run
    tool        TEXT,   -- tool steps: the tool's name as the model asked for it
    args        TEXT    CHECK (args IS NULL OR json_valid(args)),
    result      TEXT    CHECK (result IS NULL OR json_valid(result)),
    waiting_for TEXT    CHECK (waiting_for = 'policy' OR waiting_for = 'reconcile'),
    PRIMARY KEY (run_id, step),
    -- RecordApproval and approve RUN CALL: find a tool step by its call id.
    UNIQUE (run_id, call_id)
) STRICT, WITHOUT ROWID;

INSERT INTO steps_new (run_id, step, kind, state, attempt, call_id, tool, args, result, waiting_for)
SELECT run_id, step, kind, state, attempt, call_id, tool, args, result, waiting_for FROM steps;

DROP TABLE steps;

ALTER TABLE steps_new RENAME TO steps;
