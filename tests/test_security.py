"""Security (issue 11): what a member, their tables and types, or an outsider can do.

A real PostgreSQL; the worker runs the tiny engine in-process and the queue is worked by
the worker's own consumer connected as dflash_worker. Every attack here worked against the
0.1.0 install (defects 1-4 and 8 of the issue); each must now fail cleanly. The golden
privilege matrix at the end is also the one in the README's security section.
"""

import re
import subprocess
from pathlib import Path

import psycopg
import pytest
from psycopg import errors

from tests.sqlenv import ADMIN, ALICE, BOB, EVE, alice, bob, connect, drain, roles, scalar, worker_dsn  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
EMBEDDING = "[" + ",".join(["0.05"] * 384) + "]"

# Alice's traps: whoever runs `canary` tries what an attacker would (become superuser, take
# over dflash_worker, delete others' queue items, overwrite Bob's answers) and leaves their
# name in sec_alice.log, which anyone may write.
TRAPS = """
CREATE TABLE sec_alice.log (who name NOT NULL, what text NOT NULL);
GRANT USAGE ON SCHEMA sec_alice TO PUBLIC;
GRANT SELECT, INSERT ON sec_alice.log TO PUBLIC;
CREATE FUNCTION sec_alice.canary(what text) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog AS $$
BEGIN
    INSERT INTO sec_alice.log VALUES (current_user, what);
    BEGIN ALTER ROLE sec_alice SUPERUSER; EXCEPTION WHEN OTHERS THEN NULL; END;
    BEGIN ALTER ROLE dflash_worker PASSWORD 'pwned'; EXCEPTION WHEN OTHERS THEN NULL; END;
    BEGIN DELETE FROM dflash.queue WHERE calling_role <> 'sec_alice'; EXCEPTION WHEN OTHERS THEN NULL; END;
    BEGIN UPDATE sec_bob.notes SET answer = 'pwned'; EXCEPTION WHEN OTHERS THEN NULL; END;
    RETURN true;
END $$;
-- for generated columns, checks and index expressions, which want an immutable function
CREATE FUNCTION sec_alice.canary_imm(what text, x anyelement) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog AS $$ BEGIN RETURN sec_alice.canary(what); END $$;
"""


@pytest.fixture(scope="module")
def traps(roles, sql_worker):
    with connect(roles, ALICE) as alice:
        if not scalar(alice, "SELECT to_regclass('sec_alice.log') IS NOT NULL"):
            alice.execute(TRAPS)
    with connect(roles, BOB) as bob:
        # Bob's schema is visible to all (names resolve), so only dflash's rules keep others out.
        bob.execute("GRANT USAGE ON SCHEMA sec_bob TO PUBLIC")
        bob.execute("CREATE TABLE IF NOT EXISTS sec_bob.notes (id serial PRIMARY KEY, prompt text, answer text)")
        bob.execute("SELECT dflash.enable_generation('sec_bob.notes', 'prompt', 'answer', '{\"max_new_tokens\": 4}')")
    return roles


@pytest.fixture
def su(traps):
    """The superuser, with Alice's log emptied (this module's own `su`)."""
    with connect(traps) as conn:
        conn.execute("TRUNCATE sec_alice.log")
        yield conn


def ran_as(su) -> dict:
    """what -> the set of roles the canary ran as."""
    out = {}
    for who, what in su.execute("SELECT who, what FROM sec_alice.log"):
        out.setdefault(what, set()).add(who)
    return out


def assert_nothing_escalated(su):
    assert not scalar(su, "SELECT rolsuper FROM pg_roles WHERE rolname = %s", ALICE)
    assert scalar(su, "SELECT rolpassword IS NULL FROM pg_authid WHERE rolname = 'dflash_worker'")
    who = set().union(*ran_as(su).values()) if ran_as(su) else set()
    assert who <= {ALICE}, f"Alice's code ran as {who}"


def bobs_row_is_filled_by_the_worker(su, bob):
    """Bob queues a row after Alice's; it must come through whatever Alice's code tried."""
    key = scalar(bob, "INSERT INTO sec_bob.notes (prompt) VALUES ('Name a bird.') RETURNING id")
    return lambda: scalar(su, "SELECT answer FROM sec_bob.notes WHERE id = %s", key)


# --- defect 1: no user code under elevated rights -------------------------------------------


def test_a_cast_to_json_on_a_members_type_never_runs_elevated(su, alice, bob, sql_worker, worker_dsn):
    """The reported escalation: the queueing trigger ran to_jsonb(NEW) as the superuser, and
    to_jsonb calls a (non-composite) type's cast to json."""
    alice.execute("""
        CREATE TYPE sec_alice.evil AS ENUM ('x');
        CREATE FUNCTION sec_alice.evil_json(sec_alice.evil) RETURNS json
        LANGUAGE plpgsql SET search_path = pg_catalog AS $$
        BEGIN PERFORM sec_alice.canary('cast to json'); RETURN '{}'::json; END $$;
        CREATE CAST (sec_alice.evil AS json) WITH FUNCTION sec_alice.evil_json(sec_alice.evil);
        CREATE TABLE sec_alice.castjson (id serial PRIMARY KEY, prompt text, answer text, payload sec_alice.evil);
    """)
    alice.execute("SELECT dflash.enable_generation('sec_alice.castjson', 'prompt', 'answer', '{\"max_new_tokens\": 4}')")
    alice.execute("INSERT INTO sec_alice.castjson (prompt, payload) VALUES ('Say hi.', 'x')")
    bobs = bobs_row_is_filled_by_the_worker(su, bob)
    drain(sql_worker, worker_dsn)
    assert_nothing_escalated(su)
    assert scalar(su, "SELECT answer FROM sec_alice.castjson") is not None
    assert bobs() not in (None, "pwned")


