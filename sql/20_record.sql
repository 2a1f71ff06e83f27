-- The one place a finished generation is written down: the generations row and, when the
-- worker embedded it (generate with "remember": true puts `memory` {embedder, embedding}
-- in its answer), its memory row. The SQL functions call it from PL/Python (in the
-- caller's transaction, as the caller); the worker's queue consumer calls it too.
-- `result` is the worker's generate answer as JSON (protocol v1); times are milliseconds.

CREATE FUNCTION dflash.record_generation(
    mode text, prompt text, params jsonb, result jsonb, queue_ms float8, total_ms float8,
    source_table regclass DEFAULT NULL, calling_role name DEFAULT NULL)
RETURNS bigint LANGUAGE sql AS $$
    WITH gen AS (
        INSERT INTO dflash.generations (mode, status, prompt, output, target, drafter, params, block_size,
            steps, new_tokens, tau, acceptance_rate, accepted_per_position, prefill_ms, decode_ms, queue_ms,
            total_ms, tokens_per_s, calling_role, source_table)
        VALUES (mode, 'ok', prompt, result->>'text', result->>'target', result->>'drafter', params,
            (result->>'block_size')::int, (result->>'num_steps')::int, (result->>'new_tokens')::int,
            (result->>'tau')::float8, (result->>'acceptance_rate')::float8,
            CASE WHEN jsonb_typeof(result->'accepted_per_position') = 'array' THEN
                ARRAY(SELECT jsonb_array_elements_text(result->'accepted_per_position'))::int[] END,
            1000 * (result->>'prefill_s')::float8, 1000 * (result->>'decode_s')::float8, queue_ms, total_ms,
            (result->>'tokens_per_s')::float8, coalesce(calling_role, current_user), source_table)
        RETURNING id, output
    ), mem AS (
        INSERT INTO dflash.memory (generation_id, prompt, output, embedding, embedder)
        SELECT id, prompt, output, (result->'memory'->>'embedding')::vector(384), result->'memory'->>'embedder'
        FROM gen WHERE result ? 'memory'
    )
    SELECT id FROM gen
$$;
