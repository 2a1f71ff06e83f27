"""Generate on INSERT: the queue path through a `dflash serve --database` worker process
(rollback, exactly-once under a worker kill, retries into queue_failed) and the sync mode."""

import signal
import subprocess
import sys

import psycopg
import pytest

from dflash.engine.drafter import init_random_drafter, save_drafter
from dflash.engine.engine import GenerationRequest
from tests.conftest import make_tiny_target, tiny_drafter_config, wait_until


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, tiny_text_engine):
    """The tiny engine's target (same seed, same weights) and a drafter, saved as folders."""
    base = tmp_path_factory.mktemp("tiny-models")
    target = make_tiny_target(vocab=49152, context=512)
    target.model.save_pretrained(base / "target")
    tiny_text_engine.tokenizer.save_pretrained(base / "target")
    save_drafter(init_random_drafter(tiny_drafter_config(vocab=49152), seed=1, std=0.3), base / "drafter")
    return base


@pytest.fixture(scope="module")
def worker_dsn(pg_dsn):
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("ALTER ROLE dflash_worker LOGIN")
        conn.execute("SELECT dflash.set_config('queue_max_attempts', '2')")
    yield pg_dsn + " user=dflash_worker"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("SELECT dflash.set_config('queue_max_attempts', '5')")


class QueueWorker:
    def __init__(self, tiny_dirs, dsn, sock, log):
        self.args = [
            sys.executable, "-m", "dflash.cli", "serve", "--target", str(tiny_dirs / "target"),
            "--drafter", str(tiny_dirs / "drafter"), "--socket", str(sock), "--no-embedder",
            "--database", dsn, "--poll-s", "0.2", "--threads", "1", "--queue-batch", "4",
        ]
        self.log = log
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen(self.args, stdout=open(self.log, "a"), stderr=subprocess.STDOUT)
        return self

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def queue_worker(tiny_dirs, worker_dsn, tmp_path):
    w = QueueWorker(tiny_dirs, worker_dsn, tmp_path / "q.sock", tmp_path / "worker.log")
    yield w
    w.stop()


@pytest.fixture
def db(pg_dsn, sql_worker):
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        yield conn


def make_table(db, name, options):
    db.execute(f"DROP TABLE IF EXISTS {name}")
    db.execute(f"CREATE TABLE {name} (id serial PRIMARY KEY, prompt text, answer text)")
    db.execute("SELECT dflash.enable_generation(%s, 'prompt', 'answer', %s::jsonb)", (name, options))




def scalar(db, q, *args):
    return db.execute(q, args).fetchone()[0]


def test_queue_end_to_end(db, queue_worker, tiny_text_engine):
    make_table(db, "notes", '{"max_new_tokens": 8}')
    prompts = ["Name a fruit.", "Name a colour.", "Name a planet."]
    for p in prompts:
        db.execute("INSERT INTO notes (prompt) VALUES (%s)", (p,))
    assert scalar(db, "SELECT count(*) FROM dflash.queue WHERE tbl = 'notes'::regclass") == 3
    queue_worker.start()
    assert wait_until(lambda: scalar(db, "SELECT count(*) FROM notes WHERE answer IS NULL") == 0, timeout=60)
    for p in prompts:
        expected = tiny_text_engine.generate(GenerationRequest(prompt=p, chat=True, max_new_tokens=8)).text
        assert scalar(db, "SELECT answer FROM notes WHERE prompt = %s", p) == expected
    rows = db.execute("SELECT mode, status, calling_role, queue_ms IS NOT NULL FROM dflash.generations"
                      " WHERE source_table = 'notes'::regclass").fetchall()
    assert len(rows) == 3 and all(r[0] == "trigger" and r[1] == "ok" and r[3] for r in rows)
    assert scalar(db, "SELECT count(*) FROM dflash.queue") == 0
    # New rows are picked up while the worker runs (NOTIFY, with polling as the fallback).
    db.execute("INSERT INTO notes (prompt) VALUES ('Name a river.')")
    assert wait_until(lambda: scalar(db, "SELECT count(*) FROM notes WHERE answer IS NULL") == 0, timeout=20)


def test_queue_with_an_embedder_writes_the_memory_row(db, sql_worker, worker_dsn):
    """The consumer asks for the memory embedding in the generate call itself; the memory
    row holds the embedding of prompt + answer, as dflash_embed computes it."""
    from dflash.serve.queue import QueueConsumer

    make_table(db, "notes_mem", '{"max_new_tokens": 6}')
    db.execute("INSERT INTO notes_mem (prompt) VALUES ('Name a tree.')")
    consumer = QueueConsumer(sql_worker, worker_dsn)
    with psycopg.connect(worker_dsn) as conn:
        while consumer.process_one(conn):
            pass
    answer = scalar(db, "SELECT answer FROM notes_mem")
    assert answer is not None and consumer.done == 1
    row = db.execute("SELECT m.output, m.embedder, m.embedding <-> dflash_embed(%s) FROM dflash.memory m"
                     " JOIN dflash.generations g ON g.id = m.generation_id"
                     " WHERE g.source_table = 'notes_mem'::regclass", (f"Name a tree.\n\n{answer}",)).fetchall()
    assert len(row) == 1 and row[0][0] == answer and row[0][1] and row[0][2] < 1e-5


