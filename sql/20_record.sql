-- The one place a finished generation is written down: the generations row and, when the
-- worker embedded it (generate with "remember": true puts `memory` {embedder, embedding}
-- in its answer), its memory row. The SQL functions call it from PL/Python (in the
-- caller's transaction, as the caller); the worker's queue consumer calls it too.
-- `result` is the worker's generate answer as JSON (protocol v1); times are milliseconds.
-- It runs as its caller: the row is the caller's (calling_role defaults to current_user and
-- the policies refuse any other role for a member; only the queue consumer records rows
-- for the role that queued them). A SQL-standard body: names are resolved at install time.

CREATE FUNCTION dflash.record_generation(
    mode text, prompt text, params jsonb, result jsonb, queue_ms float8, total_ms float8,
    source_table regclass DEFAULT NULL, calling_role name DEFAULT NULL)
RETURNS bigint LANGUAGE sql VOLATILE SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    INSERT INTO dflash.generations (mode, status, prompt, output, target, drafter, drafter_version, params, block_size,
        steps, new_tokens, tau, acceptance_rate, accepted_per_position, judged_per_position, block_policy,
        verify_lengths, prefill_ms, decode_ms, queue_ms, total_ms, tokens_per_s, output_ids, calling_role, source_table,
        proposers, backend, forced_tokens, truncated)
    VALUES (mode, 'ok', prompt, result->>'text', result->>'target', result->>'drafter', result->>'drafter_version', params,
        -- block length auto has no one block size: NULL, and verify_lengths says what it chose
        CASE WHEN result->>'block_policy' = 'auto' THEN NULL ELSE (result->>'block_size')::int END,
        (result->>'num_steps')::int, (result->>'new_tokens')::int,
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
        coalesce(record_generation.calling_role, current_user), source_table,
        CASE WHEN jsonb_typeof(result->'proposers') = 'object' THEN result->'proposers' END,
        result->>'backend', (result->>'forced_tokens')::int, (result->>'truncated')::boolean);
    -- A separate statement, so the memory policy's check sees the generation row it belongs to.
    INSERT INTO dflash.memory (generation_id, prompt, output, embedding, embedder, calling_role)
    SELECT currval('dflash.generations_id_seq'), prompt, result->>'text',
           (result->'memory'->>'embedding')::vector(384), result->'memory'->>'embedder',
           coalesce(record_generation.calling_role, current_user)
    WHERE result ? 'memory';
    SELECT currval('dflash.generations_id_seq');
END;
