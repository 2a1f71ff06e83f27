"""Wire protocol between clients (PL/Python, CLI, tests) and the worker. Stdlib only.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON
holding one object.

Request:  {"v": 1, "id": "<request id>", "op": "<operation>", "params": {...}, "timeout_ms": N}
Response: {"v": 1, "id": "<same id>", "ok": true,  "result": {...}}
          {"v": 1, "id": "<same id>", "ok": false, "error": {"code": "...", "message": "..."}}

Operations: hello, status, generate, generate_block, embed, cancel (params {"request_id": ...}).
`timeout_ms` is the request's deadline relative to its arrival; past it the worker stops
decoding and answers with error code "deadline".
"""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Callable

PROTOCOL_VERSION = 1
DEFAULT_SOCKET = "/run/dflash/worker.sock"
DEFAULT_MAX_FRAME = 8 * 1024 * 1024
HEADER = struct.Struct("!I")
OPERATIONS = ("hello", "status", "generate", "generate_block", "embed", "cancel")


class ProtocolError(Exception):
    """A frame that cannot be read: the connection cannot continue."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class PeerClosed(ProtocolError):
    def __init__(self):
        super().__init__("closed", "the other side closed the connection")


def encode(obj: dict) -> bytes:
    body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return HEADER.pack(len(body)) + body


def send_frame(sock: socket.socket, obj: dict) -> None:
    sock.sendall(encode(obj))


def _recv_exact(sock: socket.socket, n: int, tick: Callable[[], None] | None) -> bytes:
    """Read n bytes. With a socket timeout set, `tick` runs between slices (it may raise)."""
    chunks, got = [], 0
    while got < n:
        try:
            chunk = sock.recv(min(n - got, 1 << 20))
        except socket.timeout:
            if tick is not None:
                tick()
            continue
        if not chunk:
            raise PeerClosed()
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_frame(
    sock: socket.socket, max_frame: int = DEFAULT_MAX_FRAME, tick: Callable[[], None] | None = None
) -> dict:
    (size,) = HEADER.unpack(_recv_exact(sock, HEADER.size, tick))
    if size > max_frame:
        raise ProtocolError("frame_too_large", f"frame of {size} bytes exceeds the maximum of {max_frame}")
    body = _recv_exact(sock, size, tick)
    try:
        obj = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"frame is not UTF-8 JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError("frame is not a JSON object")
    return obj


def now_ms() -> float:
    return time.monotonic() * 1000.0
