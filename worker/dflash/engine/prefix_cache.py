"""Prompts a workload's requests share, kept in the target's K/V memory (a prefix cache).

Rows of a generate-on-insert table are one prompt template with a different value in it,
and a role's calls often start alike (the chat template's system prompt, the same
instructions): on the `repetitive` suite 63 % of the prompt tokens begin the same way as an
earlier prompt of the suite. Prefilling them again costs about a verify row each on a CPU.
So a finished request's target sequence is kept (its prompt and answer, the rows the target
cached) instead of freed, and a new request of the same workload whose prompt begins with
the same tokens has those rows copied into its own sequence and prefills only the rest
(vLLM's automatic prefix caching, at the grain of whole requests). Requests of a workload
that arrive together (a table's rows inserted at once) prefill one after another, so one
about to start its prefill also copies from those of its step that have cached the same
start already.

- Exact, where used: only a backend whose cached rows are what prefilling the same tokens
  again would give offers it (`Target.copy_prefix`: the ort backend, where a row's numbers do
  not depend on the calls it was computed in), so outputs and sampling do not change.
- Per workload: a request reuses only what its own workload (one role's calls, or one role's
  rows of one table: dflash.engine.workloads) left, so one member's prompts never speed up,
  and so never reveal themselves to, another member's requests.
- Not for a request the DFlash drafter runs in: it reads the target's features of every
  prompt row, which a copied row does not bring.
- Bounded: all kept sequences together hold at most `cap_bytes` of K/V memory (each only
  its cached rows: `Target.shrink`), the least recently used freed first; a kept sequence
  whose tokens begin another kept one's is dropped for it. `status` shows the entries,
  bytes, hits and tokens not prefilled.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from dflash.engine.knobs import PREFIX_CACHE_MB, PREFIX_MIN_TOKENS


@dataclass
class _Kept:
    workload: str
    ids: list[int]  # the tokens whose K/V rows the sequence caches, in order
    seq: object
    nbytes: int


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share (a binary search over list slices, which
    compare in C: a step may look through a few dozen prompts)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixCache:
    def __init__(self, target, cap_bytes: int = int(PREFIX_CACHE_MB * 2**20), min_tokens: int = PREFIX_MIN_TOKENS):
        self.target = target
        self.cap_bytes = cap_bytes
        self.min_tokens = min_tokens
        self.kept: OrderedDict[int, _Kept] = OrderedDict()  # least recently used first
        self._serial = 0
        self.hits = self.reused_tokens = self.evicted = 0
        self.size_bytes = 0  # (a count, not a sum over `kept`: `status` reads it from another thread)

    @staticmethod
    def supported(target) -> bool:
        return target.copies_prefix

    def reuse(self, workload: str, prompt_ids: list[int], seq, live: list[tuple[list[int], object]] = ()) -> int:
        """Copy into `seq` (nothing cached) the longest run of leading prompt tokens that a
        kept sequence of `workload` caches, or one of `live` ((the tokens it caches, the
        sequence): requests of the same workload still running), if at least `min_tokens`,
        and never the prompt's last token (its row gives the first token's logits); how many
        tokens `seq` now caches."""
        best, source, n = None, None, 0
        for key, kept in self.kept.items():
            if kept.workload == workload:
                m = common_prefix(kept.ids, prompt_ids)
                if m > n:
                    best, source, n = key, kept.seq, m
        for ids, other in live:
            m = common_prefix(ids, prompt_ids)
            if m > n:
                best, source, n = None, other, m
        n = min(n, len(prompt_ids) - 1)
        if source is None or n < self.min_tokens:
            return 0
        if best is not None:
            self.kept.move_to_end(best)
        self.target.copy_prefix(source, seq, n)
        self.hits += 1
        self.reused_tokens += n
        return n

    def keep(self, workload: str, ids: list[int], seq) -> bool:
        """Keep a finished request's sequence, which caches the K/V of `ids`; False when it
        is not worth keeping (then the caller frees it). The cache owns a kept sequence."""
        if len(ids) < self.min_tokens:
            return False
        mine = [(k, v) for k, v in self.kept.items() if v.workload == workload]
        for key, kept in mine:
            if len(kept.ids) >= len(ids) and kept.ids[:len(ids)] == ids:
                self.kept.move_to_end(key)  # it holds all this one would
                return False
        self.target.shrink(seq)  # only copied from now on: its spare rows go back
        nbytes = int(self.target.kv_bytes(seq))
        if nbytes > self.cap_bytes:
            return False
        for key, kept in mine:
            if kept.ids == ids[:len(kept.ids)]:
                self._drop(key)  # what it holds, the new one holds too
        self._serial += 1
        self.kept[self._serial] = _Kept(workload, list(ids), seq, nbytes)
        self.size_bytes += nbytes
        while self.size_bytes > self.cap_bytes:
            self._drop(next(iter(self.kept)))
            self.evicted += 1
        return True

    def _drop(self, key: int) -> None:
        kept = self.kept.pop(key)
        self.size_bytes -= kept.nbytes
        self.target.free(kept.seq)

    def clear(self) -> None:
        for key in list(self.kept):
            self._drop(key)

    def status(self) -> dict:
        return {"sequences": len(self.kept), "bytes": self.size_bytes, "cap_bytes": self.cap_bytes,
                "hits": self.hits, "reused_tokens": self.reused_tokens, "evicted": self.evicted}
