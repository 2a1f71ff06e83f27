"""Faults (issue 11): whatever kills an attempt, bursts, oversized and malformed requests,
odd outputs. A real PostgreSQL; the tiny engine where the real model is not needed; the
queue is worked by the worker's own consumer as dflash_worker, with a stand-in worker where
a fault has to be injected into the generation itself."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest
from psycopg import errors

from dflash.errors import DFlashError
from dflash.serve.client import Client, WorkerError
from dflash.serve.protocol import HEADER, recv_frame, send_frame
from tests.sqlenv import ALICE, BOB, alice, connect, drain, roles, scalar, su, worker_dsn  # noqa: F401

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def max_attempts(su):
    """Set dflash.config's queue_max_attempts for one test."""
    def set_to(n: int):
        su.execute("SELECT dflash.set_config('queue_max_attempts', %s)", (str(n),))
    yield set_to
    set_to(5)


def make_table(alice, name: str, options: str = '{"max_new_tokens": 2}') -> str:
    alice.execute(f"CREATE TABLE {ALICE}.{name} (id serial PRIMARY KEY, prompt text, answer text)")
    alice.execute("SELECT dflash.enable_generation(%s, 'prompt', 'answer', %s::jsonb)", (f"{ALICE}.{name}", options))
    return f"{ALICE}.{name}"


class StandIn:
    """A worker whose generation does what a test needs (the consumer queues a job with
    submit_async and waits for its result with wait)."""

    embedder = None

    def __init__(self, on_prompt=lambda prompt: None):
        self.on_prompt = on_prompt

    def submit_async(self, op, params):
        return params

    def knows_workload(self, key):
        return True

    def wait(self, params):
        self.on_prompt(params["prompt"])
        return {"text": f"answer to {params['prompt']}", "new_tokens": 1}


# --- defect 5: an attempt counts before it starts -----------------------------------------

# A consumer whose worker dies on a poison prompt, every time (as a process killed mid-item).
POISONED_CONSUMER = """
import os, sys
from dflash.serve.queue import QueueConsumer

class Worker:
    embedder = None
    def submit_async(self, op, params):
        return params
    def knows_workload(self, key):
        return True
    def wait(self, params):
        if "poison" in params["prompt"]:
            os._exit(9)
        return {"text": "answer to " + params["prompt"], "new_tokens": 1}

consumer = QueueConsumer(Worker(), sys.argv[1], backoff_s=0)
with consumer.connect() as conn:
    while consumer.process_one(conn):
        pass
"""


def test_a_poison_prompt_that_kills_the_worker_ends_in_queue_failed(su, alice, worker_dsn, max_attempts):
    max_attempts(3)
    table = make_table(alice, "poison")
    alice.execute(f"INSERT INTO {table} (prompt) VALUES ('poison pill'), ('a healthy row')")
    runs = []
    for _ in range(6):
        runs.append(subprocess.run([sys.executable, "-c", POISONED_CONSUMER, worker_dsn], capture_output=True,
                                   text=True, timeout=60).returncode)
        if runs[-1] == 0:
            break
    assert runs == [9, 9, 9, 0]  # three attempts died; the fourth run gave the item up
    attempts, error = su.execute(f"SELECT attempts, error FROM dflash.queue_failed WHERE tbl = '{table}'::regclass"
                                 ).fetchone()
    assert attempts == 3 and "did not finish" in error
    assert scalar(su, f"SELECT answer FROM {table} WHERE prompt = 'a healthy row'") == "answer to a healthy row"
    assert scalar(su, f"SELECT count(*) FROM dflash.queue WHERE tbl = '{table}'::regclass") == 0


