-- Version 16 changes SQLite's schema only (its JSON columns lose their json_valid checks);
-- PostgreSQL's JSON columns are typed, and the server parses what it stores.
SELECT 1;
