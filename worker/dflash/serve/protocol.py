"""Wire protocol between clients (PL/Python, CLI, tests) and the worker. Stdlib only.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON
holding one object.

Request:  {"v": 1, "id": "<request id>", "op": "<operation>", "params": {...}, "timeout_ms": N}
Response: {"v": 1, "id": "<same id>", "ok": true,  "result": {...}}
          {"v": 1, "id": "<same id>", "ok": false, "error": {"code": "...", "message": "..."}}

Operations: hello, status, generate, generate_many (params {"prompts": [...], options as for
generate}: one batched request, answered {"results": [one generate answer per prompt]}),
generate_block, embed, cancel (params {"request_id": ...}), check_options (params: generation
options; answered {"constraint": its kind or null} once their types and their constraint are
checked, nothing generated),
explain_policy (params {"prior": {"accepted": [...], "judged": [...]}}), reload_drafter (params
{"path": folder under the worker's drafter roots (default: the current drafter's folder again),
"sha256": the weights' expected digest}).
`timeout_ms` is the request's deadline relative to its arrival; past it the worker stops
decoding and answers with error code "deadline".
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Callable

PROTOCOL_VERSION = 1
DEFAULT_SOCKET = "/run/dflash/worker.sock"
DEFAULT_MAX_FRAME = 8 * 1024 * 1024
HEADER = struct.Struct("!I")
OPERATIONS = ("hello", "status", "generate", "generate_many", "generate_block", "embed", "cancel", "explain_policy",
              "reload_drafter", "check_options")


# A workload's history (its past outputs, for the suffix proposer's memory) as the caller's
# side reads it: the newest generations up to this many tokens in all.
HISTORY_TOKENS = 100_000


def workload_key(role: str, source_table_oid: int | None = None) -> str:
    """The worker-side name of a workload: one role's direct calls, or one role's rows of one
    generate-on-insert table. Always per role: one member's generations never feed another's
    proposals."""
    return f"role:{role}" if source_table_oid is None else f"table:{source_table_oid}:role:{role}"


def _workload_steers(params: dict) -> bool:
    """Whether what a workload did before may steer a generation: only with block length
    auto (no block_size), and not when a seed asks for a reproducible sample (the workload's
    prior and memory change from call to call, and with them which random draws a sample
    uses; the same seed must give the same output)."""
    return params.get("block_size") is None and params.get("seed") is None


def wants_workload(params: dict) -> bool:
    """Whether a generation is sent as part of its workload (`_workload_steers`): its answer
    joins the workload's memory, its prompt may start from the rows an earlier prompt of
    the workload left in the target's cache (the prefix cache: exact, proposals or not), and
    with proposals on (the default) it drafts from the memory."""
    return _workload_steers(params)


def wants_prior(params: dict) -> bool:
    """Whether a generation should start from its workload's pooled acceptance, which steers
    its block lengths (`_workload_steers`)."""
    return _workload_steers(params)


def cut_short(result: dict) -> str | None:
    """Why a generate answer may not be given out as an answer: a constrained one (json_schema,
    regex, choices) that max_new_tokens or the context cut short of its form, which would not
    parse or validate (error code `truncated`); None when it may."""
    if not result.get("truncated"):
        return None
    return (f"the answer was cut short of its form after {result.get('new_tokens')} new tokens "
            f"(finish_reason {result.get('finish_reason')}); raise max_new_tokens")


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
    except RecursionError:  # the whole frame was read, so the connection can go on
        raise ValueError("frame nests JSON too deeply") from None
    if not isinstance(obj, dict):
        raise ValueError("frame is not a JSON object")
    return obj


# PostgreSQL's text and jsonb cannot hold U+0000; a model can still produce it.
NUL_REPLACEMENT = "\ufffd"


def pg_text(obj):
    """`obj` with U+0000 replaced by U+FFFD in every string, so a result can be stored."""
    if isinstance(obj, str):
        return obj.replace("\x00", NUL_REPLACEMENT)
    if isinstance(obj, dict):
        return {pg_text(k): pg_text(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [pg_text(v) for v in obj]
    return obj

