"""The database side of generate-on-insert: the worker consumes dflash.queue.

It LISTENs on channel `dflash_queue` and also polls (a lost notification only delays
work). An item is worked on in two transactions:

1. the claim, committed on its own: up to `batch` due items are claimed at once (FOR UPDATE
   SKIP LOCKED LIMIT n), each attempt is counted and each item put off by the retry backoff
   before any work starts, so an attempt that never finishes (the worker killed on that
   prompt, its connection cut) still counts, and an item whose attempts are used up goes
   to dflash.queue_failed;
2. the work: the claimed items are locked FOR UPDATE (SKIP LOCKED), their generations run
   together (the scheduler serves them in the same engine steps), and for each item the
   output column, the dflash.generations row, the dflash.memory row and the deletion of the
   item are written in a savepoint of its own; all commit together. A worker killed
   mid-batch never commits, so every row is filled exactly once.

The consumer never touches a user's table itself: it calls the table's writer,
dflash.write_<writer_id>(), which runs as the table's owner (see sql/40_triggers.sql), so the
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

from dflash import error_codes
from dflash.errors import DFlashError
from dflash.options import SQL_OPTIONS, in_required_order
from dflash.serve.protocol import HISTORY_TOKENS, cut_short, pg_text, wants_prior, wants_workload, workload_key

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
    LIMIT %(n)s
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
       t.options, dflash._writer_name(q.tbl)
FROM dflash.queue q LEFT JOIN dflash.generation_targets t ON t.tbl = q.tbl
WHERE q.id = %s AND q.attempts = %s
FOR UPDATE OF q SKIP LOCKED"""

RECORD = "SELECT dflash.record_generation('trigger', %s, %s, %s, %s, %s, %s::oid::regclass, %s)"
PRIOR = "SELECT dflash.workload_prior(%s::oid::regclass, %s)"
# The row's own role's earlier rows of the table: never another member's.
HISTORY = "SELECT h.output_ids FROM dflash.workload_history(%s::oid::regclass, %s, %s) h"

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

# Failures that another attempt cannot mend: give up at once (the table's `final` codes).
FINAL = error_codes.FINAL


class QueueConsumer:
    def __init__(self, worker, dsn: str, poll_s: float = 1.0, backoff_s: float = 1.0, write_timeout_s: float = 60.0,
                 batch: int = 1):
        self.worker = worker
        self.dsn = dsn
        self.batch = max(int(batch), 1)  # items claimed and generated together
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
                        while not self.stop.is_set() and self.process_batch(conn):
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
        return self.process_batch(conn, 1)

    def process_batch(self, conn: psycopg.Connection, n: int | None = None) -> bool:
        """Claim up to n items (default: the consumer's batch), generate them together and
        finish each; False when nothing is due."""
        with conn.transaction():
            claimed = conn.execute(CLAIM, {"backoff": self.backoff_s, "n": n or self.batch}).fetchall()
            if not claimed:
                return False
            work = []
            for qid, attempt, last_error, max_attempts in sorted(claimed):
                if attempt > max_attempts:  # the earlier attempts all ended without a verdict
                    self._give_up(conn, qid, attempt - 1, last_error)
                else:
                    work.append((qid, attempt, max_attempts))
        if not work:
            return True
        with conn.transaction():
            items = []
            for qid, attempt, max_attempts in work:
                row = conn.execute(TAKE, (qid, attempt)).fetchone()
                if row is not None:  # else another consumer has it, or it was deleted meanwhile
                    items.append((qid, attempt, max_attempts, row))
            started = []
            for qid, attempt, max_attempts, row in items:  # every generation in flight at once
                try:
                    started.append((qid, attempt, max_attempts, row, self._start(conn, *row)))
                except Exception as exc:
                    self._item_failed(conn, qid, attempt, max_attempts, exc)
            for qid, attempt, max_attempts, row, job in started:
                try:
                    with conn.transaction():  # a savepoint: a failure undoes only this item's writes
                        self._write(conn, *row, job)
                        conn.execute("DELETE FROM dflash.queue WHERE id = %s", (qid,))
                    self.done += 1
                except Exception as exc:
                    self._item_failed(conn, qid, attempt, max_attempts, exc)
        return True

    def _item_failed(self, conn, qid: int, attempt: int, max_attempts: int, exc: Exception) -> None:
        if conn.broken:
            raise exc  # the connection is gone: reconnect; the attempt has been counted
        if not isinstance(exc, (DFlashError, psycopg.Error)):  # a bug: say so, keep serving
            log.error("queue item %s failed unexpectedly", qid, exc_info=exc)
        self._failed(conn, qid, attempt, max_attempts, exc)

    def _start(self, conn, tbl_oid, tbl, key, prompt, role, waited_ms, options, writer):
        """Queue an item's generation on the worker; returns (its job, params, start time)."""
        if options is None:
            raise DFlashError("not_enabled", f"generation is no longer enabled for {tbl}")
        params = {k: options[k] for k in SQL_OPTIONS if k in options}
        if "json_schema" in params:  # read from jsonb, which kept no key order
            params["json_schema"] = in_required_order(params["json_schema"])
        params["prompt"] = prompt
        request = dict(params, remember=self.worker.embedder is not None)
        if wants_prior(params):  # what this table's earlier rows taught block length auto
            prior = conn.execute(PRIOR, (tbl_oid, role)).fetchone()[0]
            request["prior"] = {k: prior[k] for k in ("accepted", "judged")} if prior["generations"] else None
        if wants_workload(params):
            request["workload"] = workload_key(role, tbl_oid)
            if not self.worker.knows_workload(request["workload"]):
                request["history"] = [r[0] for r in conn.execute(HISTORY, (tbl_oid, role, HISTORY_TOKENS))]
        return self.worker.submit_async("generate", request), params, time.monotonic()

    def _write(self, conn, tbl_oid, tbl, key, prompt, role, waited_ms, options, writer, started) -> None:
        job, params, t = started
        res = pg_text(self.worker.wait(job))
        if (why := cut_short(res)) is not None:  # never written as if it were an answer
            raise DFlashError("truncated", f"{tbl}, key {key}: {why}")
        total_ms = (time.monotonic() - t) * 1000 + waited_ms
        conn.execute("SELECT set_config('statement_timeout', %s, true)", (f"{int(self.write_timeout_s * 1000)}ms",))
        written = conn.execute(
            sql.SQL("SELECT {}(%s, %s, %s)").format(sql.Identifier("dflash", writer)),
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
