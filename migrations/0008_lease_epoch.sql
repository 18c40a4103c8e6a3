-- The fencing token: a run's lease epoch, incremented by every acquisition of its lease (a
-- start, a resume, a takeover), checked with the owner by every write made under the lease,
-- and handed to the tools, so that a system a tool writes to can refuse a stalled former
-- owner's late attempt. Runs of older versions start at 0; their next acquisition takes 1.
ALTER TABLE runs ADD COLUMN lease_epoch INTEGER NOT NULL DEFAULT 0 CHECK (lease_epoch >= 0);
