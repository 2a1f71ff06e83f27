-- dflash 0.1.0 -> 0.2.0, frozen as 0.2.0 shipped it (built by extension/Makefile at 6371f7e from
-- sql/upgrade/0.1.0--0.2.0/ and that commit's sql/*.sql); @BRIDGE@ is filled in at build time.
-- 00_migrate.sql
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

-- 01_roles.sql
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

-- 02_set_config.sql
-- Changing a setting of dflash.config (00_schema.sql). A function file: an upgrade runs it
-- again as CREATE OR REPLACE (extension/Makefile).

CREATE OR REPLACE FUNCTION dflash.set_config(key text, value text) RETURNS void
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    problem text;
BEGIN
    IF key IS NULL OR value IS NULL THEN
        RAISE EXCEPTION 'dflash.set_config: key and value must not be NULL' USING ERRCODE = '22004';
    END IF;
    problem := CASE key
        WHEN 'socket_path' THEN CASE WHEN value !~ '^/' THEN 'must be an absolute path' END
        WHEN 'connect_timeout_ms' THEN CASE WHEN value !~ '^[1-9][0-9]{0,8}$' THEN 'must be an integer >= 1' END
        WHEN 'default_timeout_ms' THEN CASE WHEN value !~ '^[0-9]{1,9}$' THEN 'must be an integer >= 0' END
        WHEN 'remember' THEN CASE WHEN value NOT IN ('on', 'off') THEN 'must be "on" or "off"' END
        WHEN 'queue_max_attempts' THEN CASE WHEN value !~ '^[1-9][0-9]{0,3}$' THEN 'must be an integer from 1 to 9999' END
    END;
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'dflash.set_config: % %, got "%"', key, problem, value USING ERRCODE = '22023';
    END IF;
    UPDATE dflash.config SET value = set_config.value WHERE config.key = set_config.key;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'dflash.set_config: unknown setting "%"', key
            USING ERRCODE = '22023',
                  HINT = 'known settings: ' || (SELECT string_agg(c.key, ', ' ORDER BY c.key) FROM dflash.config c);
    END IF;
END
$$;
COMMENT ON FUNCTION dflash.set_config(text, text) IS
    'Change a dflash setting (superuser only), e.g. SELECT dflash.set_config(''socket_path'', ''/run/dflash/worker.sock'').';

-- 15_policies.sql
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

-- 20_record.sql
-- The one place a finished generation is written down: the generations row and, when the
-- worker embedded it (generate with "remember": true puts `memory` {embedder, embedding}
-- in its answer), its memory row. The SQL functions call it from PL/Python (in the
-- caller's transaction, as the caller); the worker's queue consumer calls it too.
-- `result` is the worker's generate answer as JSON (protocol v1); times are milliseconds.
-- It runs as its caller: the row is the caller's (calling_role defaults to current_user and
-- the policies refuse any other role for a member; only the queue consumer records rows
-- for the role that queued them). A SQL-standard body: names are resolved at install time.

CREATE OR REPLACE FUNCTION dflash.record_generation(
    mode text, prompt text, params jsonb, result jsonb, queue_ms float8, total_ms float8,
    source_table regclass DEFAULT NULL, calling_role name DEFAULT NULL)
RETURNS bigint LANGUAGE sql VOLATILE SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    INSERT INTO dflash.generations (mode, status, prompt, output, target, drafter, drafter_version, params, block_size,
        steps, new_tokens, tau, acceptance_rate, accepted_per_position, judged_per_position, block_policy,
        verify_lengths, prefill_ms, decode_ms, queue_ms, total_ms, tokens_per_s, output_ids, calling_role, source_table)
    VALUES (mode, 'ok', prompt, result->>'text', result->>'target', result->>'drafter', result->>'drafter_version', params,
        (result->>'block_size')::int, (result->>'num_steps')::int, (result->>'new_tokens')::int,
        (result->>'tau')::float8, (result->>'acceptance_rate')::float8,
        CASE WHEN jsonb_typeof(result->'accepted_per_position') = 'array' THEN
            ARRAY(SELECT jsonb_array_elements_text(result->'accepted_per_position'))::int[] END,
        CASE WHEN jsonb_typeof(result->'judged_per_position') = 'array' THEN
            ARRAY(SELECT jsonb_array_elements_text(result->'judged_per_position'))::int[] END,
        result->>'block_policy',
        CASE WHEN jsonb_typeof(result->'verify_length_histogram') = 'object' THEN result->'verify_length_histogram' END,
        1000 * (result->>'prefill_s')::float8, 1000 * (result->>'decode_s')::float8, queue_ms, total_ms,
        (result->>'tokens_per_s')::float8,
        CASE WHEN jsonb_typeof(result->'output_ids') = 'array' THEN
            ARRAY(SELECT jsonb_array_elements_text(result->'output_ids'))::int[] END,
        coalesce(record_generation.calling_role, current_user), source_table);
    -- A separate statement, so the memory policy's check sees the generation row it belongs to.
    INSERT INTO dflash.memory (generation_id, prompt, output, embedding, embedder, calling_role)
    SELECT currval('dflash.generations_id_seq'), prompt, result->>'text',
           (result->'memory'->>'embedding')::vector(384), result->'memory'->>'embedder',
           coalesce(record_generation.calling_role, current_user)
    WHERE result ? 'memory';
    SELECT currval('dflash.generations_id_seq');
END;

-- 30_functions.sql
-- The SQL API. PL/Python bodies are one line each: the work is in plpython/dflash_pg.py.
-- @BRIDGE@ is replaced at build time by the lines that import that module. They run as
-- the caller with search_path pinned; the bridge names every object with its schema.

CREATE OR REPLACE FUNCTION @extschema@.dflash_generate(
    prompt text,
    max_new_tokens int DEFAULT 128,
    temperature float8 DEFAULT 0,
    block_size int DEFAULT NULL,
    top_p float8 DEFAULT 1,
    top_k int DEFAULT 0,
    seed bigint DEFAULT NULL,
    chat boolean DEFAULT true
) RETURNS text
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
@BRIDGE@
return dflash_pg.generate(plpy, "dflash_generate", prompt, dict(max_new_tokens=max_new_tokens,
    temperature=temperature, block_size=block_size, top_p=top_p, top_k=top_k, seed=seed, chat=chat))["text"]
$$;
COMMENT ON FUNCTION @extschema@.dflash_generate(text, int, float8, int, float8, int, bigint, boolean) IS
    'Generate text with DFlash speculative decoding (lossless: greedy output equals the target''s own). '
    'NULL block_size (the default) means auto: each step''s length chosen by what pays on the worker''s device, '
    'starting from what this workload learned before (dflash.block_policy). Records a row in dflash.generations '
    'and dflash.memory.';

CREATE OR REPLACE FUNCTION @extschema@.dflash_generate_stats(
    prompt text,
    max_new_tokens int DEFAULT 128,
    temperature float8 DEFAULT 0,
    block_size int DEFAULT NULL,
    top_p float8 DEFAULT 1,
    top_k int DEFAULT 0,
    seed bigint DEFAULT NULL,
    chat boolean DEFAULT true
) RETURNS jsonb
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
@BRIDGE@
import json
return json.dumps(dflash_pg.generate(plpy, "dflash_generate_stats", prompt, dict(max_new_tokens=max_new_tokens,
    temperature=temperature, block_size=block_size, top_p=top_p, top_k=top_k, seed=seed, chat=chat)))
$$;
COMMENT ON FUNCTION @extschema@.dflash_generate_stats(text, int, float8, int, float8, int, bigint, boolean) IS
    'Like dflash_generate, but returns the whole result as jsonb: text, output_ids, steps, tau, '
    'acceptance_rate, accepted_per_position, timings and the dflash.generations id.';

CREATE OR REPLACE FUNCTION @extschema@.dflash_generate(
    prompts text[],
    max_new_tokens int DEFAULT 128,
    temperature float8 DEFAULT 0,
    block_size int DEFAULT NULL,
    top_p float8 DEFAULT 1,
    top_k int DEFAULT 0,
    seed bigint DEFAULT NULL,
    chat boolean DEFAULT true
) RETURNS text[]
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
@BRIDGE@
return dflash_pg.generate_many(plpy, prompts, dict(max_new_tokens=max_new_tokens,
    temperature=temperature, block_size=block_size, top_p=top_p, top_k=top_k, seed=seed, chat=chat))
$$;
COMMENT ON FUNCTION @extschema@.dflash_generate(text[], int, float8, int, float8, int, bigint, boolean) IS
    'Batch form of dflash_generate: one output per prompt, in order.';

CREATE OR REPLACE FUNCTION @extschema@.dflash_generate_block(prompt text, block_size int DEFAULT 16)
RETURNS TABLE (draft_ids int[], draft_text text, accepted int, accepted_text text,
               next_token_id int, next_token_text text, first_token_text text)
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
@BRIDGE@
return dflash_pg.generate_block(plpy, prompt, block_size)
$$;
COMMENT ON FUNCTION @extschema@.dflash_generate_block(text, int) IS
    'One DFlash block for a chat prompt: after the target''s first token, the drafter proposes '
    'block_size - 1 tokens in one forward; returns them, how many the target accepted, the accepted '
    'text and the target''s next token.';

CREATE OR REPLACE FUNCTION @extschema@.dflash_embed(text text) RETURNS vector(384)
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
@BRIDGE@
return dflash_pg.embed(plpy, None if text is None else [text])[0]
$$;
COMMENT ON FUNCTION @extschema@.dflash_embed(text) IS
    'Embed a text with the worker''s sentence-embedding model (all-MiniLM-L6-v2: 384 dimensions, normalised).';

CREATE OR REPLACE FUNCTION @extschema@.dflash_embed(texts text[]) RETURNS vector(384)[]
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
@BRIDGE@
return dflash_pg.embed(plpy, texts)
$$;
COMMENT ON FUNCTION @extschema@.dflash_embed(text[]) IS 'Batch form of dflash_embed: one vector per text, in order.';

-- The nearest rows of dflash.memory the caller may recall: their own and, unless they
-- say otherwise, rows an admin marked shared. A SQL-standard body, so pgvector's type and
-- operator are resolved at install time whatever schema pgvector lives in.
CREATE OR REPLACE FUNCTION dflash._recall(q vector, k int, include_shared boolean)
RETURNS TABLE (generation_id bigint, prompt text, output text, distance float8, created_at timestamptz)
LANGUAGE sql STABLE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT m.generation_id, m.prompt, m.output, (m.embedding <=> q)::float8, m.created_at
    FROM dflash.memory m
    WHERE m.calling_role = current_user OR (include_shared AND m.shared)
    ORDER BY m.embedding <=> q
    LIMIT k;
END;

CREATE OR REPLACE FUNCTION @extschema@.dflash_recall(query text, k int DEFAULT 5, include_shared boolean DEFAULT true)
RETURNS TABLE (generation_id bigint, prompt text, output text, distance float8, created_at timestamptz)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
SET hnsw.ef_search = 40  -- the SET clause keeps the change below inside this function
AS $$
BEGIN
    IF query IS NULL OR k IS NULL OR include_shared IS NULL THEN
        RAISE EXCEPTION 'dflash_recall: query, k and include_shared must not be NULL' USING ERRCODE = '22004';
    END IF;
    IF k < 1 THEN
        RAISE EXCEPTION 'dflash_recall: k must be >= 1, got %', k USING ERRCODE = '22023';
    END IF;
    -- One HNSW scan returns at most ef_search candidates (then fewer still after the
    -- ownership filter): ask for at least k, and (pgvector >= 0.8, set at install) let the
    -- scan continue until k rows pass the filter.
    PERFORM set_config('hnsw.ef_search', LEAST(GREATEST(k, 40), 1000)::text, true);
    RETURN QUERY SELECT * FROM dflash._recall(@extschema@.dflash_embed(query), k, include_shared);
END
$$;
COMMENT ON FUNCTION @extschema@.dflash_recall(text, int, boolean) IS
    'The k past generations nearest to the query in dflash.memory (cosine distance, HNSW index): the '
    'caller''s own, plus rows an admin marked shared unless include_shared is false.';

-- pgvector 0.8 can continue an HNSW scan until LIMIT rows pass the filter; older versions cannot.
DO $iterative$
BEGIN
    -- pgvector's library defines the setting: make sure it is loaded (an upgrade's session
    -- need not have used a vector yet).
    PERFORM '[0]'::vector;
    IF current_setting('hnsw.iterative_scan', true) IS NOT NULL THEN
        ALTER FUNCTION @extschema@.dflash_recall(text, int, boolean) SET hnsw.iterative_scan = strict_order;
    END IF;
