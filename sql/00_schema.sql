\echo Use "CREATE EXTENSION dflash CASCADE" to load this file. \quit
-- dflash: schema, roles and the one place for configuration.
-- Objects users call live in the extension's schema (@extschema@, public by default, so
-- SELECT dflash_generate(...) works with the default search_path); internals live in
-- schema dflash. Every function pins search_path to pg_catalog, pg_temp and names every
-- object of ours with its schema, so a caller's search_path (or a schema shadowing ours)
-- never changes what a function runs. Functions that use pgvector's type or operator are
-- SQL-standard bodies (BEGIN ATOMIC), resolved once at install time.

CREATE SCHEMA dflash;

-- Roles are cluster-wide and outlive the extension, so create them only if missing.
--   dflash_user   members: generate, embed, recall, enable generation on their own tables;
--                 they see only their own rows.
--   dflash_admin  a member who also sees every row and may mark memory rows shared.
--   dflash_worker the worker's queue consumer: takes queue items and records results; it
--                 has no rights on users' tables (it writes through each table owner's writer).
--   dflash_trainer drafter training from the workload (dflash train --from-database, dflash
--                 serve --learn): reads only the rows shared for training (50_drafter_versions.sql).
DO $roles$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname OPERATOR(pg_catalog.=) 'dflash_user') THEN
        CREATE ROLE dflash_user NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname OPERATOR(pg_catalog.=) 'dflash_worker') THEN
        -- An administrator gives it LOGIN and a way to authenticate.
        CREATE ROLE dflash_worker NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname OPERATOR(pg_catalog.=) 'dflash_admin') THEN
        CREATE ROLE dflash_admin NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname OPERATOR(pg_catalog.=) 'dflash_trainer') THEN
        CREATE ROLE dflash_trainer NOLOGIN;  -- an administrator gives it LOGIN or grants it to a login
    END IF;
    IF NOT pg_catalog.pg_has_role('dflash_admin', 'dflash_user', 'MEMBER') THEN
        GRANT dflash_user TO dflash_admin;
    END IF;
    IF NOT pg_catalog.pg_has_role('dflash_admin', 'dflash_trainer', 'MEMBER') THEN
        GRANT dflash_trainer TO dflash_admin;
    END IF;
END
$roles$;

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

CREATE FUNCTION dflash.set_config(key text, value text) RETURNS void
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    problem text;
BEGIN
    IF key IS NULL OR value IS NULL THEN
        RAISE EXCEPTION 'dflash.set_config: key and value must not be NULL' USING ERRCODE = '22004';
    END IF;
    problem := CASE key
        WHEN 'socket_path' THEN CASE WHEN value !~ '^/' THEN 'must be an absolute path' END
        WHEN 'connect_timeout_ms' THEN CASE WHEN value !~ '^[1-9][0-9]{0,8}$' THEN 'must be an integer >= 1' END
        WHEN 'default_timeout_ms' THEN CASE WHEN value !~ '^[0-9]{1,9}$' THEN 'must be an integer >= 0' END
        WHEN 'remember' THEN CASE WHEN value NOT IN ('on', 'off') THEN 'must be "on" or "off"' END
        WHEN 'queue_max_attempts' THEN CASE WHEN value !~ '^[1-9][0-9]{0,3}$' THEN 'must be an integer from 1 to 9999' END
    END;
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'dflash.set_config: % %, got "%"', key, problem, value USING ERRCODE = '22023';
    END IF;
    UPDATE dflash.config SET value = set_config.value WHERE config.key = set_config.key;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'dflash.set_config: unknown setting "%"', key
            USING ERRCODE = '22023',
                  HINT = 'known settings: ' || (SELECT string_agg(c.key, ', ' ORDER BY c.key) FROM dflash.config c);
    END IF;
END
$$;
COMMENT ON FUNCTION dflash.set_config(text, text) IS
    'Change a dflash setting (superuser only), e.g. SELECT dflash.set_config(''socket_path'', ''/run/dflash/worker.sock'').';
