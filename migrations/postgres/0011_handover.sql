-- A tool's progress: the last heartbeat kept of the step's call (a small JSON value), given to
-- the next attempt after a crash, a timeout or a takeover. Written at most once per throttle
-- period, never at every beat.
ALTER TABLE steps ADD COLUMN progress JSON;

-- The change feed's third kind: a run released by a draining supervisor, which a replica with
-- recovery or a watch takes over at once instead of at its next pass.
ALTER TABLE run_changes DROP CONSTRAINT run_changes_kind_check;
ALTER TABLE run_changes ADD CONSTRAINT run_changes_kind_check
    CHECK (kind IN ('decided', 'cancelled', 'released'));

CREATE FUNCTION agentrt_released() RETURNS trigger LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    PERFORM agentrt_change(runs.id, runs.agent, 'released') FROM runs WHERE runs.id = NEW.run_id;
    RETURN NULL;
END $$;

-- Deferred to the commit, as the other changes are: the counter row is the last lock taken.
CREATE CONSTRAINT TRIGGER run_changes_released AFTER INSERT ON events
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (NEW.kind = 'run.released')
    EXECUTE FUNCTION agentrt_released();
