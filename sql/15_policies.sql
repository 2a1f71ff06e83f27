-- Per-user isolation: row-level security keyed by the owning role. A member reads and
-- writes only rows whose calling_role is their own (memory also: rows an admin marked
-- shared); dflash_admin sees and manages every row; dflash_worker, the queue consumer, works
-- on every queue item and records results under the item's role. Which commands a role may
-- run at all is granted in 90_grants.sql; these policies say on which rows.

ALTER TABLE dflash.generations ENABLE ROW LEVEL SECURITY;
CREATE POLICY member_rows ON dflash.generations TO dflash_user
    USING (calling_role = current_user) WITH CHECK (calling_role = current_user);
CREATE POLICY admin_rows ON dflash.generations TO dflash_admin USING (true) WITH CHECK (true);
CREATE POLICY worker_rows ON dflash.generations TO dflash_worker USING (true) WITH CHECK (true);

ALTER TABLE dflash.memory ENABLE ROW LEVEL SECURITY;
CREATE POLICY member_read ON dflash.memory FOR SELECT TO dflash_user
    USING (calling_role = current_user OR shared);
-- A member's memory row is their own, not shared, and belongs to one of their own
-- generations (the subquery sees only those), so nothing they write reaches another's recall.
CREATE POLICY member_insert ON dflash.memory FOR INSERT TO dflash_user
    WITH CHECK (calling_role = current_user AND NOT shared
                AND (generation_id IS NULL
                     OR EXISTS (SELECT FROM dflash.generations g WHERE g.id = generation_id)));
CREATE POLICY member_delete ON dflash.memory FOR DELETE TO dflash_user USING (calling_role = current_user);
CREATE POLICY admin_rows ON dflash.memory TO dflash_admin USING (true) WITH CHECK (true);
CREATE POLICY worker_insert ON dflash.memory FOR INSERT TO dflash_worker WITH CHECK (NOT shared);

-- Members queue items (through the trigger, which runs as them) only under their own role
-- and only for tables they may insert into; they may take back their own pending items.
ALTER TABLE dflash.queue ENABLE ROW LEVEL SECURITY;
CREATE POLICY member_read ON dflash.queue FOR SELECT TO dflash_user USING (calling_role = current_user);
CREATE POLICY member_insert ON dflash.queue FOR INSERT TO dflash_user
    WITH CHECK (calling_role = current_user AND pg_catalog.has_table_privilege(tbl, 'INSERT'));
CREATE POLICY member_delete ON dflash.queue FOR DELETE TO dflash_user USING (calling_role = current_user);
CREATE POLICY admin_rows ON dflash.queue TO dflash_admin USING (true) WITH CHECK (true);
CREATE POLICY worker_rows ON dflash.queue TO dflash_worker USING (true) WITH CHECK (true);

ALTER TABLE dflash.queue_failed ENABLE ROW LEVEL SECURITY;
CREATE POLICY member_read ON dflash.queue_failed FOR SELECT TO dflash_user USING (calling_role = current_user);
CREATE POLICY admin_rows ON dflash.queue_failed TO dflash_admin USING (true) WITH CHECK (true);
CREATE POLICY worker_rows ON dflash.queue_failed TO dflash_worker USING (true) WITH CHECK (true);

-- A generation target belongs to whoever owns the table (as for ALTER TABLE: the owner or
-- a member of the owning role).
ALTER TABLE dflash.generation_targets ENABLE ROW LEVEL SECURITY;
CREATE POLICY owner_rows ON dflash.generation_targets TO dflash_user
    USING (pg_catalog.pg_has_role((SELECT c.relowner FROM pg_catalog.pg_class c WHERE c.oid = tbl), 'USAGE'))
    WITH CHECK (pg_catalog.pg_has_role((SELECT c.relowner FROM pg_catalog.pg_class c WHERE c.oid = tbl), 'USAGE'));
CREATE POLICY admin_rows ON dflash.generation_targets TO dflash_admin USING (true) WITH CHECK (true);
CREATE POLICY worker_read ON dflash.generation_targets FOR SELECT TO dflash_worker USING (true);
