"""The extension against a real PostgreSQL: functions, tables, recall, errors, cancellation,
privileges. The worker here runs the tiny engine (with SmolLM2's tokenizer) in-process."""

import json
import threading
import time

import psycopg
import pytest
from psycopg import errors

from dflash.engine.engine import GenerationRequest
from tests.conftest import wait_until
from tests.sqlenv import setting


@pytest.fixture
def db(pg_dsn, sql_worker):
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        yield conn


def count(db, table):
    return db.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


def test_generate_matches_the_engine_and_is_recorded(db, tiny_text_engine):
    before = count(db, "dflash.generations")
    text = db.execute("SELECT dflash_generate('Write a haiku about databases', max_new_tokens => 16)").fetchone()[0]
    local = tiny_text_engine.generate(
        GenerationRequest(prompt="Write a haiku about databases", chat=True, max_new_tokens=16)
    )
    assert text == local.text
    row = db.execute(
        "SELECT mode, status, prompt, output, target, drafter, block_size, new_tokens, tau, steps,"
        " accepted_per_position, calling_role, params->>'max_new_tokens' FROM dflash.generations ORDER BY id DESC LIMIT 1"
    ).fetchone()
    assert count(db, "dflash.generations") == before + 1
    assert row[:6] == ("sync", "ok", "Write a haiku about databases", text, "tiny", "tiny-drafter")
    # Block length auto (the default) has no one block size: NULL, and verify_lengths says what it chose.
    # Its steps may differ from the local run's (the worker's suffix proposer also drafts from this
    # workload's memory); the output may not.
    assert row[6] is None and row[7] == len(local.output_ids) and 1 <= row[8] <= 8
    assert row[9] >= 1 and len(row[10]) == 7 and row[12] == "16"
    mem = db.execute("SELECT output, vector_dims(embedding), embedding::text, embedder FROM dflash.memory"
                     " ORDER BY id DESC LIMIT 1").fetchone()
    assert mem[:2] == (text, 384) and mem[3]
    # the stored vector is the embedding of the question with its answer
    expected = db.execute("SELECT dflash_embed(%s)::text", (f"Write a haiku about databases\n\n{text}",)).fetchone()[0]
    assert [float(x) for x in mem[2][1:-1].split(",")] == pytest.approx(
        [float(x) for x in expected[1:-1].split(",")], abs=1e-6)


def test_generate_stats_block_and_batch(db):
    stats = db.execute("SELECT dflash_generate_stats('Hello there', max_new_tokens => 8, block_size => 4)").fetchone()[0]
    for key in ("text", "output_ids", "steps", "tau", "acceptance_rate", "generation_id", "decode_s"):
        assert key in stats
    assert stats["block_size"] == 4 and all(len(s["draft_ids"]) == 3 for s in stats["steps"])
    row = db.execute("SELECT * FROM dflash_generate_block('Write a haiku about databases', 8)").fetchone()
    draft_ids, draft_text, accepted, accepted_text, next_id, next_text, first_text = row
    assert len(draft_ids) == 7 and 0 <= accepted <= 7 and isinstance(next_id, int)
    served = "SELECT (dflash_worker_status()->'requests_served'->>'generate_many')::int"
    before = db.execute(served).fetchone()[0]
    rows_before = db.execute("SELECT count(*) FROM dflash.generations").fetchone()[0]
    outs = db.execute("SELECT dflash_generate(ARRAY['one', 'two', 'three'], max_new_tokens => 4)").fetchone()[0]
    # One batched request to the worker, one dflash.generations row per prompt.
    assert db.execute(served).fetchone()[0] == before + 1
    assert db.execute("SELECT count(*) FROM dflash.generations").fetchone()[0] == rows_before + 3
    singles = [db.execute("SELECT dflash_generate(%s, max_new_tokens => 4)", (p,)).fetchone()[0]
               for p in ("one", "two", "three")]
    assert outs == singles
    assert db.execute("SELECT dflash_generate(ARRAY[]::text[])").fetchone()[0] == []
    with pytest.raises(errors.NullValueNotAllowed):
        db.execute("SELECT dflash_generate(ARRAY['ok', NULL])")


