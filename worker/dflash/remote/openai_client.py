"""HTTP to an inference server: small JSON GETs, and streamed completions (server-sent events)
each read by a thread of its own. Stdlib only (http.client): the worker adds no dependency
for it.

A `Stream` is one request: its reader thread turns the answer into `Piece`s (what the
server's dialect parses out of each event) on its `events`, then `END`, or a DFlashError
when something went wrong, and notifies the engine's condition so a waiting step wakes.
`close()` hangs up; inference servers abort a streamed request whose connection closes
(llama-server does, at its next token or within its 1 s poll while the request waits).

Retries: only while nothing has been generated yet (a refused or reset connection, a
`503 loading model`), a few times with a short pause; then `endpoint_unavailable`. After
the first piece any failure is `endpoint_error`: a retry would generate the answer again.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.parse
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from dflash.errors import DFlashError

CONNECT_TIMEOUT_S = 5.0
# The longest wait for the next event of a stream (llama-server sends SSE pings meanwhile).
READ_TIMEOUT_S = 120.0
RETRY_PAUSES_S = (0.2, 0.5, 1.0)  # before the 2nd, 3rd and 4th attempt
RETRY_STATUSES = {408, 425, 429, 502, 503, 504}  # "not now": the server is loading, busy or behind a restart
MAX_LINE = 16 * 1024 * 1024  # one SSE line (one chunk of an answer)
MAX_ERROR_BODY = 64 * 1024


@dataclass
class Piece:
    """What one event of a streamed answer carried."""

    ids: list[int] = field(default_factory=list)  # new token ids (empty: none, or not reported)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" once the server says the answer ended
    info: dict = field(default_factory=dict)  # the server's counts and timings, when it sends them


END = object()  # the stream ended after its last piece


class Endpoint:
    """Where the server is: `http[s]://host[:port][/prefix][/v1]` and an optional API key."""

    def __init__(self, url: str, api_key: str | None = None):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise DFlashError("bad_params", f"--endpoint must be an http:// or https:// URL, got {url!r}")
        self.url = url
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.https else 80)
        base = parts.path.rstrip("/")
        self.base = base[: -len("/v1")] if base.endswith("/v1") else base  # paths below say /v1 themselves
        self.api_key = api_key

    @staticmethod
    def read_key(path: str | None) -> str | None:
        """The API key from a file (so it is not in the process list); None without a file."""
        if path is None:
            return None
        try:
            key = Path(path).read_text().strip()
        except OSError as exc:
            raise DFlashError("bad_params", f"cannot read --api-key-file {path}: {exc.strerror}") from None
        if not key:
            raise DFlashError("bad_params", f"--api-key-file {path} is empty")
        return key

    def headers(self, body: bool = False) -> dict:
        h = {"Accept": "application/json, text/event-stream"}
        if body:
            h["Content-Type"] = "application/json"
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def connect(self, timeout: float = CONNECT_TIMEOUT_S) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=timeout)
        conn.connect()
        conn.sock.settimeout(READ_TIMEOUT_S)
        return conn

    def get_json(self, path: str, timeout: float = CONNECT_TIMEOUT_S) -> dict | str | None:
        """GET a small document: parsed JSON, the text of a non-JSON 200 answer (/metrics), or
        None when the server has no such path (404, 405: another kind of server).
        Raises endpoint_unavailable (not reachable, not ready) or endpoint_error."""
        return self.small("GET", path, None, timeout)

    def post_json(self, path: str, body: dict, timeout: float = CONNECT_TIMEOUT_S) -> dict | str | None:
        """POST a small JSON request (/tokenize), answered as get_json's GET is."""
        return self.small("POST", path, body, timeout)

    def small(self, method: str, path: str, body: dict | None, timeout: float) -> dict | str | None:
        try:
            conn = self.connect(timeout)
            try:
                conn.sock.settimeout(timeout)
                conn.request(method, self.base + path, body=None if body is None else json.dumps(body).encode(),
                             headers=self.headers(body is not None))
                resp = conn.getresponse()
                data = resp.read(MAX_LINE)
            finally:
                conn.close()
        except (OSError, http.client.HTTPException) as exc:
            raise unavailable(self, exc) from None
        if resp.status in (404, 405):
            return None
        if resp.status != 200:
            raise status_error(self, path, resp.status, data)
        text = data.decode("utf-8", "replace")
        if "json" not in (resp.getheader("Content-Type") or ""):
            return text
        try:
            return json.loads(text)
        except ValueError:
            raise DFlashError("endpoint_error", f"{self.url}{path} answered something that is not JSON: "
                              f"{text[:200]!r}") from None