END
$iterative$;

CREATE OR REPLACE FUNCTION @extschema@.dflash_worker_status() RETURNS jsonb
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
@BRIDGE@
return dflash_pg.status(plpy)
$$;
COMMENT ON FUNCTION @extschema@.dflash_worker_status() IS
    'The worker''s status: models, device, uptime, requests served and in flight, tokens, recent mean tau.';

-- 35_block_policy.sql
-- Block length auto (the default: block_size NULL) chooses each step's length from the
-- device's cost curve and the acceptance it expects. It starts a call from what the same
-- workload's earlier generations learned, kept in dflash.generations: a workload is a
-- generate-on-insert table, or one role's direct calls. These rows' per-position counts,
-- pooled, are the prior the bridge and the queue consumer send with a request.

-- The pooled counts of a workload's last 200 successful generations with the drafter of
-- its newest one (another drafter's acceptance says nothing of this one's). Rows from
-- before the counts of judged positions were kept verified every position of their fixed
-- block, so position i was judged whenever position i - 1 was kept. Row-level security
-- applies: a member pools only their own rows.
CREATE OR REPLACE FUNCTION dflash.workload_prior(source_table regclass, calling_role name DEFAULT current_user)
RETURNS jsonb LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    WITH workload AS (
        SELECT g.id, g.drafter, g.accepted_per_position AS accepted,
               coalesce(g.judged_per_position,
                        ARRAY(SELECT CASE WHEN i = 1 THEN g.steps ELSE g.accepted_per_position[i - 1] END
                              FROM generate_series(1, cardinality(g.accepted_per_position)) AS i)) AS judged
        FROM dflash.generations g
        WHERE g.status = 'ok' AND g.accepted_per_position IS NOT NULL AND g.steps > 0
          AND CASE WHEN workload_prior.source_table IS NULL
                   THEN g.source_table IS NULL AND g.calling_role = workload_prior.calling_role
                   ELSE g.source_table = workload_prior.source_table END
    ), recent AS (
        SELECT w.id, w.drafter, w.accepted, w.judged FROM workload w
        WHERE w.drafter IS NOT DISTINCT FROM (SELECT n.drafter FROM workload n ORDER BY n.id DESC LIMIT 1)
        ORDER BY w.id DESC LIMIT 200
    )
    SELECT jsonb_build_object(
        'generations', (SELECT count(*) FROM recent),
        'drafter', (SELECT r.drafter FROM recent r ORDER BY r.id DESC LIMIT 1),
        'accepted', coalesce((SELECT jsonb_agg(t.n ORDER BY t.i) FROM (
            SELECT u.i, sum(u.x) AS n FROM recent r, unnest(r.accepted) WITH ORDINALITY AS u(x, i) GROUP BY u.i) t),
            '[]'::jsonb),
        'judged', coalesce((SELECT jsonb_agg(t.n ORDER BY t.i) FROM (
            SELECT u.i, sum(u.x) AS n FROM recent r, unnest(r.judged) WITH ORDINALITY AS u(x, i) GROUP BY u.i) t),
            '[]'::jsonb));
