"""The worker in remote mode (`--backend openai`) against a real llama.cpp `llama-server`,
serving the shipped Q4_1 target with the shipped drafter as its DFlash draft model:
generate through SQL equal to the server's own answer, generate on insert, cancel and
statement_timeout aborting the server-side request, the endpoint killed mid-call, 16
concurrent callers, and the speculative counts in dflash.generations.

llama-server is built from the llama-cpp-python sdist (`python -m dflash.bench.llamacpp
build`; 15-30 minutes on 2 cores, once, into the model cache). Without the build these tests
skip, and the run's summary says so; under CI (which builds it first, .ci/run) they fail;
`make test-all` builds it first (the slow test below).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest
from psycopg import errors

from dflash.bench import llamacpp
from dflash.engine.engine import GenerationRequest
from dflash.localpg import free_port
from dflash.remote.engine import remote_engine
from dflash.serve.server import Worker
from tests.conftest import REPO, unavailable, wait_until
from tests.sqlenv import drain, roles, setting, worker_dsn  # noqa: F401

HAIKU = "Write a haiku about databases"
LONG = "Write a very long story about a database administrator, with many chapters."


def needs_llama_server() -> None:
    if not llamacpp.binary("llama-server").is_file():
        unavailable("llama-server (the remote backend against a real endpoint)",
                    "not built here: `python -m dflash.bench.llamacpp build` builds it (15-30 minutes on 2 cores, "
                    "once); `make test-all` builds it first")


@pytest.mark.slow
def test_llama_server_builds():
    """First in this file: with `make test-all` the build is there for the tests below."""
    llamacpp.ensure_built()
    assert llamacpp.binary("llama-server").is_file()


def start_server(tmp_path_factory) -> llamacpp.LlamaServer:
    needs_llama_server()
    return llamacpp.default_server(threads=2, log=tmp_path_factory.mktemp("llama") / "server.log")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    server = start_server(tmp_path_factory)
    yield server
    server.close()


def get(server, path):
    with urllib.request.urlopen(server.url + path, timeout=5) as r:
        return json.loads(r.read())


def direct(server, ids: list[int], n: int) -> dict:
    """llama-server's own answer for these prompt ids, asked directly (greedy)."""
    body = {"prompt": ids, "n_predict": n, "temperature": 0, "return_tokens": True, "stream": False}
    req = urllib.request.Request(server.url + "/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def busy_slots(server) -> int:
    return sum(1 for s in get(server, "/slots") if s.get("is_processing"))


def decoding(server) -> bool:
    """A slot is busy and has generated tokens for its request (not only its prompt)."""
    return any(s.get("is_processing") and (s.get("next_token") or [{}])[0].get("n_decoded", 0) > 0
               for s in get(server, "/slots"))


def server_poll(cond, timeout: float) -> bool:
    """wait_until at 20 polls a second: every /slots request is a task for the server's own
    loop, and on 2 busy cores polling it at 100 Hz can slow the very decoding being watched."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@pytest.fixture(scope="module")
def engine(llama, smol_dir):
    return remote_engine(llama.url, smol_dir)


def prompt_ids(engine, prompt: str) -> list[int]:
    return engine.prompt_ids(GenerationRequest(prompt=prompt))


@pytest.fixture(scope="module")
def remote_worker(pg_server, pg_dsn, engine, embedder):
    """A worker in remote mode whose socket the server's backends reach; the SQL side points
    at it for this module and back at whatever it pointed at before."""
    path = pg_server.socket_dir / "remote.sock"
    worker = Worker(engine, embedder, socket_path=str(path), socket_group=pg_server.socket_group, max_queue=64)
    worker.start()
    with psycopg.connect(pg_dsn, autocommit=True) as conn, setting(conn, "socket_path", pg_server.server_path(path)):
        yield worker
    worker.shutdown(timeout=10)


@pytest.fixture
def db(pg_dsn, remote_worker):
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        yield conn


def last_row(db):
    return db.execute("SELECT output, output_ids, new_tokens, backend, proposers, tau, acceptance_rate, target, "
                      "block_size, status FROM dflash.generations ORDER BY id DESC LIMIT 1").fetchone()


def test_sql_generate_equals_the_servers_own_answer(db, llama, engine):
    want = direct(llama, prompt_ids(engine, HAIKU), 32)
    text = db.execute(f"SELECT dflash_generate('{HAIKU}', max_new_tokens => 32, temperature => 0)").fetchone()[0]
    assert text == want["content"]
    output, output_ids, new_tokens, backend, proposers, tau, rate, target, block, status = last_row(db)
    assert (output, output_ids, status) == (want["content"], want["tokens"], "ok")
    assert new_tokens == len(want["tokens"]) and backend == "openai/llama.cpp" and block is None
    assert target == engine.target.name
    spec = proposers["endpoint"]  # the server's own drafted/accepted counts for this request
    assert spec["drafted"] > 0 and 0 <= spec["accepted"] <= spec["drafted"] and spec["pooled"] is False
    assert rate == pytest.approx(spec["accepted"] / spec["drafted"]) and tau >= 1.0


def test_the_worker_status_names_the_endpoint(db, llama):
    status = db.execute("SELECT dflash_worker_status()").fetchone()[0]  # jsonb: a dict
    assert status["endpoint"] == llama.url and status["target_backend"] == "openai/llama.cpp"
    assert status["model"] and status["block_size"] is None and status["ready"]


def test_generate_on_insert_through_the_endpoint(db, llama, engine, remote_worker, worker_dsn):  # noqa: F811
    db.execute("DROP TABLE IF EXISTS remote_notes")
    db.execute("CREATE TABLE remote_notes (id serial PRIMARY KEY, prompt text, answer text)")
    db.execute("SELECT dflash.enable_generation('remote_notes', 'prompt', 'answer', "
               "'{\"max_new_tokens\": 16, \"temperature\": 0}')")
    db.execute("INSERT INTO remote_notes (prompt) VALUES (%s)", (HAIKU,))
    drain(remote_worker, worker_dsn)
    answer = db.execute("SELECT answer FROM remote_notes").fetchone()[0]
    assert answer == direct(llama, prompt_ids(engine, HAIKU), 16)["content"]
    assert last_row(db)[3] == "openai/llama.cpp"


def test_statement_timeout_aborts_the_servers_request(db, llama, remote_worker):
    # This session's first dflash call loads PL/Python and its modules, and a server's first
    # requests map its weights and build its graphs, the drafter's too (each hundreds of ms, seconds on a busy
    # machine): both done first, so that the 300 ms go to the generation.
    t = time.monotonic()
    db.execute("SELECT dflash_generate('Hi', max_new_tokens => 16)")
    print(f"warm-up call: {time.monotonic() - t:.3f} s")
    rows = db.execute("SELECT count(*) FROM dflash.generations").fetchone()[0]
    seen, stop = [], threading.Event()

    def watch():  # the server's slot while the statement runs: it did get the request
        while not stop.is_set():
            seen.append(busy_slots(llama))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    db.execute("SET statement_timeout = '300ms'")
    t = time.monotonic()
    try:
        with pytest.raises(errors.QueryCanceled):
            db.execute(f"SELECT dflash_generate('{LONG}', max_new_tokens => 2000)")
    finally:
        elapsed = time.monotonic() - t
        stop.set()
        watcher.join()
    db.execute("SET statement_timeout = 0")
    assert 1 in seen
    gone = time.monotonic()
    assert server_poll(lambda: busy_slots(llama) == 0, timeout=1.0)
    print(f"statement ended after {elapsed:.3f} s; the server's slot was free {time.monotonic() - gone:.3f} s later")
    assert elapsed < 0.3 + 0.25, elapsed
    assert wait_until(lambda: remote_worker.in_flight == 0)
    assert db.execute("SELECT count(*) FROM dflash.generations").fetchone()[0] == rows


def test_cancel_aborts_the_servers_request(pg_dsn, db, llama, remote_worker):
    pid = db.execute("SELECT pg_backend_pid()").fetchone()[0]
    outcome = {}

    def run():
        try:
            db.execute(f"SELECT dflash_generate('{LONG}', max_new_tokens => 2000)")
        except psycopg.Error as exc:
            outcome["exc"] = exc

    th = threading.Thread(target=run)
    th.start()
    assert server_poll(lambda: busy_slots(llama) == 1, timeout=10)
    with psycopg.connect(pg_dsn, autocommit=True) as ctl:
        ctl.execute("SELECT pg_cancel_backend(%s)", (pid,))
    th.join(timeout=10)
    assert isinstance(outcome.get("exc"), errors.QueryCanceled)
    assert server_poll(lambda: busy_slots(llama) == 0, timeout=1.0)


def test_sixteen_concurrent_callers(pg_dsn, db, llama, engine):
    """Each of 16 callers at once gets its own prompt's answer, recorded under its own row."""
    prompts = [f"Name a colour, number {i}." for i in range(16)]

    def one(prompt):
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            out = conn.execute("SELECT dflash_generate_stats(%s, max_new_tokens => 8, temperature => 0)",
                               (prompt,)).fetchone()[0]
            row = conn.execute("SELECT prompt, output, output_ids, status FROM dflash.generations WHERE id = %s",
                               (out["generation_id"],)).fetchone()
            return out, row

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, prompts))
    for prompt, (out, row) in zip(prompts, answers):
        assert row == (prompt, out["text"], out["output_ids"], "ok")
        assert 1 <= len(out["output_ids"]) <= 8 and out["prompt_ids"] == prompt_ids(engine, prompt)
        # The server (one slot) answers them one after another, each as it answers the prompt
        # alone; a mix-up between callers could not pass.
        assert out["text"] == direct(llama, prompt_ids(engine, prompt), 8)["content"], prompt


