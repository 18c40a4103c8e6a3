-- Schema 13 rebuilds SQLite's event log so that rows are appended at the end of its table.
-- PostgreSQL's events are already a heap in the order they were written, found by the index of
-- their primary key: nothing changes here.
SELECT 1;
