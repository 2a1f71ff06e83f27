"""Typed answers from SQL: dflash_generate's json_schema / regex / choices, dflash_generate_json,
dflash_classify, generate on insert with a schema (a jsonb column and a text column, the
queue path and the sync mode), the statistics recorded per generation, a truncated answer
as an error, and every bad input refused with 22023 before anything is generated or written.
The worker runs the tiny engine (SmolLM2's tokenizer) in-process."""

import json

import psycopg
import pytest
from psycopg import errors

from tests.sqlenv import ALICE, alice, connect, drain, roles, scalar, su, worker_dsn  # noqa: F401

pytestmark = pytest.mark.pg

TICKET = {"type": "object", "properties": {
    "plan": {"enum": ["free", "pro", "enterprise"]}, "urgent": {"type": "boolean"}},
    "required": ["plan", "urgent"], "additionalProperties": False}
LABELS = ["billing", "technical issue", "account access"]


def valid_ticket(value) -> bool:
    return set(value) == {"plan", "urgent"} and value["plan"] in ("free", "pro", "enterprise") and isinstance(
        value["urgent"], bool)


@pytest.fixture
def db(pg_dsn, sql_worker):
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        yield conn


def written(db) -> tuple:
    return tuple(scalar(db, f"SELECT count(*) FROM {t}") for t in ("dflash.generations", "dflash.memory",
                                                                     "dflash.queue", "dflash.generation_targets"))


def test_generate_with_each_constraint(db):
    choice = scalar(db, "SELECT dflash_generate('Which one?', choices => %s)", LABELS)
    assert choice in LABELS
    date = scalar(db, "SELECT dflash_generate('When?', regex => '[0-9]{4}-[0-9]{2}-[0-9]{2}')")
    assert len(date) == 10 and date[4] == date[7] == "-"
    value = json.loads(scalar(db, "SELECT dflash_generate('A ticket', json_schema => %s::jsonb)", json.dumps(TICKET)))
    assert valid_ticket(value)
    # the batch form takes them too, one answer per prompt
    many = scalar(db, "SELECT dflash_generate(ARRAY['a', 'b'], choices => %s)", LABELS)
    assert len(many) == 2 and set(many) <= set(LABELS)


def test_generate_json_is_a_valid_value_and_its_statistics_are_recorded(db):
    value = scalar(db, "SELECT dflash_generate_json('Describe the ticket as JSON.', %s::jsonb)", json.dumps(TICKET))
    assert isinstance(value, dict) and valid_ticket(value)
    row = db.execute("SELECT params->'json_schema', forced_tokens, truncated, proposers FROM dflash.generations"
                     " ORDER BY id DESC LIMIT 1").fetchone()
    assert row[0] == TICKET and row[2] is False
    # auto: `{"plan": "` and `", "urgent": ` are forced, drafted by the forced-token proposer or
    # leading a suffix chain; every token the former kept is a forced one
    kept = {name: counts["accepted"] for name, counts in row[3].items()}
    assert 0 < row[1] <= kept.get("forced", 0) + kept.get("suffix", 0)
    assert kept.get("forced", 0) <= row[1]
    stats = scalar(db, "SELECT dflash_generate_stats('x', json_schema => %s::jsonb, block_size => 1)",
                   json.dumps(TICKET))
    assert stats["truncated"] is False and stats["forced_tokens"] == 0 and valid_ticket(json.loads(stats["text"]))


def test_classify_answers_one_label(db):
    assert scalar(db, "SELECT dflash_classify('I was charged twice this month.', %s)", LABELS) in LABELS
    prompt = scalar(db, "SELECT prompt FROM dflash.generations ORDER BY id DESC LIMIT 1")
    assert "I was charged twice this month." in prompt and all(label in prompt for label in LABELS)


def test_a_truncated_answer_is_an_error_never_an_answer(db):
    before = written(db)
    for query in ("SELECT dflash_generate_json('x', %s::jsonb, max_new_tokens => 2)",
                  "SELECT dflash_generate('x', json_schema => %s::jsonb, max_new_tokens => 2)"):
        with pytest.raises(errors.StringDataRightTruncation) as err:
            db.execute(query, (json.dumps(TICKET),))
        assert "cut short" in str(err.value) and "max_new_tokens" in err.value.diag.message_hint
    assert written(db) == before
    stats = scalar(db, "SELECT dflash_generate_stats('x', json_schema => %s::jsonb, max_new_tokens => 2)",
                   json.dumps(TICKET))
    assert stats["truncated"] is True and stats["finish_reason"] == "length"
    assert scalar(db, "SELECT truncated FROM dflash.generations ORDER BY id DESC LIMIT 1") is True


