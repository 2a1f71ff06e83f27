-- Tables with generation enabled under 0.2.0 get 0.3.0's writer (dflash.write_<writer_id>,
-- naming its table) and trigger (naming its table, not its OID), so generation on them goes
-- on after a pg_dump and restore. 0.2.0's writer, named by the table's OID, goes. A disabled
-- target that had a writer keeps one (rows already queued are still filled), but no trigger.
DO $writers$
DECLARE
    t record;
    writer regprocedure;
    script_path text := pg_catalog.current_setting('search_path');
BEGIN
    -- The script's search_path starts with @extschema@, where others may have made objects:
    -- names in this block resolve in pg_catalog alone, as in the functions (00_schema.sql).
    PERFORM pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', true);
    FOR t IN SELECT g.tbl, g.mode, g.enabled,
                    to_regprocedure(format('dflash.%I(text, text, text)', 'write_' || g.tbl::oid)) AS old_writer
             FROM dflash.generation_targets g ORDER BY g.writer_id LOOP
        IF t.mode = 'async' AND (t.enabled OR t.old_writer IS NOT NULL) THEN
            PERFORM dflash._make_writer(t.tbl);
            -- A writer made in an extension script would belong to the extension; those that
            -- enable_generation makes elsewhere belong to the table's owner alone.
            writer := to_regprocedure(format('dflash.%I(text, text, text)', dflash._writer_name(t.tbl)));
            IF EXISTS (SELECT FROM pg_depend d
                       WHERE d.classid = 'pg_proc'::regclass::oid AND d.objid = writer::oid
                         AND d.refclassid = 'pg_extension'::regclass::oid AND d.deptype = 'e'::"char") THEN
                EXECUTE format('ALTER EXTENSION dflash DROP FUNCTION %s', writer);
            END IF;
            EXECUTE format('DROP FUNCTION IF EXISTS dflash.%I(text, text, text)', 'write_' || t.tbl::oid);
        END IF;
        IF t.enabled AND EXISTS (SELECT FROM pg_trigger tr WHERE tr.tgrelid = t.tbl::oid
                                 AND tr.tgname = 'dflash_generate'::name AND NOT tr.tgisinternal) THEN
            PERFORM dflash._drop_trigger(t.tbl);
            PERFORM dflash._make_trigger(t.tbl);
        END IF;
    END LOOP;
    PERFORM set_config('search_path', script_path, true);
END
$writers$;
