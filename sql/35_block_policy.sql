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
CREATE FUNCTION dflash.workload_prior(source_table regclass, calling_role name DEFAULT current_user)
RETURNS jsonb LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    WITH workload AS (
        SELECT g.id, g.drafter, g.proposers, g.accepted_per_position AS accepted,
               coalesce(g.judged_per_position,
                        ARRAY(SELECT CASE WHEN i = 1 THEN g.steps ELSE g.accepted_per_position[i - 1] END
                              FROM generate_series(1, cardinality(g.accepted_per_position)) AS i)) AS judged
        FROM dflash.generations g
        WHERE g.status = 'ok' AND g.accepted_per_position IS NOT NULL AND g.steps > 0
          AND g.calling_role = workload_prior.calling_role
          AND g.source_table IS NOT DISTINCT FROM workload_prior.source_table
    ), recent AS (
        SELECT w.id, w.drafter, w.proposers, w.accepted, w.judged FROM workload w
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
            '[]'::jsonb),
        -- Per proposer: the steps it drafted, the tokens it had verified and those kept.
        'proposers', coalesce((SELECT jsonb_object_agg(t.name, jsonb_build_object(
                'steps', t.steps, 'drafted', t.drafted, 'accepted', t.accepted)) FROM (
            SELECT p.key AS name, sum((p.value->>'steps')::bigint) AS steps,
                   sum((p.value->>'drafted')::bigint) AS drafted, sum((p.value->>'accepted')::bigint) AS accepted
            FROM recent r, jsonb_each(r.proposers) p WHERE jsonb_typeof(r.proposers) = 'object'
            GROUP BY p.key) t), '{}'::jsonb));
END;
COMMENT ON FUNCTION dflash.workload_prior(regclass, name) IS
    'Pooled per-position draft acceptance (accepted and judged counts) of a workload''s last 200 generations: '
    'a role''s rows of a generate-on-insert table, or (source_table NULL) a role''s direct calls. Block length '
    'auto starts from it.';

-- A workload's past outputs as token ids, newest first, up to max_tokens in all: what the
-- worker's suffix proposer drafts from (its workload memory, loaded on first use). Always
-- one role's rows (the bridge asks as the caller, under row security; the queue consumer
-- for the row's own role), so one member's generations never feed another's proposals.
CREATE FUNCTION dflash.workload_history(source_table regclass, calling_role name DEFAULT current_user,
                                        max_tokens int DEFAULT 100000)
RETURNS TABLE (id bigint, output_ids int[]) LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT h.id, h.output_ids FROM (
        SELECT g.id, g.output_ids, sum(cardinality(g.output_ids)) OVER (ORDER BY g.id DESC) AS upto
        FROM dflash.generations g
        WHERE g.status = 'ok' AND g.output_ids IS NOT NULL
          AND g.calling_role = workload_history.calling_role
          AND g.source_table IS NOT DISTINCT FROM workload_history.source_table
        ORDER BY g.id DESC
        LIMIT 100000
    ) h
    WHERE h.upto <= workload_history.max_tokens
    ORDER BY h.id DESC;
END;
COMMENT ON FUNCTION dflash.workload_history(regclass, name, int) IS
    'A workload''s past outputs (token ids), newest first, up to max_tokens tokens: one role''s direct calls '
    '(source_table NULL) or one role''s rows of a generate-on-insert table. The suffix proposer drafts from them.';

-- Per workload: what auto expects on the worker's device (its cost curve lives in the
-- worker, which does the arithmetic: one place for the policy). Needs the worker running.
CREATE FUNCTION dflash._block_policy()
RETURNS TABLE (source_table regclass, calling_role name, generations bigint, drafter text,
               acceptance float8[], expected_tau float8[], tokens_per_s float8[], relative_cost float8[],
               start_block_size int, proposers jsonb)
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
    'block length auto starts that workload''s next call with; proposers: per proposer (dflash, suffix) its share '
    'of the drafted steps and its acceptance. Reading it asks the worker.';
