"""The PL/Python side of dflash: thin, stdlib-only, runs inside PostgreSQL backends.

It reads settings from dflash.config (never from GUCs), forwards requests to the
worker over its Unix socket with the shared stdlib client, waits in short slices
running `SELECT 1` between them so statement_timeout and query cancel interrupt
the wait (the client then hangs up and the worker stops the request), maps worker
errors to SQLSTATEs, and records results in the caller's transaction. The SQL functions
run with search_path pinned to pg_catalog, so every query here names its schema.
A U+0000 in an answer (PostgreSQL text cannot hold it) comes back as U+FFFD.
"""

import json

from dflash import error_codes  # each worker error code's SQLSTATE and hint: one table
from dflash.serve.client import Client, WorkerError
from dflash.options import CONSTRAINTS, SQL_OPTIONS, in_required_order
from dflash.serve.protocol import HISTORY_TOKENS, cut_short, pg_text, wants_prior, wants_workload, workload_key

# dflash_classify's prompt: the input with the labels to choose from (the answer is then
# constrained to be exactly one of them).
CLASSIFY_PROMPT = "Classify the text below. Answer with exactly one of these labels: {labels}.\n\nText: {text}"


def settings(plpy):
    return {r["key"]: r["value"] for r in plpy.execute("SELECT c.key, c.value FROM dflash.config c")}


def _timeout_ms(plpy, cfg):
    """The statement's own timeout, passed down as the request's deadline."""
    row = plpy.execute(
        "SELECT (extract(epoch FROM pg_catalog.current_setting('statement_timeout')::interval) * 1000)::bigint AS ms"
    )[0]
    ms = [int(x) for x in (row["ms"] or 0, cfg.get("default_timeout_ms") or 0) if int(x) > 0]
    return min(ms) if ms else None


def fail(plpy, message, sqlstate, hint=None, detail=None):
    extra = {k: v for k, v in (("detail", detail), ("hint", hint)) if v is not None}  # None would print "None"
    plpy.error(message, sqlstate=sqlstate, **extra)


def call(plpy, op, params, cfg=None, history=None):
    """One request to the worker. `history`: how to read the workload's past outputs, should
    the worker have no memory of the request's workload yet (it answers need_history; the
    request is sent again with them)."""
    cfg = cfg or settings(plpy)
    socket_path = cfg["socket_path"]
    client = Client(socket_path, connect_timeout=int(cfg.get("connect_timeout_ms", 2000)) / 1000.0, slice_s=0.05)
    try:
        check = lambda: plpy.execute("SELECT 1")  # noqa: E731
        try:
            return client.call(op, params, timeout_ms=_timeout_ms(plpy, cfg), check=check)
        except WorkerError as exc:
            if exc.code != "need_history" or history is None:
                raise
            return client.call(op, dict(params, history=history()), timeout_ms=_timeout_ms(plpy, cfg), check=check)
    except WorkerError as exc:
        state, hint = error_codes.sqlstate(exc.code)
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
    params.update({k: args[k] for k in SQL_OPTIONS if k in args and args[k] is not None})
    if isinstance(params.get("json_schema"), str):  # a jsonb argument comes as its text
        params["json_schema"] = json.loads(params["json_schema"])
    if "json_schema" in params:  # jsonb kept no key order: the required list's is taken
        params["json_schema"] = in_required_order(params["json_schema"])
    if "choices" in params and any(c is None for c in params["choices"]):
        fail(plpy, f"{fn}: choices must not contain NULL", "22004")
    return params


def whole(plpy, fn, result):
    """A constrained answer that max_new_tokens cut short is an error, never an answer."""
    why = cut_short(result)
    if why is not None:
        state, hint = error_codes.sqlstate("truncated")
        fail(plpy, f"{fn}: {why}", state, hint=hint, detail="worker error code: truncated")
    return result


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


_READ_ONLY = "SELECT pg_catalog.current_setting('transaction_read_only')::boolean AS ro"


def check_writable(plpy, fn):
    """A generation is recorded in the caller's transaction: in a read-only one (every
    transaction on a standby is one) refuse it before the worker generates an answer that
    could not be written down."""
    if plpy.execute(_plan(plpy, "read_only", _READ_ONLY, []))[0]["ro"]:
        fail(plpy, f"{fn}: cannot record a generation in a read-only transaction", "25006",
             hint="call it in a read-write transaction on the primary (a standby's transactions are all read-only)")