def test_the_consumer_claims_a_batch_and_runs_it_together(su, alice, worker_dsn):
    """Up to `batch` due rows are claimed at once and all their generations are in flight
    before the first answer is waited for; each row is then written in its own savepoint, so
    one failing row leaves the others filled."""
    from dflash.serve.queue import QueueConsumer

    table = make_table(alice, "together")
    alice.execute(f"INSERT INTO {table} (prompt) SELECT 'row ' || i FROM generate_series(1, 5) i")
    log = []

    class Recorder(StandIn):
        def submit_async(self, op, params):
            log.append(("start", params["prompt"]))
            return params

        def wait(self, params):
            log.append(("wait", params["prompt"]))
            if params["prompt"] == "row 2":
                raise DFlashError("bad_params", "this one fails")
            return super().wait(params)

    consumer = QueueConsumer(Recorder(), worker_dsn, backoff_s=0, batch=3)
    with consumer.connect() as conn:
        assert consumer.process_batch(conn)
    assert [k for k, _ in log] == ["start"] * 3 + ["wait"] * 3
    filled = su.execute(f"SELECT prompt FROM {table} WHERE answer IS NOT NULL ORDER BY id").fetchall()
    assert [r[0] for r in filled] == ["row 1", "row 3"]
    left = scalar(su, f"SELECT count(*) + count(*) FILTER (WHERE last_error = 'this one fails') FROM dflash.queue"
                      f" WHERE tbl = '{table}'::regclass")
    su.execute(f"DELETE FROM dflash.queue WHERE tbl = '{table}'::regclass")  # leave nothing for other tests
    assert left == 3 + 1  # rows 4 and 5 not claimed yet, row 2 waits for its retry


def test_a_connection_cut_mid_generation_counts_as_an_attempt(su, alice, worker_dsn, max_attempts):
    max_attempts(2)
    table = make_table(alice, "cut")
    alice.execute(f"INSERT INTO {table} (prompt) VALUES ('cut me off')")

    def cut(prompt):
        su.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'dflash_worker'")

    for _ in range(4):
        try:
            drain(StandIn(cut), worker_dsn)
            break
        except psycopg.OperationalError:
            continue
    attempts, error = su.execute(f"SELECT attempts, error FROM dflash.queue_failed WHERE tbl = '{table}'::regclass"
                                 ).fetchone()
    assert attempts == 2 and "did not finish" in error


def test_a_short_idle_in_transaction_timeout_does_not_kill_a_long_generation(su, alice, worker_dsn):
    """The issue's loop: the server ended the consumer's session during each generation."""
    table = make_table(alice, "idle")
    alice.execute(f"INSERT INTO {table} (prompt) VALUES ('take your time')")
    su.execute("ALTER ROLE dflash_worker SET idle_in_transaction_session_timeout = '200ms'")
    try:
        drain(StandIn(lambda prompt: time.sleep(0.8)), worker_dsn)
    finally:
        su.execute("ALTER ROLE dflash_worker RESET idle_in_transaction_session_timeout")
    assert scalar(su, f"SELECT answer FROM {table}") == "answer to take your time"


def test_a_stuck_trigger_fails_its_own_row_and_no_other(su, alice, worker_dsn, max_attempts):
    """The owner's trigger runs inside the consumer's write: it gets a bounded time."""
    max_attempts(2)
    table = make_table(alice, "stuck")
    alice.execute(f"""CREATE FUNCTION {ALICE}.stall() RETURNS trigger LANGUAGE plpgsql AS $$
                      BEGIN PERFORM pg_sleep(30); RETURN NEW; END $$""")
    alice.execute(f"CREATE TRIGGER stall BEFORE UPDATE ON {table} FOR EACH ROW EXECUTE FUNCTION {ALICE}.stall()")
    alice.execute(f"INSERT INTO {table} (prompt) VALUES ('stuck')")
    other = make_table(alice, "after_stuck")
    alice.execute(f"INSERT INTO {other} (prompt) VALUES ('next in line')")
    t = time.monotonic()
    drain(StandIn(), worker_dsn, write_timeout_s=0.3)
    assert time.monotonic() - t < 10
    assert "statement timeout" in scalar(su, f"SELECT error FROM dflash.queue_failed WHERE tbl = '{table}'::regclass")
    assert scalar(su, f"SELECT answer FROM {other}") == "answer to next in line"


