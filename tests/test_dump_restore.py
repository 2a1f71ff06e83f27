"""pg_dump and pg_restore of a database that uses dflash lose nothing, and generation on
insert goes on in the restored database: the extension's tables are registered with
pg_extension_config_dump (sql/96_dump.sql), settings changed from their defaults are rows
the dump keeps, and the triggers and writers name their table, not its OID.

Runs on a local cluster of its own (pg_dump and pg_restore of this machine; the local back
end, as CI's local stage runs it)."""

from __future__ import annotations

import json
import subprocess

import psycopg
import pytest

from dflash.serve.queue import QueueConsumer
from tests.test_faults import StandIn

pytestmark = pytest.mark.pg

ALICE = "dump_alice"


@pytest.fixture(scope="module")
def cluster(pg_backend):
    from dflash.localpg import start_local_cluster

    if pg_backend != "local":
        pytest.skip("dumps with this machine's pg_dump against a cluster of its own (DFLASH_TEST_BACKEND=local; "
                    "CI runs it in its local stage)")
    server = start_local_cluster()
    yield server
    server.stop()


def answer(text: str) -> str:
    return json.dumps({"text": text, "target": "t", "drafter": "d", "block_size": 4, "block_policy": "fixed",
                       "num_steps": 2, "new_tokens": 3, "tau": 1.5, "accepted_per_position": [1, 0, 0],
                       "output_ids": [7, 8, 9], "proposers": {"dflash": {"steps": 2, "drafted": 6, "accepted": 1}},
                       "memory": {"embedder": "e", "embedding": [0.05] * 384}})


def connect(server, db, user=None):
    return psycopg.connect(server.dsn(db, user), autocommit=True)


def fill_queue(server, db) -> int:
    consumer = QueueConsumer(StandIn(), server.dsn(db, "dflash_worker"), backoff_s=0, batch=4)
    with consumer.connect() as conn:
        while consumer.process_batch(conn):
            pass
    return consumer.done


def test_dump_and_restore_keep_everything_and_generation_goes_on(cluster, tmp_path):
    from dflash.localpg import pg_bindir

    with connect(cluster, "postgres") as su:
        su.execute("CREATE DATABASE dumped")
        if su.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (ALICE,)).fetchone() is None:
            su.execute(f"CREATE ROLE {ALICE} LOGIN")
    with connect(cluster, "dumped") as su:
        su.execute("CREATE EXTENSION dflash CASCADE")
        su.execute(f"GRANT dflash_user TO {ALICE}")
        su.execute("ALTER ROLE dflash_worker LOGIN")
        su.execute(f"CREATE SCHEMA alice AUTHORIZATION {ALICE}")
        su.execute("SELECT dflash.set_config('socket_path', '/srv/dflash/w.sock')")  # changed from its default
        su.execute("SELECT dflash.set_config('queue_max_attempts', '7')")
    with connect(cluster, "dumped", ALICE) as alice:
        for name in ("notes", "instant", "paused"):
            alice.execute(f"CREATE TABLE alice.{name} (id bigint PRIMARY KEY, prompt text, answer text)")
        alice.execute("SELECT dflash.enable_generation('alice.notes', 'prompt', 'answer', '{\"max_new_tokens\": 8}')")
        alice.execute("SELECT dflash.enable_generation('alice.instant', 'prompt', 'answer', '{\"mode\": \"sync\"}')")
        alice.execute("SELECT dflash.enable_generation('alice.paused', 'prompt', 'answer')")
        alice.execute("INSERT INTO alice.notes (id, prompt) VALUES (1, 'queued before the dump'), (2, 'me too')")
        alice.execute("INSERT INTO alice.paused (id, prompt) VALUES (1, 'queued, then paused')")
        alice.execute("SELECT dflash.disable_generation('alice.paused')")
        alice.execute("SELECT dflash.record_generation('sync', 'hi', '{}', %s::jsonb, 1, 2)", (answer("hello"),))
    with connect(cluster, "dumped") as su:
        before = {t: su.execute(f"SELECT count(*) FROM dflash.{t}").fetchone()[0]
                  for t in ("generations", "memory", "queue", "generation_targets")}
        next_id = su.execute("SELECT last_value FROM dflash.generations_id_seq").fetchone()[0]

    dump = tmp_path / "dumped.dump"
    subprocess.run([str(pg_bindir() / "pg_dump"), "-Fc", "-f", str(dump), "-d", cluster.dsn("dumped")], check=True,
                   capture_output=True)
    with connect(cluster, "postgres") as su:
        su.execute("CREATE DATABASE restored")
    out = subprocess.run([str(pg_bindir() / "pg_restore"), "--exit-on-error", "-d", cluster.dsn("restored"), str(dump)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr

    with connect(cluster, "restored") as su:
        # Nothing lost: the rows, the settings changed from their defaults, the sequences' positions.
        after = {t: su.execute(f"SELECT count(*) FROM dflash.{t}").fetchone()[0] for t in before}
        assert after == before
        assert dict(su.execute("SELECT key, value FROM dflash.config WHERE key IN ('socket_path', "
                               "'queue_max_attempts', 'remember')").fetchall()) == {
            "socket_path": "/srv/dflash/w.sock", "queue_max_attempts": "7", "remember": "on"}
        assert su.execute("SELECT last_value FROM dflash.generations_id_seq").fetchone()[0] == next_id
        assert su.execute("SELECT proposers->'dflash'->>'drafted', calling_role FROM dflash.generations").fetchone() \
            == ("6", ALICE)
        assert dict(su.execute("SELECT tbl::text, enabled FROM dflash.generation_targets").fetchall()) == {
            "alice.notes": True, "alice.instant": True, "alice.paused": False}
        assert su.execute("SELECT count(*) FROM dflash.queue WHERE tbl = 'alice.notes'::regclass").fetchone()[0] == 2

    # Generation goes on: the rows queued before the dump and one inserted after it are
    # filled through the tables' writers; the paused table's queued row too.
    with connect(cluster, "restored", ALICE) as alice:
        alice.execute("INSERT INTO alice.notes (id, prompt) VALUES (3, 'queued after the restore')")
    assert fill_queue(cluster, "restored") == 4
    with connect(cluster, "restored", ALICE) as alice:
        assert alice.execute("SELECT id, answer FROM alice.notes ORDER BY id").fetchall() == [
            (1, "answer to queued before the dump"), (2, "answer to me too"), (3, "answer to queued after the restore")]
        assert alice.execute("SELECT answer FROM alice.paused").fetchone()[0] == "answer to queued, then paused"
        # a disabled table queues nothing
        alice.execute("INSERT INTO alice.paused (id, prompt) VALUES (2, 'not queued')")
        assert alice.execute("SELECT count(*) FROM dflash.queue").fetchone()[0] == 0
    with connect(cluster, "restored") as su:
        assert su.execute("SELECT count(*) FROM dflash.generations").fetchone()[0] == before["generations"] + 4
