"""The scheduler: admission, the batch of each step, chunked prefill, and the run loop.

One thread owns the engine. Work arrives as tickets (one or several generation requests
answered together: a call, a `text[]` of prompts, a claimed batch of queued rows) and as
calls (an embedding, a drafter swap) that run between steps. Every step serves every
admitted state, up to `max_batch` of them, in ONE engine step: decoding states verify
their blocks while prefilling states get chunks of their prompts within `step_tokens`, so
a long prompt delays the others by at most one chunk, never by its whole prefill (with no
state decoding, nobody waits, and prompts are cached whole). Tickets are served first come
first served; a ticket's states join the batch as slots free up.

Before each step every ticket is checked (cancel, deadline): a stopped one is answered at
once and its states freed; the others go on. A failure inside a step fails the tickets in
that step and frees their memory; the loop goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from dflash.engine.core import EngineCore
from dflash.engine.knobs import DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE, DEFAULT_STEP_TOKENS
from dflash.engine.state import DecodeState, StepResult
from dflash.errors import DFlashError

log = logging.getLogger("dflash.scheduler")


class Stopped(Exception):
    """A ticket ends early (code: cancelled | deadline | shutdown)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Ticket:
    """Generation requests answered together. `check` raises Stopped to end it early;
    `done(states, last_steps)` or `failed(exc)` is called once, on the engine thread.
    `one_step`: each request ends after its first decode step (generate_block)."""

    requests: list
    check: Callable[[], None]
    done: Callable[[list[DecodeState], list[StepResult | None]], None]
    failed: Callable[[Exception], None]
    one_step: bool = False
    states: list[DecodeState] = field(default_factory=list)
    last: list[StepResult | None] = field(default_factory=list)
    stepped: list[bool] = field(default_factory=list)

    def live(self) -> list[int]:
        """Indexes of states still to step."""
        return [i for i, s in enumerate(self.states) if not s.done and not (self.one_step and self.stepped[i])]


@dataclass
class Call:
    """Work for the engine thread between two steps (an embedding, a drafter swap):
    `done(fn())` or `failed(exc)` is called once, on that thread; `check` as a ticket's."""

    fn: Callable[[], object]
    done: Callable[[object], None]
    failed: Callable[[Exception], None]
    check: Callable[[], None] = lambda: None


class Scheduler:
    def __init__(self, engine: EngineCore, max_batch: int = DEFAULT_MAX_BATCH, step_tokens: int = DEFAULT_STEP_TOKENS,
                 max_queue: int = DEFAULT_MAX_QUEUE):
        if max_batch < 1 or step_tokens < 1:
            raise DFlashError("bad_params", "max_batch and step_tokens must be >= 1")
        self.engine = engine
        # A backend that holds KV memory for a bounded number of sequences (llama.cpp) caps
        # the batch: a finished state frees its sequence at once, so the queue moves on.
        capacity = engine.target.max_sequences
        if capacity is not None and max_batch > capacity:
            log.info("batch capped at %d: the %s backend's sequences", capacity, engine.target.backend)
            max_batch = capacity
        self.max_batch = max_batch
        self.step_tokens = step_tokens
        engine.max_batch = max_batch
        self.inbox: queue.Queue = queue.Queue(maxsize=max_queue)
        self.tickets: list[Ticket] = []  # admitted, in arrival order
        self.thread: threading.Thread | None = None
        self.steps = 0
        self.active = 0  # states in the last step

    # --- from other threads ---------------------------------------------------------------

    def submit(self, work: "Ticket | Call", wait: bool = False) -> None:
        """Queue a ticket or a call; raises queue.Full when the queue is full (unless `wait`)."""
        self.inbox.put(work, block=wait)

    def call(self, fn: Callable[[], object]):
        """Run `fn` on the engine thread between two steps and wait; returns its result (or raises)."""
        out: dict = {}
        ended = threading.Event()

        def done(result):
            out["result"] = result
            ended.set()

        def failed(exc):
            out["error"] = exc
            ended.set()

        self.submit(Call(fn, done, failed), wait=True)
        ended.wait()
        if "error" in out:
            raise out["error"]
        return out["result"]

    @property
    def queued(self) -> int:
        return self.inbox.qsize()

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name="dflash-engine", daemon=True)
        self.thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Finish what is admitted, then end the loop."""
        self.inbox.put(None)
        if self.thread is not None:
            self.thread.join(timeout)

    # --- the engine thread -----------------------------------------------------------------

    def run(self) -> None:
        closing = False
        while True:
            closing = self._intake(block=not self.tickets and not closing) or closing
            if not self.tickets:
                if closing:
                    return
                continue
            self._check()
            batch = self._batch()
            if batch:
                self._step(batch)
            self._finish()

    def _intake(self, block: bool) -> bool:
        """Admit what has arrived (waiting for something when idle); True on shutdown."""
        while True:
            try:
                item = self.inbox.get(block=block)
            except queue.Empty:
                return False
            block = False
            if item is None:
                return True
            if isinstance(item, Call):
                self._call(item)
                continue
            self._admit(item)

    @staticmethod
    def _call(call: Call) -> None:
        try:
            call.check()
            result = call.fn()
        except Exception as exc:
            if not isinstance(exc, (Stopped, DFlashError)):
                log.exception("a call on the engine thread failed")
            call.failed(exc)
            return
        call.done(result)

    def _admit(self, ticket: Ticket) -> None:
        try:
            ticket.check()
            for req in ticket.requests:
                ticket.states.append(self.engine.admit(req))
        except Exception as exc:
            self._fail(ticket, exc)
            return
        ticket.last = [None] * len(ticket.states)
        ticket.stepped = [False] * len(ticket.states)
        self.tickets.append(ticket)

    def _check(self) -> None:
        for ticket in list(self.tickets):
            try:
                ticket.check()
            except Stopped as exc:
                self._fail(ticket, exc)

    def _batch(self) -> list[tuple[Ticket, int]]:
        """Up to max_batch live states, earliest tickets first."""
        batch = []
        for ticket in self.tickets:
            for i in ticket.live():
                if len(batch) == self.max_batch:
                    return batch
                batch.append((ticket, i))
        return batch

    def _step(self, batch: list[tuple[Ticket, int]]) -> None:
        states = [t.states[i] for t, i in batch]
        decoding = any(not s.prefilling for s in states)
        try:
            results = self.engine.step(states, self.step_tokens if decoding else None)
        except Exception as exc:
            log.exception("a step of %d requests failed", len(states))
            for ticket in {id(t): t for t, _ in batch}.values():
                self._fail(ticket, exc)
            return
        self.steps += 1
        self.active = len(states)
        for (ticket, i), res in zip(batch, results):
            if res.anchor != -1:  # a decode step, not a prefill chunk
                ticket.last[i] = res
                ticket.stepped[i] = True

    def _finish(self) -> None:
        for ticket in list(self.tickets):
            if ticket.live():
                continue
            self.tickets.remove(ticket)
            try:
                ticket.done(ticket.states, ticket.last)
            except Exception as exc:  # a bug in the answer must not kill the loop
                if not isinstance(exc, DFlashError):  # else an answer that failed on its own terms (a remote error)
                    log.exception("answering a ticket failed")
                self._fail(ticket, exc, listed=False)

    def _fail(self, ticket: Ticket, exc: Exception, listed: bool = True) -> None:
        if listed and ticket in self.tickets:
            self.tickets.remove(ticket)
        for state in ticket.states:
            self.engine.release(state)
        try:
            ticket.failed(exc)
        except Exception:
            log.exception("failing a ticket failed")