def test_embed_and_recall_find_the_right_neighbour(db):
    v = db.execute("SELECT dflash_embed('a cat on a mat')::text").fetchone()[0]
    assert v.startswith("[") and v.count(",") == 383
    vs = db.execute("SELECT array_length(dflash_embed(ARRAY['a', 'b']), 1)").fetchone()[0]
    assert vs == 2
    topics = {
        "Explain how volcanoes erupt": None,
        "Give me a recipe for pancakes": None,
        "How do I sort a list in Python?": None,
    }
    for p in topics:
        topics[p] = db.execute("SELECT (dflash_generate_stats(%s, max_new_tokens => 6))->>'generation_id'",
                               (p,)).fetchone()[0]
    hits = db.execute("SELECT generation_id, prompt, distance FROM dflash_recall('pancake breakfast recipe', 3)").fetchall()
    assert hits[0][1] == "Give me a recipe for pancakes" and str(hits[0][0]) == topics[hits[0][1]]
    assert hits[0][2] <= hits[-1][2]


def test_worker_status(db):
    s = db.execute("SELECT dflash_worker_status()").fetchone()[0]
    assert s["protocol"] == 1 and s["target"] == "tiny" and s["ready"]


def test_acceptance_view_pools_tau_as_the_engine_does(db):
    """Known rows, exact values: τ pooled over the day's steps (stats.pooled_tau), which a mean
    of each row's τ is not: 1 step keeping 4 drafts (τ 5) and 11 steps keeping 4 (τ 15/11,
    whose τ × steps is 14.999999999999998 in floating point) pool to 20/12; their mean is 3.18.
    A row without steps (an endpoint that reported no counts) weighs nothing in τ."""
    from dflash.engine.stats import pooled_tau

    rows = [  # (steps, accepted drafts, new tokens, acceptance rate, decode s, total ms)
        (1, 4, 5, 1.0, 0.1, 100.0),
        (11, 4, 15, 4 / 30, 0.3, 300.0),
        (None, None, 2, None, 0.1, 200.0),
    ]
    with db.transaction(force_rollback=True):  # the test's rows go; other tests' stay apart (their target)
        for steps, accepted, new, rate, decode_s, total_ms in rows:
            result = {"text": "x", "target": "view-test", "drafter": "d", "block_size": 4, "block_policy": "fixed",
                      "num_steps": steps, "new_tokens": new, "tau": pooled_tau(accepted, steps) if steps else None,
                      "acceptance_rate": rate, "decode_s": decode_s}
            db.execute("SELECT dflash.record_generation('sync', 'p', '{}', %s, 0, %s)", (json.dumps(result), total_ms))
        got = db.execute("SELECT generations, new_tokens, mean_tau, mean_acceptance_rate, p50_ms, p95_ms,"
                         " tokens_per_s, block_size FROM dflash.acceptance_daily WHERE target = 'view-test'").fetchall()
    assert got == [(3, 22, pooled_tau(8, 12), pytest.approx((1.0 + 4 / 30) / 2), 200.0, 290.0,
                    pytest.approx(22 / 0.5), 4)]
    assert pooled_tau(8, 12) != pytest.approx((pooled_tau(4, 1) + pooled_tau(4, 11)) / 2)  # the case tells them apart


# --- bad input: a clean SQL error, nothing written ---------------------------------------------


