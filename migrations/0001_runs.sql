-- One row per agent run. `state` follows the run state machine of docs/runs.md; times are
-- milliseconds since the Unix epoch, read from Config::clock.
CREATE TABLE runs (
    id         TEXT    NOT NULL PRIMARY KEY,
    agent      TEXT    NOT NULL,
    input      TEXT    NOT NULL CHECK (json_valid(input)),
    state      TEXT    NOT NULL CHECK (state IN
                   ('RUNNING', 'WAITING_FOR_APPROVAL', 'SUCCEEDED', 'FAILED', 'CANCELLED')),
    output     TEXT,   -- the final answer, once SUCCEEDED
    error      TEXT,   -- why the run FAILED or was CANCELLED
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL
) STRICT;

-- Store::runs(Some(state)): the runs in one state, oldest first.
CREATE INDEX runs_by_state ON runs (state, created_at);