def test_a_members_key_type_and_its_casts_run_as_the_member(su, alice, sql_worker, worker_dsn):
    """The key is read as text by the trigger (as the inserting role) and converted back by
    the writer (as the table's owner): a key type's own casts run, but only as Alice."""
    alice.execute("""
        CREATE TYPE sec_alice.k AS (n int);
        CREATE FUNCTION sec_alice.k_text(sec_alice.k) RETURNS text LANGUAGE plpgsql SET search_path = pg_catalog
        AS $$ BEGIN PERFORM sec_alice.canary('key to text'); RETURN 'k' || ($1).n; END $$;
        CREATE FUNCTION sec_alice.text_k(text) RETURNS sec_alice.k LANGUAGE plpgsql SET search_path = pg_catalog
        AS $$ BEGIN PERFORM sec_alice.canary('text to key'); RETURN ROW(substr($1, 2)::int); END $$;
        CREATE CAST (sec_alice.k AS text) WITH FUNCTION sec_alice.k_text(sec_alice.k);
        CREATE CAST (text AS sec_alice.k) WITH FUNCTION sec_alice.text_k(text);
        CREATE TABLE sec_alice.keyed (id sec_alice.k PRIMARY KEY, prompt text, answer text);
    """)
    alice.execute("SELECT dflash.enable_generation('sec_alice.keyed', 'prompt', 'answer', '{\"max_new_tokens\": 4}')")
    alice.execute("INSERT INTO sec_alice.keyed VALUES (ROW(7), 'Say hi.')")
    assert scalar(su, "SELECT key_value FROM dflash.queue WHERE tbl = 'sec_alice.keyed'::regclass") == "k7"
    drain(sql_worker, worker_dsn)
    assert scalar(su, "SELECT answer FROM sec_alice.keyed") is not None
    assert ran_as(su) == {"key to text": {ALICE}, "text to key": {ALICE}}
    assert_nothing_escalated(su)


SHADOW_OPERATORS = """
CREATE FUNCTION sec_alice.eq_text(text, text) RETURNS boolean LANGUAGE plpgsql SET search_path = pg_catalog
AS $$ BEGIN PERFORM sec_alice.canary('operator'); RETURN $1 OPERATOR(pg_catalog.=) $2; END $$;
CREATE FUNCTION sec_alice.eq_name(name, name) RETURNS boolean LANGUAGE plpgsql SET search_path = pg_catalog
AS $$ BEGIN PERFORM sec_alice.canary('operator'); RETURN $1 OPERATOR(pg_catalog.=) $2; END $$;
CREATE FUNCTION sec_alice.lt_int(int, int) RETURNS boolean LANGUAGE plpgsql SET search_path = pg_catalog
AS $$ BEGIN PERFORM sec_alice.canary('operator'); RETURN $1 OPERATOR(pg_catalog.<) $2; END $$;
CREATE OPERATOR sec_alice.= (LEFTARG = text, RIGHTARG = text, FUNCTION = sec_alice.eq_text);
CREATE OPERATOR sec_alice.= (LEFTARG = name, RIGHTARG = name, FUNCTION = sec_alice.eq_name);
CREATE OPERATOR sec_alice.< (LEFTARG = int, RIGHTARG = int, FUNCTION = sec_alice.lt_int);
CREATE FUNCTION sec_alice.dflash_embed(text) RETURNS text LANGUAGE plpgsql SET search_path = pg_catalog
AS $$ BEGIN PERFORM sec_alice.canary('shadow function'); RETURN NULL; END $$;
"""


def test_operators_and_functions_in_the_callers_search_path_are_never_used(su, alice, sql_worker, worker_dsn):
    """Alice puts her own `=`, `<` and dflash_embed ahead of pg_catalog and calls everything:
    no dflash function resolves a name through her search_path."""
    if not scalar(alice, "SELECT to_regproc('sec_alice.eq_text') IS NOT NULL"):
        alice.execute(SHADOW_OPERATORS)
    alice.execute("CREATE TABLE sec_alice.ops (id serial PRIMARY KEY, prompt text, answer text)")
    alice.execute("CREATE TABLE sec_alice.ops_sync (id serial PRIMARY KEY, prompt text, answer text)")
    alice.execute("SET search_path = sec_alice, pg_catalog, public")
    for query in [
        "SELECT public.dflash_generate('Say hi.', max_new_tokens => 2)",
        "SELECT public.dflash_generate_stats('Say hi.', max_new_tokens => 2)",
        "SELECT public.dflash_embed('Say hi.')",
        "SELECT count(*) FROM public.dflash_recall('Say hi.', 3)",
        "SELECT dflash.enable_generation('sec_alice.ops', 'prompt', 'answer', '{\"max_new_tokens\": 2}')",
        "SELECT dflash.enable_generation('sec_alice.ops_sync', 'prompt', 'answer', '{\"mode\": \"sync\", \"max_new_tokens\": 2}')",
        "INSERT INTO sec_alice.ops (prompt) VALUES ('Say hi.')",
        "INSERT INTO sec_alice.ops_sync (prompt) VALUES ('Say hi.')",
        "SELECT dflash.record_generation('sync', 'p', '{}', '{\"text\": \"t\", \"accepted_per_position\": [1]}', 0, 0)",
        "SELECT dflash.disable_generation('sec_alice.ops_sync')",
    ]:
        alice.execute(query)
    drain(sql_worker, worker_dsn)
    assert ran_as(su) == {}, "a dflash function used a name from the caller's search_path"
    assert scalar(su, "SELECT answer FROM sec_alice.ops") is not None


