-- The roles dflash's grants and policies name. Roles are cluster-wide and outlive the
-- extension, so create them only if missing (an upgrade runs this file again: a role a
-- later version introduces is created there).
--   dflash_user   members: generate, embed, recall, enable generation on their own tables;
--                 they see only their own rows.
--   dflash_admin  a member who also sees every row and may mark memory rows shared.
--   dflash_worker the worker's queue consumer: takes queue items and records results; it
--                 has no rights on users' tables (it writes through each table owner's writer).
--   dflash_trainer drafter training from the workload (dflash train --from-database, dflash
--                 serve --learn): reads only the rows shared for training (50_drafter_versions.sql).
DO $roles$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname OPERATOR(pg_catalog.=) 'dflash_user') THEN
        CREATE ROLE dflash_user NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname OPERATOR(pg_catalog.=) 'dflash_worker') THEN
        -- An administrator gives it LOGIN and a way to authenticate.
        CREATE ROLE dflash_worker NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname OPERATOR(pg_catalog.=) 'dflash_admin') THEN
        CREATE ROLE dflash_admin NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname OPERATOR(pg_catalog.=) 'dflash_trainer') THEN
        CREATE ROLE dflash_trainer NOLOGIN;  -- an administrator gives it LOGIN or grants it to a login
    END IF;
    IF NOT pg_catalog.pg_has_role('dflash_admin', 'dflash_user', 'MEMBER') THEN
        GRANT dflash_user TO dflash_admin;
    END IF;
    IF NOT pg_catalog.pg_has_role('dflash_admin', 'dflash_trainer', 'MEMBER') THEN
        GRANT dflash_trainer TO dflash_admin;
    END IF;
END
$roles$;