@pytest.mark.parametrize("n", [2, 4])
def test_queue_max_attempts_in_dflash_config_is_what_the_consumer_uses(su, alice, worker_dsn, max_attempts, n):
    from dflash.errors import DFlashError

    max_attempts(n)
    table = make_table(alice, f"attempts{n}")
    alice.execute(f"INSERT INTO {table} (prompt) VALUES ('always fails')")
    tried = []

    def fail(prompt):
        tried.append(prompt)
        raise DFlashError("bad_block_size", "block size must be an integer from 1 to 8")

    drain(StandIn(fail), worker_dsn)
    assert tried.count("always fails") == n
    assert scalar(su, f"SELECT attempts FROM dflash.queue_failed WHERE tbl = '{table}'::regclass") == n


def test_set_config_refuses_values_it_cannot_use(su):
    for key, value in [("queue_max_attempts", "0"), ("queue_max_attempts", "lots"), ("connect_timeout_ms", "-1"),
                       ("remember", "maybe"), ("socket_path", "relative.sock"), ("default_timeout_ms", "1e3")]:
        with pytest.raises(errors.InvalidParameterValue):
            su.execute("SELECT dflash.set_config(%s, %s)", (key, value))
    assert scalar(su, "SELECT value FROM dflash.config WHERE key = 'queue_max_attempts'") == "5"


# --- item 9: disable_generation leaves queued rows to be filled ------------------------------


def test_rows_queued_before_disable_generation_are_still_filled(su, alice, sql_worker, worker_dsn):
    table = make_table(alice, "disabled")
    alice.execute(f"INSERT INTO {table} (prompt) VALUES ('Say hi.')")
    alice.execute(f"SELECT dflash.disable_generation('{table}')")
    alice.execute(f"INSERT INTO {table} (prompt) VALUES ('not queued')")
    drain(sql_worker, worker_dsn)
    assert scalar(su, f"SELECT answer FROM {table} WHERE prompt = 'Say hi.'") is not None
    assert scalar(su, f"SELECT answer FROM {table} WHERE prompt = 'not queued'") is None


# --- defect 6: a burst of callers never sees a false "worker down" ---------------------------


class SlowAcceptor:
    """A worker stand-in whose accept backlog is full: it listens with a backlog of 1 and
    starts accepting only after `delay_s`; then it answers every hello."""

    def __init__(self, path: Path, delay_s: float):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(1)
        threading.Thread(target=self._serve, args=(delay_s,), daemon=True).start()

    def _serve(self, delay_s):
        time.sleep(delay_s)
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    @staticmethod
    def _answer(conn):
        with conn:
            msg = recv_frame(conn)
            send_frame(conn, {"v": 1, "id": msg["id"], "ok": True, "result": {}})


