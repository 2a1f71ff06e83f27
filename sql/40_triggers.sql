-- Generate on INSERT. Default (async): an AFTER INSERT trigger queues the row in the
-- inserting transaction and NOTIFYs; the worker (dflash serve --database ...) fills the
-- output column later, exactly once. {"mode": "sync"} fills it in a BEFORE INSERT trigger
-- within the inserting statement instead (small tables only: the insert waits).
--
-- Nothing here runs a user's code with rights the user does not have:
--   * the triggers run as the inserting role (SECURITY INVOKER): whatever the table's
--     types, casts and defaults do, they do it with that role's rights;
--   * the worker never touches a user's table itself: it calls the table's writer, a
--     function owned by the table's owner (SECURITY DEFINER as that owner), so the owner's
--     triggers run as the owner. dflash_worker has no rights on users' tables at all;
--   * the only functions that run as the superuser (dflash._make_writer, the drop
--     handler) take an OID, read the catalogs and run fixed DDL: no user code.

-- A key's text form must not depend on the session that wrote it: the trigger and the
-- writer both use these settings (the writer converts the text back to the key's type).
-- TG_ARGV: the generation target's qualified name (a partition's rows are queued for their
-- partitioned parent; a name, not an OID, so a pg_dump and restore keeps the trigger
-- working), the prompt column, the key column.
CREATE FUNCTION dflash._enqueue() RETURNS trigger
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET datestyle = 'ISO, YMD' SET intervalstyle = 'postgres' SET timezone = 'UTC' SET extra_float_digits = 1
SET bytea_output = 'hex'
AS $$
DECLARE
    key_text text;
    prompt_text text;
BEGIN
    IF NOT pg_has_role('dflash_user', 'USAGE') THEN
        RAISE EXCEPTION 'dflash: inserting into % generates text, which only members of dflash_user may do',
            TG_RELID::regclass USING ERRCODE = '42501', HINT = 'GRANT dflash_user TO ' || quote_ident(current_user::text);
    END IF;
    EXECUTE format('SELECT ($1).%I::text, ($1).%I::text', TG_ARGV[2], TG_ARGV[1])
        INTO key_text, prompt_text USING NEW;
    IF prompt_text IS NULL THEN
        RETURN NULL;  -- nothing to generate from
    END IF;
    INSERT INTO dflash.queue (tbl, key_value, prompt) VALUES (TG_ARGV[0]::regclass, key_text, prompt_text);
    PERFORM pg_notify('dflash_queue', '');
    RETURN NULL;
END
$$;

CREATE FUNCTION dflash._generate_row() RETURNS trigger
LANGUAGE plpython3u VOLATILE SET search_path = pg_catalog, pg_temp AS $$
@BRIDGE@
return dflash_pg.trigger_sync(plpy, TD)
$$;

-- The table's single primary-key column: its name, its type as SQL writes it without a
-- length (typmod -1: bpchar, where NULL would give character(1)), and the schema and name
-- of the equality operator of its btree index. No row: no key, or a key of several columns.
CREATE FUNCTION dflash._primary_key(tbl regclass)
RETURNS TABLE (attname name, type text, oprschema name, oprname name)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT a.attname, format_type(a.atttypid, -1), opn.nspname, o.oprname
    FROM pg_index i
    JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
    JOIN pg_opclass oc ON oc.oid = i.indclass[0]
    JOIN pg_amop ao ON ao.amopfamily = oc.opcfamily AND ao.amopstrategy = 3
                   AND ao.amoplefttype = oc.opcintype AND ao.amoprighttype = oc.opcintype
                   AND ao.amopmethod = (SELECT am.oid FROM pg_am am WHERE am.amname = 'btree')
    JOIN pg_operator o ON o.oid = ao.amopopr
    JOIN pg_namespace opn ON opn.oid = o.oprnamespace
    WHERE i.indrelid = tbl AND i.indisprimary AND i.indnatts = 1;
END;

-- The writer of one table: dflash.write_<writer_id>(key text, output text, prompt text) sets
-- the output column of the row with that key, if its prompt is still that prompt, and
-- returns how many rows it set (0 or 1). Owned by the table's owner and run as them; only
-- dflash_worker may call it. If its owner makes it run as the caller, it refuses before
-- touching the table. It names the table, and its target's writer_id names it, so both
-- survive a pg_dump and restore (OIDs do not).
CREATE FUNCTION dflash._writer_name(tbl regclass) RETURNS name
LANGUAGE sql STABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT ('write_' || g.writer_id::text)::name FROM dflash.generation_targets g WHERE g.tbl = _writer_name.tbl;
END;