def test_endpoint_killed_mid_call_then_down(pg_server, pg_dsn, smol_dir, embedder, tmp_path_factory):
    """A server of its own, killed while it answers: a clean error, nothing written, the
    worker alive; the next call finds it down."""
    server = start_server(tmp_path_factory)
    path = pg_server.socket_dir / "remote-kill.sock"
    worker = Worker(remote_engine(server.url, smol_dir), embedder, socket_path=str(path),
                    socket_group=pg_server.socket_group)
    worker.start()
    try:
        with psycopg.connect(pg_dsn, autocommit=True) as conn, \
                setting(conn, "socket_path", pg_server.server_path(path)):
            rows = conn.execute("SELECT count(*) FROM dflash.generations").fetchone()[0]

            def kill_mid_answer():  # once the server has generated tokens, and sent them
                if server_poll(lambda: decoding(server), timeout=60):
                    time.sleep(0.2)
                server.proc.kill()

            threading.Thread(target=kill_mid_answer).start()  # 2000 tokens take far longer
            with pytest.raises(psycopg.Error) as err:
                conn.execute(f"SELECT dflash_generate('{LONG}', max_new_tokens => 2000)")
            assert err.value.sqlstate == "DF000" and "worker error code: endpoint_error" in err.value.diag.message_detail
            with pytest.raises(psycopg.Error) as err:
                conn.execute(f"SELECT dflash_generate('{HAIKU}')")
            assert err.value.sqlstate == "DF001" and "endpoint_unavailable" in err.value.diag.message_detail
            assert conn.execute("SELECT count(*) FROM dflash.generations").fetchone()[0] == rows
            assert conn.execute("SELECT dflash_worker_status()").fetchone()[0]["ready"]
    finally:
        worker.shutdown(timeout=10)
        server.close()