def test_connecting_waits_while_the_accept_backlog_is_full(tmp_path):
    path = tmp_path / "busy.sock"
    acceptor = SlowAcceptor(path, delay_s=0.5)
    outcomes = []

    def call():
        try:
            Client(str(path), connect_timeout=5).call("hello")
            outcomes.append("ok")
        except WorkerError as exc:
            outcomes.append(exc.code)

    threads = [threading.Thread(target=call) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    acceptor.sock.close()
    assert outcomes == ["ok"] * 20


def test_a_missing_worker_is_still_reported_at_once(tmp_path):
    t = time.monotonic()
    with pytest.raises(WorkerError) as err:
        Client(str(tmp_path / "nobody.sock"), connect_timeout=5).call("hello")
    assert err.value.code == "unavailable" and time.monotonic() - t < 0.5


@pytest.fixture(scope="module")
def burst_cluster(tiny_text_engine):
    """A cluster of our own that takes 300 connections, with the extension and a worker."""
    from dflash.localpg import pg_bindir, start_local_cluster
    from dflash.serve.server import Worker

    server = start_local_cluster()
    try:
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            data = scalar(conn, "SHOW data_directory")
            conn.execute("ALTER SYSTEM SET max_connections = 300")
        run_as = ["runuser", "-u", server.os_user, "--"] if os.geteuid() == 0 else []
        log = str(Path(data).parent / "restart.log")  # the server must not inherit our pipes
        subprocess.run([*run_as, str(pg_bindir() / "pg_ctl"), "-D", data, "-l", log, "-w", "restart"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        path = server.socket_dir / "burst.sock"
        worker = Worker(tiny_text_engine, None, socket_path=str(path), socket_group=server.socket_group)
        worker.start()
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            conn.execute("CREATE EXTENSION dflash CASCADE")
            conn.execute("SELECT dflash.set_config('socket_path', %s)", (server.server_path(path),))
        yield server
        worker.shutdown(timeout=10)
    finally:
        server.stop()


def test_250_simultaneous_calls_get_no_false_worker_down(burst_cluster):
    n = 250
    conns = [psycopg.connect(burst_cluster.dsn(), autocommit=True) for _ in range(n)]
    try:
        for conn in conns:  # load PL/Python in every backend first, so the calls below come at once
            with pytest.raises(errors.NullValueNotAllowed):
                conn.execute("SELECT dflash_embed(NULL::text)")
        start, outcomes = threading.Barrier(n), []

        def call(conn):
            start.wait()
            try:
                conn.execute("SELECT dflash_worker_status()")
                outcomes.append("ok")
            except psycopg.Error as exc:
                outcomes.append(exc.sqlstate)

        threads = [threading.Thread(target=call, args=(c,)) for c in conns]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for conn in conns:
            conn.close()
    assert outcomes.count("ok") == n, {s: outcomes.count(s) for s in set(outcomes)}


# --- defect 7 and item 9: what a request carries -----------------------------------------------


def test_a_huge_prompt_does_not_delay_another_caller(pg_dsn, sql_worker):
    def small_call():
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            t = time.monotonic()
            conn.execute("SELECT dflash_generate('Say hi.', max_new_tokens => 4)")
            return time.monotonic() - t

    alone = min(small_call() for _ in range(3))
    huge = threading.Thread(target=lambda: _expect_error(pg_dsn, "SELECT dflash_generate(repeat('word ', 1500000))"))
    huge.start()
    time.sleep(0.3)  # the huge request is at the worker
    beside = small_call()
    huge.join()
    assert beside - alone < 1.0, (alone, beside)


def _expect_error(dsn, query):
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.Error):
            conn.execute(query)


def test_a_request_over_the_frame_limit_is_54000_not_worker_down(pg_dsn, sql_worker):
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.Error) as err:
            conn.execute("SELECT dflash_generate(repeat('x', 9 * 1024 * 1024))")
        assert err.value.sqlstate == "54000", (err.value.sqlstate, str(err.value))
        assert "frame" in str(err.value)
        assert conn.execute("SELECT dflash_worker_status()->>'ready'").fetchone()[0] == "true"


def test_a_deeply_nested_frame_is_answered_and_the_connection_goes_on(sql_worker):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(sql_worker.socket_path))
        body = b"[" * 200_000 + b"]" * 200_000
        sock.sendall(HEADER.pack(len(body)) + body)
        reply = recv_frame(sock)
        assert reply["ok"] is False and reply["error"]["code"] == "bad_frame"
        send_frame(sock, {"v": 1, "id": "after", "op": "hello"})
        assert recv_frame(sock)["ok"] is True


@pytest.mark.parametrize("param", ["temperature", "top_p"])
def test_a_tiny_but_valid_sampling_parameter_works_or_is_a_clean_22023(pg_dsn, sql_worker, param):
    temperature = "1e-40" if param == "temperature" else "0.7"
    top_p = "1e-40" if param == "top_p" else "1"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        try:
            out = conn.execute(f"SELECT dflash_generate('Say hi.', max_new_tokens => 4, temperature => {temperature},"
                               f" top_p => {top_p}, seed => 1)").fetchone()[0]
            assert isinstance(out, str)
        except psycopg.Error as exc:
            assert exc.sqlstate == "22023", (exc.sqlstate, str(exc))