@pytest.mark.parametrize(
    "query, exc",
    [
        ("SELECT dflash_generate(NULL::text)", errors.NullValueNotAllowed),
        ("SELECT dflash_generate('hi', max_new_tokens => NULL)", errors.NullValueNotAllowed),
        ("SELECT dflash_generate('')", errors.InvalidParameterValue),
        ("SELECT dflash_generate('   ')", errors.InvalidParameterValue),
        ("SELECT dflash_generate('hi', block_size => 0)", errors.InvalidParameterValue),
        ("SELECT dflash_generate('hi', block_size => 1000)", errors.InvalidParameterValue),
        ("SELECT dflash_generate('hi', max_new_tokens => -5)", errors.InvalidParameterValue),
        ("SELECT dflash_generate('hi', temperature => -1)", errors.InvalidParameterValue),
        ("SELECT dflash_generate('hi', top_p => 0)", errors.InvalidParameterValue),
        ("SELECT dflash_generate(repeat('word ', 20000))", errors.ProgramLimitExceeded),
        ("SELECT * FROM dflash_generate_block('hi', 0)", errors.InvalidParameterValue),
        ("SELECT * FROM dflash_generate_block('hi', 1000)", errors.InvalidParameterValue),
        ("SELECT * FROM dflash_generate_block(NULL, 4)", errors.NullValueNotAllowed),
        ("SELECT dflash_embed('')", errors.InvalidParameterValue),
        ("SELECT dflash_embed(NULL::text)", errors.NullValueNotAllowed),
        ("SELECT dflash_embed(ARRAY['ok', NULL])", errors.NullValueNotAllowed),
        ("SELECT * FROM dflash_recall('x', 0)", errors.InvalidParameterValue),
        ("SELECT dflash.set_config('nope', 'x')", errors.InvalidParameterValue),
    ],
)
def test_bad_input_is_a_clean_error_and_writes_nothing(db, query, exc):
    before = (count(db, "dflash.generations"), count(db, "dflash.memory"))
    with pytest.raises(exc):
        db.execute(query)
    assert (count(db, "dflash.generations"), count(db, "dflash.memory")) == before
    assert db.execute("SELECT 1").fetchone() == (1,)  # the backend is alive


def test_unusual_text_round_trips(db):
    prompt = "tab\there, newline\nquote' backslash\\ emoji 😀 bidi \u202e nul-free \u2028 done"
    out = db.execute("SELECT dflash_generate_stats(%s, max_new_tokens => 4)", (prompt,)).fetchone()[0]
    stored = db.execute("SELECT prompt FROM dflash.generations WHERE id = %s", (out["generation_id"],)).fetchone()[0]
    assert stored == prompt


# --- cancellation and a missing worker ---------------------------------------------------------


LONG = "SELECT dflash_generate('Tell a very long story', max_new_tokens => 400, block_size => 1)"


@pytest.fixture
def slow_worker(sql_worker, slow_engine):
    return sql_worker


def test_statement_timeout_stops_the_call_and_the_worker(pg_dsn, slow_worker):
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("SET statement_timeout = '300ms'")
        t = time.monotonic()
        with pytest.raises(errors.QueryCanceled):
            conn.execute(LONG)
        elapsed = time.monotonic() - t
    assert elapsed < 0.3 + 0.25, elapsed
    assert wait_until(lambda: slow_worker.in_flight == 0)


def test_pg_cancel_backend_stops_the_call(pg_dsn, slow_worker):
    with psycopg.connect(pg_dsn, autocommit=True) as conn, psycopg.connect(pg_dsn, autocommit=True) as ctl:
        pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        outcome = {}

        def run():
            try:
                conn.execute(LONG)
            except psycopg.Error as exc:
                outcome["exc"] = exc
                outcome["t"] = time.monotonic()

        th = threading.Thread(target=run)
        th.start()
        assert wait_until(lambda: slow_worker.in_flight == 1)
        t = time.monotonic()
        ctl.execute("SELECT pg_cancel_backend(%s)", (pid,))
        th.join(timeout=10)
        assert isinstance(outcome.get("exc"), errors.QueryCanceled)
        assert outcome["t"] - t < 0.25
    assert wait_until(lambda: slow_worker.in_flight == 0)