def test_cli_generate_prints_the_same_json(llama, engine):
    proc = subprocess.run([sys.executable, "-m", "dflash.cli", "generate", "--backend", "openai", "--endpoint",
                           llama.url, "--prompt", HAIKU, "--max-new-tokens", "16", "--json"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    want = direct(llama, prompt_ids(engine, HAIKU), 16)
    assert out["text"] == want["content"] and out["output_ids"] == want["tokens"]
    for key in ("prompt_ids", "new_tokens", "tau", "acceptance_rate", "prefill_s", "decode_s", "tokens_per_s",
                "finish_reason", "target", "drafter", "speculative"):
        assert key in out


def test_serve_command_serves_and_stops_with_its_parent():
    needs_llama_server()
    port = free_port()
    # A parent that starts the command and is then killed: the command and its server go too.
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-m', 'dflash.bench.llamacpp', 'serve', '--port', '{port}', "
        "'--threads', '2'])\n"
        "time.sleep(3600)\n")], cwd=REPO)
    url = f"http://127.0.0.1:{port}/health"

    def healthy():
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        assert wait_until(healthy, timeout=120)
        props = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/props", timeout=5).read())
        assert "default_generation_settings" in props
    finally:
        parent.kill()
        parent.wait()
    assert wait_until(lambda: not healthy(), timeout=30)
