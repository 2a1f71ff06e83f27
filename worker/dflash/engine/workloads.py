"""Workload memory: the past outputs of each workload, indexed for the suffix proposer.

A workload is one role's direct calls, or one role's rows of one generate-on-insert table
(the key says which; it is never shared between roles, so one member's generations never
feed another member's proposals). Its memory is a suffix index over its past outputs,
loaded on first use from what the caller could read (the history a request brings: the
bridge reads it under the caller's row security, the queue consumer for the row's own
role), extended by every generation of that workload the engine finishes, and bounded: all
workloads together hold at most `cap_bytes`, the least recently used going first, and one
workload's history is loaded newest first only up to what fits.
"""

from __future__ import annotations

from collections import OrderedDict

from dflash.engine.knobs import WORKLOAD_MEMORY_MB
from dflash.engine.proposers.suffix_index import SuffixIndex
from dflash.errors import DFlashError

MAX_KEY = 200
BYTES_PER_TOKEN = 48  # what the index holds per token (dflash.engine.proposers.suffix_index), with room
EVICT_TO = 0.9  # over the cap, a workload's oldest outputs go until it holds this share of the cap


class Workload:
    def __init__(self):
        self.index = SuffixIndex()
        self.docs: list[int] = []  # document ids, oldest first
        self.next_doc = 0

    def add(self, tokens: list[int]) -> None:
        if tokens:
            self.index.add(self.next_doc, list(tokens))
            self.docs.append(self.next_doc)
            self.next_doc += 1

    def shrink_to(self, max_bytes: int) -> None:
        gone = set(self.index.evict_oldest(max_bytes))
        self.docs = [d for d in self.docs if d not in gone]

    @property
    def size_bytes(self) -> int:
        return self.index.size_bytes()


class WorkloadMemory:
    def __init__(self, cap_mb: float = WORKLOAD_MEMORY_MB):
        if not cap_mb >= 0:
            raise DFlashError("bad_params", f"the workload memory cap must be >= 0 MB, got {cap_mb}")
        self.cap_bytes = int(cap_mb * 1024 * 1024)
        self.workloads: OrderedDict[str, Workload] = OrderedDict()  # least recently used first
        self.evicted = 0

    @staticmethod
    def check_key(key) -> str:
        if not isinstance(key, str) or not key or len(key) > MAX_KEY:
            raise DFlashError("bad_params", f"workload must be a non-empty string of at most {MAX_KEY} characters")
        return key

    def get(self, key: str) -> Workload | None:
        w = self.workloads.get(key)
        if w is not None:
            self.workloads.move_to_end(key)
        return w

    def load(self, key: str, history: list[list[int]]) -> Workload:
        """A workload's memory from its history (newest first), as much as fits the cap."""
        w = Workload()
        budget = self.cap_bytes
        kept = []
        for tokens in history:  # newest first: keep what fits, then add oldest first
            kept.append(tokens)
            budget -= BYTES_PER_TOKEN * (len(tokens) + 1)
            if budget < 0:
                kept.pop()
                break
        for tokens in reversed(kept):
            w.add(tokens)
        self.workloads[key] = w
        self.workloads.move_to_end(key)
        self._bound(keep=key)
        return w

    def remember(self, key: str, tokens: list[int]) -> None:
        """A finished generation of the workload joins its memory."""
        w = self.workloads.get(key)
        if w is None:
            return  # evicted meanwhile: the next request of it loads its history again
        w.add(tokens)
        self.workloads.move_to_end(key)
        self._bound(keep=key)

    def _bound(self, keep: str) -> None:
        total = self.size_bytes
        while total > self.cap_bytes and self.workloads:
            key, w = next(iter(self.workloads.items()))
            if key == keep:
                if len(self.workloads) == 1 or not w.docs:  # alone over the cap: its oldest go
                    w.shrink_to(int(self.cap_bytes * EVICT_TO))
                    return
                self.workloads.move_to_end(key)
                continue
            total -= w.size_bytes
            del self.workloads[key]
            self.evicted += 1

    @property
    def size_bytes(self) -> int:
        return sum(w.size_bytes for w in list(self.workloads.values()))  # (a snapshot: status reads it from another thread)

    def clear(self) -> None:
        self.workloads.clear()

    def status(self) -> dict:
        return {"workloads": len(self.workloads), "bytes": self.size_bytes, "cap_bytes": self.cap_bytes,
                "evicted": self.evicted}
