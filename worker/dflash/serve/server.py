"""The worker: one process owns the models and serves many clients over a Unix socket.

Threads: one accepts connections, one per connection reads frames and waits for its job,
and the scheduler's engine thread owns the models (dflash.engine.scheduler): every step it
serves all admitted generations in one batched forward, so many callers share each weight
read instead of taking turns. This module keeps sockets, peer checks, the protocol, jobs
and status; what a job runs and how its answer is built is in jobs.py. A job stops within
one engine step when it is cancelled (a `cancel` request or its client hanging up) or its
deadline passes.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections import deque
from pathlib import Path

import torch

from dflash.engine.core import EngineCore
from dflash.engine.engine import check_prior
from dflash.engine.knobs import DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE, DEFAULT_STEP_TOKENS, RECENT_TAU
from dflash.engine.scheduler import Call, Scheduler
from dflash.engine.stats import pooled_tau
from dflash.errors import DFlashError
from dflash.serve.drafters import DrafterReloader
from dflash.serve.jobs import Answers, Job, check_options, error_reply
from dflash.serve.sockets import bind_socket, hung_up, peer_creds
from dflash.serve.protocol import (
    DEFAULT_MAX_FRAME,
    DEFAULT_SOCKET,
    OPERATIONS,
    PROTOCOL_VERSION,
    ProtocolError,
    recv_frame,
    send_frame,
)

log = logging.getLogger("dflash.worker")

GENERATION_OPS = ("generate", "generate_many", "generate_block")


class Worker:
    def __init__(
        self,
        engine: EngineCore,
        embedder=None,
        socket_path: str = DEFAULT_SOCKET,
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_active: int = DEFAULT_MAX_BATCH,
        max_frame: int = DEFAULT_MAX_FRAME,
        socket_group: str | None = None,
        allow_uids: list[int] | None = None,
        allow_gids: list[int] | None = None,
        drafter_dir: str | Path | None = None,
        drafter_roots: list[str | Path] = (),
        step_tokens: int = DEFAULT_STEP_TOKENS,
    ):
        self.engine = engine
        self.scheduler = Scheduler(engine, max_batch=max_active, step_tokens=step_tokens, max_queue=max_queue)
        self.drafters = DrafterReloader(engine, drafter_dir, drafter_roots)
        self.answers = Answers(self)
        self.learner = None  # dflash.serve.learn.Learner with --learn
        self.last_activity = time.monotonic()
        self.embedder = embedder
        self.socket_path = Path(socket_path)
        self.max_frame = max_frame
        self.socket_group = socket_group
        self.allow_uids = set(allow_uids or [])
        self.allow_gids = set(allow_gids or [])
        self.jobs: dict[tuple[int | None, str], Job] = {}  # by (owner, request id): ids are per client
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.served = {op: 0 for op in OPERATIONS}
        self.tokens = 0
        self.recent_steps: deque[tuple[int, int]] = deque(maxlen=RECENT_TAU)  # (accepted, steps) per generation
        self.listener: socket.socket | None = None
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []

    @property
    def drafter_dir(self) -> Path | None:
        return self.drafters.drafter_dir

    @property
    def drafter_roots(self) -> list[Path]:
        return self.drafters.drafter_roots

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        # The block-length policy prices steps by this device's cost curve (by batch, up to
        # the scheduler's): measure it (or read it from the disk cache) before serving, so no
        # request waits for it.
        self.engine.cost_curve
        self.listener = bind_socket(self.socket_path, self.socket_group)
        self.scheduler.start()
        t = threading.Thread(target=self._accept_loop, name="dflash-accept", daemon=True)
        t.start()
        self.threads.append(t)
        log.info(
            "dflash worker ready on %s (target %s, drafter %s%s, embedder %s, device %s, batch %d)",
            self.socket_path,
            self.engine.target.name,
            self.engine.drafter_name,
            " [random weights]" if self.engine.random_drafter else "",
            self.embedder.name if self.embedder else "none",
            self.engine.target.device,
            self.scheduler.max_batch,
        )

    def shutdown(self, timeout: float = 600.0) -> None:
        """Stop accepting, let queued and running jobs finish, then close."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        if self.listener is not None:
            self.listener.close()
        end = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < end:
            time.sleep(0.02)
        self.scheduler.stop()
        for t in self.threads:
            t.join(timeout=5)
        try:
            self.socket_path.unlink()
        except FileNotFoundError:
            pass
        log.info(
            "dflash worker stopped after %.0f s: served %s; %d tokens generated",
            time.monotonic() - self.started,
            ", ".join(f"{n} {op}" for op, n in self.served.items() if n) or "nothing",
            self.tokens,
        )

    @property
    def in_flight(self) -> int:
        with self.lock:
            return len(self.jobs)

    # --- connections ----------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            t = threading.Thread(target=self._serve_connection, args=(conn,), daemon=True)
            t.start()

    def _peer_allowed(self, conn: socket.socket) -> bool:
        if not self.allow_uids and not self.allow_gids:
            return True
        _pid, uid, gid = peer_creds(conn)
        return uid in self.allow_uids or gid in self.allow_gids

    def _serve_connection(self, conn: socket.socket) -> None:
        conn.settimeout(0.2)
        try:
            if not self._peer_allowed(conn):
                send_frame(conn, self._error(None, "forbidden", "this user may not use the dflash worker"))
                return
            while not self.stopping.is_set() or self.in_flight:
                try:
                    msg = recv_frame(conn, self.max_frame, tick=self._tick_idle)
                except ValueError as exc:  # a whole frame that is not a JSON object: keep serving
                    send_frame(conn, self._error(None, "bad_frame", str(exc)))
                    continue
                except ProtocolError as exc:
                    if exc.code == "frame_too_large":  # cannot resynchronise: answer, then hang up
                        send_frame(conn, self._error(None, exc.code, exc.message))
                    return
                try:
                    reply = self._handle(conn, msg)
                except Exception as exc:  # a bug must not end the connection without an answer
                    log.exception("request %r failed", msg.get("id"))
                    reply = self._error(msg.get("id"), "internal", f"{type(exc).__name__}: {exc}")
                if reply is None:  # the client hung up while its job ran
                    return
                send_frame(conn, reply)
        except (OSError, _Idle):
            pass
        finally:
            conn.close()

    def _tick_idle(self) -> None:
        if self.stopping.is_set():
            raise _Idle()

    def _error(self, rid, code: str, message: str) -> dict:
        return error_reply(rid, code, message)

    def _handle(self, conn: socket.socket, msg: dict) -> dict | None:
        rid, op, params = msg.get("id"), msg.get("op"), msg.get("params", {})
        if msg.get("v", PROTOCOL_VERSION) != PROTOCOL_VERSION:
            return self._error(rid, "bad_version", f"protocol version {msg.get('v')} is not {PROTOCOL_VERSION}")
        if op not in OPERATIONS:
            return self._error(rid, "unknown_op", f"unknown operation {op!r}; known: {', '.join(OPERATIONS)}")
        if not isinstance(params, dict):
            return self._error(rid, "bad_params", "params must be a JSON object")
        if rid is not None and not isinstance(rid, (str, int)):
            return self._error(rid, "bad_params", "id must be a string or integer")
        rid = str(rid) if rid is not None else f"anon-{id(conn)}-{time.monotonic_ns()}"
        timeout_ms = msg.get("timeout_ms")
        if timeout_ms is not None and (not isinstance(timeout_ms, (int, float)) or timeout_ms <= 0):
            return self._error(rid, "bad_params", "timeout_ms must be a positive number")
        with self.lock:
            self.served[op] += 1
        if op in ("hello", "status"):
            return {"v": PROTOCOL_VERSION, "id": rid, "ok": True, "result": self.status()}
        if op == "explain_policy":  # arithmetic over the cost curve: no model, no engine thread
            try:
                result = self.engine.explain_policy(check_prior(params.get("prior")))
            except DFlashError as exc:
                return self._error(rid, exc.code, exc.message)
            return {"v": PROTOCOL_VERSION, "id": rid, "ok": True, "result": result}
        if op == "check_options":  # the grammar library's check: no model, no engine thread
            try:
                result = check_options(self.engine, params)
            except DFlashError as exc:
                return self._error(rid, exc.code, exc.message)
            return {"v": PROTOCOL_VERSION, "id": rid, "ok": True, "result": result}
        if op == "cancel":
            # Only the process that sent a request may cancel it (its PostgreSQL backend, say):
            # another client is told nothing about it.
            target = params.get("request_id")
            with self.lock:
                job = self.jobs.get((peer_creds(conn)[0], str(target)))
            mine = job is not None
            if mine:
                job.cancel.set()
            return {"v": PROTOCOL_VERSION, "id": rid, "ok": True, "result": {"cancelled": mine}}
        if self.stopping.is_set():
            return self._error(rid, "shutting_down", "the worker is shutting down")
        deadline = time.monotonic() + timeout_ms / 1000.0 if timeout_ms else None
        job = Job(rid, op, params, deadline, owner=peer_creds(conn)[0], on_answer=self._forget)
        with self.lock:
            if job.key in self.jobs:  # only the same client can collide with its own ids
                return self._error(rid, "duplicate_id", f"request id {rid} is already in flight")
            self.jobs[job.key] = job
        try:
            self._run(job, wait=False)
        except queue.Full:
            self._forget(job)
            return self._error(rid, "busy", f"the worker queue is full ({self.scheduler.inbox.maxsize}); try again")
        while not job.done.wait(0.02):
            if hung_up(conn):
                job.cancel.set()
                job.done.wait()
                return None
        return job.reply

    def _run(self, job: Job, wait: bool) -> None:
        """Hand a job to the scheduler (or answer it now: a bad request, a drafter that does
        not load). Raises queue.Full when the queue is full and not `wait`."""
        try:
            if job.op in GENERATION_OPS:
                self.scheduler.submit(self.answers.ticket_for(job), wait=wait)
            elif job.op == "embed":
                embedder = self.require_embedder()

                def embed(texts=job.params.get("texts")):
                    return {"model": embedder.name, "dim": embedder.dim, "embeddings": embedder.embed(texts)}

                self.scheduler.submit(Call(embed, job.ok, job.fail, job.check), wait=wait)
            elif job.op == "reload_drafter":  # read the weights here, so the engine thread only swaps
                new = self.drafters.read(job.params)
                self.scheduler.submit(Call(lambda: self.drafters.swap(new), job.ok, job.fail, job.check), wait=wait)
            else:
                job.error("unknown_op", f"operation {job.op} is not run by the engine")
        except DFlashError as exc:
            job.fail(exc)

    def _forget(self, job: Job) -> None:
        with self.lock:
            self.jobs.pop(job.key, None)
            self.last_activity = time.monotonic()

    def submit_async(self, op: str, params: dict, timeout_s: float | None = None) -> Job:
        """Queue one operation from inside the worker (the queue consumer, the learner),
        waiting for a queue slot rather than answering busy; `wait(job)` for its result."""
        job = Job(f"internal-{time.monotonic_ns()}", op, params, time.monotonic() + timeout_s if timeout_s else None,
                  on_answer=self._forget)
        with self.lock:
            self.jobs[job.key] = job
        self._run(job, wait=True)
        return job

    @staticmethod
    def wait(job: Job) -> dict:
        """A job's result; raises DFlashError on failure."""
        job.done.wait()
        if not job.reply["ok"]:
            raise DFlashError(job.reply["error"]["code"], job.reply["error"]["message"])
        return job.reply["result"]

    def submit(self, op: str, params: dict, timeout_s: float | None = None) -> dict:
        """Run one operation from inside the worker and wait for its result (DFlashError on failure)."""
        return self.wait(self.submit_async(op, params, timeout_s))

    def reload_drafter(self, path: str | None = None, sha256: str | None = None) -> dict:
        """Swap the drafter from inside the worker (the learner), as the operation does."""
        params = {k: v for k, v in (("path", path), ("sha256", sha256)) if v is not None}
        return self.submit("reload_drafter", params)

    def knows_workload(self, key: str) -> bool:
        """Whether the engine holds a memory of this workload (else a request needs its history)."""
        return self.engine.knows_workload(key)

    def require_embedder(self, what: str = "embed texts"):
        """The embedding model, or no_embedder saying what needed it (`what`)."""
        if self.embedder is None:
            raise DFlashError("no_embedder", f"this worker was started without an embedding model (--no-embedder), "
                                             f"so it cannot {what}")
        return self.embedder

    # --- bookkeeping and status ---------------------------------------------------------------

    def account(self, res) -> None:
        with self.lock:
            self.tokens += res.stats.new_tokens
            if res.stats.num_steps:
                self.recent_steps.append((res.stats.accepted, res.stats.num_steps))

    def model_ids(self, state=None) -> dict:
        """The models that produced a state's result (the drafter it started with), or the
        current ones."""
        drafter = self.engine.in_use(state)
        return {
            "target": self.engine.target.name,
            "drafter": drafter.name,
            "drafter_version": drafter.version,
            "random_drafter": self.engine.random_drafter,
            # what computed it (dflash.generations.backend): "hf" here, "openai/llama.cpp" or "openai" remote
            "backend": self.engine.target.backend,
        }

    def status(self) -> dict:
        sched = self.scheduler
        with self.lock:
            accepted = sum(a for a, _ in self.recent_steps)
            steps = sum(n for _, n in self.recent_steps)
            return {
                "protocol": PROTOCOL_VERSION,
                **self.model_ids(),
                "embedder": self.embedder.name if self.embedder else None,
                "embedding_dim": self.embedder.dim if self.embedder else None,
                **self.engine.status(),
                "threads": torch.get_num_threads(),
                "uptime_s": time.monotonic() - self.started,
                "requests_served": dict(self.served),
                "in_flight": len(self.jobs),
                "queued": sched.queued,
                "max_queue": sched.inbox.maxsize,
                "max_active": sched.max_batch,
                "step_tokens": sched.step_tokens,
                "batch_last_step": sched.active,
                "engine_steps": sched.steps,
                "tokens_generated": self.tokens,
                "recent_tau": pooled_tau(accepted, steps),  # pooled over the last generations
                "pid": os.getpid(),
                "ready": not self.stopping.is_set(),
                "learn": self.learner.status() if self.learner is not None else None,
            }


class _Idle(Exception):
    """An idle connection noticed the worker is stopping."""
