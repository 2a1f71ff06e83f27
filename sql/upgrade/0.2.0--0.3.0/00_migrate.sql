\echo Use "ALTER EXTENSION dflash UPDATE TO '0.3.0'" to load this file. \quit
-- dflash 0.2.0 -> 0.3.0: what only an upgrade does, before the install files that can run on
-- a 0.2.0 schema (extension/Makefile interleaves them by file name: the function files
-- replace every function in place, 03_config.sql makes the settings view,
-- 11_acceptance_daily.sql replaces 0.2.0's view (tau pooled, not averaged), 90_grants.sql
-- grants 0.3.0's rights, 96_dump.sql registers the tables with pg_dump) and, at the end,
-- 95_writers.sql, which gives tables with generation enabled 0.3.0's triggers and writers.
-- The result is what CREATE EXTENSION dflash makes at 0.3.0 (tests/test_upgrade.py compares
-- the two catalogs), except that columns added here come last in their table.

-- Settings: dflash.config becomes a view of every setting (03_config.sql); the table keeps
-- only those changed from their defaults, so pg_dump can keep them.
ALTER TABLE dflash.config RENAME TO settings;
ALTER TABLE dflash.settings RENAME CONSTRAINT config_pkey TO settings_pkey;
-- Readers read the view (90_grants.sql); the table is the superuser's alone.
REVOKE ALL ON dflash.settings FROM dflash_user, dflash_worker;
DELETE FROM dflash.settings s
WHERE (s.key, s.value) IN (VALUES ('socket_path', '/run/dflash/worker.sock'), ('connect_timeout_ms', '2000'),
                                  ('default_timeout_ms', '0'), ('remember', 'on'), ('queue_max_attempts', '5'));

-- dflash.generations: who drafted what, which backend computed the row, and for typed answers
-- (json_schema, regex, choices) the tokens the grammar forced and whether the answer was cut
-- short (10_tables.sql says what each means); block length auto has no one block size, so its
-- rows say NULL there (0.2.0 wrote the drafter's block size) and verify_lengths says what it chose.
ALTER TABLE dflash.generations
    ADD COLUMN IF NOT EXISTS proposers jsonb,
    ADD COLUMN IF NOT EXISTS backend text,
    ADD COLUMN IF NOT EXISTS forced_tokens int,
    ADD COLUMN IF NOT EXISTS truncated boolean;
UPDATE dflash.generations SET block_size = NULL WHERE block_policy = 'auto' AND block_size IS NOT NULL;

-- Writers are named by a number of their target's, not by the table's OID (which a pg_dump
-- and restore changes): 95_writers.sql makes them anew.
ALTER TABLE dflash.generation_targets ADD COLUMN IF NOT EXISTS writer_id bigserial NOT NULL UNIQUE;

-- Generation took an option more (proposals); the old signatures would make calls ambiguous.
DROP FUNCTION IF EXISTS @extschema@.dflash_generate(text, int, float8, int, float8, int, bigint, boolean);
DROP FUNCTION IF EXISTS @extschema@.dflash_generate_stats(text, int, float8, int, float8, int, bigint, boolean);
DROP FUNCTION IF EXISTS @extschema@.dflash_generate(text[], int, float8, int, float8, int, bigint, boolean);
-- The block_policy view gained a column (proposers): its function's row type changes.
DROP VIEW IF EXISTS dflash.block_policy;
DROP FUNCTION IF EXISTS dflash._block_policy();
