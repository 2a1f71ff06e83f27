-- Learning from the workload: which generations may train the deployment's drafter, the
-- drafters that training produced, and the admin's way to make the worker load one.
--
-- Training data is scoped by consent, in one place (dflash.training_rows):
--   * rows of a generate-on-insert table whose owner set generation_targets.share_for_training
--     (UPDATE dflash.generation_targets SET share_for_training = true WHERE tbl = 'my_table'::regclass);
--   * direct calls (no source table) of roles listed in dflash.training_consent: a member lists
--     themselves (INSERT INTO dflash.training_consent DEFAULT VALUES), an admin lists anyone.
-- Training reads only that view, whoever runs it (an admin or a superuser included), and the
-- role made for it, dflash_trainer (01_roles.sql), can read nothing else of dflash.generations.

-- Roles whose direct calls may train the drafter.
CREATE TABLE dflash.training_consent (
    calling_role name PRIMARY KEY DEFAULT current_user,
    granted_by   name NOT NULL DEFAULT current_user,
    created_at   timestamptz NOT NULL DEFAULT now()
);

ALTER TABLE dflash.training_consent ENABLE ROW LEVEL SECURITY;
CREATE POLICY member_rows ON dflash.training_consent TO dflash_user
    USING (calling_role = current_user) WITH CHECK (calling_role = current_user AND granted_by = current_user);
CREATE POLICY admin_rows ON dflash.training_consent TO dflash_admin USING (true) WITH CHECK (true);

-- The generations training may read. The view runs with its owner's rights (it sees past
-- row-level security) and is a security barrier: a reader's own conditions run only on the
-- rows it returns. Its operators were resolved when it was created.
CREATE VIEW dflash.training_rows WITH (security_barrier = true) AS
SELECT g.id, g.created_at, g.calling_role, g.source_table, g.target, g.drafter, g.drafter_version, g.params,
       g.prompt, g.output, g.output_ids, g.new_tokens
FROM dflash.generations g
WHERE g.status = 'ok' AND g.output IS NOT NULL
  AND CASE WHEN g.source_table IS NULL
           THEN EXISTS (SELECT FROM dflash.training_consent c WHERE c.calling_role = g.calling_role)
           ELSE EXISTS (SELECT FROM dflash.generation_targets t
                        WHERE t.tbl = g.source_table AND t.share_for_training) END;
COMMENT ON VIEW dflash.training_rows IS
    'The successful generations drafter training may read: rows of tables whose owner set '
    'generation_targets.share_for_training, and direct calls of roles in dflash.training_consent.';

-- One row per fine-tuning run (`dflash train --from-database`, `dflash serve --learn`): what it
-- read, what it cost, τ of the old and the new drafter on the held-out rows, and, when the new
-- one was adopted, where it was written and its digest (dflash.engine.versions).
CREATE TABLE dflash.drafter_versions (
    id             bigserial PRIMARY KEY,
    target         text NOT NULL,
    adopted        boolean NOT NULL,
    drafter        text,      -- the name the worker reports for it (its folder's name)
    version        text,      -- the first 16 hex digits of sha256: dflash.generations.drafter_version
    sha256         text,
    path           text,      -- the drafter folder, on the machine that trained it
    parent_version text,      -- the drafter it was fine-tuned from
    rows_used      int NOT NULL,     -- rows trained on
    heldout_rows   int NOT NULL,     -- the newest rows, kept back for τ
    last_row_id    bigint,           -- the newest dflash.generations id read
    steps          int NOT NULL,
    train_seconds  float8 NOT NULL,
    tau_before     float8,           -- on the held-out rows, with the engine, greedy
    tau_after      float8,
    margin         float8 NOT NULL,  -- adopted when tau_after > tau_before * (1 + margin)
    details        jsonb NOT NULL DEFAULT '{}',  -- filters, settings, per-drafter evaluation
    trained_by     name NOT NULL DEFAULT current_user,
    created_at     timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT adopted_has_weights CHECK (NOT adopted OR (version IS NOT NULL AND sha256 IS NOT NULL
                                                          AND path IS NOT NULL AND drafter IS NOT NULL))
);
CREATE INDEX drafter_versions_target ON dflash.drafter_versions (target, id);

ALTER TABLE dflash.drafter_versions ENABLE ROW LEVEL SECURITY;
CREATE POLICY admin_rows ON dflash.drafter_versions TO dflash_admin USING (true) WITH CHECK (true);
CREATE POLICY trainer_read ON dflash.drafter_versions FOR SELECT TO dflash_trainer USING (true);
CREATE POLICY trainer_insert ON dflash.drafter_versions FOR INSERT TO dflash_trainer
    WITH CHECK (trained_by = current_user);

-- The worker loads an adopted version (the newest for its target, or the one named) between
-- requests: generations already started finish with the drafter they started with. The worker
-- checks the weights' digest and refuses a drafter that does not load or does not fit its
-- target (the old one stays), or one outside its drafter roots. Admins only.
CREATE FUNCTION dflash.reload_drafter(version text DEFAULT NULL) RETURNS jsonb
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
@BRIDGE@
return dflash_pg.reload_drafter(plpy, version)
$$;
COMMENT ON FUNCTION dflash.reload_drafter(text) IS
    'Make the worker load an adopted drafter of dflash.drafter_versions (default: the newest for its target); '
    'returns the worker''s answer (previous and new drafter version). Admins only.';
