-- dflash: schema, roles and the one place for configuration.
-- Objects users call live in the extension's schema (public by default, so
-- SELECT dflash_generate(...) works with the default search_path); internals live in
-- schema dflash.

CREATE SCHEMA dflash;

-- Roles are cluster-wide and outlive the extension, so create them only if missing.
DO $roles$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'dflash_user') THEN
        CREATE ROLE dflash_user NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'dflash_worker') THEN
        -- The worker's queue consumer connects as this low-privilege role
        -- (an administrator gives it LOGIN and a way to authenticate).
        CREATE ROLE dflash_worker NOLOGIN;
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
    ('connect_timeout_ms', '2000'),
    ('default_timeout_ms', '0'),                 -- 0: only statement_timeout limits a call
    ('remember', 'on'),                          -- store generations in dflash.memory
    ('queue_max_attempts', '5');

CREATE FUNCTION dflash.set_config(key text, value text) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF key IS NULL OR value IS NULL THEN
        RAISE EXCEPTION 'dflash.set_config: key and value must not be NULL' USING ERRCODE = '22004';
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