# jsonb stores keys shortest first ("plan" before "urgent"); the required list says otherwise
URGENT_FIRST = dict(TICKET, required=["urgent", "plan"])


def test_a_schemas_properties_come_in_its_required_order(db, alice, sql_worker, worker_dsn):
    text = scalar(db, "SELECT dflash_generate('A ticket', json_schema => %s::jsonb)", json.dumps(URGENT_FIRST))
    assert text.startswith('{"urgent": ') and valid_ticket(json.loads(text)), text
    for mode in ("sync", "async"):
        table = f"{ALICE}.tickets_order_{mode}"
        make_table(alice, table, "text", {"mode": mode, "json_schema": URGENT_FIRST, "max_new_tokens": 40})
        alice.execute(f"INSERT INTO {table} (prompt) VALUES ('first')")
        if mode == "async":
            drain(sql_worker, worker_dsn, batch=1)
        text = scalar(alice, f"SELECT answer FROM {table}")
        assert text.startswith('{"urgent": ') and valid_ticket(json.loads(text)), (mode, text)


@pytest.mark.parametrize("query, args, words", [
    ("SELECT dflash_generate_json('x', '{\"type\": \"nonsense\"}')", (), "nonsense"),
    ("SELECT dflash_generate_json('x', '{\"type\": \"array\", \"uniqueItems\": true}')", (), "uniqueItems"),
    ("SELECT dflash_generate_json('x', '[1, 2]')", (), "json_schema"),
    ("SELECT dflash_generate('x', regex => '(ab')", (), "unclosed"),
    ("SELECT dflash_generate('x', choices => ARRAY[]::text[])", (), "empty"),
    ("SELECT dflash_generate('x', regex => 'a', choices => ARRAY['a'])", (), "at most one"),
    ("SELECT dflash_generate('x', regex => 'a', json_schema => '{}')", (), "at most one"),
    ("SELECT dflash_generate(ARRAY[]::text[], choices => ARRAY[]::text[])", (), "empty"),
    ("SELECT dflash_generate_json('x', '[1, 2]')", (), "a JSON object"),
    ("SELECT dflash_classify('x', ARRAY[]::text[])", (), "empty"),
    ("SELECT dflash_classify('x', ARRAY['a', ''])", (), "non-empty"),
])
def test_bad_input_is_22023_naming_the_problem_and_writes_nothing(db, query, args, words):
    before = written(db)
    with pytest.raises(errors.InvalidParameterValue) as err:
        db.execute(query, args)
    assert words in str(err.value), str(err.value)
    assert written(db) == before


@pytest.mark.parametrize("query", ["SELECT dflash_generate_json('x', NULL)", "SELECT dflash_classify('x', NULL)",
                                   "SELECT dflash_classify(NULL, ARRAY['a'])",
                                   "SELECT dflash_classify('x', ARRAY['a', NULL])"])
def test_nulls_are_22004(db, query):
    with pytest.raises(errors.NullValueNotAllowed):
        db.execute(query)


# --- generate on insert with a schema ---------------------------------------------------------


def make_table(conn, name, column_type, options):
    conn.execute(f"DROP TABLE IF EXISTS {name}")
    conn.execute(f"CREATE TABLE {name} (id serial PRIMARY KEY, prompt text, answer {column_type})")
    conn.execute("SELECT dflash.enable_generation(%s, 'prompt', 'answer', %s::jsonb)", (name, json.dumps(options)))


