"""The database side of generate-on-insert: the worker consumes dflash.queue.

It LISTENs on channel `dflash_queue` and also polls (a lost notification only delays
work). Each item is taken with FOR UPDATE SKIP LOCKED; the generation runs while the
row is locked, and the output column, the dflash.generations row, the dflash.memory
row and the deletion of the item commit in ONE transaction. A worker killed mid-item
never commits, so its lock goes away and the item is done again: every row is
generated exactly once. Failures are retried with exponential backoff, then moved to
dflash.queue_failed.
"""

from __future__ import annotations

import logging
import threading
import time

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from dflash.errors import DFlashError

log = logging.getLogger("dflash.queue")

TAKE = """
SELECT q.id, q.tbl::text, q.key_value, q.prompt, q.options, q.calling_role, q.attempts,
       (extract(epoch FROM now() - q.created_at) * 1000)::float8 AS waited_ms,
       t.output_column, t.key_column
FROM dflash.queue q LEFT JOIN dflash.generation_targets t ON t.tbl = q.tbl
WHERE q.next_attempt_at <= now()
ORDER BY q.id
FOR UPDATE OF q SKIP LOCKED
LIMIT 1"""

RECORD = "SELECT dflash.record_generation('trigger', %s, %s, %s, %s, %s, %s::regclass, %s)"

GENERATE_OPTIONS = ("max_new_tokens", "temperature", "block_size", "top_p", "top_k", "seed", "chat")


class QueueConsumer:
    def __init__(self, worker, dsn: str, poll_s: float = 1.0, max_attempts: int = 5, backoff_s: float = 1.0):
        self.worker = worker
        self.dsn = dsn
        self.poll_s = poll_s
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.done = 0
        self.failed = 0

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="dflash-queue", daemon=True)
        self.thread.start()

    def shutdown(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=30)
        log.info("queue consumer stopped: %d rows generated, %d given up", self.done, self.failed)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                with psycopg.connect(self.dsn, autocommit=True) as listen, psycopg.connect(self.dsn) as conn:
                    listen.execute("LISTEN dflash_queue")
                    log.info("queue consumer listening on dflash_queue")
                    while not self.stop.is_set():
                        while not self.stop.is_set() and self.process_one(conn):
                            pass
                        for _ in listen.notifies(timeout=self.poll_s, stop_after=1):
                            pass
            except psycopg.Error as exc:
                log.warning("queue consumer lost the database (%s); reconnecting", exc)
                self.stop.wait(2.0)
            except Exception:
                log.exception("queue consumer error; restarting it")
                self.stop.wait(2.0)

    def process_one(self, conn: psycopg.Connection) -> bool:
        """Take and finish one item; False when nothing is due."""
        with conn.transaction():
            row = conn.execute(TAKE).fetchone()
            if row is None:
                return False
            qid, tbl, key, prompt, options, role, attempts, waited_ms, out_col, key_col = row
            try:
                with conn.transaction():  # a savepoint: a failure undoes only this item's writes
                    self._fill(conn, tbl, key, prompt, options or {}, role, waited_ms, out_col, key_col)
                    conn.execute("DELETE FROM dflash.queue WHERE id = %s", (qid,))
                self.done += 1
            except psycopg.OperationalError:
                raise  # the connection is gone: reconnect; the item's lock went with it
            except (DFlashError, psycopg.Error) as exc:
                self._retry_or_give_up(conn, qid, attempts + 1, str(getattr(exc, "message", exc)))
            except Exception as exc:  # a bug: keep the item, say what happened, keep serving
                log.exception("queue item %s failed unexpectedly", qid)
                self._retry_or_give_up(conn, qid, attempts + 1, f"{type(exc).__name__}: {exc}")
        return True

    def _fill(self, conn, tbl, key, prompt, options, role, waited_ms, out_col, key_col) -> None:
        if out_col is None:
            raise DFlashError("not_enabled", f"generation is no longer enabled for {tbl}")
        params = {k: options[k] for k in GENERATE_OPTIONS if k in options}
        params.setdefault("chat", True)
        params["prompt"] = prompt
        t = time.monotonic()
        res = self.worker.submit("generate", dict(params, remember=self.worker.embedder is not None))
        total_ms = (time.monotonic() - t) * 1000 + waited_ms
        updated = conn.execute(
            sql.SQL("UPDATE {} SET {} = %s WHERE {}::text = %s").format(
                sql.SQL(tbl), sql.Identifier(out_col), sql.Identifier(key_col)  # tbl is regclass output: quoted
            ),
            (res["text"], key),
        ).rowcount
        if updated != 1:
            raise DFlashError("row_gone", f"row {key_col} = {key} of {tbl} no longer exists")
        shown = {k: v for k, v in params.items() if k != "prompt"}
        conn.execute(RECORD, (prompt, Jsonb(shown), Jsonb(res), waited_ms, total_ms, tbl, role))

    def _retry_or_give_up(self, conn, qid: int, attempts: int, error: str) -> None:
        if attempts >= self.max_attempts:
            conn.execute(
                "INSERT INTO dflash.queue_failed (id, tbl, key_value, prompt, options, calling_role, attempts, error,"
                " created_at) SELECT id, tbl, key_value, prompt, options, calling_role, %s, %s, created_at"
                " FROM dflash.queue WHERE id = %s",
                (attempts, error, qid),
            )
            conn.execute(
                "INSERT INTO dflash.generations (mode, status, error, prompt, params, calling_role, source_table)"
                " SELECT 'trigger', 'error', %s, coalesce(prompt, ''), options, calling_role, tbl"
                " FROM dflash.queue WHERE id = %s",
                (error, qid),
            )
            conn.execute("DELETE FROM dflash.queue WHERE id = %s", (qid,))
            self.failed += 1
            log.warning("queue item %s failed %d times, moved to dflash.queue_failed: %s", qid, attempts, error)
        else:
            delay = self.backoff_s * 2 ** (attempts - 1)
            conn.execute(
                "UPDATE dflash.queue SET attempts = %s, last_error = %s,"
                " next_attempt_at = now() + make_interval(secs => %s) WHERE id = %s",
                (attempts, error, delay, qid),
            )
            log.info("queue item %s failed (attempt %d), retrying in %.1f s: %s", qid, attempts, delay, error)