def test_defaults_checks_generated_columns_indexes_and_triggers_run_as_the_owner(su, alice, bob, sql_worker,
                                                                                 worker_dsn):
    """Defect 2: the consumer used to UPDATE the table itself, so the owner's triggers (and
    checks, generated columns, index expressions) ran as dflash_worker. Now they run as the
    owner, through the writer: the password of dflash_worker, Bob's queue item and Bob's
    answers stay as they were."""
    alice.execute("""
        CREATE TABLE sec_alice.trapped (
            id serial PRIMARY KEY, prompt text, answer text,
            d boolean DEFAULT sec_alice.canary('default'),
            g boolean GENERATED ALWAYS AS (sec_alice.canary_imm('generated column', answer)) STORED,
            CHECK (sec_alice.canary_imm('check', answer)));
        CREATE INDEX ON sec_alice.trapped ((sec_alice.canary_imm('index expression', answer)));
        CREATE FUNCTION sec_alice.trap() RETURNS trigger LANGUAGE plpgsql SET search_path = pg_catalog AS $$
        BEGIN PERFORM sec_alice.canary(TG_WHEN || ' ' || TG_OP || ' ' || TG_LEVEL); RETURN NEW; END $$;
        CREATE TRIGGER b BEFORE UPDATE ON sec_alice.trapped FOR EACH ROW EXECUTE FUNCTION sec_alice.trap();
        CREATE TRIGGER a AFTER UPDATE ON sec_alice.trapped FOR EACH STATEMENT EXECUTE FUNCTION sec_alice.trap();
    """)
    alice.execute("SELECT dflash.enable_generation('sec_alice.trapped', 'prompt', 'answer', '{\"max_new_tokens\": 4}')")
    alice.execute("INSERT INTO sec_alice.trapped (prompt) VALUES ('Say hi.')")
    bobs = bobs_row_is_filled_by_the_worker(su, bob)
    su.execute("TRUNCATE sec_alice.log")  # from here on only the worker's write runs Alice's code
    drain(sql_worker, worker_dsn)
    seen = ran_as(su)
    for what in ("BEFORE UPDATE ROW", "AFTER UPDATE STATEMENT", "check", "generated column", "index expression"):
        assert seen.get(what) == {ALICE}, (what, seen)
    assert_nothing_escalated(su)
    assert scalar(su, "SELECT answer FROM sec_alice.trapped") is not None
    assert bobs() not in (None, "pwned")


def test_a_writer_made_to_run_as_its_caller_refuses_before_touching_the_table(su, alice, sql_worker, worker_dsn):
    """Alice owns her table's writer, so she can make it SECURITY INVOKER (and point its
    search_path at her operators): then it would run as dflash_worker. It refuses first."""
    if not scalar(alice, "SELECT to_regproc('sec_alice.eq_text') IS NOT NULL"):
        alice.execute(SHADOW_OPERATORS)
    alice.execute("""
        CREATE TABLE sec_alice.flipped (id serial PRIMARY KEY, prompt text, answer text);
        CREATE FUNCTION sec_alice.trap2() RETURNS trigger LANGUAGE plpgsql SET search_path = pg_catalog AS $$
        BEGIN PERFORM sec_alice.canary('flipped writer'); RETURN NEW; END $$;
        CREATE TRIGGER b BEFORE UPDATE ON sec_alice.flipped FOR EACH STATEMENT EXECUTE FUNCTION sec_alice.trap2();
    """)
    alice.execute("SELECT dflash.enable_generation('sec_alice.flipped', 'prompt', 'answer', '{\"max_new_tokens\": 4}')")
    writer = scalar(alice, "SELECT 'dflash.write_' || writer_id FROM dflash.generation_targets"
                           " WHERE tbl = 'sec_alice.flipped'::regclass")
    alice.execute(f"ALTER FUNCTION {writer}(text, text, text) SECURITY INVOKER")
    alice.execute(f"ALTER FUNCTION {writer}(text, text, text) SET search_path = sec_alice, pg_catalog")
    alice.execute("INSERT INTO sec_alice.flipped (prompt) VALUES ('Say hi.')")
    drain(sql_worker, worker_dsn)
    assert ran_as(su) == {}
    assert_nothing_escalated(su)
    error = scalar(su, "SELECT error FROM dflash.queue_failed WHERE tbl = 'sec_alice.flipped'::regclass")
    assert "does not run as the table's owner" in error
    # enabling again restores the writer, and the next row is filled
    alice.execute("SELECT dflash.enable_generation('sec_alice.flipped', 'prompt', 'answer', '{\"max_new_tokens\": 4}')")
    alice.execute("INSERT INTO sec_alice.flipped (prompt) VALUES ('Say hi again.')")
    drain(sql_worker, worker_dsn)
    assert scalar(su, "SELECT count(answer) FROM sec_alice.flipped") == 1
    assert ran_as(su) == {"flipped writer": {ALICE}}


def test_the_superuser_helpers_cannot_be_turned_against_another_member(su, alice, bob):
    """dflash._make_writer runs as the superuser but takes only an OID: called on Bob's
    table it rebuilds Bob's writer, owned by Bob. Bob's writer and queue are out of reach."""
    bobs = scalar(su, "SELECT 'sec_bob.notes'::regclass::oid")
    writer = scalar(su, "SELECT dflash._writer_name('sec_bob.notes')")
    alice.execute("SELECT dflash._make_writer(%s::oid::regclass)", (bobs,))
    assert scalar(su, f"SELECT proowner::regrole::text FROM pg_proc WHERE proname = '{writer}'") == BOB
    with pytest.raises(errors.InsufficientPrivilege):
        alice.execute(f"SELECT dflash.{writer}('1', 'pwned', 'Name a bird.')")
    with pytest.raises(errors.InsufficientPrivilege):
        alice.execute("INSERT INTO dflash.queue (tbl, key_value, prompt) VALUES ('sec_bob.notes', '1', 'x')")
    with pytest.raises(errors.InsufficientPrivilege):
        alice.execute("INSERT INTO dflash.queue (tbl, key_value, prompt, calling_role) "
                      "VALUES ('sec_alice.log', '1', 'x', 'sec_bob')")
    with pytest.raises(errors.InsufficientPrivilege):
        alice.execute("SELECT dflash.enable_generation('sec_bob.notes', 'prompt', 'answer')")
    with pytest.raises(errors.InsufficientPrivilege):
        alice.execute("SELECT dflash.disable_generation('sec_bob.notes')")
    assert scalar(su, "SELECT enabled FROM dflash.generation_targets WHERE tbl = 'sec_bob.notes'::regclass")


