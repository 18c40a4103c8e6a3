-- The change feed: decisions and cancels in the order they committed, whoever wrote them (a
-- supervisor, `agentrt approve`, another process). A supervisor with `Config::watch` reads the
-- changes after the last one it saw, so what it reads does not grow with the number of runs.
-- Filled by the triggers below, so that every writer of this schema fills it and the moves
-- stay as they are. AUTOINCREMENT: an id is never given twice, even once the oldest rows are
-- trimmed, so a reader's cursor is the last id it read.
CREATE TABLE run_changes (
    id     INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT    NOT NULL,
    agent  TEXT    NOT NULL, -- the run's: a reader keeps the changes of its agents unread
    kind   TEXT    NOT NULL CHECK (kind = 'decided' OR kind = 'cancelled')
) STRICT;

-- An operator decided a waiting call: a watching supervisor resumes the run. A decision
-- refused as a duplicate (ON CONFLICT DO NOTHING) inserts no row and fires nothing.
CREATE TRIGGER run_changes_decided AFTER INSERT ON approvals
BEGIN
    INSERT INTO run_changes (run_id, agent, kind)
    SELECT id, agent, 'decided' FROM runs WHERE id = NEW.run_id;
END;

-- A run moved to CANCELLED: the supervisor executing it fires its tool's cancellation signal.
-- `OF state` keeps lease renewals and touches (which set other columns) from firing it at all;
-- the other moves of a run's state pass the WHEN and write nothing.
CREATE TRIGGER run_changes_cancelled AFTER UPDATE OF state ON runs
WHEN NEW.state = 'CANCELLED' AND OLD.state <> 'CANCELLED'
BEGIN
    INSERT INTO run_changes (run_id, agent, kind) VALUES (NEW.id, NEW.agent, 'cancelled');
END;

-- Keeps the feed bounded: the last 1024 changes. A reader that fell further behind (the oldest
-- change it finds is past the one after its cursor) reads the waiting runs once instead. A
-- range of the primary key: one row deleted per change once the feed is full.
CREATE TRIGGER run_changes_trimmed AFTER INSERT ON run_changes
BEGIN
    DELETE FROM run_changes WHERE id <= NEW.id - 1024;
END;
