-- Retention: a finished run (SUCCEEDED, FAILED, CANCELLED) may be purged with its steps,
-- events and approvals (Store::purge). A run that has not finished keeps every row: these
-- triggers refuse to delete any of its rows, whatever the statement. Updating an event stays
-- refused for every run (events_are_append_only_update).
DROP TRIGGER events_are_append_only_delete;

CREATE TRIGGER events_of_unfinished_runs_are_kept BEFORE DELETE ON events
WHEN NOT EXISTS (SELECT 1 FROM runs WHERE id = OLD.run_id
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

CREATE TRIGGER unfinished_runs_are_kept BEFORE DELETE ON runs
WHEN NOT (OLD.state = 'SUCCEEDED' OR OLD.state = 'FAILED' OR OLD.state = 'CANCELLED')
BEGIN
    SELECT RAISE(ABORT, 'a run that has not finished cannot be deleted');
END;

-- Store::purge by age: the finished runs, by the time of their last move (when they
-- finished). Only finished runs enter it, so a live run's moves, which each stamp updated_at,
-- never write to it. The purge's query names it (INDEXED BY) and repeats this WHERE clause
-- word for word, which SQLite needs to use a partial index.
CREATE INDEX runs_finished ON runs (updated_at, id)
    WHERE state = 'SUCCEEDED' OR state = 'FAILED' OR state = 'CANCELLED';

-- Store::list_runs without a filter (agentrt runs): a page of runs after a cursor, in
-- (created_at, id) order.
CREATE INDEX runs_by_created ON runs (created_at, id);

-- Store::list_runs by agent (agentrt runs --agent), with or without a created-since bound.
CREATE INDEX runs_by_agent ON runs (agent, created_at, id);

-- Store::runs(Some(state)) and Store::list_runs by state: the same index, with the id that
-- breaks ties in created_at order, so that a page after a cursor is a range of it.
DROP INDEX runs_by_state;
CREATE INDEX runs_by_state ON runs (state, created_at, id);