# --- defect 3: members are isolated from each other ---------------------------------------------


def record(conn, prompt, role=None):
    return scalar(conn, "SELECT dflash.record_generation('sync', %s, '{}', %s::jsonb, 0, 0, NULL, %s)",
                  prompt, f'{{"text": "answer to {prompt}", "memory": {{"embedding": "{EMBEDDING}"}}}}', role)


def test_members_see_only_their_own_rows(su, alice, bob):
    record(alice, "alice's secret")
    record(bob, "bob's secret")
    bob.execute("INSERT INTO sec_bob.notes (prompt) VALUES ('bob''s queued secret')")
    su.execute("INSERT INTO dflash.queue_failed (id, tbl, key_value, prompt, options, calling_role, attempts, error,"
               " created_at) VALUES (-1, 'sec_bob.notes', '1', 'bob''s failed secret', '{}', %s, 1, 'x', now())"
               " ON CONFLICT DO NOTHING", (BOB,))
    for table in ("generations", "memory", "queue", "queue_failed"):
        assert scalar(alice, f"SELECT count(*) FROM dflash.{table} WHERE calling_role <> current_user") == 0, table
        assert scalar(bob, f"SELECT count(*) FROM dflash.{table} WHERE calling_role = current_user") > 0, table
    assert scalar(alice, "SELECT count(*) FROM dflash.generation_targets WHERE tbl = 'sec_bob.notes'::regclass") == 0
    assert scalar(alice, "SELECT coalesce(sum(generations), 0) FROM dflash.acceptance_daily") == scalar(
        alice, "SELECT count(*) FROM dflash.generations WHERE status = 'ok'")
    recalled = alice.execute("SELECT prompt FROM public.dflash_recall('secret', 50, include_shared => false)")
    assert not any("bob" in prompt for (prompt,) in recalled)


@pytest.mark.parametrize("attack", [
    "INSERT INTO dflash.generations (mode, status, prompt, calling_role) VALUES ('sync', 'ok', 'forged', 'sec_bob')",
    "SELECT dflash.record_generation('sync', 'forged', '{}', '{\"text\": \"x\"}', 0, 0, NULL, 'sec_bob')",
    f"INSERT INTO dflash.memory (prompt, output, embedding, calling_role) VALUES ('p', 'o', '{EMBEDDING}', 'sec_bob')",
    f"INSERT INTO dflash.memory (prompt, output, embedding, shared) VALUES ('p', 'o', '{EMBEDDING}', true)",
    f"INSERT INTO dflash.memory (generation_id, prompt, output, embedding) VALUES (BOBS, 'p', 'o', '{EMBEDDING}')",
    "UPDATE dflash.memory SET shared = true",
])
def test_members_cannot_forge_rows_or_plant_memory(su, alice, bob, attack):
    """Forged generations (directly or through record_generation), memory rows under
    another role, shared or tied to another's generation: refused, nothing written."""
    attack = attack.replace("BOBS", str(record(bob, "bob's latest")))
    written = ("SELECT (SELECT count(*) FROM dflash.generations) + (SELECT count(*) FROM dflash.memory)"
               " + (SELECT count(*) FROM dflash.memory WHERE shared)")
    before = scalar(su, written)
    with pytest.raises(errors.InsufficientPrivilege):
        alice.execute(attack)
    assert scalar(su, written) == before


def test_members_cannot_touch_each_others_generation_targets(su, alice):
    assert alice.execute("UPDATE dflash.generation_targets SET output_column = 'prompt'"
                         " WHERE tbl = 'sec_bob.notes'::regclass").rowcount == 0
    assert alice.execute("DELETE FROM dflash.generation_targets WHERE tbl = 'sec_bob.notes'::regclass").rowcount == 0
    with pytest.raises(errors.InsufficientPrivilege):
        alice.execute("INSERT INTO dflash.generation_targets (tbl, prompt_column, output_column, key_column, mode)"
                      " VALUES ('sec_bob.notes', 'prompt', 'answer', 'id', 'async')"
                      " ON CONFLICT (tbl) DO UPDATE SET output_column = 'prompt'")
    assert scalar(su, "SELECT output_column FROM dflash.generation_targets"
                      " WHERE tbl = 'sec_bob.notes'::regclass") == "answer"


def test_shared_memory_is_marked_by_an_admin_and_recalled_by_everyone(traps, su, alice, bob, sql_worker):
    gid = scalar(bob, "SELECT (public.dflash_generate_stats('Recipe for pancakes with blueberries',"
                      " max_new_tokens => 4))->>'generation_id'")
    recall = "SELECT generation_id::text FROM public.dflash_recall('pancakes with blueberries', 50, %s)"
    assert gid not in [r[0] for r in alice.execute(recall, (True,))]
    with pytest.raises(errors.InsufficientPrivilege):
        bob.execute("UPDATE dflash.memory SET shared = true WHERE generation_id = %s", (gid,))
    with connect(traps, ADMIN) as admin:
        assert scalar(admin, "SELECT count(*) FROM dflash.generations WHERE calling_role = %s", BOB) > 0
        admin.execute("UPDATE dflash.memory SET shared = true WHERE generation_id = %s", (gid,))
    assert gid in [r[0] for r in alice.execute(recall, (True,))]
    assert gid not in [r[0] for r in alice.execute(recall, (False,))]


# --- defects 4 and 8: members enable generation on any table of theirs ----------------------------


KEY_TYPES = {
    "timestamp": "'2024-02-29 23:59:59.999999'",
    "timestamptz": "'2024-02-29 23:59:59.123456+05:30'",
    "char(6)": "'ab'",
    "float8": "0.1",
    "real": "1.1",
    "numeric": "3.14159265358979323846",
    "uuid": "'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'",
    "date": "'2024-01-02'",
    "interval": "'1 day 2 hours'",
    "bytea": "'\\x00ff'",
    "text": "'a key with spaces and \"quotes\"'",
    "bigint": "9007199254740993",
}