END;
COMMENT ON FUNCTION dflash.workload_prior(regclass, name) IS
    'Pooled per-position draft acceptance (accepted and judged counts) of a workload''s last 200 generations: '
    'a generate-on-insert table, or (source_table NULL) a role''s direct calls. Block length auto starts from it.';

-- Per workload: what auto expects on the worker's device (its cost curve lives in the
-- worker, which does the arithmetic: one place for the policy). Needs the worker running.
CREATE OR REPLACE FUNCTION dflash._block_policy()
RETURNS TABLE (source_table regclass, calling_role name, generations bigint, drafter text,
               acceptance float8[], expected_tau float8[], tokens_per_s float8[], relative_cost float8[],
               start_block_size int)
LANGUAGE plpython3u VOLATILE SET search_path = pg_catalog, pg_temp AS $$
@BRIDGE@
return dflash_pg.block_policy(plpy)
$$;

CREATE VIEW dflash.block_policy WITH (security_invoker = true) AS
SELECT * FROM dflash._block_policy();
COMMENT ON VIEW dflash.block_policy IS
    'Per workload (a generate-on-insert table, or a role''s direct calls): generations pooled, conditional '
    'acceptance per draft position, and for each block length L (array index L) the expected tau, tokens per '
    'second and cost relative to a plain step under the worker''s cost curve; start_block_size is the length '
    'block length auto starts that workload''s next call with. Reading it asks the worker.';

