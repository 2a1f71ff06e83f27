-- The event trigger that forgets dropped tables (dflash._forget_dropped_tables, 40_triggers.sql).
-- Not a function file: an upgrade from a version that has it skips this file (extension/Makefile).
CREATE EVENT TRIGGER dflash_forget_dropped_tables ON sql_drop
    WHEN TAG IN ('DROP TABLE', 'DROP SCHEMA', 'DROP OWNED')
    EXECUTE FUNCTION dflash._forget_dropped_tables();