# --- what the SQL functions call -------------------------------------------------------------


_PRIOR = "SELECT dflash.workload_prior($1, pg_catalog.current_user()) AS prior"
_HISTORY = "SELECT h.output_ids FROM dflash.workload_history($1, pg_catalog.current_user(), $2) h"
_ME = "SELECT pg_catalog.current_user()::text AS me"


def workload(plpy, request, source_table=None):
    """The workload the request drafts from (the caller's direct calls, or the caller's rows
    of this table), and how to read its history: under the caller's row security, so it
    only ever holds rows the caller could read."""
    me = plpy.execute(_plan(plpy, "me", _ME, []))[0]["me"]
    oid = None if source_table is None else int(source_table)
    request["workload"] = workload_key(me, oid)

    def history():
        plan = _plan(plpy, "history", _HISTORY, ["regclass", "int"])
        return [list(r["output_ids"]) for r in plpy.execute(plan, [source_table, HISTORY_TOKENS])]

    return history


def workload_prior(plpy, source_table=None):
    """Pooled per-position acceptance of the caller's recent generations of this workload
    (the same source table for triggered rows, else the caller's direct calls), or None."""
    plan = _plan(plpy, "prior", _PRIOR, ["regclass"])
    prior = json.loads(plpy.execute(plan, [source_table])[0]["prior"])
    return {k: prior[k] for k in ("accepted", "judged")} if prior["generations"] else None


def generate(plpy, fn, prompt, args, mode="sync", source_table=None, cut_ok=False):
    """One generation, recorded. `cut_ok`: an answer cut short of its form is returned (with
    "truncated": true) rather than refused (dflash_generate_stats)."""
    import time

    params = generation_params(plpy, fn, prompt, args)
    check_writable(plpy, fn)
    cfg = settings(plpy)
    t = time.monotonic()
    # The worker embeds the answer for dflash.memory in the same call (`remember`), and
    # block length auto starts from what this workload's earlier generations learned.
    request = dict(params, remember=cfg.get("remember", "on") == "on")
    if wants_prior(params):
        request["prior"] = workload_prior(plpy, source_table)
    history = workload(plpy, request, source_table) if wants_workload(params) else None
    result = pg_text(call(plpy, "generate", request, cfg, history))
    if not cut_ok:
        whole(plpy, fn, result)
    total_ms = (time.monotonic() - t) * 1000
    result["generation_id"] = record(plpy, mode, params, result, total_ms, source_table)
    result.pop("memory", None)  # stored; not part of what the caller sees
    return result


def generate_many(plpy, prompts, args):
    """dflash_generate(text[]): one batched request (the worker serves every prompt in the
    same engine steps), one dflash.generations row per prompt."""
    import time

    _check_not_null(plpy, "dflash_generate", prompts=prompts)
    if any(p is None for p in prompts):
        fail(plpy, "dflash_generate: prompts must not contain NULL", "22004")
    params = generation_params(plpy, "dflash_generate", prompts[0] if prompts else "", args)
    del params["prompt"]
    if not prompts:  # nothing to generate, but bad options are still an error
        if any(k in params for k in CONSTRAINTS):
            call(plpy, "check_options", params)
        return []
    check_writable(plpy, "dflash_generate")
    cfg = settings(plpy)
    t = time.monotonic()
    request = dict(params, prompts=list(prompts), remember=cfg.get("remember", "on") == "on")
    if wants_prior(params):
        request["prior"] = workload_prior(plpy)
    history = workload(plpy, request) if wants_workload(params) else None
    results = [whole(plpy, "dflash_generate", r) for r in
               pg_text(call(plpy, "generate_many", request, cfg, history))["results"]]
    total_ms = (time.monotonic() - t) * 1000
    for prompt, result in zip(prompts, results):
        record(plpy, "sync", dict(params, prompt=prompt), result, total_ms)
    return [r["text"] for r in results]


def generate_json(plpy, prompt, schema, args):
    """dflash_generate_json: a JSON value that validates against `schema` (returned as jsonb)."""
    _check_not_null(plpy, "dflash_generate_json", schema=schema)
    return generate(plpy, "dflash_generate_json", prompt, dict(args, json_schema=schema))["text"]


