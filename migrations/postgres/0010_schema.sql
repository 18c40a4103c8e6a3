-- The schema of a PostgreSQL store: the same tables, guards and change feed as an SQLite
-- store's at its schema 10, in PostgreSQL's types. Times are milliseconds since the Unix
-- epoch (lease times by the server's clock); JSON is kept as written.

CREATE TABLE runs (
    id               TEXT   NOT NULL PRIMARY KEY,
    agent            TEXT   NOT NULL,
    input            JSON   NOT NULL,
    state            TEXT   NOT NULL CHECK (state IN
                         ('RUNNING', 'WAITING_FOR_APPROVAL', 'SUCCEEDED', 'FAILED', 'CANCELLED')),
    output           TEXT,   -- the final answer, once SUCCEEDED
    error            TEXT,   -- why the run FAILED or was CANCELLED
    created_at       BIGINT NOT NULL,
    updated_at       BIGINT NOT NULL,
    lease_owner      TEXT,
    lease_expires_at BIGINT, -- by the server's clock
    lease_epoch      BIGINT NOT NULL DEFAULT 0 CHECK (lease_epoch >= 0) -- the fencing token
);

CREATE INDEX runs_by_state ON runs (state, created_at, id);
CREATE INDEX runs_by_created ON runs (created_at, id);
CREATE INDEX runs_by_agent ON runs (agent, created_at, id);
CREATE INDEX runs_by_lease_owner ON runs (lease_owner) WHERE lease_owner IS NOT NULL;
CREATE INDEX runs_finished ON runs (updated_at, id)
    WHERE state IN ('SUCCEEDED', 'FAILED', 'CANCELLED');

CREATE TABLE steps (
    run_id      TEXT    NOT NULL REFERENCES runs (id),
    step        INTEGER NOT NULL CHECK (step >= 1),
    kind        TEXT    NOT NULL CHECK (kind IN ('model', 'tool')),
    state       TEXT    NOT NULL CHECK (state IN
                    ('pending', 'waiting', 'in_flight', 'interrupted', 'finished')),
    attempt     INTEGER NOT NULL DEFAULT 0 CHECK (attempt >= 0), -- attempts started so far
    call_id     TEXT,   -- tool steps: the call's id, unique within the run (kept by the loop)
    tool        TEXT,   -- tool steps: the tool's name as the model asked for it
    args        JSON,
    result      JSON,
    waiting_for TEXT    CHECK (waiting_for IN ('policy', 'reconcile')),
    PRIMARY KEY (run_id, step)
);

CREATE UNIQUE INDEX steps_waiting_call ON steps (run_id, call_id) WHERE state = 'waiting';

CREATE TABLE events (
    run_id  TEXT    NOT NULL REFERENCES runs (id),
    seq     BIGINT  NOT NULL CHECK (seq >= 1),
    kind    TEXT    NOT NULL,
    at      BIGINT  NOT NULL, -- from Config::clock
    step    INTEGER,
    payload JSON    NOT NULL,
    PRIMARY KEY (run_id, seq)
);

CREATE TABLE approvals (
    run_id     TEXT    NOT NULL,
    step       INTEGER NOT NULL,
    attempt    INTEGER NOT NULL CHECK (attempt >= 1),
    approved   BOOLEAN NOT NULL,
    decided_by TEXT    NOT NULL,
    note       TEXT,
    at         BIGINT  NOT NULL,
    PRIMARY KEY (run_id, step, attempt),
    FOREIGN KEY (run_id, step) REFERENCES steps (run_id, step)
);

-- The guards: events are append-only, and nothing of a run that has not finished is deleted.
-- Every function runs with the search_path it was created with (the store's schema), whatever
-- the writing session's: the feed and the channel are always this store's.
CREATE FUNCTION agentrt_refuse() RETURNS trigger LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    RAISE EXCEPTION '%', TG_ARGV[0] USING ERRCODE = 'restrict_violation';
END $$;

CREATE FUNCTION agentrt_keep_unfinished() RETURNS trigger LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM runs WHERE id = OLD.run_id
                   AND state IN ('SUCCEEDED', 'FAILED', 'CANCELLED')) THEN
        RAISE EXCEPTION '%', TG_ARGV[0] USING ERRCODE = 'restrict_violation';
    END IF;
    RETURN OLD;
END $$;

CREATE TRIGGER events_are_append_only_update BEFORE UPDATE ON events
    FOR EACH ROW EXECUTE FUNCTION agentrt_refuse('events are append-only');
CREATE TRIGGER events_of_unfinished_runs_are_kept BEFORE DELETE ON events
    FOR EACH ROW EXECUTE FUNCTION
    agentrt_keep_unfinished('events are append-only while their run has not finished');
CREATE TRIGGER steps_of_unfinished_runs_are_kept BEFORE DELETE ON steps
    FOR EACH ROW EXECUTE FUNCTION
    agentrt_keep_unfinished('the steps of a run that has not finished cannot be deleted');
CREATE TRIGGER approvals_of_unfinished_runs_are_kept BEFORE DELETE ON approvals
    FOR EACH ROW EXECUTE FUNCTION
    agentrt_keep_unfinished('the approvals of a run that has not finished cannot be deleted');
CREATE TRIGGER unfinished_runs_are_kept BEFORE DELETE ON runs
    FOR EACH ROW WHEN (OLD.state NOT IN ('SUCCEEDED', 'FAILED', 'CANCELLED'))
    EXECUTE FUNCTION agentrt_refuse('a run that has not finished cannot be deleted');

-- The change feed a watching supervisor reads: decisions recorded and runs cancelled. Its ids
-- come from one counter row, updated in the transaction that makes the change: the row's lock
-- is held to the commit, so ids are given in commit order and a rolled-back change leaves no
-- gap, which lets a reader trust that a gap means it fell behind. Every change notifies the
-- schema's channel, which wakes the readers.
CREATE TABLE run_changes_head (
    only_row BOOLEAN NOT NULL PRIMARY KEY DEFAULT TRUE CHECK (only_row),
    last     BIGINT  NOT NULL
);
INSERT INTO run_changes_head (last) VALUES (0);

CREATE TABLE run_changes (
    id     BIGINT NOT NULL PRIMARY KEY,
    run_id TEXT   NOT NULL,
    agent  TEXT   NOT NULL, -- the run's: a reader keeps the changes of its agents unread
    kind   TEXT   NOT NULL CHECK (kind IN ('decided', 'cancelled'))
);

CREATE FUNCTION agentrt_change(run_id TEXT, agent TEXT, kind TEXT) RETURNS void
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    n BIGINT;
BEGIN
    UPDATE run_changes_head SET last = last + 1 RETURNING last INTO n;
    INSERT INTO run_changes (id, run_id, agent, kind) VALUES (n, run_id, agent, kind);
    DELETE FROM run_changes WHERE id <= n - 1024;
    PERFORM pg_notify('agentrt_' || current_schema(), '');
END $$;

CREATE FUNCTION agentrt_decided() RETURNS trigger LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    PERFORM agentrt_change(runs.id, runs.agent, 'decided') FROM runs WHERE runs.id = NEW.run_id;
    RETURN NULL;
END $$;

CREATE FUNCTION agentrt_cancelled() RETURNS trigger LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    PERFORM agentrt_change(NEW.id, NEW.agent, 'cancelled');
    RETURN NULL;
END $$;

-- Deferred to the commit: the counter row is the last lock a transaction takes, after every
-- run's row, so two transactions that record changes never wait for each other in a cycle.
CREATE CONSTRAINT TRIGGER run_changes_decided AFTER INSERT ON approvals
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION agentrt_decided();
CREATE CONSTRAINT TRIGGER run_changes_cancelled AFTER UPDATE OF state ON runs
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (NEW.state = 'CANCELLED' AND OLD.state <> 'CANCELLED')
    EXECUTE FUNCTION agentrt_cancelled();
