"""The worker: one process owns the models and serves many clients over a Unix socket.

Threads: one accepts connections, one per connection reads frames and waits for its
job, and one engine thread runs jobs one at a time from a bounded queue (the models
are not shared between threads). A job stops within one engine step when it is
cancelled (a `cancel` request or its client hanging up) or its deadline passes.
"""

from __future__ import annotations

import grp
import logging
import os
import queue
import select
import socket
import stat
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from dflash.engine.engine import Engine, GenerationRequest
from dflash.errors import DFlashError
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

GENERATE_PARAMS = {
    "prompt": (str, type(None)),
    "input_ids": (list, type(None)),
    "chat": (bool,),
    "max_new_tokens": (int,),
    "block_size": (int, type(None)),
    "temperature": (int, float),
    "top_k": (int,),
    "top_p": (int, float),
    "seed": (int, type(None)),
    "verify": (str, type(None)),
    "stop": (list,),
    "stop_ids": (list,),
}


class Stopped(Exception):
    """Raised inside the engine loop to end a job early (code: cancelled | deadline | shutdown)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Job:
    id: str
    op: str
    params: dict
    deadline: float | None  # time.monotonic() seconds
    queued_at: float = field(default_factory=time.monotonic)
    cancel: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    reply: dict | None = None

    def check(self) -> None:
        if self.cancel.is_set():
            raise Stopped("cancelled", f"request {self.id} was cancelled")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise Stopped("deadline", f"request {self.id} passed its deadline")


def generation_request(params: dict) -> GenerationRequest:
    unknown = sorted(set(params) - set(GENERATE_PARAMS))
    if unknown:
        raise DFlashError("bad_params", f"unknown generate parameters: {', '.join(unknown)}")
    for key, value in params.items():
        types = GENERATE_PARAMS[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise DFlashError("bad_params", f"parameter '{key}' must be {names}, got {type(value).__name__}")
    return GenerationRequest(**params)


def memory_text(prompt: str, output: str) -> str:
    """What a remembered generation is embedded as: the question with its answer."""
    return f"{prompt}\n\n{output}"


class Worker:
    def __init__(
        self,
        engine: Engine,
        embedder=None,
        socket_path: str = DEFAULT_SOCKET,
        max_queue: int = 64,
        max_frame: int = DEFAULT_MAX_FRAME,
        socket_group: str | None = None,
        allow_uids: list[int] | None = None,
        allow_gids: list[int] | None = None,
    ):
        self.engine = engine
        self.embedder = embedder
        self.socket_path = Path(socket_path)
        self.max_frame = max_frame
        self.socket_group = socket_group
        self.allow_uids = set(allow_uids or [])
        self.allow_gids = set(allow_gids or [])
        self.queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self.jobs: dict[str, Job] = {}
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.served = {op: 0 for op in OPERATIONS}
        self.tokens = 0
        self.recent_tau: deque[float] = deque(maxlen=100)
        self.listener: socket.socket | None = None
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        self.listener = self._bind()
        for target, name in ((self._engine_loop, "engine"), (self._accept_loop, "accept")):
            t = threading.Thread(target=target, name=f"dflash-{name}", daemon=True)
            t.start()
            self.threads.append(t)
        log.info(
            "dflash worker ready on %s (target %s, drafter %s%s, embedder %s, device %s)",
            self.socket_path,
            self.engine.target.name,
            self.engine.drafter_name,
            " [random weights]" if self.engine.random_drafter else "",
            self.embedder.name if self.embedder else "none",
            self.engine.target.device,
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
        self.queue.put(None)  # wakes the engine thread so it can exit
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

    def _bind(self) -> socket.socket:
        path = self.socket_path
        path.parent.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(path):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise DFlashError("socket_in_use", f"{path} exists and is not a socket; refusing to replace it")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(path))
            except OSError:
                path.unlink()  # stale: nobody listens there
            else:
                raise DFlashError("socket_in_use", f"another worker is already listening on {path}")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o117)  # created 0660: never a moment with wider permissions
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        os.chmod(path, 0o660)
        if self.socket_group:
            group = str(self.socket_group)
            os.chown(path, -1, int(group) if group.isdigit() else grp.getgrnam(group).gr_gid)
        sock.listen(128)
        sock.settimeout(0.2)
        return sock

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
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, gid = struct.unpack("3i", creds)
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
                reply = self._handle(conn, msg)
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
        return {"v": PROTOCOL_VERSION, "id": rid, "ok": False, "error": {"code": code, "message": message}}

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
        if op == "cancel":
            target = params.get("request_id")
            with self.lock:
                job = self.jobs.get(str(target))
            if job is not None:
                job.cancel.set()
            return {"v": PROTOCOL_VERSION, "id": rid, "ok": True, "result": {"cancelled": job is not None}}
        if self.stopping.is_set():
            return self._error(rid, "shutting_down", "the worker is shutting down")
        deadline = time.monotonic() + timeout_ms / 1000.0 if timeout_ms else None
        job = Job(rid, op, params, deadline)
        with self.lock:
            if rid in self.jobs:
                return self._error(rid, "duplicate_id", f"request id {rid} is already in flight")
            try:
                self.queue.put_nowait(job)
            except queue.Full:
                return self._error(rid, "busy", f"the worker queue is full ({self.queue.maxsize}); try again")
            self.jobs[rid] = job
        while not job.done.wait(0.02):
            if _hung_up(conn):
                job.cancel.set()
                job.done.wait()
                return None
        return job.reply

    def submit(self, op: str, params: dict, timeout_s: float | None = None) -> dict:
        """Run one operation on the engine thread from inside the worker (the queue consumer);
        waits for a queue slot rather than answering busy. Raises DFlashError on failure."""
        job = Job(f"internal-{time.monotonic_ns()}", op, params, time.monotonic() + timeout_s if timeout_s else None)
        with self.lock:
            self.jobs[job.id] = job
        self.queue.put(job)
        job.done.wait()
        if not job.reply["ok"]:
            raise DFlashError(job.reply["error"]["code"], job.reply["error"]["message"])
        return job.reply["result"]

    # --- the engine thread --------------------------------------------------------------

    def _engine_loop(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            try:
                job.check()
                result = self._run(job)
                job.reply = {"v": PROTOCOL_VERSION, "id": job.id, "ok": True, "result": result}
            except Stopped as exc:
                job.reply = self._error(job.id, exc.code, exc.message)
            except DFlashError as exc:
                job.reply = self._error(job.id, exc.code, exc.message)
            except Exception as exc:  # a bug must not kill the worker; say what happened
                log.exception("request %s failed", job.id)
                job.reply = self._error(job.id, "internal", f"{type(exc).__name__}: {exc}")
            finally:
                with self.lock:
                    self.jobs.pop(job.id, None)
                job.done.set()

    def _embedder(self):
        if self.embedder is None:
            raise DFlashError("no_embedder", "this worker was started without an embedding model")
        return self.embedder

    def _run(self, job: Job) -> dict:
        if job.op == "embed":
            embedder = self._embedder()
            vectors = embedder.embed(job.params.get("texts"))
            return {"model": embedder.name, "dim": embedder.dim, "embeddings": vectors}
        queue_ms = (time.monotonic() - job.queued_at) * 1000.0
        if job.op == "generate":
            params = dict(job.params)
            remember = params.pop("remember", False)
            if not isinstance(remember, bool):
                raise DFlashError("bad_params", f"parameter 'remember' must be bool, got {type(remember).__name__}")
            request = generation_request(params)
            embedder = self._embedder() if remember else None  # refuse before decoding, not after
            res = self.engine.generate(request, on_step=lambda out: job.check())
            self._account(res)
            out = res.to_dict()
            out.update(self.model_ids(), queue_ms=queue_ms)
            if embedder is not None and out["text"].strip():
                out["memory"] = {"embedder": embedder.name,
                                 "embedding": embedder.embed([memory_text(params.get("prompt") or "", out["text"])])[0]}
            return out
        if job.op == "generate_block":
            return self._generate_block(job, queue_ms)
        raise DFlashError("unknown_op", f"operation {job.op} is not run by the engine")

    def _generate_block(self, job: Job, queue_ms: float) -> dict:
        """One draft-and-verify step: what the drafter proposed and what the target kept."""
        params = dict(job.params)
        block = params.get("block_size")
        if block is None:
            block = self.engine.block_size
        if not isinstance(block, int) or isinstance(block, bool) or not 1 <= block <= self.engine.block_size:
            raise DFlashError(
                "bad_block_size", f"block size must be an integer from 1 to the drafter's {self.engine.block_size}"
            )
        params.update(block_size=block, max_new_tokens=block + 1)
        params.setdefault("chat", True)
        calls = []

        def after_step(out):
            job.check()
            calls.append(len(out))
            return "block" if len(calls) > 1 else None  # the first call follows prefill

        res = self.engine.generate(generation_request(params), on_step=after_step)
        self._account(res)
        decode = self.engine.decode
        out = res.output_ids
        step = res.stats.steps[0] if res.stats.steps else None
        drafts = step.draft_ids if step else []
        a = step.accepted if step else 0
        nxt = out[1 + a] if len(out) > 1 + a else None
        return {
            "block_size": block,
            "anchor_id": out[0],
            "anchor_text": decode(out[:1]),
            "draft_ids": drafts,
            "draft_text": decode(drafts),
            "accepted": a,
            "accepted_ids": drafts[:a],
            "accepted_text": decode(drafts[:a]),
            "next_token_id": nxt,
            "next_token_text": decode([nxt]) if nxt is not None else None,
            "prompt_ids": res.prompt_ids,
            "queue_ms": queue_ms,
            **self.model_ids(),
        }

    def _account(self, res) -> None:
        with self.lock:
            self.tokens += res.stats.new_tokens
            if res.stats.tau is not None:
                self.recent_tau.append(res.stats.tau)

    def model_ids(self) -> dict:
        return {
            "target": self.engine.target.name,
            "drafter": self.engine.drafter_name,
            "random_drafter": self.engine.random_drafter,
        }

    def status(self) -> dict:
        with self.lock:
            return {
                "protocol": PROTOCOL_VERSION,
                **self.model_ids(),
                "embedder": self.embedder.name if self.embedder else None,
                "embedding_dim": self.embedder.dim if self.embedder else None,
                "device": str(self.engine.target.device),
                "dtype": str(self.engine.target.dtype).replace("torch.", ""),
                "block_size": self.engine.block_size,
                "uptime_s": time.monotonic() - self.started,
                "requests_served": dict(self.served),
                "in_flight": len(self.jobs),
                "queued": self.queue.qsize(),
                "max_queue": self.queue.maxsize,
                "tokens_generated": self.tokens,
                "recent_mean_tau": sum(self.recent_tau) / len(self.recent_tau) if self.recent_tau else None,
                "pid": os.getpid(),
                "ready": not self.stopping.is_set(),
            }


class _Idle(Exception):
    """An idle connection noticed the worker is stopping."""


def _hung_up(conn: socket.socket) -> bool:
    readable, _, _ = select.select([conn], [], [], 0)
    if not readable:
        return False
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