def classify(plpy, text, labels, args):
    """dflash_classify: the label out of `labels` the model gives the text."""
    _check_not_null(plpy, "dflash_classify", input=text, labels=labels)
    if any(label is None for label in labels):
        fail(plpy, "dflash_classify: labels must not contain NULL", "22004")
    prompt = CLASSIFY_PROMPT.format(labels=", ".join(labels), text=text)
    return generate(plpy, "dflash_classify", prompt, dict(args, choices=list(labels)))["text"]


def check_options(plpy, options):
    """dflash.enable_generation's check of a table's options with a constraint, by the worker."""
    opts = json.loads(options)
    call(plpy, "check_options", {k: opts[k] for k in SQL_OPTIONS if k in opts})


def generate_block(plpy, prompt, block_size):
    _check_not_null(plpy, "dflash_generate_block", prompt=prompt)
    r = pg_text(call(plpy, "generate_block", {"prompt": prompt, "block_size": block_size}))
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
    if not plpy.execute("SELECT pg_catalog.pg_has_role('dflash_user', 'USAGE') AS ok")[0]["ok"]:
        fail(plpy, f"dflash: inserting into {TD['table_schema']}.{TD['table_name']} generates text, which only "
             "members of dflash_user may do", "42501", hint="GRANT dflash_user TO the inserting role")
    prompt = TD["new"].get(prompt_col)
    if prompt is None:
        return None
    result = generate(plpy, "dflash trigger", prompt, options, mode="trigger-sync", source_table=TD["relid"])
    TD["new"][output_col] = result["text"]
    return "MODIFY"


def block_policy(plpy):
    """The rows of the view dflash.block_policy: per workload the caller may see (a role's
    direct calls, or a role's rows of a table), its pooled acceptance, what block length auto
    expects of it on the worker's device, and who drafted for it."""
    workloads = plpy.execute(
        "SELECT g.source_table::oid AS tbl, g.calling_role AS role"
        " FROM dflash.generations g WHERE g.status = 'ok' AND g.accepted_per_position IS NOT NULL"
        " GROUP BY 1, 2 ORDER BY 1 NULLS FIRST, 2")
    plan = _plan(plpy, "prior_of", "SELECT dflash.workload_prior($1::oid::regclass, $2) AS prior", ["oid", "name"])
    cfg = settings(plpy)
    rows = []
    for w in workloads:
        prior = json.loads(plpy.execute(plan, [w["tbl"], w["role"]])[0]["prior"])
        ex = call(plpy, "explain_policy", {"prior": {k: prior[k] for k in ("accepted", "judged")}}, cfg)
        lengths = ex["lengths"]
        rows.append((w["tbl"], w["role"], prior["generations"], prior["drafter"], ex["acceptance"],
                     [r["expected_tau"] for r in lengths], [r["tokens_per_s"] for r in lengths],
                     [r["relative_cost"] for r in lengths], ex["start_block_size"],
                     json.dumps(proposer_shares(prior.get("proposers") or {}))))
    return rows


def proposer_shares(pooled):
    """Per proposer: its share of the drafted steps and its acceptance (kept / verified)."""
    steps = sum(c["steps"] for c in pooled.values())
    return {name: {**c, "share": c["steps"] / steps if steps else None,
                   "acceptance": c["accepted"] / c["drafted"] if c["drafted"] else None}
            for name, c in sorted(pooled.items())}


_VERSION = ("SELECT v.version, v.sha256, v.path FROM dflash.drafter_versions v"
            " WHERE v.adopted AND v.target = $1 AND ($2::text IS NULL OR v.version = $2) ORDER BY v.id DESC LIMIT 1")


def reload_drafter(plpy, version):
    """dflash.reload_drafter(): the worker loads an adopted drafter version (the newest for
    its target, or the one named), checking the weights' digest."""
    cfg = settings(plpy)
    target = call(plpy, "status", {}, cfg)["target"]
    rows = plpy.execute(_plan(plpy, "version", _VERSION, ["text", "text"]), [target, version])
    if not rows:
        which = f"version {version}" if version is not None else "version"
        fail(plpy, f"dflash.reload_drafter: no adopted drafter {which} for target {target} in dflash.drafter_versions",
             "22023", hint="dflash train --from-database DSN writes one when a fine-tuned drafter beats the old one")
    row = rows[0]
    return json.dumps(call(plpy, "reload_drafter", {"path": row["path"], "sha256": row["sha256"]}, cfg))