-- 40_triggers.sql
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
-- TG_ARGV: the generation target's OID (a partition's rows are queued for their
-- partitioned parent), the prompt column, the key column.
CREATE OR REPLACE FUNCTION dflash._enqueue() RETURNS trigger
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
    INSERT INTO dflash.queue (tbl, key_value, prompt) VALUES (TG_ARGV[0]::oid, key_text, prompt_text);
    PERFORM pg_notify('dflash_queue', TG_ARGV[0]);
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION dflash._generate_row() RETURNS trigger
LANGUAGE plpython3u VOLATILE SET search_path = pg_catalog, pg_temp AS $$
@BRIDGE@
return dflash_pg.trigger_sync(plpy, TD)
$$;

-- The table's single primary-key column: its name, its type as SQL writes it without a
-- length (typmod -1: bpchar, where NULL would give character(1)), and the schema and name
-- of the equality operator of its btree index. No row: no key, or a key of several columns.
CREATE OR REPLACE FUNCTION dflash._primary_key(tbl regclass)
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

-- The writer of one table: dflash.write_<table oid>(key text, output text, prompt text) sets the output
-- column of the row with that key, if its prompt is still that prompt, and returns how many
-- rows it set (0 or 1). Owned by the table's owner and run as them; only dflash_worker
-- may call it. If its owner makes it run as the caller, it refuses before touching the table.
CREATE OR REPLACE FUNCTION dflash._writer_name(tbl regclass) RETURNS name
LANGUAGE sql IMMUTABLE PARALLEL SAFE SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT ('write_' || tbl::oid::text)::name;
END;

