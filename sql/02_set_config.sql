-- Changing a setting of dflash.config (03_config.sql; the changed ones are rows of
-- dflash.settings, 00_schema.sql). A function file: an upgrade runs it again as CREATE OR
-- REPLACE (extension/Makefile).

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
    IF NOT EXISTS (SELECT FROM dflash.config c WHERE c.key = set_config.key) THEN
        RAISE EXCEPTION 'dflash.set_config: unknown setting "%"', key
            USING ERRCODE = '22023',
                  HINT = 'known settings: ' || (SELECT string_agg(c.key, ', ' ORDER BY c.key) FROM dflash.config c);
    END IF;
    INSERT INTO dflash.settings AS s (key, value) VALUES (set_config.key, set_config.value)
    ON CONFLICT ON CONSTRAINT settings_pkey DO UPDATE SET value = EXCLUDED.value;
END
$$;
COMMENT ON FUNCTION dflash.set_config(text, text) IS
    'Change a dflash setting (superuser only), e.g. SELECT dflash.set_config(''socket_path'', ''/run/dflash/worker.sock'').';
