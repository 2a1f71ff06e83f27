-- The SQL API. PL/Python bodies are one line each: the work is in plpython/dflash_pg.py.
-- @BRIDGE@ is replaced at build time by the lines that import that module. They run as
-- the caller with search_path pinned; the bridge names every object with its schema.

CREATE FUNCTION @extschema@.dflash_generate(
    prompt text,
    max_new_tokens int DEFAULT 128,
    temperature float8 DEFAULT 0,
    block_size int DEFAULT NULL,
    top_p float8 DEFAULT 1,
    top_k int DEFAULT 0,
    seed bigint DEFAULT NULL,
    chat boolean DEFAULT true,
    proposals boolean DEFAULT true,
    json_schema jsonb DEFAULT NULL,
    regex text DEFAULT NULL,
    choices text[] DEFAULT NULL
) RETURNS text
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
@BRIDGE@
return dflash_pg.generate(plpy, "dflash_generate", prompt, dict(max_new_tokens=max_new_tokens,
    temperature=temperature, block_size=block_size, top_p=top_p, top_k=top_k, seed=seed, chat=chat,
    proposals=proposals, json_schema=json_schema, regex=regex, choices=choices))["text"]
$$;
COMMENT ON FUNCTION @extschema@.dflash_generate(text, int, float8, int, float8, int, bigint, boolean, boolean, jsonb, text, text[]) IS
    'Generate text with DFlash speculative decoding (lossless: greedy output equals the target''s own). '
    'NULL block_size (the default) means auto: each step''s length chosen by what pays on the worker''s device, '
    'starting from what this workload learned before (dflash.block_policy); with proposals (the default) the '
    'suffix proposer also drafts from the prompt, the output so far and this workload''s past outputs. At most one '
    'of json_schema, regex and choices gives the answer its form (the tokens it forces are drafted for free); an '
    'answer max_new_tokens cuts short of that form is an error (22001), never returned. Records a row in '
    'dflash.generations and dflash.memory.';

CREATE FUNCTION @extschema@.dflash_generate_stats(
    prompt text,
    max_new_tokens int DEFAULT 128,
    temperature float8 DEFAULT 0,
    block_size int DEFAULT NULL,
    top_p float8 DEFAULT 1,
    top_k int DEFAULT 0,
    seed bigint DEFAULT NULL,
    chat boolean DEFAULT true,
    proposals boolean DEFAULT true,
    json_schema jsonb DEFAULT NULL,
    regex text DEFAULT NULL,
    choices text[] DEFAULT NULL
) RETURNS jsonb
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
@BRIDGE@
import json
return json.dumps(dflash_pg.generate(plpy, "dflash_generate_stats", prompt, dict(max_new_tokens=max_new_tokens,
    temperature=temperature, block_size=block_size, top_p=top_p, top_k=top_k, seed=seed, chat=chat,
    proposals=proposals, json_schema=json_schema, regex=regex, choices=choices), cut_ok=True))
$$;
COMMENT ON FUNCTION @extschema@.dflash_generate_stats(text, int, float8, int, float8, int, bigint, boolean, boolean, jsonb, text, text[]) IS
    'Like dflash_generate, but returns the whole result as jsonb: text, output_ids, steps, tau, '
    'acceptance_rate, accepted_per_position, proposers, forced_tokens, truncated (an answer cut short of its '
    'form is returned here, with truncated true), timings and the dflash.generations id.';

CREATE FUNCTION @extschema@.dflash_generate(
    prompts text[],
    max_new_tokens int DEFAULT 128,
    temperature float8 DEFAULT 0,
    block_size int DEFAULT NULL,
    top_p float8 DEFAULT 1,
    top_k int DEFAULT 0,
    seed bigint DEFAULT NULL,
    chat boolean DEFAULT true,
    proposals boolean DEFAULT true,
    json_schema jsonb DEFAULT NULL,
    regex text DEFAULT NULL,
    choices text[] DEFAULT NULL
) RETURNS text[]
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
@BRIDGE@
return dflash_pg.generate_many(plpy, prompts, dict(max_new_tokens=max_new_tokens,
    temperature=temperature, block_size=block_size, top_p=top_p, top_k=top_k, seed=seed, chat=chat,
    proposals=proposals, json_schema=json_schema, regex=regex, choices=choices))
$$;
COMMENT ON FUNCTION @extschema@.dflash_generate(text[], int, float8, int, float8, int, bigint, boolean, boolean, jsonb, text, text[]) IS
    'Batch form of dflash_generate: one output per prompt, in order.';

