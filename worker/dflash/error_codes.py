"""Every error code dflash reports, in one place: its SQLSTATE, what it means and the hint.

A `DFlashError`, a worker's error answer, the client's `WorkerError` and the protocol's
`ProtocolError` all carry one of these codes. The protocol's bad-input list, the PL/Python
bridge's SQLSTATEs and hints, the queue consumer's give-up-at-once list and the docs' table
(docs/sql.md) all read this table; tests/test_error_codes.py holds every code raised in the
source tree, the bridge and the docs to it. Stdlib only: PostgreSQL backends import it
through the bridge.

SQLSTATEs: bad input is 22023; a constrained answer cut short by max_new_tokens is 22001
(string data, right truncation); a worker started without what the request needs (no_embedder)
is 55000, object not in prerequisite state; DF000 (other worker errors), DF001 (the worker, or
the inference endpoint it sends requests to, is down or stopping) and DF002 (its queue is
full) are dflash's own class. A code the table does not know becomes DF000.
"""

from __future__ import annotations

from dataclasses import dataclass

BAD_INPUT_STATE = "22023"
OTHER_STATE = "DF000"


@dataclass(frozen=True)
class ErrorCode:
    code: str
    sqlstate: str  # what a SQL caller gets (PL/Python bridge)
    meaning: str
    hint: str | None = None  # the HINT a SQL caller gets; {socket}: the worker's socket path
    final: bool = False  # the queue consumer gives a row up at once: another attempt cannot mend it


def _bad(code: str, meaning: str) -> ErrorCode:
    return ErrorCode(code, BAD_INPUT_STATE, meaning)


def _other(code: str, meaning: str, hint: str | None = None, final: bool = False) -> ErrorCode:
    return ErrorCode(code, OTHER_STATE, meaning, hint, final)


