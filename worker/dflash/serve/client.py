"""Stdlib-only client for the worker, shared by PL/Python, the CLI and the tests.

It waits for the answer in short slices and calls `check()` between them, so a
caller such as PL/Python can run `plpy.execute("SELECT 1")` there and be
interrupted by statement_timeout or a query cancel. When `check()` raises, the
connection is closed, which tells the worker to stop the request.

Connecting waits too: a worker whose accept backlog is momentarily full (a burst of
callers) refuses with EAGAIN, and one that is restarting with ECONNREFUSED; the client
retries until its connect timeout or the request's deadline, whichever comes first, and
only then reports the worker unavailable.
"""

from __future__ import annotations

import errno
import itertools
import os
import socket
import time
from collections.abc import Callable

from dflash.serve.protocol import (
    DEFAULT_MAX_FRAME,
    DEFAULT_SOCKET,
    PROTOCOL_VERSION,
    PeerClosed,
    ProtocolError,
    recv_frame,
    send_frame,
)

_ids = itertools.count(1)
# A full accept backlog (EAGAIN), a worker between bind and listen (ECONNREFUSED), a signal.
_RETRY_CONNECT = (errno.EAGAIN, errno.ECONNREFUSED, errno.EINTR, errno.ETIMEDOUT)


class WorkerError(Exception):
    """The worker answered with an error, or could not be reached (code 'unavailable')."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Client:
    def __init__(
        self,
        path: str = DEFAULT_SOCKET,
        connect_timeout: float = 5.0,
        slice_s: float = 0.05,
        max_frame: int = DEFAULT_MAX_FRAME * 8,
    ):
        self.path = path
        self.connect_timeout = connect_timeout
        self.slice_s = slice_s
        self.max_frame = max_frame
        self.sock: socket.socket | None = None

    def connect(self, timeout_s: float | None = None, check: Callable[[], None] | None = None) -> "Client":
        """Connect, retrying while the worker is there but cannot take the connection yet."""
        end = time.monotonic() + min(self.connect_timeout, timeout_s if timeout_s is not None else float("inf"))
        pause = 0.002
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(max(end - time.monotonic(), 0.001))
            try:
                sock.connect(self.path)
                break
            except OSError as exc:
                sock.close()
                busy = exc.errno in _RETRY_CONNECT and os.path.exists(self.path)
                if not busy or time.monotonic() + pause > end:
                    raise WorkerError(
                        "unavailable", f"cannot connect to the dflash worker at {self.path}: {exc}"
                    ) from None
            if check is not None:
                check()
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        sock.settimeout(self.slice_s)
        self.sock = sock
        return self

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def __enter__(self):
        return self.connect()

    def __exit__(self, *exc):
        self.close()

    def call(
        self,
        op: str,
        params: dict | None = None,
        *,
        timeout_ms: int | None = None,
        request_id: str | None = None,
        check: Callable[[], None] | None = None,
    ) -> dict:
        """Send one request and wait for its answer; returns `result` or raises WorkerError."""
        if self.sock is None:
            self.connect(timeout_ms / 1000.0 if timeout_ms else None, check)
        rid = request_id or f"{os.getpid()}-{next(_ids)}"
        msg = {"v": PROTOCOL_VERSION, "id": rid, "op": op, "params": params or {}}
        if timeout_ms is not None:
            msg["timeout_ms"] = timeout_ms
        try:
            self._send(msg, check)
            reply = recv_frame(self.sock, self.max_frame, tick=check)
        except PeerClosed:
            self.close()
            raise WorkerError("unavailable", "the dflash worker closed the connection (did it stop?)") from None
        except ProtocolError as exc:
            self.close()
            raise WorkerError(exc.code, exc.message) from None
        except OSError as exc:
            self.close()
            raise WorkerError("unavailable", f"lost the dflash worker at {self.path}: {exc}") from None
        except BaseException:
            # Interrupted by check() (cancel, timeout): hang up so the worker stops this request.
            self.close()
            raise
        if not reply.get("ok"):
            err = reply.get("error") or {}
            raise WorkerError(err.get("code", "error"), err.get("message", "unknown error"))
        return reply.get("result") or {}

    def _send(self, msg: dict, check: Callable[[], None] | None) -> None:
        """Send a request. A worker that refuses it midway (a frame over its limit) answers
        and hangs up, so the send breaks: its answer is then what the caller gets."""
        try:
            send_frame(self.sock, msg)
        except (BrokenPipeError, ConnectionResetError):
            try:
                reply = recv_frame(self.sock, self.max_frame, tick=check)
            except (ProtocolError, OSError, ValueError):
                raise PeerClosed() from None
            err = reply.get("error") or {}
            if reply.get("ok") is False and err.get("code"):
                raise ProtocolError(err["code"], err.get("message", "")) from None
            raise PeerClosed() from None


def call(op: str, params: dict | None = None, path: str = DEFAULT_SOCKET, **kwargs) -> dict:
    """One request on a fresh connection."""
    with Client(path) as client:
        return client.call(op, params, **kwargs)
