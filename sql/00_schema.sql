\echo Use "CREATE EXTENSION dflash CASCADE" to load this file. \quit
-- dflash: the schema and the one place for configuration (its roles: 01_roles.sql; the
-- function that changes a setting: 02_set_config.sql).
-- Objects users call live in the extension's schema (@extschema@, public by default, so
-- SELECT dflash_generate(...) works with the default search_path); internals live in
-- schema dflash. Every function pins search_path to pg_catalog, pg_temp and names every
-- object of ours with its schema, so a caller's search_path (or a schema shadowing ours)
-- never changes what a function runs. Functions that use pgvector's type or operator are
-- SQL-standard bodies (BEGIN ATOMIC), resolved once at install time.

CREATE SCHEMA dflash;

-- Settings that matter for security (the worker's socket path) live here, not in GUCs
-- any user could SET. Only the owner (a superuser) may change them.
CREATE TABLE dflash.config (
    key   text PRIMARY KEY,
    value text NOT NULL,
    CONSTRAINT config_known_key CHECK (key IN (
        'socket_path', 'connect_timeout_ms', 'default_timeout_ms', 'remember', 'queue_max_attempts'))
);

INSERT INTO dflash.config (key, value) VALUES
    ('socket_path', '/run/dflash/worker.sock'),  -- the worker's default socket
    ('connect_timeout_ms', '2000'),              -- how long a call waits to get through to the worker
    ('default_timeout_ms', '0'),                 -- 0: only statement_timeout limits a call
    ('remember', 'on'),                          -- store generations in dflash.memory
    ('queue_max_attempts', '5');                 -- tries per queued row before dflash.queue_failed