ERROR_CODES = (
    # The request's input (SQLSTATE 22023): nothing is generated or written.
    _bad("bad_params", "a parameter is unknown, of the wrong type or out of range"),
    _bad("empty_prompt", "the prompt (or its input ids) is empty"),
    _bad("bad_prompt", "not exactly one of a prompt text or input ids, or a prompt the target cannot take "
                       "(no tokenizer, no chat template)"),
    _bad("bad_input_ids", "input ids outside the target's vocabulary"),
    _bad("bad_block_size", "block_size is not an integer from 1 to the drafter's block size (or null: auto)"),
    _bad("bad_max_new_tokens", "max_new_tokens is not an integer >= 1"),
    _bad("bad_temperature", "temperature is not a finite number >= 0"),
    _bad("bad_top_p", "top_p is not in (0, 1]"),
    _bad("bad_top_k", "top_k is not an integer >= 0"),
    _bad("bad_verify", "verify is not a known mode, or 'greedy' with a temperature above 0"),
    _bad("bad_seed", "seed is not an integer in [0, 2^63)"),
    _bad("bad_stop", "stop strings or stop ids the target cannot use"),
    _bad("bad_prior", "prior is not {\"accepted\": [counts], \"judged\": [counts]} of numbers >= 0"),
    _bad("empty_text", "a text to embed is empty"),
    _bad("bad_json_schema", "json_schema is not a JSON Schema object, or one no value satisfies"),
    _bad("unsupported_schema", "json_schema uses a keyword, format or reference the grammar library does not "
                               "implement"),
    _bad("bad_regex", "regex is not a string the grammar library compiles (Rust's regex syntax: no look-around, "
                      "no back-references)"),
    _bad("bad_choices", "choices is not a non-empty list of non-empty strings"),
    _bad("conflicting_constraints", "more than one of json_schema, regex and choices, or one of them with stop "
                                    "strings or stop ids (the grammar decides where the answer ends)"),
    _bad("unsupported_option", "an option this worker cannot honour: with --backend openai block_size and so "
                               "generate_block, verify, json_schema, regex and choices; a constraint on a target "
                               "without a tokenizer"),
    ErrorCode("truncated", "22001", "max_new_tokens (or the context) cut a constrained answer (json_schema, regex, "
              "choices) short of a whole one: it would not parse or validate, so it is not returned as an answer",
              "raise max_new_tokens (dflash_generate_stats returns the cut answer with \"truncated\": true)",
              final=True),
    ErrorCode("context_exceeded", "54000", "the prompt plus max_new_tokens does not fit the target's context",
              "shorten the prompt or ask for fewer new tokens"),
    ErrorCode("frame_too_large", "54000", "a frame over the receiver's limit: a request over the worker's "
              "--max-frame (the worker answers, then hangs up)", "the request is larger than the worker's --max-frame"),
    # The worker and the connection to it.
    ErrorCode("unavailable", "DF001", "the client cannot reach the worker, or lost it mid-call",
              "start the dflash worker (dflash serve --socket {socket}) or point "
              "dflash.set_config('socket_path', ...) at it"),
    ErrorCode("shutting_down", "DF001", "the worker is stopping and takes no new requests",
              "the dflash worker is stopping; start it again (dflash serve)"),
    ErrorCode("endpoint_unavailable", "DF001", "the worker's inference endpoint (--backend openai) cannot be "
              "reached, refuses the connection or says it is not ready, before anything was generated",
              "start the inference server the worker's --endpoint names, or point the worker at one that runs"),
    ErrorCode("busy", "DF002", "the worker's queue is full",
              "the worker's queue is full; retry later or start it with a larger --max-queue"),
    ErrorCode("deadline", "57014", "the request passed its deadline (timeout_ms: the statement's timeout)",
              "raise statement_timeout or ask for fewer tokens"),
    ErrorCode("cancelled", "57014", "the request was cancelled"),
    ErrorCode("forbidden", "42501", "the connecting user may not use the worker (--allow-uid/--allow-gid); "
              "in `dflash train --from-database`, the role may not read dflash.training_rows",
              "start the worker with --allow-uid/--allow-gid including the PostgreSQL server's user"),
    ErrorCode("no_embedder", "55000", "the worker was started without an embedding model (--no-embedder): it "
              "cannot embed, nor remember a generation (the extension's 'remember' setting, on by default)",
              "start the worker with an embedding model (without --no-embedder), or stop remembering generations: "
              "SELECT dflash.set_config('remember', 'off')"),
    _other("bad_frame", "a frame that is not a UTF-8 JSON object, or nests too deeply (the connection stays "
                        "usable)"),
    _other("bad_version", "the request's protocol version is not the worker's"),
    _other("unknown_op", "an operation the worker does not know"),
    _other("duplicate_id", "a request id that is already in flight from the same client"),
    _other("forbidden_path", "reload_drafter: a path outside the worker's --drafter-root folders"),
    _other("endpoint_error", "the worker's inference endpoint answered with an error or with something that is "
                             "not its API, stopped answering, or broke off mid-answer"),
    _other("internal", "a bug in the worker: the request failed unexpectedly"),
    _other("closed", "the other side closed the connection (the client reports it as unavailable)"),
    _other("error", "an error answer that names no code"),
    _other("need_history", "internal, between the bridge and the worker: the worker has no memory of the "
                           "request's workload yet, and the bridge sends the request again with its history"),
    # The generate-on-insert queue.
    _other("not_enabled", "a queued row's table no longer has generation enabled", final=True),
    _other("row_gone", "a queued row no longer exists or its prompt changed", final=True),
    # Models: loading them (worker start, reload_drafter, the CLI).
    _other("bad_drafter", "a drafter that cannot be found, read or run"),
    _other("incompatible_drafter", "a drafter that does not fit the target (hidden size, vocabulary, layers)"),
    _other("bad_target", "a target that cannot be found, read or run"),
    _other("backend_unusable", "a target backend asked for by name failed its probe on this machine (its child "
                               "process died, hung or disagreed with the reference path)",
           "choose another --target-backend (or auto), or probe again after a rebuild: dflash doctor --reprobe"),
    _other("bad_head", "a next-token head that cannot be read"),
    _other("bad_embedder", "an embedding model that cannot be read"),
    _other("missing_model", "a default model's package is not installed"),
    _other("bad_dtype", "--dtype or --draft-dtype is not a known dtype"),
    _other("bad_device", "--device is not cpu or an available cuda[:N]"),
    _other("socket_in_use", "dflash serve: another worker listens on the socket, or its path is not a socket"),
    # Commands (CLI only).
    _other("bad_format", "dflash convert: a bad --to or --outtype, or an output that would overwrite"),
    _other("export_failed", "dflash convert: the ONNX export failed"),
    _other("bad_corpus", "dflash train: a training corpus that is missing, altered or holds benchmark prompts"),
    _other("output_in_use", "dflash train: another process is writing the output"),
    _other("bad_filter", "dflash train --from-database: a filter the database rejects"),
    _other("too_few_rows", "dflash train --from-database: too few rows of dflash.training_rows to train on"),
    _other("bad_assistant", "dflash bench: the assistant model's weights are missing or incomplete"),
    _other("bad_method", "dflash bench: a method that cannot run with these models"),
    _other("peer_failed", "dflash bench: building or running llama.cpp failed"),
    _other("bad_prompts", "dflash bench --prompts: a prompts file that is missing, empty or not JSON lines"),
    _other("unknown_suite", "dflash bench: an unknown prompt suite"),
    _other("missing_suite", "dflash bench: a prompt suite's package is not installed"),
)

BY_CODE = {c.code: c for c in ERROR_CODES}
assert len(BY_CODE) == len(ERROR_CODES), "an error code is listed twice"

# Codes that mean the caller's input was wrong (SQLSTATE 22023).
BAD_INPUT = tuple(c.code for c in ERROR_CODES if c.sqlstate == BAD_INPUT_STATE)
# Codes after which the queue consumer gives a row up at once.
FINAL = tuple(c.code for c in ERROR_CODES if c.final)
# code -> (SQLSTATE, hint or None), as the bridge reports it.
SQLSTATES = {c.code: (c.sqlstate, c.hint) for c in ERROR_CODES}


def sqlstate(code: str) -> tuple[str, str | None]:
    """(SQLSTATE, hint or None) for a worker error code; DF000 for one the table does not know."""
    return SQLSTATES.get(code, (OTHER_STATE, None))


def markdown_table() -> str:
    """The codes as the docs show them (docs/sql.md holds this table; a test compares)."""
    rows = ["| code | SQLSTATE | meaning | hint |", "|---|---|---|---|"]
    for c in ERROR_CODES:
        hint = c.hint.format(socket="SOCKET") if c.hint else ""
        meaning = c.meaning + ("; the queue gives the row up at once" if c.final else "")
        rows.append(f"| `{c.code}` | `{c.sqlstate}` | {meaning} | {hint} |")
    return "\n".join(rows) + "\n"