CREATE OR REPLACE FUNCTION dflash._make_writer(tbl regclass) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    t record;
    k record;
    fn name := dflash._writer_name(tbl);
    body text;
BEGIN
    SELECT g.prompt_column, g.output_column, c.relowner, n.nspname, c.relname INTO t
    FROM dflash.generation_targets g
    JOIN pg_class c ON c.oid = g.tbl
    JOIN pg_namespace n ON n.oid = c.relnamespace
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
                                              WHERE c.oid OPERATOR(pg_catalog.=) %s::pg_catalog.oid)) IS NOT TRUE THEN
        RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = %L;
    END IF;
    UPDATE %I.%I SET %I = $2 WHERE %I OPERATOR(%I.%s) $1::%s AND %I OPERATOR(pg_catalog.=) $3;
    GET DIAGNOSTICS dflash_rows = ROW_COUNT;
    RETURN dflash_rows;
END
$body$,
        tbl::oid,
        format('dflash: the writer of %s.%s does not run as the table''s owner; run dflash.enable_generation again',
               quote_ident(t.nspname), quote_ident(t.relname)),
        t.nspname, t.relname, t.output_column, k.attname, k.oprschema, k.oprname, k.type, t.prompt_column);
    EXECUTE format('CREATE OR REPLACE FUNCTION dflash.%I(text, text, text) RETURNS integer '
                   'LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp '
                   'SET datestyle = ''ISO, YMD'' SET intervalstyle = ''postgres'' SET timezone = ''UTC'' '
                   'SET extra_float_digits = 1 SET bytea_output = ''hex'' AS %L', fn, body);
    EXECUTE format('ALTER FUNCTION dflash.%I(text, text, text) OWNER TO %I', fn, pg_get_userbyid(t.relowner));
    EXECUTE format('REVOKE ALL ON FUNCTION dflash.%I(text, text, text) FROM PUBLIC', fn);
    EXECUTE format('GRANT EXECUTE ON FUNCTION dflash.%I(text, text, text) TO dflash_worker', fn);
