"""The PL/Python side of dflash: thin, stdlib-only, runs inside PostgreSQL backends.

It reads settings from dflash.config (never from GUCs), forwards requests to the
worker over its Unix socket with the shared stdlib client, waits in short slices
running `SELECT 1` between them so statement_timeout and query cancel interrupt
the wait (the client then hangs up and the worker stops the request), maps worker
errors to SQLSTATEs, and records results in the caller's transaction.
"""

import json

from dflash.serve.client import Client, WorkerError

# Worker error code -> (SQLSTATE, hint). DF000-DF002 are dflash's own class.
BAD_INPUT = (
    "bad_params empty_prompt bad_prompt bad_input_ids bad_block_size bad_max_new_tokens bad_temperature "
    "bad_top_p bad_top_k bad_verify bad_seed bad_stop empty_text"
).split()
SQLSTATES = {
    "unavailable": ("DF001", "start the dflash worker (dflash serve --socket {socket}) or point "
                    "dflash.set_config('socket_path', ...) at it"),
    "busy": ("DF002", "the worker's queue is full; retry later or start it with a larger --max-queue"),
    "shutting_down": ("DF001", "the dflash worker is stopping; start it again (dflash serve)"),
    "deadline": ("57014", "raise statement_timeout or ask for fewer tokens"),
    "cancelled": ("57014", None),
    "forbidden": ("42501", "start the worker with --allow-uid/--allow-gid including the PostgreSQL server's user"),
    "context_exceeded": ("54000", "shorten the prompt or ask for fewer new tokens"),
    "frame_too_large": ("54000", "the request is larger than the worker's --max-frame"),
    "no_embedder": ("DF000", "start the worker with an embedding model (without --no-embedder)"),
}

_GENERATE_KEYS = ("max_new_tokens", "temperature", "block_size", "top_p", "top_k", "seed", "chat")


def settings(plpy):
    return {r["key"]: r["value"] for r in plpy.execute("SELECT key, value FROM dflash.config")}


def _timeout_ms(plpy, cfg):
    """The statement's own timeout, passed down as the request's deadline."""
    row = plpy.execute(
        "SELECT (extract(epoch FROM pg_catalog.current_setting('statement_timeout')::interval) * 1000)::bigint AS ms"
    )[0]
    ms = [int(x) for x in (row["ms"] or 0, cfg.get("default_timeout_ms") or 0) if int(x) > 0]
    return min(ms) if ms else None


def fail(plpy, message, sqlstate, hint=None, detail=None):
    plpy.error(message, detail=detail, hint=hint, sqlstate=sqlstate)


def call(plpy, op, params, cfg=None):
    cfg = cfg or settings(plpy)
    socket_path = cfg["socket_path"]
    client = Client(socket_path, connect_timeout=int(cfg.get("connect_timeout_ms", 2000)) / 1000.0, slice_s=0.05)
    try:
        return client.call(op, params, timeout_ms=_timeout_ms(plpy, cfg), check=lambda: plpy.execute("SELECT 1"))
    except WorkerError as exc:
        if exc.code in BAD_INPUT:
            state, hint = "22023", None
        else:
            state, hint = SQLSTATES.get(exc.code, ("DF000", None))
        fail(plpy, f"dflash: {exc.message}", state, hint=hint.format(socket=socket_path) if hint else None,
             detail=f"worker error code: {exc.code}")
    finally:
        client.close()


def _check_not_null(plpy, fn, **values):
    for name, value in values.items():
        if value is None:
            fail(plpy, f"{fn}: {name} must not be NULL", "22004")


def generation_params(plpy, fn, prompt, args):
    _check_not_null(plpy, fn, prompt=prompt, **{k: args[k] for k in ("max_new_tokens", "temperature", "top_p",
                                                                      "top_k", "chat") if k in args})
    params = {"prompt": prompt}
    params.update({k: args[k] for k in _GENERATE_KEYS if k in args and args[k] is not None})
    return params


# --- recording ----------------------------------------------------------------------------

_RECORD = "SELECT dflash.record_generation($1, $2, $3::jsonb, $4::jsonb, $5, $6, $7) AS id"


def _plan(plpy, name, query, types):
    import sys

    plans = sys.modules[__name__].__dict__.setdefault("_plans", {})
    if name not in plans:
        plans[name] = plpy.prepare(query, types)
    return plans[name]


def record(plpy, mode, params, result, total_ms, source_table=None):
    """Write the generations row (and the memory row, from the answer's `memory`) in the
    caller's transaction."""
    plan = _plan(plpy, "record", _RECORD, ["text", "text", "text", "text", "float8", "float8", "regclass"])
    shown = {k: v for k, v in params.items() if k != "prompt"}
    return plpy.execute(plan, [mode, params["prompt"], json.dumps(shown), json.dumps(result), result.get("queue_ms"),
                               total_ms, source_table])[0]["id"]


# --- what the SQL functions call -------------------------------------------------------------


def generate(plpy, fn, prompt, args, mode="sync"):
    import time

    params = generation_params(plpy, fn, prompt, args)
    cfg = settings(plpy)
    t = time.monotonic()
    # The worker embeds the answer for dflash.memory in the same call (`remember`).
    result = call(plpy, "generate", dict(params, remember=cfg.get("remember", "on") == "on"), cfg)
    total_ms = (time.monotonic() - t) * 1000
    result["generation_id"] = record(plpy, mode, params, result, total_ms)
    result.pop("memory", None)  # stored; not part of what the caller sees
    return result


def generate_many(plpy, prompts, args):
    _check_not_null(plpy, "dflash_generate", prompts=prompts)
    return [generate(plpy, "dflash_generate", p, args)["text"] for p in prompts]


def generate_block(plpy, prompt, block_size):
    _check_not_null(plpy, "dflash_generate_block", prompt=prompt, block_size=block_size)
    r = call(plpy, "generate_block", {"prompt": prompt, "block_size": block_size, "chat": True})
    return [(r["draft_ids"], r["draft_text"], r["accepted"], r["accepted_text"], r["next_token_id"],
             r["next_token_text"], r["anchor_text"])]


def vector_text(values):
    return "[" + ",".join(repr(x) for x in values) + "]"


def embed(plpy, texts):
    _check_not_null(plpy, "dflash_embed", text=texts)
    if any(t is None for t in texts):
        fail(plpy, "dflash_embed: texts must not contain NULL", "22004")
    if not texts:
        return []
    return [vector_text(v) for v in call(plpy, "embed", {"texts": list(texts)})["embeddings"]]


def status(plpy):
    return json.dumps(call(plpy, "status", {}))


def trigger_sync(plpy, TD):
    """BEFORE INSERT, mode sync: fill the output column within the inserting statement."""
    prompt_col, output_col, options = TD["args"][0], TD["args"][1], json.loads(TD["args"][2])
    options.setdefault("chat", True)  # as the queue consumer does
    prompt = TD["new"].get(prompt_col)
    if prompt is None:
        return None
    result = generate(plpy, "dflash trigger", prompt, options, mode="trigger-sync")
    TD["new"][output_col] = result["text"]
    return "MODIFY"