def test_any_primary_key_type_other_schemas_and_odd_session_settings(su, alice, sql_worker, worker_dsn):
    """Defect 8: keys whose to_jsonb text differed from their ::text were never found. The
    inserting session's DateStyle, TimeZone and float digits do not matter either."""
    alice.execute("SET datestyle = 'SQL, DMY'; SET timezone = 'Asia/Kathmandu'; SET extra_float_digits = -15;"
                  " SET intervalstyle = 'sql_standard'; SET bytea_output = 'escape'")
    for i, (typ, value) in enumerate(KEY_TYPES.items()):
        alice.execute(f"CREATE TABLE sec_alice.pk{i} (id {typ} PRIMARY KEY, prompt text, answer varchar)")
        alice.execute(f"SELECT dflash.enable_generation('sec_alice.pk{i}', 'prompt', 'answer', "
                      "'{\"max_new_tokens\": 2}')")
        alice.execute(f"INSERT INTO sec_alice.pk{i} VALUES ({value}, 'Say hi.')")
    drain(sql_worker, worker_dsn)
    for i, typ in enumerate(KEY_TYPES):
        assert scalar(su, f"SELECT answer FROM sec_alice.pk{i}") is not None, typ


def test_partitioned_tables_are_filled_through_the_parent(su, alice, sql_worker, worker_dsn):
    alice.execute("""
        CREATE TABLE sec_alice.parted (id int PRIMARY KEY, prompt text, answer text) PARTITION BY RANGE (id);
        CREATE TABLE sec_alice.parted_low PARTITION OF sec_alice.parted FOR VALUES FROM (0) TO (100);
        CREATE TABLE sec_alice.parted_high PARTITION OF sec_alice.parted FOR VALUES FROM (100) TO (200);
    """)
    alice.execute("SELECT dflash.enable_generation('sec_alice.parted', 'prompt', 'answer', '{\"max_new_tokens\": 2}')")
    alice.execute("INSERT INTO sec_alice.parted (id, prompt) VALUES (1, 'Say hi.'), (150, 'Say bye.')")
    alice.execute("INSERT INTO sec_alice.parted_high (id, prompt) VALUES (151, 'Say what.')")
    tables = {r[0] for r in su.execute("SELECT tbl::text FROM dflash.queue WHERE tbl::text LIKE 'sec_alice.parted%'")}
    assert tables == {"sec_alice.parted"}
    drain(sql_worker, worker_dsn)
    assert scalar(su, "SELECT count(answer) FROM sec_alice.parted") == 3
    # the sync mode too
    alice.execute("SELECT dflash.enable_generation('sec_alice.parted', 'prompt', 'answer', "
                  "'{\"mode\": \"sync\", \"max_new_tokens\": 2}')")
    assert scalar(alice, "INSERT INTO sec_alice.parted (id, prompt) VALUES (2, 'Say hi.') RETURNING answer")


@pytest.mark.parametrize("ddl, table, options, exc", [
    ("CREATE VIEW sec_alice.v AS SELECT 1 AS id, ''::text AS prompt, ''::text AS answer", "sec_alice.v", "{}",
     errors.WrongObjectType),
    ("CREATE TEMP TABLE tmp_q (id int PRIMARY KEY, prompt text, answer text)", "tmp_q", "{}",
     errors.FeatureNotSupported),
    ("CREATE TABLE sec_alice.twokey (a int, b int, prompt text, answer text, PRIMARY KEY (a, b))",
     "sec_alice.twokey", "{}", errors.InvalidColumnReference),
    ("CREATE TABLE sec_alice.badopt (id int PRIMARY KEY, prompt text, answer text)", "sec_alice.badopt",
     '{"max_new_tokens": "many"}', errors.InvalidParameterValue),
    ("CREATE TABLE sec_alice.sameco (id int PRIMARY KEY, prompt text, answer text)", "sec_alice.sameco",
     "{}", errors.InvalidParameterValue),
])
def test_what_cannot_be_filled_is_refused_at_enable_time(alice, ddl, table, options, exc):
    alice.execute(ddl)
    output = "prompt" if "sameco" in table else "answer"
    with pytest.raises(exc):
        alice.execute("SELECT dflash.enable_generation(%s, 'prompt', %s, %s::jsonb)", (table, output, options))


def test_a_dropped_table_takes_its_target_and_writer_with_it(su, alice):
    alice.execute("CREATE TABLE sec_alice.gone (id int PRIMARY KEY, prompt text, answer text)")
    alice.execute("SELECT dflash.enable_generation('sec_alice.gone', 'prompt', 'answer')")
    oid = scalar(su, "SELECT 'sec_alice.gone'::regclass::oid")
    writer = scalar(su, "SELECT dflash._writer_name('sec_alice.gone')")
    assert scalar(su, "SELECT to_regproc(%s)", f"dflash.{writer}") is not None
    alice.execute("DROP TABLE sec_alice.gone")
    assert scalar(su, "SELECT count(*) FROM dflash.generation_targets WHERE tbl::oid = %s", oid) == 0
    assert scalar(su, "SELECT to_regproc(%s)", f"dflash.{writer}") is None


# --- search_path, the install script, the catalog ---------------------------------------------


def test_functions_work_without_public_in_the_search_path(alice, sql_worker, worker_dsn, su):
    alice.execute("SET search_path = pg_catalog")
    alice.execute("CREATE TABLE sec_alice.nopub (id int PRIMARY KEY, prompt text, answer text)")
    assert scalar(alice, "SELECT public.dflash_generate('Say hi.', max_new_tokens => 2)") is not None
    assert scalar(alice, "SELECT count(*) FROM public.dflash_recall('Say hi.', 2)") >= 1
    assert scalar(alice, "SELECT public.dflash_embed('x') IS NOT NULL")
    alice.execute("SELECT dflash.enable_generation('sec_alice.nopub', 'prompt', 'answer', '{\"max_new_tokens\": 2}')")
    alice.execute("INSERT INTO sec_alice.nopub VALUES (1, 'Say hi.')")
    drain(sql_worker, worker_dsn)
    assert scalar(su, "SELECT answer FROM sec_alice.nopub") is not None


