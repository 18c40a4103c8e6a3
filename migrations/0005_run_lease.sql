-- The run lease: which live process executes a RUNNING run, and until when (wall-clock
-- milliseconds since the Unix epoch, never Config::clock). NULL owner: nobody holds it.
ALTER TABLE runs ADD COLUMN lease_owner TEXT;
ALTER TABLE runs ADD COLUMN lease_expires_at INTEGER;

-- A RUNNING run of an older version may still be executing in a process that knows nothing of
-- leases: give it a grace lease of the default TTL (30 s) before anyone may take it over.
UPDATE runs
SET lease_owner = 'agentrt:pre-lease-version',
    lease_expires_at = CAST(unixepoch('subsec') * 1000 AS INTEGER) + 30000
WHERE state = 'RUNNING';

-- LeaseKeeper's renewal: the runs one owner holds.
CREATE INDEX runs_by_lease_owner ON runs (lease_owner) WHERE lease_owner IS NOT NULL;
