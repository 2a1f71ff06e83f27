-- The SQL API. PL/Python bodies are one line each: the work is in plpython/dflash_pg.py.
-- @BRIDGE@ is replaced at build time by the lines that import that module.

CREATE FUNCTION dflash_generate(
    prompt text,
    max_new_tokens int DEFAULT 128,
    temperature float8 DEFAULT 0,
    block_size int DEFAULT NULL,
    top_p float8 DEFAULT 1,
    top_k int DEFAULT 0,
    seed bigint DEFAULT NULL,
    chat boolean DEFAULT true
) RETURNS text
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE AS $$
@BRIDGE@
return dflash_pg.generate(plpy, "dflash_generate", prompt, dict(max_new_tokens=max_new_tokens,
    temperature=temperature, block_size=block_size, top_p=top_p, top_k=top_k, seed=seed, chat=chat))["text"]
$$;
COMMENT ON FUNCTION dflash_generate(text, int, float8, int, float8, int, bigint, boolean) IS
    'Generate text with DFlash speculative decoding (lossless: greedy output equals the target''s own). '
    'NULL block_size means the worker''s default. Records a row in dflash.generations and dflash.memory.';

CREATE FUNCTION dflash_generate_stats(
    prompt text,
    max_new_tokens int DEFAULT 128,
    temperature float8 DEFAULT 0,
    block_size int DEFAULT NULL,
    top_p float8 DEFAULT 1,
    top_k int DEFAULT 0,
    seed bigint DEFAULT NULL,
    chat boolean DEFAULT true
) RETURNS jsonb
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE AS $$
@BRIDGE@
import json
return json.dumps(dflash_pg.generate(plpy, "dflash_generate_stats", prompt, dict(max_new_tokens=max_new_tokens,
    temperature=temperature, block_size=block_size, top_p=top_p, top_k=top_k, seed=seed, chat=chat)))
$$;
COMMENT ON FUNCTION dflash_generate_stats(text, int, float8, int, float8, int, bigint, boolean) IS
    'Like dflash_generate, but returns the whole result as jsonb: text, output_ids, steps, tau, '
    'acceptance_rate, accepted_per_position, timings and the dflash.generations id.';

CREATE FUNCTION dflash_generate(
    prompts text[],
    max_new_tokens int DEFAULT 128,
    temperature float8 DEFAULT 0,
    block_size int DEFAULT NULL,
    top_p float8 DEFAULT 1,
    top_k int DEFAULT 0,
    seed bigint DEFAULT NULL,
    chat boolean DEFAULT true
) RETURNS text[]
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE AS $$
@BRIDGE@
return dflash_pg.generate_many(plpy, prompts, dict(max_new_tokens=max_new_tokens,
    temperature=temperature, block_size=block_size, top_p=top_p, top_k=top_k, seed=seed, chat=chat))
$$;
COMMENT ON FUNCTION dflash_generate(text[], int, float8, int, float8, int, bigint, boolean) IS
    'Batch form of dflash_generate: one output per prompt, in order.';

CREATE FUNCTION dflash_generate_block(prompt text, block_size int DEFAULT 16)
RETURNS TABLE (draft_ids int[], draft_text text, accepted int, accepted_text text,
               next_token_id int, next_token_text text, first_token_text text)
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE AS $$
@BRIDGE@
return dflash_pg.generate_block(plpy, prompt, block_size)
$$;
COMMENT ON FUNCTION dflash_generate_block(text, int) IS
    'One DFlash block for a chat prompt: after the target''s first token, the drafter proposes '
    'block_size - 1 tokens in one forward; returns them, how many the target accepted, the accepted '
    'text and the target''s next token.';

CREATE FUNCTION dflash_embed(text text) RETURNS vector(384)
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE AS $$
@BRIDGE@
return dflash_pg.embed(plpy, None if text is None else [text])[0]
$$;
COMMENT ON FUNCTION dflash_embed(text) IS
    'Embed a text with the worker''s sentence-embedding model (all-MiniLM-L6-v2: 384 dimensions, normalised).';

CREATE FUNCTION dflash_embed(texts text[]) RETURNS vector(384)[]
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE AS $$
@BRIDGE@
return dflash_pg.embed(plpy, texts)
$$;
COMMENT ON FUNCTION dflash_embed(text[]) IS 'Batch form of dflash_embed: one vector per text, in order.';

CREATE FUNCTION dflash_recall(query text, k int DEFAULT 5)
RETURNS TABLE (generation_id bigint, prompt text, output text, distance float8, created_at timestamptz)
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE AS $$
DECLARE
    q vector(384);
BEGIN
    IF query IS NULL OR k IS NULL THEN
        RAISE EXCEPTION 'dflash_recall: query and k must not be NULL' USING ERRCODE = '22004';
    END IF;
    IF k < 1 THEN
        RAISE EXCEPTION 'dflash_recall: k must be >= 1, got %', k USING ERRCODE = '22023';
    END IF;
    q := dflash_embed(query);  -- once, not per row
    RETURN QUERY
        SELECT m.generation_id, m.prompt, m.output, (m.embedding <=> q)::float8, m.created_at
        FROM dflash.memory m
        ORDER BY m.embedding <=> q
        LIMIT k;
END
$$;
COMMENT ON FUNCTION dflash_recall(text, int) IS
    'The k past generations nearest to the query in dflash.memory (cosine distance, HNSW index).';

CREATE FUNCTION dflash_worker_status() RETURNS jsonb
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE AS $$
@BRIDGE@
return dflash_pg.status(plpy)
$$;
COMMENT ON FUNCTION dflash_worker_status() IS
    'The worker''s status: models, device, uptime, requests served and in flight, tokens, recent mean tau.';
