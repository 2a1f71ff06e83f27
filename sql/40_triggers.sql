-- Generate on INSERT. Default (async): an AFTER INSERT trigger queues the row in the
-- inserting transaction and NOTIFYs; the worker (dflash serve --database ...) fills the
-- output column later, exactly once. {"mode": "sync"} fills it in a BEFORE INSERT trigger
-- within the inserting statement instead (small tables only: the insert waits).

CREATE FUNCTION dflash._enqueue() RETURNS trigger
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
-- SECURITY DEFINER so inserting users need no rights on dflash.queue.
-- TG_ARGV: prompt column, key column, options (jsonb text).
DECLARE
    r jsonb := to_jsonb(NEW);
BEGIN
    IF r ->> TG_ARGV[0] IS NULL THEN
        RETURN NULL;  -- nothing to generate from
    END IF;
    INSERT INTO dflash.queue (tbl, key_value, prompt, options, calling_role)
    VALUES (TG_RELID::regclass, r ->> TG_ARGV[1], r ->> TG_ARGV[0], TG_ARGV[2]::jsonb, session_user);
    PERFORM pg_notify('dflash_queue', TG_RELID::regclass::text);
    RETURN NULL;
END
$$;

CREATE FUNCTION dflash._generate_row() RETURNS trigger
LANGUAGE plpython3u VOLATILE AS $$
@BRIDGE@
return dflash_pg.trigger_sync(plpy, TD)
$$;

CREATE FUNCTION dflash.enable_generation(
    tbl regclass, prompt_column name, output_column name, options jsonb DEFAULT '{}'
) RETURNS void
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    mode text := coalesce(options ->> 'mode', 'async');
    gen_options jsonb := options - 'mode';
    key_col name;
    col name;
    bad text;
BEGIN
    IF tbl IS NULL OR prompt_column IS NULL OR output_column IS NULL OR options IS NULL THEN
        RAISE EXCEPTION 'dflash.enable_generation: arguments must not be NULL' USING ERRCODE = '22004';
    END IF;
    IF mode NOT IN ('async', 'sync') THEN
        RAISE EXCEPTION 'dflash.enable_generation: mode must be "async" or "sync", got "%"', mode
            USING ERRCODE = '22023';
    END IF;
    SELECT string_agg(k, ', ') INTO bad FROM jsonb_object_keys(gen_options) k
    WHERE k NOT IN ('max_new_tokens', 'temperature', 'block_size', 'top_p', 'top_k', 'seed', 'chat');
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'dflash.enable_generation: unknown options: %', bad USING ERRCODE = '22023',
            HINT = 'options: mode, max_new_tokens, temperature, block_size, top_p, top_k, seed, chat';
    END IF;
    FOREACH col IN ARRAY ARRAY[prompt_column, output_column] LOOP
        PERFORM 1 FROM pg_attribute
        WHERE attrelid = tbl AND attname = col AND attnum > 0 AND NOT attisdropped
          AND atttypid IN ('text'::regtype, 'varchar'::regtype);
        IF NOT FOUND THEN
            RAISE EXCEPTION 'dflash.enable_generation: % has no text column "%"', tbl, col USING ERRCODE = '42703';
        END IF;
    END LOOP;
    SELECT a.attname INTO key_col
    FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey)
    WHERE i.indrelid = tbl AND i.indisprimary AND i.indnatts = 1;
    IF key_col IS NULL THEN
        RAISE EXCEPTION 'dflash.enable_generation: % needs a single-column primary key', tbl
            USING ERRCODE = '42P10', HINT = 'the worker finds the row to fill by its key';
    END IF;

    EXECUTE format('DROP TRIGGER IF EXISTS dflash_generate ON %s', tbl);
    IF mode = 'async' THEN
        EXECUTE format('CREATE TRIGGER dflash_generate AFTER INSERT ON %s FOR EACH ROW '
                       'EXECUTE FUNCTION dflash._enqueue(%L, %L, %L)', tbl, prompt_column, key_col, gen_options);
        -- The worker writes only the output column, found by key.
        EXECUTE format('GRANT SELECT (%I), UPDATE (%I) ON %s TO dflash_worker', key_col, output_column, tbl);
    ELSE
        EXECUTE format('CREATE TRIGGER dflash_generate BEFORE INSERT ON %s FOR EACH ROW '
                       'EXECUTE FUNCTION dflash._generate_row(%L, %L, %L)', tbl, prompt_column, output_column,
                       gen_options);
    END IF;
    INSERT INTO dflash.generation_targets (tbl, prompt_column, output_column, key_column, mode, options)
    VALUES (tbl, prompt_column, output_column, key_col, mode, gen_options)
    ON CONFLICT ON CONSTRAINT generation_targets_pkey DO UPDATE
        SET prompt_column = EXCLUDED.prompt_column, output_column = EXCLUDED.output_column,
            key_column = EXCLUDED.key_column, mode = EXCLUDED.mode, options = EXCLUDED.options;
END
$$;
COMMENT ON FUNCTION dflash.enable_generation(regclass, name, name, jsonb) IS
    'Generate output_column from prompt_column for every inserted row. options: {"mode": "async"} '
    '(default: queued, filled by the worker) or {"mode": "sync"} (filled within the INSERT), plus '
    'max_new_tokens, temperature, block_size, top_p, top_k, seed, chat.';

CREATE FUNCTION dflash.disable_generation(tbl regclass) RETURNS void
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF tbl IS NULL THEN
        RAISE EXCEPTION 'dflash.disable_generation: tbl must not be NULL' USING ERRCODE = '22004';
    END IF;
    EXECUTE format('DROP TRIGGER IF EXISTS dflash_generate ON %s', tbl);
    DELETE FROM dflash.generation_targets t WHERE t.tbl = disable_generation.tbl;
END
$$;
COMMENT ON FUNCTION dflash.disable_generation(regclass) IS
    'Stop generating on insert for this table (rows already queued are still filled).';
