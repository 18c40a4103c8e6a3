-- Runs that wait for something other than an approval: a person's answer, an external event, a
-- timer, or a child run. The run's state says which; its one wait is a row of `waits`, and it
-- holds no lease while it waits.
ALTER TABLE runs DROP CONSTRAINT runs_state_check;
ALTER TABLE runs ADD CONSTRAINT runs_state_check CHECK (state IN
    ('RUNNING', 'WAITING_FOR_APPROVAL', 'WAITING_FOR_ANSWER', 'WAITING_FOR_EVENT',
     'WAITING_FOR_TIMER', 'WAITING_FOR_CHILD', 'SUCCEEDED', 'FAILED', 'CANCELLED'));

-- The change feed's fourth kind: a wait woken (its answer, event or child's end recorded),
-- which a replica with the run's agent acts on at once.
ALTER TABLE run_changes DROP CONSTRAINT run_changes_kind_check;
ALTER TABLE run_changes ADD CONSTRAINT run_changes_kind_check
    CHECK (kind IN ('decided', 'cancelled', 'released', 'woken'));

-- A run's one wait: what its waiting tool step waits for, from the step's wait to the run's
-- resume, which deletes it. `kind` and `key`: 'answer' (the call's id), 'event' (the event's
-- name), 'timer' (the reason), 'child' (the child run's id). `ready_at`: from when the run can
-- go on (a timer's due time; an answer's, event's or child's arrival). `result`: the tool
-- result it resumes with, once something came (NULL for a timer).
CREATE TABLE waits (
    run_id   TEXT    NOT NULL,
    step     INTEGER NOT NULL,
    agent    TEXT    NOT NULL,
    kind     TEXT    NOT NULL CHECK (kind IN ('answer', 'event', 'timer', 'child')),
    key      TEXT    NOT NULL,
    detail   JSON    NOT NULL,
    since    BIGINT  NOT NULL,
    due_at   BIGINT,
    ready_at BIGINT,
    result   JSON,
    PRIMARY KEY (run_id, step),
    FOREIGN KEY (run_id, step) REFERENCES steps (run_id, step)
);
CREATE INDEX waits_ready ON waits (agent, ready_at) WHERE ready_at IS NOT NULL;
CREATE INDEX waits_woken ON waits (ready_at) WHERE result IS NOT NULL;
CREATE INDEX waits_by_since ON waits (since, run_id);
CREATE INDEX waits_child ON waits (key) WHERE kind = 'child';

CREATE FUNCTION agentrt_woken() RETURNS trigger LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    PERFORM agentrt_change(NEW.run_id, NEW.agent, 'woken');
    RETURN NULL;
END $$;

CREATE CONSTRAINT TRIGGER run_changes_woken AFTER UPDATE OF result ON waits
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (NEW.result IS NOT NULL AND OLD.result IS NULL)
    EXECUTE FUNCTION agentrt_woken();

-- The events delivered to a run, kept until a wait of the run takes them (step), and keyed by
-- the sender's event id, so that a delivery sent twice is kept once.
CREATE TABLE inbox (
    run_id   TEXT    NOT NULL REFERENCES runs (id),
    event_id TEXT    NOT NULL,
    name     TEXT    NOT NULL,
    payload  JSON    NOT NULL,
    at       BIGINT  NOT NULL,
    step     INTEGER,
    PRIMARY KEY (run_id, event_id)
);
CREATE INDEX inbox_kept ON inbox (run_id, name, at) WHERE step IS NULL;

-- Schedules: a run of `agent` with `input` at each occurrence of `cron` (UTC); `next_at` is the
-- next occurrence not started yet, advanced by a compare-and-set at each start.
CREATE TABLE schedules (
    name       TEXT    NOT NULL PRIMARY KEY,
    agent      TEXT    NOT NULL,
    input      JSON    NOT NULL,
    cron       TEXT    NOT NULL,
    catch_up   BOOLEAN NOT NULL,
    paused     BOOLEAN NOT NULL DEFAULT FALSE,
    next_at    BIGINT  NOT NULL,
    created_at BIGINT  NOT NULL,
    updated_at BIGINT  NOT NULL
);
-- The schedules due, read once per pass for each agent of a supervisor with recovery
-- (`due_schedules`), and the next occurrence after now (`next_scheduled_at`).
CREATE INDEX schedules_due ON schedules (agent, next_at) WHERE NOT paused;