CREATE FUNCTION dflash._make_writer(tbl regclass) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    t record;
    k record;
    fn name := dflash._writer_name(tbl);
    body text;
BEGIN
    SELECT g.prompt_column, g.output_column, c.relowner, n.nspname, c.relname,
           -- a jsonb output column (json_schema) takes the answer's JSON text as jsonb
           CASE WHEN a.atttypid = 'jsonb'::regtype THEN 'jsonb' ELSE 'text' END AS output_type INTO t
    FROM dflash.generation_targets g
    JOIN pg_class c ON c.oid = g.tbl
    JOIN pg_namespace n ON n.oid = c.relnamespace
    LEFT JOIN pg_attribute a ON a.attrelid = g.tbl AND a.attname = g.output_column AND NOT a.attisdropped
    WHERE g.tbl = _make_writer.tbl AND g.mode = 'async';
    IF NOT FOUND THEN
        RAISE EXCEPTION 'dflash: % has no queued generation to write for', tbl USING ERRCODE = '55000';
    END IF;
    SELECT * INTO k FROM dflash._primary_key(tbl);
    IF NOT FOUND THEN
        RAISE EXCEPTION 'dflash: % needs a single-column primary key with a btree index', tbl USING ERRCODE = '42P10';
    END IF;
    -- Parameters are positional ($1 key, $2 output, $3 prompt) and columns win over the
    -- one variable, whatever the table's columns are called.
    body := format($body$
#variable_conflict use_column
DECLARE
    dflash_rows int;
BEGIN
    IF (current_user OPERATOR(pg_catalog.=) (SELECT pg_catalog.pg_get_userbyid(c.relowner) FROM pg_catalog.pg_class c
                                              WHERE c.oid OPERATOR(pg_catalog.=) %L::pg_catalog.regclass)) IS NOT TRUE THEN
        RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = %L;
    END IF;
    UPDATE %I.%I SET %I = $2::pg_catalog.%s WHERE %I OPERATOR(%I.%s) $1::%s AND %I OPERATOR(pg_catalog.=) $3;
    GET DIAGNOSTICS dflash_rows = ROW_COUNT;
    RETURN dflash_rows;
END
$body$,
        format('%I.%I', t.nspname, t.relname),
        format('dflash: the writer of %s.%s does not run as the table''s owner; run dflash.enable_generation again',
               quote_ident(t.nspname), quote_ident(t.relname)),
        t.nspname, t.relname, t.output_column, t.output_type, k.attname, k.oprschema, k.oprname, k.type,
        t.prompt_column);
    EXECUTE format('CREATE OR REPLACE FUNCTION dflash.%I(text, text, text) RETURNS integer '
                   'LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp '
                   'SET datestyle = ''ISO, YMD'' SET intervalstyle = ''postgres'' SET timezone = ''UTC'' '
                   'SET extra_float_digits = 1 SET bytea_output = ''hex'' AS %L', fn, body);
    EXECUTE format('ALTER FUNCTION dflash.%I(text, text, text) OWNER TO %I', fn, pg_get_userbyid(t.relowner));
    EXECUTE format('REVOKE ALL ON FUNCTION dflash.%I(text, text, text) FROM PUBLIC', fn);
    EXECUTE format('GRANT EXECUTE ON FUNCTION dflash.%I(text, text, text) TO dflash_worker', fn);
END
$$;

-- A table's generation options with a constraint (json_schema, regex, choices), checked by
-- the worker's grammar library when generation is enabled: a schema, regex or choice list it
-- cannot take is refused there (22023), before any row is queued.
CREATE FUNCTION dflash._check_options(options jsonb) RETURNS void
LANGUAGE plpython3u VOLATILE SET search_path = pg_catalog, pg_temp AS $$
@BRIDGE@
dflash_pg.check_options(plpy, options)
$$;

-- The table's catalog row, after checking that the caller may act as its owner.
CREATE FUNCTION dflash._owned_table(fn text, tbl regclass) RETURNS pg_class
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    rel pg_class;
BEGIN
    SELECT c.* INTO rel FROM pg_class c WHERE c.oid = tbl;
    IF rel.oid IS NULL THEN
        RAISE EXCEPTION '%: table % does not exist', fn, tbl::oid USING ERRCODE = '42P01';
    END IF;
    IF rel.relkind NOT IN ('r', 'p') THEN
        RAISE EXCEPTION '%: % is not a table', fn, tbl USING ERRCODE = '42809';
    END IF;
    IF NOT pg_has_role(rel.relowner, 'USAGE') THEN
        RAISE EXCEPTION '%: must be the owner of table %', fn, tbl USING ERRCODE = '42501';
    END IF;
    RETURN rel;
