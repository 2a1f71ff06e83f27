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
-- any user could SET. Only the owner (a superuser) may change them (dflash.set_config).
-- This table holds the settings changed from their defaults; the view dflash.config
-- (03_config.sql) reads every setting with its default. Only changed settings are rows, so
-- pg_dump keeps them (96_dump.sql) and a restore adds them to a fresh install.
CREATE TABLE dflash.settings (
    key   text PRIMARY KEY,
    value text NOT NULL,
    CONSTRAINT config_known_key CHECK (key IN (
        'socket_path', 'connect_timeout_ms', 'default_timeout_ms', 'remember', 'queue_max_attempts'))
);