CREATE FUNCTION @extschema@.dflash_generate_json(
    prompt text,
    schema jsonb,
    max_new_tokens int DEFAULT 128,
    temperature float8 DEFAULT 0,
    block_size int DEFAULT NULL,
    top_p float8 DEFAULT 1,
    top_k int DEFAULT 0,
    seed bigint DEFAULT NULL,
    chat boolean DEFAULT true,
    proposals boolean DEFAULT true
) RETURNS jsonb
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
@BRIDGE@
return dflash_pg.generate_json(plpy, prompt, schema, dict(max_new_tokens=max_new_tokens,
    temperature=temperature, block_size=block_size, top_p=top_p, top_k=top_k, seed=seed, chat=chat,
    proposals=proposals))
$$;
COMMENT ON FUNCTION @extschema@.dflash_generate_json(text, jsonb, int, float8, int, float8, int, bigint, boolean,
                                                     boolean) IS
    'A JSON value that validates against the JSON Schema `schema`, generated for the prompt (the grammar''s mask '
    'applies at every verified token; the tokens it forces are drafted for free). An answer max_new_tokens cuts '
    'short is an error (SQLSTATE 22001), never returned; a schema the grammar library cannot take is 22023.';

CREATE FUNCTION @extschema@.dflash_classify(
    input text,
    labels text[],
    max_new_tokens int DEFAULT 128,
    temperature float8 DEFAULT 0,
    block_size int DEFAULT NULL,
    top_p float8 DEFAULT 1,
    top_k int DEFAULT 0,
    seed bigint DEFAULT NULL,
    chat boolean DEFAULT true,
    proposals boolean DEFAULT true
) RETURNS text
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
@BRIDGE@
return dflash_pg.classify(plpy, input, labels, dict(max_new_tokens=max_new_tokens,
    temperature=temperature, block_size=block_size, top_p=top_p, top_k=top_k, seed=seed, chat=chat,
    proposals=proposals))
$$;
COMMENT ON FUNCTION @extschema@.dflash_classify(text, text[], int, float8, int, float8, int, bigint, boolean,
                                                boolean) IS
    'One of labels for the input text: the model is asked to classify the text with one of them, and its answer '
    'is constrained to be exactly one (greedy: chosen token by token, so of labels sharing a start the likelier start wins, not always the likeliest whole label). Empty labels are 22023.';

CREATE FUNCTION @extschema@.dflash_generate_block(prompt text, block_size int DEFAULT NULL)
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

CREATE FUNCTION @extschema@.dflash_embed(text text) RETURNS vector(384)
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
@BRIDGE@
return dflash_pg.embed(plpy, None if text is None else [text])[0]
$$;
COMMENT ON FUNCTION @extschema@.dflash_embed(text) IS
    'Embed a text with the worker''s sentence-embedding model (all-MiniLM-L6-v2: 384 dimensions, normalised).';

CREATE FUNCTION @extschema@.dflash_embed(texts text[]) RETURNS vector(384)[]
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
@BRIDGE@
return dflash_pg.embed(plpy, texts)
$$;
COMMENT ON FUNCTION @extschema@.dflash_embed(text[]) IS 'Batch form of dflash_embed: one vector per text, in order.';

-- The nearest rows of dflash.memory the caller may recall: their own and, unless they
-- say otherwise, rows an admin marked shared. A SQL-standard body, so pgvector's type and
-- operator are resolved at install time whatever schema pgvector lives in.
CREATE FUNCTION dflash._recall(q vector, k int, include_shared boolean)
RETURNS TABLE (generation_id bigint, prompt text, output text, distance float8, created_at timestamptz)
LANGUAGE sql STABLE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT m.generation_id, m.prompt, m.output, (m.embedding <=> q)::float8, m.created_at
    FROM dflash.memory m
    WHERE m.calling_role = current_user OR (include_shared AND m.shared)
    ORDER BY m.embedding <=> q
    LIMIT k;
END;

CREATE FUNCTION @extschema@.dflash_recall(query text, k int DEFAULT 5, include_shared boolean DEFAULT true)
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

CREATE FUNCTION @extschema@.dflash_worker_status() RETURNS jsonb
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE SET search_path = pg_catalog, pg_temp AS $$
@BRIDGE@
return dflash_pg.status(plpy)
$$;
COMMENT ON FUNCTION @extschema@.dflash_worker_status() IS
    'The worker''s status: models, device, uptime, requests served and in flight, tokens, recent mean tau.';