def test_worker_down_is_a_clean_error_with_a_hint(pg_dsn, sql_worker, pg_server):
    with psycopg.connect(pg_dsn, autocommit=True) as conn, \
            setting(conn, "socket_path", pg_server.server_path(pg_server.socket_dir / "none.sock")):
        with pytest.raises(psycopg.Error) as err:
            conn.execute("SELECT dflash_generate('hi')")
        assert err.value.sqlstate == "DF001"
        assert "dflash serve" in err.value.diag.message_hint
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_worker_dying_mid_call(pg_dsn, sql_worker, pg_server):
    """A worker that reads the request and then vanishes: a clean DF001 error."""
    import os
    import socket

    path = pg_server.socket_dir / "dying.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    os.chmod(path, 0o666)
    srv.listen(1)

    def die():
        conn, _ = srv.accept()
        conn.recv(65536)
        time.sleep(0.2)
        conn.close()

    th = threading.Thread(target=die)
    th.start()
    with psycopg.connect(pg_dsn, autocommit=True) as conn, setting(conn, "socket_path", pg_server.server_path(path)):
        with pytest.raises(psycopg.Error) as err:
            conn.execute("SELECT dflash_generate('hi')")
        assert err.value.sqlstate == "DF001"
    th.join()
    srv.close()


def test_remember_without_an_embedder_is_a_clean_error_naming_the_setting(pg_dsn, sql_worker, pg_server,
                                                                          tiny_text_engine):
    """A worker started with --no-embedder while the extension remembers generations: 55000
    naming the 'remember' setting (once DF000), refused before decoding, nothing written;
    with remembering off the same worker generates."""
    from dflash.serve.server import Worker

    path = pg_server.socket_dir / "no-embedder.sock"
    worker = Worker(tiny_text_engine, None, socket_path=str(path), socket_group=pg_server.socket_group)
    worker.start()
    try:
        with psycopg.connect(pg_dsn, autocommit=True) as conn, \
                setting(conn, "socket_path", pg_server.server_path(path)):
            rows, memories = count(conn, "dflash.generations"), count(conn, "dflash.memory")
            for query in ("SELECT dflash_generate('hi', max_new_tokens => 4)",
                          "SELECT dflash_generate(ARRAY['a', 'b'], max_new_tokens => 4)"):
                with pytest.raises(errors.ObjectNotInPrerequisiteState) as err:
                    conn.execute(query)
                assert "--no-embedder" in err.value.diag.message_primary and "'remember'" in err.value.diag.message_primary
                assert "dflash.set_config('remember', 'off')" in err.value.diag.message_hint
                assert err.value.diag.message_detail == "worker error code: no_embedder"
            assert count(conn, "dflash.generations") == rows and worker.tokens == 0  # nothing decoded nor written
            with setting(conn, "remember", "off"):
                assert conn.execute("SELECT dflash_generate('hi', max_new_tokens => 4)").fetchone()[0]
            assert (count(conn, "dflash.generations"), count(conn, "dflash.memory")) == (rows + 1, memories)
    finally:
        worker.shutdown(timeout=10)


@pytest.mark.parametrize("query", ["SELECT dflash_generate('hi', max_new_tokens => 4)",
                                   "SELECT dflash_generate_stats('hi', max_new_tokens => 4)",
                                   "SELECT dflash_generate(ARRAY['a', 'b'], max_new_tokens => 4)"])
