\echo Use "ALTER EXTENSION dflash UPDATE TO '0.2.0'" to load this file. \quit
-- dflash 0.1.0 -> 0.2.0: what only an upgrade does, before the install files that can run on
-- a 0.1.0 schema (extension/Makefile interleaves them by file name: 01_roles.sql adds the new
-- roles, the function files replace every function in place, 15_policies.sql and the other
-- new files create what 0.1.0 lacked, 90_grants.sql grants 0.2.0's rights) and, at the end,
-- 95_enabled_tables.sql, which moves tables with generation enabled to 0.2.0's triggers.
-- The result is what CREATE EXTENSION dflash makes at 0.2.0 (tests/test_upgrade.py compares
-- the two catalogs), except that columns added here come last in their table.

-- dflash.generations: what 0.2.0 records besides (sql/10_tables.sql says what each means).
-- 0.1.0 recorded none of it: old rows keep NULL, which dflash.workload_prior understands.
ALTER TABLE dflash.generations
    ADD COLUMN IF NOT EXISTS drafter_version text,
    ADD COLUMN IF NOT EXISTS judged_per_position int[],
    ADD COLUMN IF NOT EXISTS block_policy text CHECK (block_policy IN ('auto', 'fixed')),
    ADD COLUMN IF NOT EXISTS verify_lengths jsonb,
    ADD COLUMN IF NOT EXISTS output_ids int[];
CREATE INDEX IF NOT EXISTS generations_calling_role ON dflash.generations (calling_role);
CREATE INDEX IF NOT EXISTS generations_workload ON dflash.generations (source_table, calling_role, id);

-- dflash.memory rows now belong to a role, as generations rows always did: each to the role
-- of its generation. A row without one (0.1.0 wrote none) stays the upgrading role's, which
-- only admins see. None is shared: only an admin shares a row.
ALTER TABLE dflash.memory
    ADD COLUMN IF NOT EXISTS calling_role name NOT NULL DEFAULT current_user,
    ADD COLUMN IF NOT EXISTS shared boolean NOT NULL DEFAULT false;
UPDATE dflash.memory m SET calling_role = g.calling_role
FROM dflash.generations g
WHERE g.id = m.generation_id AND m.calling_role IS DISTINCT FROM g.calling_role;

-- Disabling generation now keeps the target (enabled = false), so rows already queued are
-- still filled; no table is shared for drafter training until its owner says so.
ALTER TABLE dflash.generation_targets
    ADD COLUMN IF NOT EXISTS enabled boolean NOT NULL DEFAULT true,
    ADD COLUMN IF NOT EXISTS share_for_training boolean NOT NULL DEFAULT false;
-- 0.1.0 had no drop handler: the targets of tables dropped since then point nowhere (and
-- their OID may be a new table's by now). 0.2.0's handler (40_triggers.sql) forgets them.
DELETE FROM dflash.generation_targets g
WHERE NOT EXISTS (SELECT FROM pg_catalog.pg_class c WHERE c.oid = g.tbl::pg_catalog.oid);

-- A queued row's options are read from its generation target when it is worked on (0.1.0
-- copied them into the queue; for rows still queued they are the target's).
ALTER TABLE dflash.queue DROP COLUMN IF EXISTS options;

-- The view now shows the reader only the rows row-level security lets them see.
ALTER VIEW dflash.acceptance_daily SET (security_invoker = true);

-- dflash_recall gained include_shared; the old signature would make every call ambiguous.
DROP FUNCTION IF EXISTS @extschema@.dflash_recall(text, int);

-- 0.1.0 gave the queue consumer whole tables to read (generations, memory, queue_failed,
-- acceptance_daily); 0.2.0 gives every role less of some things and more of others. The
-- dflash roles start from nothing on dflash's objects and 90_grants.sql then grants
-- exactly 0.2.0's rights (the functions in @extschema@ keep theirs: 0.2.0 grants the same).
REVOKE ALL ON ALL TABLES IN SCHEMA dflash FROM dflash_user, dflash_worker;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA dflash FROM dflash_user, dflash_worker;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA dflash FROM dflash_user, dflash_worker;
