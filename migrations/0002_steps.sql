-- The steps of a run, numbered from 1 per run: a model call or one tool call.
-- state: pending (a tool call the policy has not decided yet), waiting (for an approval),
-- in_flight (started, outcome not yet written), interrupted (its executor died while it was
-- in flight; to be reconciled), finished.
CREATE TABLE steps (
    run_id      TEXT    NOT NULL REFERENCES runs (id),
    step        INTEGER NOT NULL CHECK (step >= 1),
    kind        TEXT    NOT NULL CHECK (kind IN ('model', 'tool')),
    state       TEXT    NOT NULL CHECK (state IN
                    ('pending', 'waiting', 'in_flight', 'interrupted', 'finished')),
    attempt     INTEGER NOT NULL DEFAULT 0 CHECK (attempt >= 0), -- attempts started so far
    call_id     TEXT,   -- tool steps: the call's id, unique within the run
    tool        TEXT,   -- tool steps: the tool's name as the model asked for it
    args        TEXT    CHECK (args IS NULL OR json_valid(args)),
    result      TEXT    CHECK (result IS NULL OR json_valid(result)),
    waiting_for TEXT    CHECK (waiting_for IN ('policy', 'reconcile')),
    PRIMARY KEY (run_id, step),
    -- RecordApproval and approve RUN CALL: find a tool step by its call id.
    UNIQUE (run_id, call_id)
) STRICT, WITHOUT ROWID;
