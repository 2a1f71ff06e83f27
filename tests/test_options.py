"""The generation options are defined once (dflash.options); the hand-written SQL, the docs'
table, the CLI, the protocol check and the engine's request all agree with that definition."""

import re
from pathlib import Path

import pytest

from dflash.engine.engine import GenerationRequest
from dflash.options import BY_NAME, CONSTRAINTS, GENERATION_OPTIONS, SQL_OPTIONS, defaults, markdown_table

REPO = Path(__file__).resolve().parents[1]
FUNCTIONS = (REPO / "sql" / "30_functions.sql").read_text()
TRIGGERS = (REPO / "sql" / "40_triggers.sql").read_text()


def _sql_default(option) -> str:
    d = option.default
    if d is None:
        return "NULL"
    if isinstance(d, bool):
        return "true" if d else "false"
    return str(int(d)) if isinstance(d, float) and d.is_integer() else str(d)


TYPED = tuple(o for o in SQL_OPTIONS if o not in CONSTRAINTS)  # the schema or the labels stand for the constraint


@pytest.mark.parametrize("function, options", [
    ("dflash_generate(prompt text", SQL_OPTIONS), ("dflash_generate_stats(prompt text", SQL_OPTIONS),
    ("dflash_generate(prompts text[]", SQL_OPTIONS), ("dflash_generate_json(prompt text,\n    schema jsonb", TYPED),
    ("dflash_classify(input text,\n    labels text[]", TYPED)])
def test_sql_signatures_follow_the_definition(function, options):
    name, first = function.split("(", 1)
    blocks = re.findall(r"CREATE FUNCTION @extschema@\." + re.escape(name) + r"\(\n    " + re.escape(first)
                        + r",\n(.*?)\n\)", FUNCTIONS, re.S)
    assert len(blocks) == 1, function
    params = [line.strip().rstrip(",").split(None, 3) for line in blocks[0].splitlines()]
    assert [p[0] for p in params] == list(options)
    for pname, typ, kw, default in params:
        o = BY_NAME[pname]
        assert (typ, kw, default) == (o.sql_type, "DEFAULT", _sql_default(o)), pname
    # The body passes every option on to the bridge.
    body = FUNCTIONS[FUNCTIONS.index(blocks[0]):].split("$$")[1]
    for o in options:
        assert f"{o}={o}" in body, (function, o)


def test_generate_block_defaults_to_the_drafters_block():
    assert "dflash_generate_block(prompt text, block_size int DEFAULT NULL)" in FUNCTIONS


def test_enable_generation_accepts_exactly_the_sql_options():
    keys = re.search(r"WHERE key NOT IN \(([^)]*)\);", TRIGGERS).group(1)
    assert [k.strip().strip("'") for k in keys.split(",")] == list(SQL_OPTIONS)
    hint = re.search(r"HINT = 'options: mode, ([^']*)'", TRIGGERS).group(1)
    assert hint.split(", ") == list(SQL_OPTIONS)
    booleans = [o for o in SQL_OPTIONS if BY_NAME[o].types == (bool,)]
    nullable = [o for o in SQL_OPTIONS if BY_NAME[o].nullable]
    assert "CASE WHEN key IN (" + ", ".join(f"'{o}'" for o in booleans) + ") THEN 'boolean'" in TRIGGERS
    assert "key IN (" + ", ".join(f"'{o}'" for o in nullable) + ")" in TRIGGERS
    # the constraints' JSON types: an object, a string, an array
    json_type = {dict: "object", str: "string", list: "array"}
    for o in CONSTRAINTS:
        assert f"WHEN key = '{o}' THEN '{json_type[BY_NAME[o].types[0]]}'" in TRIGGERS, o


def test_the_docs_table_is_the_definition():
    doc = (REPO / "docs" / "sql.md").read_text()
    start, end = "<!-- generation-options:start -->\n", "<!-- generation-options:end -->"
    assert doc[doc.index(start) + len(start): doc.index(end)] == markdown_table()


def test_the_engine_request_and_the_cli_take_the_defaults():
    from dflash.cli import build_parser

    req = GenerationRequest()
    for name, value in defaults().items():
        assert getattr(req, name) == value, name
    args = build_parser().parse_args(["generate", "--prompt", "hi"])
    for o in GENERATION_OPTIONS:
        assert getattr(args, o.name) == defaults()[o.name], o.name
    assert build_parser().parse_args(["generate", "--prompt", "hi", "--no-chat"]).chat is False


def test_the_protocol_checks_types_from_the_definition():
    from dflash.errors import DFlashError
    from dflash.serve.jobs import generation_request

    assert generation_request({"prompt": "x", **defaults()}).chat is True
    for name, bad in (("chat", 1), ("max_new_tokens", 1.5), ("temperature", "0"), ("seed", True), ("stop", "x")):
        with pytest.raises(DFlashError) as err:
            generation_request({"prompt": "x", name: bad})
        assert err.value.code == "bad_params" and name in err.value.message
    with pytest.raises(DFlashError):
        generation_request({"prompt": "x", "no_such_option": 1})