END
$$;

-- The table's dflash_generate trigger, from its generation target.
CREATE FUNCTION dflash._make_trigger(tbl regclass) RETURNS void
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    g dflash.generation_targets;
BEGIN
    SELECT * INTO g FROM dflash.generation_targets t WHERE t.tbl = _make_trigger.tbl;
    IF g.mode = 'async' THEN
        EXECUTE format('CREATE TRIGGER dflash_generate AFTER INSERT ON %s FOR EACH ROW '
                       'EXECUTE FUNCTION dflash._enqueue(%L, %L, %L)', tbl, tbl::text, g.prompt_column, g.key_column);
    ELSE
        EXECUTE format('CREATE TRIGGER dflash_generate BEFORE INSERT ON %s FOR EACH ROW '
                       'EXECUTE FUNCTION dflash._generate_row(%L, %L, %L)', tbl, g.prompt_column, g.output_column,
                       g.options);
    END IF;
END
$$;

CREATE FUNCTION dflash._drop_trigger(tbl regclass) RETURNS void
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF EXISTS (SELECT FROM pg_trigger WHERE tgrelid = tbl AND tgname = 'dflash_generate' AND NOT tgisinternal) THEN
        EXECUTE format('DROP TRIGGER dflash_generate ON %s', tbl);
    END IF;
END
$$;

-- Runs as the caller, who must own the table.
CREATE FUNCTION dflash.enable_generation(
    tbl regclass, prompt_column name, output_column name, options jsonb DEFAULT '{}'
) RETURNS void
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    mode text := coalesce(options ->> 'mode', 'async');
    gen_options jsonb := options - 'mode';
    rel pg_class;
    key_col name;
    col name;
    bad text;