def test_a_schema_shadowing_ours_is_never_used(alice, su, sql_worker):
    alice.execute("""
        CREATE TABLE IF NOT EXISTS sec_alice.config (key text, value text);
        CREATE TABLE IF NOT EXISTS sec_alice.memory (prompt text);
        CREATE TABLE IF NOT EXISTS sec_alice.generations (prompt text);
    """)
    if not scalar(alice, "SELECT to_regproc('sec_alice.eq_text') IS NOT NULL"):
        alice.execute(SHADOW_OPERATORS)
    alice.execute("SET search_path = sec_alice, public")
    assert scalar(alice, "SELECT count(*) FROM dflash_recall('Say hi.', 2)") >= 0
    assert scalar(alice, "SELECT dflash_generate('Say hi.', max_new_tokens => 2)") is not None
    assert ran_as(su) == {}


def extension_script(su) -> Path:
    """The install script of the version CREATE EXTENSION installs (the folder also holds
    upgrade scripts and, after tests/test_upgrade.py, 0.1.0's)."""
    share = subprocess.check_output(["pg_config", "--sharedir"], text=True).strip()
    version = scalar(su, "SELECT default_version FROM pg_available_extensions WHERE name = 'dflash'")
    return Path(share, "extension", f"dflash--{version}.sql")


def test_the_install_script_refuses_to_run_outside_create_extension(pg_server, roles):
    """Fed to psql, the script says to use CREATE EXTENSION and creates nothing."""
    with connect(roles) as su:
        su.execute("DROP DATABASE IF EXISTS dflash_guard")
        su.execute("CREATE DATABASE dflash_guard")
        script = extension_script(su)
    psql = Path(subprocess.check_output(["pg_config", "--bindir"], text=True).strip()) / "psql"
    out = subprocess.run([str(psql), "-h", pg_server.host, "-p", str(pg_server.port), "-U", pg_server.superuser,
                          "-d", "dflash_guard", "-v", "ON_ERROR_STOP=1", "-f", "-"],
                         input=script.read_text(), capture_output=True, text=True)
    assert 'Use "CREATE EXTENSION dflash' in out.stdout + out.stderr
    with psycopg.connect(pg_server.dsn("dflash_guard"), autocommit=True) as guard:
        assert scalar(guard, "SELECT count(*) FROM pg_namespace WHERE nspname = 'dflash'") == 0


def test_every_function_pins_its_search_path_and_only_two_run_as_their_owner(su):
    rows = su.execute("""
        SELECT p.oid::regprocedure::text, p.prosecdef, p.proconfig
        FROM pg_proc p JOIN pg_depend d ON d.objid = p.oid AND d.classid = 'pg_proc'::regclass AND d.deptype = 'e'
        JOIN pg_extension e ON e.oid = d.refobjid AND e.extname = 'dflash'""").fetchall()
    assert len(rows) >= 15
    for name, _definer, config in rows:
        assert "search_path=pg_catalog, pg_temp" in (config or []), name
    assert sorted(name for name, definer, _ in rows if definer) == [
        "dflash._forget_dropped_tables()", "dflash._make_writer(regclass)"]


# --- the privilege matrix ------------------------------------------------------------------------

# role columns: outsider (may log in, not a member), member, admin (dflash_admin), worker
# (dflash_worker). "others'" rows belong to another member (Bob). "-": does not apply.
GOLDEN = """
| object | action | outsider | member | admin | worker |
|---|---|---|---|---|---|
| dflash_generate, dflash_generate_stats, dflash_generate_json, dflash_classify, dflash_generate_block, dflash_embed, dflash_recall, dflash_worker_status | EXECUTE | denied | allowed | allowed | denied |
| dflash.enable_generation, dflash.disable_generation | own table | denied | allowed | allowed | - |
| dflash.enable_generation, dflash.disable_generation | others' table | denied | denied | denied | denied |
| dflash.set_config, UPDATE dflash.config | EXECUTE | denied | denied | denied | denied |
| dflash.config | SELECT | denied | allowed | allowed | allowed |
| dflash.record_generation | own rows | denied | allowed | allowed | allowed |
| dflash.record_generation | as another role | denied | denied | allowed | allowed |
| dflash.write_&lt;writer_id&gt; (a table's writer) | EXECUTE | denied | denied | denied | allowed |
| a member's table | SELECT, UPDATE | denied | denied | denied | denied |
| dflash.generations | SELECT own | denied | allowed | allowed | - |
| dflash.generations | SELECT others' prompts and outputs | denied | denied | allowed | denied |
| dflash.generations | SELECT others' acceptance counts | denied | denied | allowed | allowed |
| dflash.generations | INSERT own | denied | allowed | allowed | - |
| dflash.generations | INSERT as another role | denied | denied | allowed | allowed |
| dflash.generations | DELETE others' | denied | denied | allowed | denied |
| dflash.memory | SELECT own | denied | allowed | allowed | - |
| dflash.memory | SELECT others' | denied | denied | allowed | denied |
| dflash.memory | SELECT shared | denied | allowed | allowed | denied |
| dflash.memory | INSERT own | denied | allowed | allowed | - |
| dflash.memory | INSERT shared | denied | denied | allowed | denied |
| dflash.memory | mark shared | denied | denied | allowed | denied |
| dflash.memory | DELETE own | denied | allowed | allowed | - |
| dflash.memory | DELETE others' | denied | denied | allowed | denied |
| dflash.queue | SELECT own | denied | allowed | allowed | - |
| dflash.queue | SELECT others' | denied | denied | allowed | allowed |
| dflash.queue | INSERT for own table | denied | allowed | allowed | - |
| dflash.queue | INSERT for others' table | denied | denied | allowed | denied |
| dflash.queue | UPDATE others' | denied | denied | allowed | allowed |
| dflash.queue | DELETE own | denied | allowed | allowed | - |
| dflash.queue | DELETE others' | denied | denied | allowed | allowed |
| dflash.queue_failed | SELECT own | denied | allowed | allowed | - |
| dflash.queue_failed | SELECT others' | denied | denied | allowed | denied |
| dflash.generation_targets | SELECT own | denied | allowed | allowed | - |
| dflash.generation_targets | SELECT others' | denied | denied | allowed | allowed |
| dflash.generation_targets | UPDATE others' | denied | denied | allowed | denied |
| dflash.generation_targets | DELETE others' | denied | denied | allowed | denied |
| dflash.acceptance_daily | SELECT others' rows | denied | denied | allowed | denied |
"""


