"""The generation options: each one's name, type, default, bounds and meaning, in one place.

The engine's `GenerationRequest`, the worker protocol's parameter check, the CLI's flags,
the PL/Python bridge, the queue consumer and the docs' option table all read this table;
the SQL function signatures and `dflash.enable_generation`'s option check are written by
hand and a test holds them to it (tests/test_options.py). Stdlib only: PostgreSQL backends
import it through the bridge.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    name: str
    types: tuple  # the JSON/Python types a value may have (NoneType: may be null)
    default: object
    doc: str
    bounds: str  # the valid range, in words (checked by the engine)
    sql_type: str | None = None  # its type in the SQL functions; None: not settable from SQL
    cli: str | None = None  # its `dflash generate` flag, when not --name-with-dashes

    @property
    def nullable(self) -> bool:
        return type(None) in self.types

    @property
    def flag(self) -> str:
        return self.cli or "--" + self.name.replace("_", "-")


GENERATION_OPTIONS: tuple[Option, ...] = (
    Option("max_new_tokens", (int,), 128, "the most new tokens to generate", ">= 1, and prompt + it <= the "
           "target's context", "int"),
    Option("temperature", (int, float), 0.0, "0: greedy (the target's own argmax); > 0: sample", "finite, >= 0",
           "float8"),
    Option("block_size", (int, type(None)), None, "tokens verified per step; null: auto (each step's length "
           "chosen by what pays on the worker's device)", "1 to the drafter's block size, or null", "int"),
    Option("top_p", (int, float), 1.0, "nucleus sampling: keep the most likely tokens up to this mass",
           "(0, 1]", "float8"),
    Option("top_k", (int,), 0, "keep the k most likely tokens; 0: all", ">= 0", "int"),
    Option("seed", (int, type(None)), None, "the random seed of a sampled generation; null: a fresh one",
           "[0, 2^63) or null", "bigint"),
    Option("chat", (bool,), True, "wrap the prompt in the target's chat template as a user turn (the default: "
           "the embedded model and most served models are instruction-tuned)", "true or false", "boolean"),
    Option("proposals", (bool,), True, "also draft from what is already there: the prompt, the output so far "
           "and this workload's past outputs (the suffix proposer, beside the drafter; block length auto only)",
           "true or false", "boolean"),
    Option("stop", (list,), (), "stop strings: the output ends before the first one", "non-empty strings"),
    Option("stop_ids", (list,), (), "extra stop token ids (besides the target's end of sequence)",
           "ids in the vocabulary", cli="--stop-id"),
    Option("verify", (str, type(None)), None, "the verify rule when sampling: strict or probabilistic (the "
           "default); greedy needs temperature 0", "greedy, strict, probabilistic or null"),
    # Typed answers (dflash.engine.grammar checks them; at most one per request, and not with
    # stop strings or stop ids).
    Option("json_schema", (dict, type(None)), None, "the answer is JSON that validates against this JSON Schema",
           "a JSON Schema object the grammar library implements, or null", "jsonb"),
    Option("regex", (str, type(None)), None, "the answer matches this regular expression, whole",
           "Rust regex syntax (no look-around, no back-references), or null", "text"),
    Option("choices", (list, type(None)), None, "the answer is one of these strings",
           "a non-empty list of non-empty strings, or null", "text[]", cli="--choice"),
)
# The options that constrain the answer's form; a request gives at most one.
CONSTRAINTS = ("json_schema", "regex", "choices")

BY_NAME = {o.name: o for o in GENERATION_OPTIONS}
# What a SQL caller or a generate-on-insert table may set, in signature order.
SQL_OPTIONS = tuple(o.name for o in GENERATION_OPTIONS if o.sql_type is not None)


def defaults() -> dict:
    return {o.name: (list(o.default) if isinstance(o.default, tuple) else o.default) for o in GENERATION_OPTIONS}


def in_required_order(schema):
    """A JSON Schema as jsonb gives it back: jsonb keeps no key order (it stores keys shortest
    first), and the grammar writes an answer's properties in the schema's order, so an
    object's `properties` are put in its `required` list's order (an array keeps its order),
    the others after them. A caller who wants a reasoning field before the answer lists
    both, in that order, under `required`."""
    if isinstance(schema, list):
        return [in_required_order(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: in_required_order(v) for k, v in schema.items()}
    props, required = out.get("properties"), schema.get("required")
    if isinstance(props, dict) and isinstance(required, list):
        first = [k for k in dict.fromkeys(required) if isinstance(k, str) and k in props]
        out["properties"] = {**{k: props[k] for k in first}, **{k: v for k, v in props.items() if k not in first}}
    return out


_JSON_NAMES = {dict: "a JSON object", list: "an array", str: "a string", int: "an integer", float: "a number",
               bool: "a boolean", type(None): "null"}


def type_error(name: str, value) -> str | None:
    """Why `value` cannot be option `name` (by type; the engine checks ranges), or None."""
    types = BY_NAME[name].types
    if isinstance(value, types) and not (isinstance(value, bool) and bool not in types):
        return None
    names = " or ".join(dict.fromkeys("a number" if t in (int, float) and float in types else
                                      _JSON_NAMES.get(t, t.__name__) for t in types))
    return f"parameter '{name}' must be {names}, got {_JSON_NAMES.get(type(value), type(value).__name__)}"


def markdown_table() -> str:
    """The options as the docs show them (docs/sql.md holds this table; a test compares)."""
    rows = ["| option | SQL type | default | valid | meaning |", "|---|---|---|---|---|"]
    for o in GENERATION_OPTIONS:
        if o.sql_type is None:
            continue
        default = "NULL" if o.default is None else str(o.default).lower() if isinstance(o.default, bool) else o.default
        rows.append(f"| `{o.name}` | {o.sql_type} | {default} | {o.bounds} | {o.doc} |")
    return "\n".join(rows) + "\n"
