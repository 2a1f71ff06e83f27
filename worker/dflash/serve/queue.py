"""The database side of generate-on-insert: the worker consumes dflash.queue.

It LISTENs on channel `dflash_queue` and also polls (a lost notification only delays
work). An item is worked on in two transactions:

1. the claim, committed on its own: the attempt is counted and the item is put off by the
   retry backoff before any work starts, so an attempt that never finishes (the worker
   killed on that prompt, its connection cut) still counts, and an item whose attempts
   are used up goes to dflash.queue_failed;
2. the work: the item is locked FOR UPDATE (SKIP LOCKED), the generation runs, and the
   output column, the dflash.generations row, the dflash.memory row and the deletion of
   the item commit together. A worker killed mid-item never commits, so every row is
   filled exactly once.

The consumer never touches a user's table itself: it calls the table's writer,
dflash.write_<oid>(), which runs as the table's owner (see sql/40_triggers.sql), so the
owner's triggers never run with dflash_worker's rights. The number of attempts is the
`queue_max_attempts` setting in dflash.config, read at every claim.
"""

from __future__ import annotations

import logging
import threading
import time

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from dflash.errors import DFlashError
from dflash.serve.protocol import GENERATE_OPTIONS, pg_text, wants_prior

log = logging.getLogger("dflash.queue")

# The session settings the consumer needs whatever the role's or server's defaults: it holds
# a transaction open while a generation runs, and resolves names in pg_catalog only.
SESSION = (
    "SET idle_in_transaction_session_timeout = 0",
    "SET statement_timeout = 0",
    "SET search_path = pg_catalog, pg_temp",
)

CLAIM = """
WITH item AS (
    SELECT q.id FROM dflash.queue q
    WHERE q.next_attempt_at <= now()
    ORDER BY q.id
    FOR UPDATE SKIP LOCKED
    LIMIT 1
)
UPDATE dflash.queue q
SET attempts = q.attempts + 1,
    next_attempt_at = now() + make_interval(secs => %(backoff)s * 2 ^ q.attempts),
    last_error = coalesce(q.last_error, 'an attempt did not finish (the worker stopped or lost its database)')
FROM item WHERE q.id = item.id
RETURNING q.id, q.attempts, q.last_error,
          (SELECT c.value::int FROM dflash.config c WHERE c.key = 'queue_max_attempts')"""

TAKE = """
SELECT q.tbl::oid, q.tbl::text, q.key_value, q.prompt, q.calling_role,
       (extract(epoch FROM now() - q.created_at) * 1000)::float8 AS waited_ms,
       t.options
FROM dflash.queue q LEFT JOIN dflash.generation_targets t ON t.tbl = q.tbl
WHERE q.id = %s AND q.attempts = %s
FOR UPDATE OF q SKIP LOCKED"""

RECORD = "SELECT dflash.record_generation('trigger', %s, %s, %s, %s, %s, %s::oid::regclass, %s)"
PRIOR = "SELECT dflash.workload_prior(%s::oid::regclass, %s)"

GIVE_UP = """
WITH gone AS (DELETE FROM dflash.queue WHERE id = %(id)s RETURNING *),
failed AS (
    INSERT INTO dflash.queue_failed (id, tbl, key_value, prompt, options, calling_role, attempts, error, created_at)
    SELECT g.id, g.tbl, g.key_value, g.prompt, coalesce(t.options, '{}'), g.calling_role, %(attempts)s, %(error)s,
           g.created_at
    FROM gone g LEFT JOIN dflash.generation_targets t ON t.tbl = g.tbl
)
INSERT INTO dflash.generations (mode, status, error, prompt, params, calling_role, source_table)
SELECT 'trigger', 'error', %(error)s, coalesce(g.prompt, ''), coalesce(t.options, '{}'), g.calling_role, g.tbl
FROM gone g LEFT JOIN dflash.generation_targets t ON t.tbl = g.tbl"""

# Failures that another attempt cannot mend: give up at once.
FINAL = ("not_enabled", "row_gone")


