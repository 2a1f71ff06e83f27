"""Stdlib-only client for the worker, shared by PL/Python, the CLI and the tests.

It waits for the answer in short slices and calls `check()` between them, so a
caller such as PL/Python can run `plpy.execute("SELECT 1")` there and be
interrupted by statement_timeout or a query cancel. When `check()` raises, the
connection is closed, which tells the worker to stop the request.
"""

from __future__ import annotations

import itertools
import os
import socket
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

    def connect(self) -> "Client":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.connect_timeout)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise WorkerError("unavailable", f"cannot connect to the dflash worker at {self.path}: {exc}") from None
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
            self.connect()
        rid = request_id or f"{os.getpid()}-{next(_ids)}"
        msg = {"v": PROTOCOL_VERSION, "id": rid, "op": op, "params": params or {}}
        if timeout_ms is not None:
            msg["timeout_ms"] = timeout_ms
        try:
            send_frame(self.sock, msg)
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


def call(op: str, params: dict | None = None, path: str = DEFAULT_SOCKET, **kwargs) -> dict:
    """One request on a fresh connection."""
    with Client(path) as client:
        return client.call(op, params, **kwargs)