@pytest.mark.parametrize("read_only", ["BEGIN READ ONLY", "SET default_transaction_read_only = on"])
def test_a_read_only_transaction_is_refused_before_the_worker_generates(pg_dsn, sql_worker, query, read_only):
    """A generation is recorded in the caller's transaction: in a read-only one (as on a
    standby, where transaction_read_only is on in every transaction, as it is here under
    default_transaction_read_only) it is refused with 25006 before the worker decodes a token."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        rows, tokens = count(conn, "dflash.generations"), sql_worker.tokens
        conn.execute(read_only)
        with pytest.raises(errors.ReadOnlySqlTransaction) as err:
            conn.execute(query)
        assert "read-only transaction" in err.value.diag.message_primary and "primary" in err.value.diag.message_hint
        conn.execute("ROLLBACK" if read_only.startswith("BEGIN") else "RESET default_transaction_read_only")
        assert sql_worker.tokens == tokens and count(conn, "dflash.generations") == rows
        assert conn.execute(query).fetchone()[0]  # read-write again: generated




# --- privileges ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def roles(pg_dsn):
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for r in ("dflash_alice", "dflash_bob"):
            conn.execute(f"DROP ROLE IF EXISTS {r}")
            conn.execute(f"CREATE ROLE {r} LOGIN")
        conn.execute("GRANT dflash_user TO dflash_bob")
    return pg_dsn


USER_CALLS = [
    "SELECT dflash_generate('hi', max_new_tokens => 2)",
    "SELECT dflash_generate_stats('hi', max_new_tokens => 2)",
    "SELECT dflash_generate(ARRAY['hi'], max_new_tokens => 2)",
    "SELECT * FROM dflash_generate_block('hi', 4)",
    "SELECT dflash_embed('hi')",
    "SELECT dflash_embed(ARRAY['hi'])",
    "SELECT * FROM dflash_recall('hi', 1)",
    "SELECT dflash_worker_status()",
    "SELECT count(*) FROM dflash.generations",
]


@pytest.mark.parametrize("query", USER_CALLS)
def test_privileges_public_denied_user_allowed(roles, sql_worker, query):
    with psycopg.connect(roles + " user=dflash_alice", autocommit=True) as alice:
        with pytest.raises(errors.InsufficientPrivilege):
            alice.execute(query)
    with psycopg.connect(roles + " user=dflash_bob", autocommit=True) as bob:
        bob.execute(query)


@pytest.mark.parametrize("query", [
    "SELECT dflash.set_config('socket_path', '/tmp/evil.sock')",
    "UPDATE dflash.config SET value = '/tmp/evil.sock' WHERE key = 'socket_path'",
    "INSERT INTO dflash.settings VALUES ('socket_path', '/tmp/evil.sock')",
    "UPDATE dflash.settings SET value = '/tmp/evil.sock'",
    "DELETE FROM dflash.queue",
    "SET dflash.socket_path = '/tmp/evil.sock'; SELECT dflash_worker_status()",
])
def test_users_cannot_move_the_socket(roles, sql_worker, query):
    with psycopg.connect(roles + " user=dflash_bob", autocommit=True) as bob:
        try:
            bob.execute(query)
        except (errors.InsufficientPrivilege, errors.ObjectNotInPrerequisiteState):  # the view cannot be updated
            pass
        # whatever happened, the worker is still the configured one
        assert bob.execute("SELECT value FROM dflash.config WHERE key = 'socket_path'").fetchone()[0].endswith(
            "worker.sock")
        assert bob.execute("SELECT dflash_worker_status()->>'target'").fetchone()[0] == "tiny"


@pytest.mark.parametrize("extreme", ["temperature => 1e-300, seed => 1", "temperature => 1, top_p => 1e-300"])
def test_extreme_sampling_parameters_generate_instead_of_failing(db, extreme):
    """Once DF000 (a NaN in the sampler): a temperature that rounds to 0 is greedy, a top_p that
    rounds to 0 keeps the top token; both are the greedy output here."""
    got = db.execute(f"SELECT dflash_generate_stats('hi', max_new_tokens => 4, {extreme})").fetchone()[0]
    greedy = db.execute("SELECT dflash_generate_stats('hi', max_new_tokens => 4)").fetchone()[0]
    assert len(got["output_ids"]) == 4 and got["output_ids"] == greedy["output_ids"]