BEGIN
    IF tbl IS NULL OR prompt_column IS NULL OR output_column IS NULL OR options IS NULL THEN
        RAISE EXCEPTION 'dflash.enable_generation: arguments must not be NULL' USING ERRCODE = '22004';
    END IF;
    IF jsonb_typeof(options) <> 'object' THEN
        RAISE EXCEPTION 'dflash.enable_generation: options must be a JSON object' USING ERRCODE = '22023';
    END IF;
    IF mode NOT IN ('async', 'sync') THEN
        RAISE EXCEPTION 'dflash.enable_generation: mode must be "async" or "sync", got "%"', mode
            USING ERRCODE = '22023';
    END IF;
    SELECT string_agg(key, ', ') INTO bad FROM jsonb_each(gen_options)
    WHERE key NOT IN ('max_new_tokens', 'temperature', 'block_size', 'top_p', 'top_k', 'seed', 'chat', 'proposals',
                      'json_schema', 'regex', 'choices');
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'dflash.enable_generation: unknown options: %', bad USING ERRCODE = '22023',
            HINT = 'options: mode, max_new_tokens, temperature, block_size, top_p, top_k, seed, chat, proposals, json_schema, regex, choices';
    END IF;
    SELECT string_agg(key, ', ') INTO bad FROM jsonb_each(gen_options)
    WHERE jsonb_typeof(value) <> CASE WHEN key IN ('chat', 'proposals') THEN 'boolean'
                                      WHEN key = 'json_schema' THEN 'object' WHEN key = 'regex' THEN 'string'
                                      WHEN key = 'choices' THEN 'array' ELSE 'number' END
      AND NOT (key IN ('block_size', 'seed', 'json_schema', 'regex', 'choices') AND jsonb_typeof(value) = 'null');
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'dflash.enable_generation: options of the wrong JSON type: %', bad USING ERRCODE = '22023',
            HINT = 'chat and proposals are booleans, json_schema an object, regex a string, choices an array of '
                   'strings, the others are numbers';
    END IF;
    -- A null constraint is none: dropped, so a constraint key is there only when one is given.
    gen_options := gen_options - ARRAY(SELECT key FROM jsonb_each(gen_options)
                                       WHERE key IN ('json_schema', 'regex', 'choices') AND jsonb_typeof(value) = 'null');
    rel := dflash._owned_table('dflash.enable_generation', tbl);
    IF rel.relpersistence = 't' AND mode = 'async' THEN
        RAISE EXCEPTION 'dflash.enable_generation: % is a temporary table, which the worker cannot see', tbl
            USING ERRCODE = '0A000', HINT = 'use {"mode": "sync"} for a temporary table';
    END IF;
    FOREACH col IN ARRAY ARRAY[prompt_column, output_column] LOOP
        -- A JSON answer (json_schema) may also fill a jsonb column.
        PERFORM FROM pg_attribute
        WHERE attrelid = tbl AND attname = col AND attnum > 0 AND NOT attisdropped
          AND (atttypid IN ('text'::regtype, 'varchar'::regtype)
               OR (col = output_column AND gen_options ? 'json_schema' AND atttypid = 'jsonb'::regtype));
        IF NOT FOUND THEN
            RAISE EXCEPTION 'dflash.enable_generation: % has no text column "%"%', tbl, col,
                CASE WHEN col = output_column AND gen_options ? 'json_schema' THEN ' (or jsonb column)' ELSE '' END
                USING ERRCODE = '42703';
        END IF;
    END LOOP;
    IF prompt_column = output_column THEN
        RAISE EXCEPTION 'dflash.enable_generation: the prompt and output columns must differ' USING ERRCODE = '22023';
    END IF;
    SELECT k.attname INTO key_col FROM dflash._primary_key(tbl) k;
    IF key_col IS NULL THEN
        RAISE EXCEPTION 'dflash.enable_generation: % needs a single-column primary key', tbl
            USING ERRCODE = '42P10', HINT = 'the worker finds the row to fill by its key';
    END IF;
    IF gen_options ?| ARRAY['json_schema', 'regex', 'choices'] THEN
        PERFORM dflash._check_options(gen_options);
    END IF;

    INSERT INTO dflash.generation_targets (tbl, prompt_column, output_column, key_column, mode, options)
    VALUES (tbl, prompt_column, output_column, key_col, mode, gen_options)
    ON CONFLICT ON CONSTRAINT generation_targets_pkey DO UPDATE
        SET prompt_column = EXCLUDED.prompt_column, output_column = EXCLUDED.output_column,
            key_column = EXCLUDED.key_column, mode = EXCLUDED.mode, options = EXCLUDED.options, enabled = true;
    PERFORM dflash._drop_trigger(tbl);
    IF mode = 'async' THEN
        PERFORM dflash._make_writer(tbl);
    END IF;
    PERFORM dflash._make_trigger(tbl);
END
$$;
COMMENT ON FUNCTION dflash.enable_generation(regclass, name, name, jsonb) IS
    'Generate output_column from prompt_column for every row inserted into a table you own. options: '
    '{"mode": "async"} (default: queued, filled by the worker) or {"mode": "sync"} (filled within the INSERT), '
    'plus max_new_tokens, temperature, block_size, top_p, top_k, seed, chat, proposals, and at most one of '
    'json_schema (a JSON Schema object: the output column may then be jsonb), regex, choices (checked by the worker '
    'now). Partitioned tables, any schema and any single-column primary key work.';

CREATE FUNCTION dflash.disable_generation(tbl regclass) RETURNS void
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF tbl IS NULL THEN
        RAISE EXCEPTION 'dflash.disable_generation: tbl must not be NULL' USING ERRCODE = '22004';
    END IF;
    PERFORM dflash._owned_table('dflash.disable_generation', tbl);
    PERFORM dflash._drop_trigger(tbl);
    -- The target and its writer stay, so rows already queued are still filled.
    UPDATE dflash.generation_targets t SET enabled = false WHERE t.tbl = disable_generation.tbl;
END
$$;
COMMENT ON FUNCTION dflash.disable_generation(regclass) IS
    'Stop generating on insert for this table (rows already queued are still filled).';

-- A dropped table takes its generation target and writer with it.
CREATE FUNCTION dflash._forget_dropped_tables() RETURNS event_trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    gone record;
BEGIN
    FOR gone IN
        SELECT d.objid, g.writer_id FROM pg_event_trigger_dropped_objects() d
        JOIN dflash.generation_targets g ON g.tbl::oid = d.objid
        WHERE d.classid = 'pg_class'::regclass AND d.objsubid = 0
    LOOP
        DELETE FROM dflash.generation_targets g WHERE g.tbl::oid = gone.objid;
        EXECUTE format('DROP FUNCTION IF EXISTS dflash.%I(text, text, text)', 'write_' || gone.writer_id);
    END LOOP;
END
$$;