@pytest.mark.parametrize("column_type", ["jsonb", "text"])
def test_the_queue_fills_a_column_with_valid_json(alice, sql_worker, worker_dsn, column_type):
    table = f"{ALICE}.tickets_{column_type}"
    make_table(alice, table, column_type, {"json_schema": TICKET, "max_new_tokens": 40})
    alice.execute(f"INSERT INTO {table} (prompt) SELECT 'Ticket ' || i FROM generate_series(1, 6) i")
    drain(sql_worker, worker_dsn, batch=3)
    answers = [r[0] for r in alice.execute(f"SELECT answer FROM {table} ORDER BY id")]
    assert len(answers) == 6
    for a in answers:
        assert valid_ticket(a if column_type == "jsonb" else json.loads(a)), a
    rows = alice.execute("SELECT mode, truncated, forced_tokens FROM dflash.generations WHERE source_table = %s::regclass",
                         (table,)).fetchall()
    # `{"plan": "` and `", "urgent": ` are forced in every answer
    assert len(rows) == 6 and all(r[0] == "trigger" and r[1] is False and r[2] > 0 for r in rows)


def test_the_sync_mode_fills_a_jsonb_column(alice, sql_worker):
    table = f"{ALICE}.tickets_sync"
    make_table(alice, table, "jsonb", {"mode": "sync", "json_schema": TICKET})
    alice.execute(f"INSERT INTO {table} (prompt) VALUES ('first'), ('second')")
    assert all(valid_ticket(r[0]) for r in alice.execute(f"SELECT answer FROM {table}"))
    alice.execute("SELECT dflash.enable_generation(%s, 'prompt', 'answer', %s::jsonb)",
                  (table, json.dumps({"mode": "sync", "json_schema": TICKET, "max_new_tokens": 2})))
    with pytest.raises(errors.StringDataRightTruncation):  # cut short: the INSERT fails, nothing written
        alice.execute(f"INSERT INTO {table} (prompt) VALUES ('third')")
    assert scalar(alice, f"SELECT count(*) FROM {table}") == 2


def test_a_truncated_queued_answer_is_given_up_not_written(alice, sql_worker, worker_dsn):
    table = f"{ALICE}.tickets_cut"
    make_table(alice, table, "jsonb", {"json_schema": TICKET, "max_new_tokens": 2})
    alice.execute(f"INSERT INTO {table} (prompt) VALUES ('cut')")
    drain(sql_worker, worker_dsn)
    assert scalar(alice, f"SELECT answer FROM {table}") is None
    error = scalar(alice, "SELECT error FROM dflash.queue_failed WHERE tbl = %s::regclass", table)
    assert "cut short" in error


@pytest.mark.parametrize("options, state, words", [
    ({"json_schema": {"type": "nonsense"}}, errors.InvalidParameterValue, "nonsense"),
    ({"json_schema": {"type": "string", "format": "colour"}}, errors.InvalidParameterValue, "colour"),
    ({"regex": "(ab"}, errors.InvalidParameterValue, "unclosed"),
    ({"choices": []}, errors.InvalidParameterValue, "empty"),
    ({"choices": ["a"], "regex": "a"}, errors.InvalidParameterValue, "at most one"),
    ({"json_schema": "{}"}, errors.InvalidParameterValue, "wrong JSON type"),
    ({"choices": "a"}, errors.InvalidParameterValue, "wrong JSON type"),
])
def test_bad_constraints_are_refused_when_generation_is_enabled(alice, sql_worker, options, state, words):
    table = f"{ALICE}.tickets_bad"
    alice.execute(f"DROP TABLE IF EXISTS {table}")
    alice.execute(f"CREATE TABLE {table} (id serial PRIMARY KEY, prompt text, answer text)")
    with pytest.raises(state) as err:
        alice.execute("SELECT dflash.enable_generation(%s, 'prompt', 'answer', %s::jsonb)", (table, json.dumps(options)))
    assert words in str(err.value), str(err.value)
    assert scalar(alice, "SELECT count(*) FROM dflash.generation_targets WHERE tbl = %s::regclass", table) == 0


def test_a_jsonb_output_column_needs_a_schema(alice):
    table = f"{ALICE}.tickets_noschema"
    alice.execute(f"DROP TABLE IF EXISTS {table}")
    alice.execute(f"CREATE TABLE {table} (id serial PRIMARY KEY, prompt text, answer jsonb)")
    with pytest.raises(errors.UndefinedColumn):
        alice.execute("SELECT dflash.enable_generation(%s, 'prompt', 'answer', '{\"regex\": \"a\"}')", (table,))