END
$$;

-- The table's catalog row, after checking that the caller may act as its owner.
CREATE OR REPLACE FUNCTION dflash._owned_table(fn text, tbl regclass) RETURNS pg_class
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

CREATE OR REPLACE FUNCTION dflash._drop_trigger(tbl regclass) RETURNS void
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF EXISTS (SELECT FROM pg_trigger WHERE tgrelid = tbl AND tgname = 'dflash_generate' AND NOT tgisinternal) THEN
        EXECUTE format('DROP TRIGGER dflash_generate ON %s', tbl);
    END IF;
END
$$;

-- Runs as the caller, who must own the table.
CREATE OR REPLACE FUNCTION dflash.enable_generation(
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
    WHERE key NOT IN ('max_new_tokens', 'temperature', 'block_size', 'top_p', 'top_k', 'seed', 'chat');
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'dflash.enable_generation: unknown options: %', bad USING ERRCODE = '22023',
            HINT = 'options: mode, max_new_tokens, temperature, block_size, top_p, top_k, seed, chat';
    END IF;
    SELECT string_agg(key, ', ') INTO bad FROM jsonb_each(gen_options)
    WHERE jsonb_typeof(value) <> CASE key WHEN 'chat' THEN 'boolean' ELSE 'number' END
      AND NOT (key IN ('block_size', 'seed') AND jsonb_typeof(value) = 'null');
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'dflash.enable_generation: options of the wrong JSON type: %', bad USING ERRCODE = '22023',
            HINT = 'chat is a boolean, the others are numbers';
    END IF;
    rel := dflash._owned_table('dflash.enable_generation', tbl);
    IF rel.relpersistence = 't' AND mode = 'async' THEN
        RAISE EXCEPTION 'dflash.enable_generation: % is a temporary table, which the worker cannot see', tbl
            USING ERRCODE = '0A000', HINT = 'use {"mode": "sync"} for a temporary table';
    END IF;
    FOREACH col IN ARRAY ARRAY[prompt_column, output_column] LOOP
        PERFORM FROM pg_attribute
        WHERE attrelid = tbl AND attname = col AND attnum > 0 AND NOT attisdropped
          AND atttypid IN ('text'::regtype, 'varchar'::regtype);
        IF NOT FOUND THEN
            RAISE EXCEPTION 'dflash.enable_generation: % has no text column "%"', tbl, col USING ERRCODE = '42703';
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

    INSERT INTO dflash.generation_targets (tbl, prompt_column, output_column, key_column, mode, options)
    VALUES (tbl, prompt_column, output_column, key_col, mode, gen_options)
    ON CONFLICT ON CONSTRAINT generation_targets_pkey DO UPDATE
        SET prompt_column = EXCLUDED.prompt_column, output_column = EXCLUDED.output_column,
            key_column = EXCLUDED.key_column, mode = EXCLUDED.mode, options = EXCLUDED.options, enabled = true;
    PERFORM dflash._drop_trigger(tbl);
    IF mode = 'async' THEN
        PERFORM dflash._make_writer(tbl);
        EXECUTE format('CREATE TRIGGER dflash_generate AFTER INSERT ON %s FOR EACH ROW '
                       'EXECUTE FUNCTION dflash._enqueue(%L, %L, %L)', tbl, tbl::oid, prompt_column, key_col);
    ELSE
        EXECUTE format('CREATE TRIGGER dflash_generate BEFORE INSERT ON %s FOR EACH ROW '
                       'EXECUTE FUNCTION dflash._generate_row(%L, %L, %L)', tbl, prompt_column, output_column,
                       gen_options);
    END IF;
END
$$;
COMMENT ON FUNCTION dflash.enable_generation(regclass, name, name, jsonb) IS
    'Generate output_column from prompt_column for every row inserted into a table you own. options: '
    '{"mode": "async"} (default: queued, filled by the worker) or {"mode": "sync"} (filled within the INSERT), '
    'plus max_new_tokens, temperature, block_size, top_p, top_k, seed, chat. Partitioned tables, any schema '
    'and any single-column primary key work.';

CREATE OR REPLACE FUNCTION dflash.disable_generation(tbl regclass) RETURNS void
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
CREATE OR REPLACE FUNCTION dflash._forget_dropped_tables() RETURNS event_trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    gone oid;
BEGIN
    FOR gone IN
        SELECT d.objid FROM pg_event_trigger_dropped_objects() d
        JOIN dflash.generation_targets g ON g.tbl::oid = d.objid
        WHERE d.classid = 'pg_class'::regclass AND d.objsubid = 0
    LOOP
        DELETE FROM dflash.generation_targets g WHERE g.tbl::oid = gone;
        EXECUTE format('DROP FUNCTION IF EXISTS dflash.%I(text, text, text)', dflash._writer_name(gone::regclass));
    END LOOP;
END
$$;
CREATE EVENT TRIGGER dflash_forget_dropped_tables ON sql_drop
    WHEN TAG IN ('DROP TABLE', 'DROP SCHEMA', 'DROP OWNED')
    EXECUTE FUNCTION dflash._forget_dropped_tables();

-- 50_drafter_versions.sql
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
CREATE OR REPLACE FUNCTION dflash.reload_drafter(version text DEFAULT NULL) RETURNS jsonb
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
@BRIDGE@
return dflash_pg.reload_drafter(plpy, version)
$$;
COMMENT ON FUNCTION dflash.reload_drafter(text) IS
    'Make the worker load an adopted drafter of dflash.drafter_versions (default: the newest for its target); '
    'returns the worker''s answer (previous and new drafter version). Admins only.';

-- 90_grants.sql
-- Nothing is callable by PUBLIC; dflash_user gets what a member needs, dflash_admin what an
-- administrator of dflash's data needs, dflash_worker what the queue consumer needs. Which
-- rows each may touch is up to the policies in 15_policies.sql. Grant the roles to people:
-- GRANT dflash_user TO alice;  The README's security section has the whole matrix.

REVOKE ALL ON SCHEMA dflash FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA dflash FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA dflash FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA dflash FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.dflash_generate(text, int, float8, int, float8, int, bigint, boolean),
                       @extschema@.dflash_generate_stats(text, int, float8, int, float8, int, bigint, boolean),
                       @extschema@.dflash_generate(text[], int, float8, int, float8, int, bigint, boolean),
                       @extschema@.dflash_generate_block(text, int),
                       @extschema@.dflash_embed(text), @extschema@.dflash_embed(text[]),
                       @extschema@.dflash_recall(text, int, boolean),
                       @extschema@.dflash_worker_status()
    FROM PUBLIC;
REVOKE ALL ON FUNCTION dflash.reload_drafter(text) FROM PUBLIC;

GRANT USAGE ON SCHEMA dflash TO dflash_user, dflash_worker;

-- Members: the SQL API, generation on their own tables, their own rows.
GRANT EXECUTE ON FUNCTION @extschema@.dflash_generate(text, int, float8, int, float8, int, bigint, boolean),
                          @extschema@.dflash_generate_stats(text, int, float8, int, float8, int, bigint, boolean),
                          @extschema@.dflash_generate(text[], int, float8, int, float8, int, bigint, boolean),
                          @extschema@.dflash_generate_block(text, int),
                          @extschema@.dflash_embed(text), @extschema@.dflash_embed(text[]),
                          @extschema@.dflash_recall(text, int, boolean),
                          @extschema@.dflash_worker_status(),
                          dflash._recall(vector, int, boolean),
                          dflash.record_generation(text, text, jsonb, jsonb, float8, float8, regclass, name),
                          dflash.enable_generation(regclass, name, name, jsonb),
                          dflash.disable_generation(regclass),
                          dflash._owned_table(text, regclass),
                          dflash._drop_trigger(regclass),
                          dflash._primary_key(regclass),
                          dflash._make_writer(regclass),
                          dflash._enqueue(),
                          dflash._generate_row(),
                          dflash.workload_prior(regclass, name),
                          dflash._block_policy()
    TO dflash_user;
GRANT SELECT ON dflash.block_policy TO dflash_user;
GRANT SELECT ON dflash.config, dflash.acceptance_daily TO dflash_user;
-- The synchronous path records rows in the caller's transaction, as the caller.
GRANT SELECT, INSERT ON dflash.generations TO dflash_user;
GRANT SELECT, INSERT, DELETE ON dflash.memory TO dflash_user;
GRANT USAGE ON SEQUENCE dflash.generations_id_seq, dflash.memory_id_seq, dflash.queue_id_seq TO dflash_user;
-- The queueing trigger runs as the inserting member; the other columns take their defaults.
GRANT SELECT, DELETE ON dflash.queue TO dflash_user;
GRANT INSERT (tbl, key_value, prompt) ON dflash.queue TO dflash_user;
GRANT SELECT ON dflash.queue_failed TO dflash_user;
GRANT SELECT, INSERT, UPDATE, DELETE ON dflash.generation_targets TO dflash_user;

-- Admins (also members): every row; they mark memory rows shared.
GRANT SELECT, UPDATE, DELETE ON dflash.generations, dflash.memory, dflash.queue, dflash.queue_failed,
                                dflash.generation_targets TO dflash_admin;

-- The worker takes queue items, writes results through each table's writer (granted to it
-- by dflash._make_writer), records the generations, retries or gives up.
GRANT EXECUTE ON FUNCTION dflash.record_generation(text, text, jsonb, jsonb, float8, float8, regclass, name)
    TO dflash_worker;