class QueueConsumer:
    def __init__(self, worker, dsn: str, poll_s: float = 1.0, backoff_s: float = 1.0, write_timeout_s: float = 60.0):
        self.worker = worker
        self.dsn = dsn
        self.poll_s = poll_s
        self.backoff_s = backoff_s
        # The longest one write may take, the table owner's triggers included: a slow or stuck
        # trigger fails its own item instead of holding up everyone's.
        self.write_timeout_s = write_timeout_s
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

    def connect(self, **kwargs) -> psycopg.Connection:
        conn = psycopg.connect(self.dsn, **kwargs)
        for statement in SESSION:
            conn.execute(statement)
        if not kwargs.get("autocommit"):
            conn.commit()
        return conn

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                with psycopg.connect(self.dsn, autocommit=True) as listen, self.connect() as conn:
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
        """Claim and finish one item; False when nothing is due."""
        with conn.transaction():
            claimed = conn.execute(CLAIM, {"backoff": self.backoff_s}).fetchone()
            if claimed is None:
                return False
            qid, attempt, last_error, max_attempts = claimed
            if attempt > max_attempts:  # the earlier attempts all ended without a verdict
                self._give_up(conn, qid, attempt - 1, last_error)
                return True
        with conn.transaction():
            row = conn.execute(TAKE, (qid, attempt)).fetchone()
            if row is None:
                return True  # another consumer has it, or it was deleted meanwhile
            try:
                with conn.transaction():  # a savepoint: a failure undoes only this item's writes
                    self._fill(conn, *row)
                    conn.execute("DELETE FROM dflash.queue WHERE id = %s", (qid,))
                self.done += 1
            except Exception as exc:
                if conn.broken:
                    raise  # the connection is gone: reconnect; the attempt has been counted
                if not isinstance(exc, (DFlashError, psycopg.Error)):  # a bug: say so, keep serving
                    log.exception("queue item %s failed unexpectedly", qid)
                self._failed(conn, qid, attempt, max_attempts, exc)
        return True

    def _fill(self, conn, tbl_oid, tbl, key, prompt, role, waited_ms, options) -> None:
        if options is None:
            raise DFlashError("not_enabled", f"generation is no longer enabled for {tbl}")
        params = {k: options[k] for k in GENERATE_OPTIONS if k in options}
        params.setdefault("chat", True)
        params["prompt"] = prompt
        request = dict(params, remember=self.worker.embedder is not None)
        if wants_prior(params):  # what this table's earlier rows taught block length auto
            prior = conn.execute(PRIOR, (tbl_oid, role)).fetchone()[0]
            request["prior"] = {k: prior[k] for k in ("accepted", "judged")} if prior["generations"] else None
        t = time.monotonic()
        res = pg_text(self.worker.submit("generate", request))
        total_ms = (time.monotonic() - t) * 1000 + waited_ms
        conn.execute("SELECT set_config('statement_timeout', %s, true)", (f"{int(self.write_timeout_s * 1000)}ms",))
        written = conn.execute(
            sql.SQL("SELECT {}(%s, %s, %s)").format(sql.Identifier("dflash", f"write_{tbl_oid}")),
            (key, res["text"], prompt),
        ).fetchone()[0]
        conn.execute("SELECT set_config('statement_timeout', '0', true)")
        if written != 1:
            raise DFlashError("row_gone", f"the row with key {key} of {tbl} no longer exists or its prompt changed")
        shown = {k: v for k, v in params.items() if k != "prompt"}
        conn.execute(RECORD, (prompt, Jsonb(shown), Jsonb(res), waited_ms, total_ms, tbl_oid, role))

    def _failed(self, conn, qid: int, attempt: int, max_attempts: int, exc: Exception) -> None:
        error = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
        if attempt >= max_attempts or getattr(exc, "code", None) in FINAL:
            self._give_up(conn, qid, attempt, error)
        else:
            # The claim already put the item off by the backoff; keep why this attempt failed.
            conn.execute("UPDATE dflash.queue SET last_error = %s WHERE id = %s", (error, qid))
            log.info("queue item %s failed (attempt %d of %d), will retry: %s", qid, attempt, max_attempts, error)

    def _give_up(self, conn, qid: int, attempts: int, error: str) -> None:
        conn.execute(GIVE_UP, {"id": qid, "attempts": attempts, "error": error})
        self.failed += 1
        log.warning("queue item %s failed %d times, moved to dflash.queue_failed: %s", qid, attempts, error)