@pytest.fixture
def nul_in_answers(tiny_text_engine, monkeypatch):
    """The engine's answers contain U+0000 (a byte-level tokenizer can produce it)."""
    real = tiny_text_engine.finish

    def finish(state):
        res = real(state)
        res.text = "nul\x00inside " + res.text
        return res

    monkeypatch.setattr(tiny_text_engine, "finish", finish)


def test_a_nul_in_the_answer_is_stored_as_u_fffd(pg_dsn, alice, su, sql_worker, worker_dsn, nul_in_answers):
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        text = conn.execute("SELECT dflash_generate('Say hi.', max_new_tokens => 2)").fetchone()[0]
        stats = conn.execute("SELECT dflash_generate_stats('Say hi.', max_new_tokens => 2)").fetchone()[0]
    assert text.startswith("nul\ufffdinside ") and stats["text"] == text
    table = make_table(alice, "nul")
    alice.execute(f"INSERT INTO {table} (prompt) VALUES ('Say hi.')")
    sync = make_table(alice, "nul_sync", '{"mode": "sync", "max_new_tokens": 2}')
    assert scalar(alice, f"INSERT INTO {sync} (prompt) VALUES ('Say hi.') RETURNING answer") == text
    drain(sql_worker, worker_dsn)
    assert scalar(su, f"SELECT answer FROM {table}") == text
    assert scalar(su, f"SELECT count(*) FROM dflash.queue_failed WHERE tbl = '{table}'::regclass") == 0


def test_recall_returns_k_rows_when_k_exceeds_ef_search(su, roles, sql_worker):
    """The HNSW scan stops at hnsw.ef_search (40) candidates, fewer still after the filter to
    the caller's own rows: k = 100 must still give 100."""
    import random

    rng = random.Random(0)

    def vec():
        v = [rng.gauss(0, 1) for _ in range(384)]
        norm = sum(x * x for x in v) ** 0.5
        return "[" + ",".join(f"{x / norm:.6f}" for x in v) + "]"

    with su.transaction():
        for role, n in ((BOB, 300), (ALICE, 150)):
            for i in range(n):
                su.execute("INSERT INTO dflash.memory (prompt, output, embedding, calling_role)"
                           " VALUES (%s, 'o', %s, %s)", (f"recall row {i}", vec(), role))
    with connect(roles, ALICE) as alice:
        alice.execute("SET enable_seqscan = off")  # as on a big table: the HNSW index answers
        got = scalar(alice, "SELECT count(*) FROM dflash_recall('recall row', 100, include_shared => false)")
    assert got == 100


# --- item 9: cancel ownership --------------------------------------------------------------------

CANCEL_FROM_ANOTHER_PROCESS = """
import json, sys
from dflash.serve.client import Client
print(json.dumps(Client(sys.argv[1]).call("cancel", {"request_id": sys.argv[2]})))
"""


def test_only_the_client_that_sent_a_request_may_cancel_it(sql_worker, slow_engine):
    path = str(sql_worker.socket_path)
    answers = {}

    def run(rid):
        try:
            answers[rid] = Client(path).call("generate", {"prompt": "Tell a long story", "max_new_tokens": 300,
                                                          "block_size": 1}, request_id=rid)
        except WorkerError as exc:
            answers[rid] = exc.code

    victim = threading.Thread(target=run, args=("victim",))
    victim.start()
    assert _wait(lambda: "victim" in {rid for _, rid in sql_worker.jobs})
    other = subprocess.run([sys.executable, "-c", CANCEL_FROM_ANOTHER_PROCESS, path, "victim"],
                           capture_output=True, text=True, timeout=60)
    assert json.loads(other.stdout) == {"cancelled": False}, other.stderr
    mine = threading.Thread(target=run, args=("mine",))
    mine.start()
    assert _wait(lambda: "mine" in {rid for _, rid in sql_worker.jobs})
    assert Client(path).call("cancel", {"request_id": "mine"}) == {"cancelled": True}
    victim.join(timeout=120)
    mine.join(timeout=120)
    assert isinstance(answers["victim"], dict) and answers["victim"]["new_tokens"] > 0
    assert answers["mine"] == "cancelled"


def _wait(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False