def parse_matrix(text: str) -> dict:
    rows = [line.strip().strip("|").split("|") for line in text.strip().splitlines()[2:]]
    return {(r[0].strip(), r[1].strip()): tuple(c.strip() for c in r[2:]) for r in rows}


ROLE_COLUMNS = (EVE, ALICE, ADMIN, "dflash_worker")
MEMORY = f"'{EMBEDDING}'"
REC = "'{\"text\": \"t\", \"memory\": {\"embedding\": \"" + EMBEDDING + "\"}}'"


def actions(bob_writer: str) -> dict:
    """(object, action) -> statements; each must succeed on at least one row to count as allowed.
    {me} is the acting role, {own} a table it owns (its schema's `own` table)."""
    api = ["SELECT public.dflash_generate('hi', max_new_tokens => 1)",
           "SELECT public.dflash_generate_stats('hi', max_new_tokens => 1)",
           "SELECT public.dflash_generate(ARRAY['hi'], max_new_tokens => 1)",
           "SELECT public.dflash_generate_json('hi', '{\"type\": \"boolean\"}', max_new_tokens => 8)",
           "SELECT public.dflash_classify('hi', ARRAY['yes', 'no'], max_new_tokens => 8)",
           "SELECT * FROM public.dflash_generate_block('hi', 2)",
           "SELECT public.dflash_embed('hi')", "SELECT public.dflash_embed(ARRAY['hi'])",
           "SELECT * FROM public.dflash_recall('hi', 1)", "SELECT public.dflash_worker_status()"]
    bob_row = "calling_role = 'sec_bob'"
    return {
        ("dflash_generate, dflash_generate_stats, dflash_generate_json, dflash_classify, dflash_generate_block, "
         "dflash_embed, dflash_recall, dflash_worker_status", "EXECUTE"): api,
        ("dflash.enable_generation, dflash.disable_generation", "own table"): [
            "SELECT dflash.enable_generation('{own}', 'prompt', 'answer')",
            "SELECT dflash.disable_generation('{own}')"],
        ("dflash.enable_generation, dflash.disable_generation", "others' table"): [
            "SELECT dflash.enable_generation('sec_bob.notes', 'prompt', 'answer')",
            "SELECT dflash.disable_generation('sec_bob.notes')"],
        ("dflash.set_config, UPDATE dflash.config", "EXECUTE"): [
            "SELECT dflash.set_config('socket_path', '/tmp/evil.sock')",
            "UPDATE dflash.config SET value = '/tmp/evil.sock' WHERE key = 'socket_path'"],
        ("dflash.config", "SELECT"): ["SELECT * FROM dflash.config"],
        ("dflash.record_generation", "own rows"): [f"SELECT dflash.record_generation('sync', 'p', '{{}}', {REC}, 0, 0)"],
        ("dflash.record_generation", "as another role"): [
            f"SELECT dflash.record_generation('sync', 'p', '{{}}', {REC}, 0, 0, NULL, 'sec_bob')"],
        ("dflash.write_&lt;writer_id&gt; (a table's writer)", "EXECUTE"): [f"SELECT {bob_writer}('0', 'x', 'y')"],
        ("a member's table", "SELECT, UPDATE"): ["SELECT * FROM sec_bob.notes",
                                                 "UPDATE sec_bob.notes SET answer = 'x'"],
        ("dflash.generations", "SELECT own"): ["SELECT 1 FROM dflash.generations WHERE calling_role = '{me}'"],
        ("dflash.generations", "SELECT others' prompts and outputs"): [
            f"SELECT prompt, output FROM dflash.generations WHERE {bob_row}"],
        # Block length auto's workload prior for a table's rows: the queue consumer reads counts only.
        ("dflash.generations", "SELECT others' acceptance counts"): [
            f"SELECT accepted_per_position, judged_per_position FROM dflash.generations WHERE {bob_row}"],
        ("dflash.generations", "INSERT own"): [
            "INSERT INTO dflash.generations (mode, status, prompt) VALUES ('sync', 'ok', 'p')"],
        ("dflash.generations", "INSERT as another role"): [
            "INSERT INTO dflash.generations (mode, status, prompt, calling_role) VALUES ('sync', 'ok', 'p', 'sec_bob')"],
        ("dflash.generations", "DELETE others'"): [f"DELETE FROM dflash.generations WHERE {bob_row}"],
        ("dflash.memory", "SELECT own"): ["SELECT 1 FROM dflash.memory WHERE calling_role = '{me}'"],
        ("dflash.memory", "SELECT others'"): [f"SELECT 1 FROM dflash.memory WHERE {bob_row} AND NOT shared"],
        ("dflash.memory", "SELECT shared"): ["SELECT 1 FROM dflash.memory WHERE shared AND calling_role <> '{me}'"],
        ("dflash.memory", "INSERT own"): [
            f"INSERT INTO dflash.memory (prompt, output, embedding) VALUES ('p', 'o', {MEMORY})"],
        ("dflash.memory", "INSERT shared"): [
            f"INSERT INTO dflash.memory (prompt, output, embedding, shared) VALUES ('p', 'o', {MEMORY}, true)"],
        ("dflash.memory", "mark shared"): [f"UPDATE dflash.memory SET shared = true WHERE {bob_row}"],
        ("dflash.memory", "DELETE own"): ["DELETE FROM dflash.memory WHERE calling_role = '{me}'"],
        ("dflash.memory", "DELETE others'"): [f"DELETE FROM dflash.memory WHERE {bob_row}"],
        ("dflash.queue", "SELECT own"): ["SELECT 1 FROM dflash.queue WHERE calling_role = '{me}'"],
        ("dflash.queue", "SELECT others'"): [f"SELECT 1 FROM dflash.queue WHERE {bob_row}"],
        ("dflash.queue", "INSERT for own table"): [
            "INSERT INTO dflash.queue (tbl, key_value, prompt) VALUES ('{own}', '1', 'p')"],
        ("dflash.queue", "INSERT for others' table"): [
            "INSERT INTO dflash.queue (tbl, key_value, prompt) VALUES ('sec_bob.notes', '1', 'p')"],
        ("dflash.queue", "UPDATE others'"): [f"UPDATE dflash.queue SET attempts = 0 WHERE {bob_row}"],
        ("dflash.queue", "DELETE own"): ["DELETE FROM dflash.queue WHERE calling_role = '{me}'"],
        ("dflash.queue", "DELETE others'"): [f"DELETE FROM dflash.queue WHERE {bob_row}"],
        ("dflash.queue_failed", "SELECT own"): ["SELECT 1 FROM dflash.queue_failed WHERE calling_role = '{me}'"],
        ("dflash.queue_failed", "SELECT others'"): [f"SELECT 1 FROM dflash.queue_failed WHERE {bob_row}"],
        ("dflash.generation_targets", "SELECT own"): [
            "SELECT 1 FROM dflash.generation_targets WHERE tbl = '{own}'::regclass"],
        ("dflash.generation_targets", "SELECT others'"): [
            "SELECT 1 FROM dflash.generation_targets WHERE tbl = 'sec_bob.notes'::regclass"],
        ("dflash.generation_targets", "UPDATE others'"): [
            "UPDATE dflash.generation_targets SET options = '{}' WHERE tbl = 'sec_bob.notes'::regclass"],
        ("dflash.generation_targets", "DELETE others'"): [
            "DELETE FROM dflash.generation_targets WHERE tbl = 'sec_bob.notes'::regclass"],
        ("dflash.acceptance_daily", "SELECT others' rows"): [
            "SELECT 1 FROM dflash.acceptance_daily WHERE generations > (SELECT count(*) FROM dflash.generations"
            " WHERE calling_role = '{me}' AND status = 'ok')"],
    }


