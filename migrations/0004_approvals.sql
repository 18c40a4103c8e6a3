-- An operator's decision on a tool call that waits for one. A step may wait more than once
-- (once for the policy, again after an interrupted attempt), so a decision is for the attempt
-- it would start: the step's attempt count at the time, plus one.
CREATE TABLE approvals (
    run_id     TEXT    NOT NULL,
    step       INTEGER NOT NULL,
    attempt    INTEGER NOT NULL CHECK (attempt >= 1),
    approved   INTEGER NOT NULL CHECK (approved IN (0, 1)),
    decided_by TEXT    NOT NULL,
    note       TEXT,
    at         INTEGER NOT NULL,
    PRIMARY KEY (run_id, step, attempt),
    FOREIGN KEY (run_id, step) REFERENCES steps (run_id, step)
) STRICT, WITHOUT ROWID;