def test_rolled_back_insert_queues_nothing(db):
    make_table(db, "notes_rb", '{}')
    before = scalar(db, "SELECT count(*) FROM dflash.queue")
    with pytest.raises(psycopg.errors.RaiseException):
        with db.transaction():
            db.execute("INSERT INTO notes_rb (prompt) VALUES ('never')")
            assert scalar(db, "SELECT count(*) FROM dflash.queue") == before + 1
            db.execute("DO $$ BEGIN RAISE EXCEPTION 'roll back'; END $$")
    assert scalar(db, "SELECT count(*) FROM dflash.queue") == before


def test_exactly_once_when_the_worker_is_killed(db, queue_worker):
    """The consumer claims and generates 4 rows at a time (--queue-batch 4) and commits them
    together: killed in the middle of a batch, it loses none and fills none twice."""
    make_table(db, "notes_kill", '{"max_new_tokens": 300, "block_size": 1}')
    n = 12
    for i in range(n):
        db.execute("INSERT INTO notes_kill (prompt) VALUES (%s)", (f"Write a long story number {i}.",))
    done = "SELECT count(*) FROM dflash.generations WHERE source_table = 'notes_kill'::regclass"
    queue_worker.start()
    assert wait_until(lambda: scalar(db, done) >= 1, timeout=60)
    queue_worker.kill()  # most likely in the middle of the next batch
    left = scalar(db, "SELECT count(*) FROM dflash.queue WHERE tbl = 'notes_kill'::regclass")
    assert left == n - scalar(db, done) and left > 0
    assert scalar(db, done) % 4 == 0  # whole batches committed, nothing of the interrupted one
    queue_worker.start()
    queued = "SELECT count(*) FROM dflash.queue WHERE tbl = 'notes_kill'::regclass"
    assert wait_until(lambda: scalar(db, queued) == 0, timeout=60)
    assert scalar(db, done) == n  # one generation per row, none twice
    assert scalar(db, "SELECT count(*) FROM notes_kill WHERE answer IS NULL") == 0


def test_failures_retry_then_land_in_queue_failed(db, queue_worker):
    make_table(db, "notes_bad", '{"block_size": 1000}')
    db.execute("INSERT INTO notes_bad (prompt) VALUES ('fails every time')")
    queue_worker.start()
    failed = "SELECT count(*) FROM dflash.queue_failed WHERE tbl = 'notes_bad'::regclass"
    assert wait_until(lambda: scalar(db, failed) == 1, timeout=60)
    attempts, error = db.execute("SELECT attempts, error FROM dflash.queue_failed WHERE tbl = 'notes_bad'::regclass").fetchone()
    assert attempts == 2 and "block size" in error
    assert scalar(db, "SELECT count(*) FROM dflash.queue WHERE tbl = 'notes_bad'::regclass") == 0
    assert scalar(db, "SELECT answer FROM notes_bad") is None
    status, err = db.execute("SELECT status, error FROM dflash.generations"
                             " WHERE source_table = 'notes_bad'::regclass").fetchone()
    assert status == "error" and "block size" in err


def test_sync_mode_fills_within_the_insert(db, tiny_text_engine):
    make_table(db, "notes_sync", '{"mode": "sync", "max_new_tokens": 6}')
    answer = scalar(db, "INSERT INTO notes_sync (prompt) VALUES ('Say hi.') RETURNING answer")
    assert answer == tiny_text_engine.generate(GenerationRequest(prompt="Say hi.", chat=True, max_new_tokens=6)).text
    assert scalar(db, "SELECT mode FROM dflash.generations ORDER BY id DESC LIMIT 1") == "trigger-sync"
    assert scalar(db, "SELECT count(*) FROM dflash.queue WHERE tbl = 'notes_sync'::regclass") == 0


def test_disable_and_bad_enable(db):
    make_table(db, "notes_off", '{}')
    db.execute("SELECT dflash.disable_generation('notes_off')")
    db.execute("INSERT INTO notes_off (prompt) VALUES ('x')")
    assert scalar(db, "SELECT count(*) FROM dflash.queue WHERE tbl = 'notes_off'::regclass") == 0
    with pytest.raises(psycopg.errors.UndefinedColumn):
        db.execute("SELECT dflash.enable_generation('notes_off', 'nope', 'answer')")
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        db.execute("SELECT dflash.enable_generation('notes_off', 'prompt', 'answer', '{\"colour\": 1}')")
    db.execute("CREATE TABLE IF NOT EXISTS nokey (prompt text, answer text)")
    with pytest.raises(psycopg.errors.InvalidColumnReference):
        db.execute("SELECT dflash.enable_generation('nokey', 'prompt', 'answer')")
