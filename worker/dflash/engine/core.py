"""The engine core: what the scheduler and the worker's server drive, whichever engine runs.

The native engine (dflash.engine.engine.Engine: a target and its proposers in this process)
and the remote one (dflash.remote.engine.RemoteEngine: an OpenAI-compatible inference
server does the work) both implement it; the serving side uses nothing else of them.
"""

from __future__ import annotations

from typing import Protocol


class EngineCore(Protocol):
    target: object  # the Target protocol's name, backend, device, dtype, context_length, vocab_size, max_sequences
    endpoint: str | None  # the inference server it sends requests to; None: it runs the models
    max_batch: int  # set by the scheduler: the most requests one step serves
    block_size: int | None  # the largest verify length (None: the endpoint picks its own)
    random_drafter: bool
    drafter_name: str | None
    drafter_version: str | None
    drafter_sha256: str | None

    def admit(self, request) -> object:
        """Validate a GenerationRequest; its state, nothing computed yet (DFlashError if bad)."""

    def step(self, states: list, budget: int | None = None) -> list:
        """One step for every state given (none done): a StepResult each, in order."""

    def release(self, state) -> None:
        """Free a state that ends early (cancelled, past its deadline, its ticket failed)."""

    def finish(self, state):
        """A done state's GenerationResult (its memory freed)."""

    def status(self) -> dict:
        """What the worker's `status` shows of the engine (docs/worker.md names the keys)."""

    def in_use(self):
        """The drafter a state started now keeps (name, version)."""

    def knows_workload(self, key: str) -> bool:
        """Whether it holds a memory of the workload (else a request must bring its history)."""

    def explain_policy(self, prior: dict | None = None) -> dict: ...

    def swap_drafter(self, drafter, name: str, sha256: str | None = None, random_drafter: bool = False) -> dict: ...

    def decode(self, ids: list[int]) -> str: ...
