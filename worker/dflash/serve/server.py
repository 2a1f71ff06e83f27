"""The worker: one process owns the models and serves many clients over a Unix socket.

Threads: one accepts connections, one per connection reads frames and waits for its
job, and one engine thread owns the models. It takes jobs from a bounded queue and
advances up to `max_active` generations one step each in turn, so one long generation
never stalls another caller. A job stops within one engine step when it is cancelled (a
`cancel` request or its client hanging up) or its deadline passes.
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

import torch

from dflash.engine.engine import Engine, GenerationRequest, check_compatible, check_prior
from dflash.engine.state import DecodeState, StepResult
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
    "prior": (dict, type(None)),
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
    owner: int | None = None  # the client process (peer pid) that may cancel it; None: internal
    payload: object = None  # reload_drafter: the drafter read and checked off the engine thread

    @property
    def key(self) -> tuple[int | None, str]:
        return (self.owner, self.id)

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
        max_active: int = 4,
        max_frame: int = DEFAULT_MAX_FRAME,
        socket_group: str | None = None,
        allow_uids: list[int] | None = None,
        allow_gids: list[int] | None = None,
        drafter_dir: str | Path | None = None,
        drafter_roots: list[str | Path] = (),
    ):
        self.engine = engine
        # reload_drafter without a path reads this folder again; with a path, only folders
        # under the drafter roots load (a socket peer must not make the worker read anything else).
        self.drafter_dir = Path(drafter_dir) if drafter_dir else None
        self.drafter_roots = [Path(r).resolve() for r in drafter_roots]
        self.learner = None  # dflash.serve.learn.Learner with --learn
        self.last_activity = time.monotonic()
        self.embedder = embedder
        self.socket_path = Path(socket_path)
        self.max_frame = max_frame
        self.socket_group = socket_group
        self.allow_uids = set(allow_uids or [])
        self.allow_gids = set(allow_gids or [])
        self.queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self.jobs: dict[tuple[int | None, str], Job] = {}  # by (owner, request id): ids are per client
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.served = {op: 0 for op in OPERATIONS}
        self.tokens = 0
        self.recent_steps: deque[tuple[int, int]] = deque(maxlen=100)  # (accepted, steps) per generation
        self.max_active = max_active
        self.listener: socket.socket | None = None
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        # The block-length policy prices steps by this device's cost curve: measure it (or
        # read it from the disk cache) before serving, so no request waits for it.
        self.engine.cost_curve
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
        # A burst of callers (one per PostgreSQL backend) must queue, not be refused: the
        # kernel caps this at net.core.somaxconn.
        sock.listen(socket.SOMAXCONN)
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
        if op == "explain_policy":  # arithmetic over the cost curve: no model, no engine thread
            try:
                result = self.engine.explain_policy(check_prior(params.get("prior")))
            except DFlashError as exc:
                return self._error(rid, exc.code, exc.message)
            return {"v": PROTOCOL_VERSION, "id": rid, "ok": True, "result": result}
        if op == "cancel":
            # Only the process that sent a request may cancel it (its PostgreSQL backend, say):
            # another client is told nothing about it.
            target = params.get("request_id")
            with self.lock:
                job = self.jobs.get((_peer_pid(conn), str(target)))
            mine = job is not None
            if mine:
                job.cancel.set()
            return {"v": PROTOCOL_VERSION, "id": rid, "ok": True, "result": {"cancelled": mine}}
        if self.stopping.is_set():
            return self._error(rid, "shutting_down", "the worker is shutting down")
        payload = None
        if op == "reload_drafter":  # read the weights here, so the engine thread only swaps
            try:
                payload = self.read_drafter(params)
            except DFlashError as exc:
                return self._error(rid, exc.code, exc.message)
        deadline = time.monotonic() + timeout_ms / 1000.0 if timeout_ms else None
        job = Job(rid, op, params, deadline, owner=_peer_pid(conn), payload=payload)
        with self.lock:
            if job.key in self.jobs:  # only the same client can collide with its own ids
                return self._error(rid, "duplicate_id", f"request id {rid} is already in flight")
            try:
                self.queue.put_nowait(job)
            except queue.Full:
                return self._error(rid, "busy", f"the worker queue is full ({self.queue.maxsize}); try again")
            self.jobs[job.key] = job
        while not job.done.wait(0.02):
            if _hung_up(conn):
                job.cancel.set()
                job.done.wait()
                return None
        return job.reply

    def submit(self, op: str, params: dict, timeout_s: float | None = None, payload=None) -> dict:
        """Run one operation on the engine thread from inside the worker (the queue consumer);
        waits for a queue slot rather than answering busy. Raises DFlashError on failure."""
        job = Job(f"internal-{time.monotonic_ns()}", op, params, time.monotonic() + timeout_s if timeout_s else None,
                  payload=payload)
        with self.lock:
            self.jobs[job.key] = job
        self.queue.put(job)
        job.done.wait()
        if not job.reply["ok"]:
            raise DFlashError(job.reply["error"]["code"], job.reply["error"]["message"])
        return job.reply["result"]

    # --- the drafter, replaced between steps ---------------------------------------------

    def read_drafter(self, params: dict) -> dict:
        """Read and check the drafter a reload_drafter names (`path`: a folder under the
        drafter roots; none: the current drafter's folder again; `sha256`: the digest its
        weights must have). Runs on the caller's thread. Raises DFlashError."""
        from dflash.engine.versions import load_versioned

        unknown = sorted(set(params) - {"path", "sha256"})
        if unknown:
            raise DFlashError("bad_params", f"unknown reload_drafter parameters: {', '.join(unknown)}")
        path, sha256 = params.get("path"), params.get("sha256")
        for key, value in (("path", path), ("sha256", sha256)):
            if value is not None and (not isinstance(value, str) or not value):
                raise DFlashError("bad_params", f"parameter '{key}' must be a non-empty string")
        if path is None:
            if self.drafter_dir is None:
                raise DFlashError("bad_params", "this worker's drafter was not loaded from a folder: give a path")
            folder = self.drafter_dir
        else:
            folder = Path(path).resolve()
            if not any(folder.is_relative_to(root) for root in self.drafter_roots):
                raise DFlashError("forbidden_path", f"{path} is not under the worker's drafter roots "
                                  "(dflash serve --drafter-root DIR)")
        target = self.engine.target
        try:
            model, digest = load_versioned(folder, device=target.device, dtype=target.dtype)
        except DFlashError:
            raise
        except Exception as exc:  # a half-written or foreign folder: refuse it, keep serving
            raise DFlashError("bad_drafter", f"cannot load a drafter from {folder}: {type(exc).__name__}: {exc}")
        check_compatible(target, model.config)
        if sha256 is not None and digest != sha256:
            raise DFlashError("bad_drafter", f"the drafter in {folder} has digest {digest}, not the expected {sha256}")
        return {"model": model, "sha256": digest, "path": folder, "name": folder.name}

    def reload_drafter(self, path: str | None = None, sha256: str | None = None) -> dict:
        """Swap the drafter from inside the worker (the learner), as the operation does."""
        params = {k: v for k, v in (("path", path), ("sha256", sha256)) if v is not None}
        return self.submit("reload_drafter", params, payload=self.read_drafter(params))

    def _swap(self, job: Job) -> None:
        new = job.payload
        result = self.engine.swap_drafter(new["model"], new["name"], new["sha256"])
        self.drafter_dir = new["path"]
        if not result["cost_curve_kept"]:
            self.engine.cost_curve  # measure now, not inside a request's step
        log.info("drafter %s (%s) replaced by %s (%s) from %s", result["previous"]["drafter"],
                 result["previous"]["drafter_version"], result["drafter"], result["drafter_version"], new["path"])
        self._ok(job, {**result, "drafter_sha256": new["sha256"], "path": str(new["path"])})

    # --- the engine thread --------------------------------------------------------------

    def _engine_loop(self) -> None:
        """Admit jobs while there is room, then advance the active decodes one step each in
        turn: a long generation slows the others down by its share but never blocks them,
        and a cancel or a deadline is seen within one step."""
        active: deque[Run] = deque()
        closing = False
        while True:
            while not closing and len(active) < self.max_active:
                try:
                    job = self.queue.get(block=not active)
                except queue.Empty:
                    break
                if job is None:  # shutdown: finish what is active, admit nothing more
                    closing = True
                    break
                run = self._guard(job, lambda job=job: self._begin(job))
                if run is not None:
                    active.append(run)
            if not active:
                if closing:
                    return
                continue
            run = active.popleft()
            if self._guard(run.job, lambda: self._advance(run)):
                active.append(run)

    def _guard(self, job: Job, work):
        """Run one piece of a job's work; on any failure answer the job with an error."""
        try:
            job.check()
            return work()
        except (Stopped, DFlashError) as exc:
            self._answer(job, self._error(job.id, exc.code, exc.message))
        except Exception as exc:  # a bug must not kill the worker; say what happened
            log.exception("request %s failed", job.id)
            self._answer(job, self._error(job.id, "internal", f"{type(exc).__name__}: {exc}"))
        return None

    def _answer(self, job: Job, reply: dict) -> None:
        job.reply = reply
        with self.lock:
            self.jobs.pop(job.key, None)
            self.last_activity = time.monotonic()
        job.done.set()

    def _ok(self, job: Job, result: dict) -> None:
        self._answer(job, {"v": PROTOCOL_VERSION, "id": job.id, "ok": True, "result": result})

    def _embedder(self):
        if self.embedder is None:
            raise DFlashError("no_embedder", "this worker was started without an embedding model")
        return self.embedder

    def _begin(self, job: Job) -> "Run | None":
        """Validate and prefill a generation (or answer an embed or a drafter swap at once:
        between two steps, so states already started keep their drafter)."""
        if job.op == "reload_drafter":
            self._swap(job)
            return None
        if job.op == "embed":
            embedder = self._embedder()
            vectors = embedder.embed(job.params.get("texts"))
            self._ok(job, {"model": embedder.name, "dim": embedder.dim, "embeddings": vectors})
            return None
        queue_ms = (time.monotonic() - job.queued_at) * 1000.0
        params = dict(job.params)
        if job.op == "generate":
            remember = params.pop("remember", False)
            if not isinstance(remember, bool):
                raise DFlashError("bad_params", f"parameter 'remember' must be bool, got {type(remember).__name__}")
            embedder = self._embedder() if remember else None  # refuse before decoding, not after
        elif job.op == "generate_block":
            embedder = None
            block = params.get("block_size")
            params["block_size"] = self.engine.block_size if block is None else block
            if isinstance(params["block_size"], int) and not isinstance(params["block_size"], bool):
                params["max_new_tokens"] = params["block_size"] + 1  # the first token, then one block
            params.setdefault("chat", True)
        else:
            raise DFlashError("unknown_op", f"operation {job.op} is not run by the engine")
        run = Run(job, self.engine.start(generation_request(params)), queue_ms, embedder, params.get("prompt"))
        return run if not run.state.done else self._end(run)

    def _advance(self, run: "Run") -> bool:
        """One step; True while the run goes on."""
        run.last = self.engine.step(run.state)
        if run.state.done or run.job.op == "generate_block":
            self._end(run)
            return False
        return True

    def _end(self, run: "Run") -> None:
        res = self.engine.finish(run.state)
        self._account(res)
        if run.job.op == "generate_block":
            self._ok(run.job, {**self._block_result(res, run.last, run.queue_ms), **self.model_ids(run.state)})
            return None
        out = res.to_dict()
        out.update(self.model_ids(run.state), queue_ms=run.queue_ms)
        if run.embedder is not None and out["text"].strip():
            text = memory_text(run.prompt or "", out["text"])
            out["memory"] = {"embedder": run.embedder.name, "embedding": run.embedder.embed([text])[0]}
        self._ok(run.job, out)
        return None

    def _block_result(self, res, step: StepResult | None, queue_ms: float) -> dict:
        """generate_block's answer: what the drafter proposed after the target's first token
        and what the target kept of it."""
        decode = self.engine.decode
        drafts = step.draft_ids if step else []
        a = step.accepted if step else 0
        nxt = step.next_token if step and len(step.committed) > a else None  # None: a stop came first
        return {
            "block_size": res.stats.block_size,
            "anchor_id": res.output_ids[0],
            "anchor_text": decode(res.output_ids[:1]),
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
            if res.stats.num_steps:
                self.recent_steps.append((res.stats.accepted, res.stats.num_steps))

    def model_ids(self, state: DecodeState | None = None) -> dict:
        """The models that produced a state's result (the drafter it started with), or the
        current ones."""
        drafter = state.drafter if state is not None and state.drafter is not None else self.engine.in_use()
        return {
            "target": self.engine.target.name,
            "drafter": drafter.name,
            "drafter_version": drafter.version,
            "random_drafter": self.engine.random_drafter,
        }

    def status(self) -> dict:
        with self.lock:
            accepted = sum(a for a, _ in self.recent_steps)
            steps = sum(n for _, n in self.recent_steps)
            return {
                "protocol": PROTOCOL_VERSION,
                **self.model_ids(),
                "embedder": self.embedder.name if self.embedder else None,
                "embedding_dim": self.embedder.dim if self.embedder else None,
                "device": str(self.engine.target.device),
                "dtype": str(self.engine.target.dtype).replace("torch.", ""),
                "draft_dtype": str(self.engine.draft_dtype).replace("torch.", ""),
                "threads": torch.get_num_threads(),
                "block_size": self.engine.block_size,
                "cost_curve": self.engine.cost_curve.to_dict(),
                "uptime_s": time.monotonic() - self.started,
                "requests_served": dict(self.served),
                "in_flight": len(self.jobs),
                "queued": self.queue.qsize(),
                "max_queue": self.queue.maxsize,
                "max_active": self.max_active,
                "tokens_generated": self.tokens,
                # Pooled over the last generations: (accepted drafts + steps) / steps.
                "recent_tau": (accepted + steps) / steps if steps else None,
                "pid": os.getpid(),
                "ready": not self.stopping.is_set(),
                "drafter_sha256": self.engine.drafter_sha256,
                "learn": self.learner.status() if self.learner is not None else None,
            }


@dataclass
class Run:
    """A generation the engine thread is advancing, step by step."""

    job: Job
    state: DecodeState
    queue_ms: float
    embedder: object | None
    prompt: str | None
    last: StepResult | None = None


class _Idle(Exception):
    """An idle connection noticed the worker is stopping."""


def _peer_pid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]


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