def unavailable(endpoint: Endpoint, exc: Exception) -> DFlashError:
    why = "timed out" if isinstance(exc, (socket.timeout, TimeoutError)) else (
        getattr(exc, "strerror", None) or type(exc).__name__)
    return DFlashError("endpoint_unavailable", f"the inference endpoint {endpoint.url} cannot be reached: {why}")


def error_message(data: bytes) -> str:
    """The message of an error answer: OpenAI's {"error": {"message"}}, FastAPI's {"detail"},
    or the start of the body."""
    text = data[:MAX_ERROR_BODY].decode("utf-8", "replace")
    try:
        obj = json.loads(text)
    except ValueError:
        return text.strip()[:300]
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail", obj.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            return str(err)[:300]
    return text.strip()[:300]


def status_error(endpoint: Endpoint, path: str, status: int, data: bytes) -> DFlashError:
    code = "endpoint_unavailable" if status in RETRY_STATUSES else "endpoint_error"
    return DFlashError(code, f"the inference endpoint {endpoint.url} answered {path} with HTTP {status}: "
                       f"{error_message(data)}")


class _Retry(Exception):
    """An attempt failed before anything was generated, in a way another attempt may mend."""

    def __init__(self, error: DFlashError):
        self.error = error


class Stream:
    """One streamed completion: POST `body` to `path`, parse each event with `parse` (a
    dialect's: JSON object -> Piece, raising endpoint_error on what it cannot read), in a
    thread of its own. `fallback` (optional): the body to send instead when the server
    refuses the first one as a bad request (HTTP 400/422) before generating anything (a
    prompt of token ids it does not take); `used_fallback` then says so. `counters`
    (optional): reads the server's cumulative speculative counters; read before the request
    and after its answer, their difference comes as a last Piece's info["counters_delta"]."""

    def __init__(self, endpoint: Endpoint, path: str, body: dict, parse, arrived: threading.Condition,
                 fallback: dict | None = None, counters=None):
        self.endpoint, self.path, self.body, self.parse = endpoint, path, body, parse
        self.fallback = fallback
        self.counters = counters
        self.used_fallback = False
        self.arrived = arrived
        self.events: deque = deque()
        self.generated = False  # a piece with tokens or text arrived: no more retries
        self.closed = False
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="dflash-remote-stream", daemon=True)
        self.thread.start()

    # --- the engine's side ----------------------------------------------------------------

    def close(self) -> None:
        """Hang up (the server aborts the request); later events are dropped. Idempotent."""
        with self._lock:
            self.closed = True
            conn, self._conn = self._conn, None
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader at once; the FIN tells the server
            except OSError:
                pass
        if conn is not None:
            conn.close()

    # --- the reader thread ------------------------------------------------------------------

    def _push(self, item) -> None:
        with self.arrived:
            if not self.closed:
                self.events.append(item)
            self.arrived.notify_all()

    def _run(self) -> None:
        before = self.counters() if self.counters is not None else None
        for attempt in range(len(RETRY_PAUSES_S) + 1):
            try:
                self._attempt()
                after = self.counters() if before is not None and not self.closed else None
                if after is not None:
                    self._push(Piece(info={"counters_delta": {k: after[k] - before[k] for k in after}}))
                self._push(END)
                return
            except _Retry as r:
                if self.closed:
                    return
                if attempt == len(RETRY_PAUSES_S):
                    self._push(r.error)
                    return
                time.sleep(RETRY_PAUSES_S[attempt])
            except DFlashError as exc:
                self._push(exc)
                return
            except Exception as exc:  # a bug here must still end the request, not hang it
                self._push(DFlashError("endpoint_error", f"reading the answer of {self.endpoint.url} failed: "
                                       f"{type(exc).__name__}: {exc}"))
                return

    def _attempt(self) -> None:
        try:
            conn = self.endpoint.connect()
        except (OSError, http.client.HTTPException) as exc:
            raise _Retry(unavailable(self.endpoint, exc)) from None
        with self._lock:
            if self.closed:
                conn.close()
                return
            self._conn = conn
        try:
            self._exchange(conn)
        except (OSError, http.client.HTTPException) as exc:
            if self.closed:
                return  # we hung up ourselves
            if not self.generated:
                raise _Retry(unavailable(self.endpoint, exc)) from None
            why = "timed out" if isinstance(exc, (socket.timeout, TimeoutError)) else f"{type(exc).__name__}: {exc}"
            raise DFlashError("endpoint_error", f"the inference endpoint {self.endpoint.url} broke off mid-answer "
                              f"({why})") from None
        finally:
            conn.close()

    def _exchange(self, conn: http.client.HTTPConnection) -> None:
        body = self.fallback if self.used_fallback else self.body
        conn.request("POST", self.endpoint.base + self.path, body=json.dumps(body).encode(),
                     headers=self.endpoint.headers(body=True))
        resp = conn.getresponse()
        if resp.status != 200:
            error = status_error(self.endpoint, self.path, resp.status, resp.read(MAX_ERROR_BODY))
            if resp.status in (400, 422) and self.fallback is not None and not self.used_fallback:
                self.used_fallback = True
                raise _Retry(error)
            raise _Retry(error) if error.code == "endpoint_unavailable" else error
        ctype = resp.getheader("Content-Type") or ""
        if "text/event-stream" not in ctype:
            start = resp.read(200).decode("utf-8", "replace")
            raise DFlashError("endpoint_error", f"the inference endpoint {self.endpoint.url} answered "
                              f"{ctype or 'without a content type'} where a stream was asked for: {start!r}")
        ended = False
        for data in sse_events(resp):
            if self.closed:
                return
            if data == "[DONE]":
                break
            try:
                obj = json.loads(data)
            except ValueError:
                raise DFlashError("endpoint_error", f"the inference endpoint {self.endpoint.url} sent an event that "
                                  f"is not JSON: {data[:200]!r}") from None
            if not isinstance(obj, dict):
                raise DFlashError("endpoint_error", f"the inference endpoint {self.endpoint.url} sent an event that "
                                  f"is not a JSON object: {data[:200]!r}")
            if "error" in obj:
                raise DFlashError("endpoint_error", f"the inference endpoint {self.endpoint.url} failed: "
                                  f"{error_message(data.encode())}")
            piece = self.parse(obj)
            if piece.ids or piece.text:
                self.generated = True
            ended = ended or piece.finish_reason is not None
            self._push(piece)
        if not ended and not self.closed:
            if not self.generated:
                raise _Retry(DFlashError("endpoint_unavailable", f"the inference endpoint {self.endpoint.url} "
                                         "closed the stream before answering"))
            raise DFlashError("endpoint_error", f"the inference endpoint {self.endpoint.url} ended the stream "
                              "before the answer ended")


def sse_events(resp) -> "iter[str]":
    """The data of each server-sent event (its `data:` lines joined); comments (pings) and
    other fields are skipped."""
    lines: list[str] = []
    while True:
        raw = resp.readline(MAX_LINE)
        if not raw:
            if lines:
                yield "\n".join(lines)
            return
        line = raw.rstrip(b"\r\n")
        if not line:
            if lines:
                yield "\n".join(lines)
                lines = []
            continue
        if line.startswith(b":"):
            continue
        name, _, value = line.partition(b":")
        if name == b"data":
            try:
                lines.append(value[1:].decode() if value.startswith(b" ") else value.decode())
            except UnicodeDecodeError:
                raise DFlashError("endpoint_error", "the inference endpoint sent an event that is not UTF-8") from None
