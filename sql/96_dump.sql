-- pg_dump keeps what the extension's tables hold (CREATE EXTENSION alone would restore them
-- empty): every row, since the install script puts none in them (dflash.config's defaults
-- live in a view, 03_config.sql), and the sequences' positions. Generation on insert goes on
-- after a restore: the triggers and writers name their table, not its OID (40_triggers.sql).
-- A function file: an upgrade runs it again (registering a table twice changes nothing).
-- One call per statement (each updates the extension's own catalog row).
DO $dump$
DECLARE
    t regclass;
BEGIN
    FOREACH t IN ARRAY ARRAY['dflash.settings', 'dflash.generations', 'dflash.generations_id_seq', 'dflash.memory',
                             'dflash.memory_id_seq', 'dflash.generation_targets',
                             'dflash.generation_targets_writer_id_seq', 'dflash.queue', 'dflash.queue_id_seq',
                             'dflash.queue_failed', 'dflash.training_consent', 'dflash.drafter_versions',
                             'dflash.drafter_versions_id_seq']::regclass[] LOOP
        PERFORM pg_catalog.pg_extension_config_dump(t, '');
    END LOOP;
END
$dump$;
