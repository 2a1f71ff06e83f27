-- Tables with generation enabled under 0.1.0 move to 0.2.0's path. 0.1.0's trigger queued
-- rows as the extension's owner (SECURITY DEFINER), with other arguments than 0.2.0's, and
-- the worker wrote the output with a grant of its own on the table. 0.2.0's trigger runs as
-- the inserting role (who must be a member of dflash_user) and the worker writes through the
-- table owner's writer (40_triggers.sql). dflash.enable_generation makes those, so it runs
-- here for each target, as the target was enabled.
--
-- A target 0.2.0 refuses (it checks more: a prompt column that is also the output column,
-- options of the wrong JSON type, a temporary table queued for the worker, ...) is left
-- disabled, its trigger dropped, with a WARNING naming the table and the reason: fix that
-- and run dflash.enable_generation again. So is a target whose trigger was dropped by hand.
DO $enabled$
DECLARE
    t record;
    writer regprocedure;
    worker oid := 'dflash_worker'::regrole::oid;
    stmt text;
    why text;
    script_path text := pg_catalog.current_setting('search_path');
BEGIN
    -- The script's search_path starts with @extschema@, where others may have made objects:
    -- names in this block resolve in pg_catalog alone, as in the functions (00_schema.sql).
    PERFORM pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', true);
    FOR t IN SELECT g.tbl, g.prompt_column, g.output_column, g.mode, g.options
             FROM dflash.generation_targets g ORDER BY g.tbl::oid LOOP
        -- 0.1.0's grants to the worker (SELECT on the key, UPDATE on the output column):
        -- 0.2.0 gives it none. Only what it holds is revoked, so other ACLs stay as they were.
        FOR stmt IN
            SELECT format('REVOKE ALL (%I) ON %s FROM dflash_worker', a.attname, t.tbl)
            FROM pg_attribute a
            WHERE a.attrelid = t.tbl::oid AND EXISTS (SELECT FROM aclexplode(a.attacl) x WHERE x.grantee = worker)
            UNION ALL
            SELECT format('REVOKE ALL ON %s FROM dflash_worker', t.tbl)
            FROM pg_class c
            WHERE c.oid = t.tbl::oid AND EXISTS (SELECT FROM aclexplode(c.relacl) x WHERE x.grantee = worker)
        LOOP
            EXECUTE stmt;
        END LOOP;
        IF NOT EXISTS (SELECT FROM pg_trigger tr
                       WHERE tr.tgrelid = t.tbl::oid AND tr.tgname = 'dflash_generate'::name
                         AND tr.tgfoid IN ('dflash._enqueue()'::regprocedure::oid,
                                           'dflash._generate_row()'::regprocedure::oid)) THEN
            UPDATE dflash.generation_targets g SET enabled = false WHERE g.tbl::oid = t.tbl::oid;
            RAISE WARNING 'dflash upgrade: % has no dflash_generate trigger: generation on it is disabled', t.tbl
                USING HINT = 'SELECT dflash.enable_generation(...) enables it again';
            CONTINUE;
        END IF;
        BEGIN
            PERFORM dflash.enable_generation(t.tbl, t.prompt_column, t.output_column,
                                             t.options || jsonb_build_object('mode', t.mode));
            -- A writer made in an extension script would belong to the extension; those that
            -- enable_generation makes elsewhere belong to the table's owner alone.
            writer := to_regprocedure(format('dflash.%I(text, text, text)', dflash._writer_name(t.tbl)));
            IF writer IS NOT NULL AND EXISTS (
                    SELECT FROM pg_depend d
                    WHERE d.classid = 'pg_proc'::regclass::oid AND d.objid = writer::oid
                      AND d.refclassid = 'pg_extension'::regclass::oid AND d.deptype = 'e'::"char") THEN
                EXECUTE format('ALTER EXTENSION dflash DROP FUNCTION %s', writer);
            END IF;
        EXCEPTION WHEN OTHERS THEN
            GET STACKED DIAGNOSTICS why = MESSAGE_TEXT;
            PERFORM dflash._drop_trigger(t.tbl);
            UPDATE dflash.generation_targets g SET enabled = false WHERE g.tbl::oid = t.tbl::oid;
            RAISE WARNING 'dflash upgrade: generation on % is disabled: %', t.tbl, why
                USING HINT = 'fix that, then SELECT dflash.enable_generation(...) enables it again';
        END;
    END LOOP;
    PERFORM set_config('search_path', script_path, true);
END
$enabled$;