class _Undo(Exception):
    def __init__(self, rows: int):
        self.rows = rows


def outcome(conn, statements) -> str:
    """allowed: every statement worked on at least one row; denied: a privilege error or no row."""
    for statement in statements:
        try:
            with conn.transaction():
                cur = conn.execute(statement)
                raise _Undo(len(cur.fetchall()) if cur.description else cur.rowcount)
        except _Undo as undo:
            if undo.rows < 1:
                return "denied"
        except errors.InsufficientPrivilege:
            return "denied"
    return "allowed"


@pytest.fixture(scope="module")
def matrix_rows(traps, sql_worker):
    """A table (`<role>.own`) for each role but the worker, and for the member, the admin and
    Bob rows of every kind; one of Bob's memory rows is shared. Returns Bob's writer."""
    with connect(traps) as su:
        for role in (EVE, ALICE, ADMIN, BOB):
            with connect(traps, role) as conn:
                conn.execute(f"CREATE TABLE IF NOT EXISTS {role}.own (id serial PRIMARY KEY, prompt text, answer text)")
                if role == EVE:
                    continue
                conn.execute(f"SELECT dflash.enable_generation('{role}.own', 'prompt', 'answer')")
                conn.execute(f"INSERT INTO {role}.own (prompt) VALUES ('queued')")
                record(conn, f"{role}'s row")
                record(conn, f"{role}'s other row")
            su.execute("INSERT INTO dflash.queue_failed (id, tbl, key_value, prompt, options, calling_role, attempts,"
                       " created_at) SELECT -100 - count(*), %s::regclass, '1', 'p', '{}', %s, 1, now()"
                       " FROM dflash.queue_failed", (f"{role}.own", role))
        su.execute("UPDATE dflash.memory SET shared = true WHERE id = (SELECT max(id) FROM dflash.memory"
                   " WHERE calling_role = %s)", (BOB,))
        return "dflash." + str(scalar(su, "SELECT dflash._writer_name('sec_bob.notes')"))


def test_the_privilege_matrix_is_the_golden_one(traps, matrix_rows):
    golden = parse_matrix(GOLDEN)
    acts = actions(matrix_rows)
    assert set(acts) == set(golden)
    measured, conns = {}, {role: connect(traps, role) for role in ROLE_COLUMNS}
    try:
        for key, statements in acts.items():
            row = []
            for role, expected in zip(ROLE_COLUMNS, golden[key]):
                if expected == "-":
                    row.append("-")
                    continue
                own = f"{role}.own" if role != "dflash_worker" else "-"
                row.append(outcome(conns[role], [s.replace("{me}", role).replace("{own}", own) for s in statements]))
            measured[key] = tuple(row)
    finally:
        for conn in conns.values():
            conn.close()
    wrong = {k: (golden[k], measured[k]) for k in golden if golden[k] != measured[k]}
    assert not wrong, wrong


def test_the_readme_states_the_golden_matrix():
    readme = (REPO / "README.md").read_text()
    found = re.search(r"<!-- privilege-matrix:start -->(.*?)<!-- privilege-matrix:end -->", readme, re.S)
    assert found, "README has no privilege matrix"
    assert parse_matrix(found.group(1)) == parse_matrix(GOLDEN)
