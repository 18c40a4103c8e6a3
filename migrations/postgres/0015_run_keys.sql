-- Schema 15 gives SQLite's runs an integer key that its event log refers to (see
-- migrations/0015_run_keys.sql); PostgreSQL's tables stay as they are.
SELECT 1;