GRANT SELECT ON dflash.config, dflash.generation_targets TO dflash_worker;
GRANT SELECT, UPDATE, DELETE ON dflash.queue TO dflash_worker;
GRANT INSERT ON dflash.queue_failed, dflash.generations, dflash.memory TO dflash_worker;
GRANT USAGE ON SEQUENCE dflash.generations_id_seq, dflash.memory_id_seq TO dflash_worker;
-- Block length auto's prior for a table's rows: the counts, never the prompts or outputs.
GRANT EXECUTE ON FUNCTION dflash.workload_prior(regclass, name) TO dflash_worker;
GRANT SELECT (id, status, drafter, steps, accepted_per_position, judged_per_position, source_table, calling_role)
    ON dflash.generations TO dflash_worker;

-- Learning from the workload (50_drafter_versions.sql). Members consent for their own direct
-- calls; admins manage consent, read the drafter versions and make the worker load one; the
-- trainer reads the consented rows (through dflash.training_rows only) and records its runs.
GRANT SELECT, INSERT, DELETE ON dflash.training_consent TO dflash_user;
GRANT UPDATE ON dflash.training_consent TO dflash_admin;
GRANT SELECT, DELETE ON dflash.drafter_versions TO dflash_admin;
GRANT EXECUTE ON FUNCTION dflash.reload_drafter(text) TO dflash_admin;
GRANT USAGE ON SCHEMA dflash TO dflash_trainer;
GRANT SELECT ON dflash.training_rows, dflash.drafter_versions TO dflash_trainer;
GRANT INSERT ON dflash.drafter_versions TO dflash_trainer;
GRANT USAGE ON SEQUENCE dflash.drafter_versions_id_seq TO dflash_trainer;

-- 95_enabled_tables.sql
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

