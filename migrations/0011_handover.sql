-- A tool's progress: the last heartbeat kept of the step's call (a small JSON value), given to
-- the next attempt after a crash, a timeout or a takeover so that a long job resumes where it
-- was. Written at most once per throttle period, never at every beat.
ALTER TABLE steps ADD COLUMN progress TEXT CHECK (progress IS NULL OR json_valid(progress));

-- The change feed learns a third kind: a run released by a draining supervisor, which a
-- replica with recovery or a watch takes over at once instead of at its next pass. SQLite
-- cannot widen a CHECK in place: the table is copied, ids and all, so that readers' cursors
-- stay valid and AUTOINCREMENT goes on past the last id.
DROP TRIGGER run_changes_decided;
DROP TRIGGER run_changes_cancelled;
DROP TRIGGER run_changes_trimmed;
CREATE TABLE run_changes_v11 (
    id     INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT    NOT NULL,
    agent  TEXT    NOT NULL, -- the run's: a reader keeps the changes of its agents unread
    kind   TEXT    NOT NULL CHECK (kind IN ('decided', 'cancelled', 'released'))
) STRICT;
INSERT INTO run_changes_v11 (id, run_id, agent, kind)
    SELECT id, run_id, agent, kind FROM run_changes;
DROP TABLE run_changes;
ALTER TABLE run_changes_v11 RENAME TO run_changes;

CREATE TRIGGER run_changes_decided AFTER INSERT ON approvals
BEGIN
    INSERT INTO run_changes (run_id, agent, kind)
    SELECT id, agent, 'decided' FROM runs WHERE id = NEW.run_id;
END;

CREATE TRIGGER run_changes_cancelled AFTER UPDATE OF state ON runs
WHEN NEW.state = 'CANCELLED' AND OLD.state <> 'CANCELLED'
BEGIN
    INSERT INTO run_changes (run_id, agent, kind) VALUES (NEW.id, NEW.agent, 'cancelled');
END;

-- A draining supervisor released the run's lease (`run.released`): nothing was in flight, and
-- the next owner continues it with no reconciliation.
CREATE TRIGGER run_changes_released AFTER INSERT ON events
WHEN NEW.kind = 'run.released'
BEGIN
    INSERT INTO run_changes (run_id, agent, kind)
    SELECT id, agent, 'released' FROM runs WHERE id = NEW.run_id;
END;

CREATE TRIGGER run_changes_trimmed AFTER INSERT ON run_changes
BEGIN
    DELETE FROM run_changes WHERE id <= NEW.id - 1024;
END;
