"""A model-free proposer's index: the continuation of the longest matching context.

`SuffixIndex` holds a set of token-id documents (a request's prompt and output so far, or a
workload's past outputs). `propose(context, max_tokens)` finds the longest suffix of
`context` (at most `max_context` tokens) that occurs somewhere in the documents followed by
at least one more token, then walks forward like a suffix tree would: at each position it
takes the most frequent next token among the occurrences still consistent with the matched
context and the tokens chosen so far, keeps only the occurrences that continue with it, and
goes on until `max_tokens` tokens or no occurrence continues. `propose_from` does the same
over several indexes at once (a request's own index and its workload's memory), counting
occurrences from all of them; `continuations_from` stops before the walk and returns what
followed every occurrence (`Continuations`), so a caller can choose the first token itself
(the next-token head's say, dflash.engine.proposers.suffix) and walk on from it.

Definitions (what the tests' brute-force reference checks):

* An occurrence is a position p inside a document (p < its length) whose preceding tokens
  end with the matched suffix; its next token is doc[p]. A suffix that occurs only at the
  very end of a document has no next token and does not count, so the context never
  "matches itself" at the end of the document it is the text of.
* Matches never cross documents.
* Confidence of a position = c / (n + prior): n occurrences still consistent continue
  there, c of them with the chosen token; `prior` (1 by default) is a pseudo-count for
  "something else", shrinking estimates from little support (one occurrence: 0.5; ten that
  agree: 0.91). It is the conditional rate the block-length policy calibrates. With
  `per_context=True` the pseudo-count is divided by the length of the context those
  occurrences agree with at that position (the match plus the tokens proposed before it):
  one occurrence after a one-token match 0.5, after a match of 9 tokens 0.9. A continuation
  that a long stretch of text agrees with is more often right than one after a single token
  with the same counts (measured on the bench's suites, ort on a Zen 4: one occurrence's
  next token was kept 21-44 % of the time after a one-token match, 87-98 % after 16 or more).
* Ties: the smallest token id wins. Deterministic: the answer depends only on the
  documents and their order (older first); when more than `max_occurrences` occurrences
  of the looked-up n-gram exist, only the most recent ones are considered (the one place
  it is not exact; the bound keeps a lookup's cost fixed).

Structure. Every document lives in one token arena (numpy int32), each followed by a
sentinel (-1), so comparisons stop at document ends by themselves. For a few n-gram
lengths k (`levels`, default 1, 4, 16) every arena position p is keyed by a 64-bit hash of
the k tokens before it; the (key, position) pairs are kept sorted in a few runs of
geometrically growing size (a log-structured merge: new pairs go to a small unsorted tail,
which is sorted into a run when full, and the two newest runs merge while the older is not
larger), so adding is amortised O(log n) per token in vectorised numpy and a lookup is a
binary search per run (plus a linear scan of the tail). A step's few new tokens (an extend by
up to 8) go to a dict beside the tail instead, key -> positions: in the engine's loop that
cut indexing a step's tokens from ~0.13 to ~0.05 ms (ort, Zen 4, the agent suite). A proposal looks up the longest
level k <= len(context) with a hit: every occurrence of a match of length >= k is among that
k-gram's positions, so extending those backwards (vectorised gathers in blocks of doubling
width, only still-matching rows going on) gives the exact longest match; if the level has
none the match is shorter than k and the next level down is tried. The forward walk
gathers a window of max_tokens tokens after each surviving occurrence and filters it
column by column (numpy while many occurrences are left, plain Python for the last few).

Costs (n tokens indexed, levels L, runs R ~ log2(n / tail)):
* add / extend of the most recently added document: O(m) hashing per level plus amortised
  O(log n) merging per token; a merge cascade now and then re-sorts up to the whole level
  (a linear merge, tens of ms at 1e6 tokens). Extending an older document moves it to the
  arena's end, which costs a removal (below): keep one index per request for its own text.
* remove: O(n) vectorised (the arena and every run are compacted and positions shifted),
  so `size_bytes` falls at once; `remove_many` / `evict_oldest` drop many in one pass.
* propose: O(L * R) binary searches + at most max_occurrences x max_context gathered tokens
  + the walk over at most max_occurrences rows x max_tokens.
* memory: 4 bytes per token for the arena + 12 per token per level (an 8-byte key and a
  4-byte position): about 40 bytes per token with the default levels, all in numpy arrays
  whose size `size_bytes` reports (plus an estimate per document of the Python table).

Measured (2-core AMD EPYC VM, shared, best of 5 per query; synthetic Zipf text built from
repeated phrases): adding ~0.5-0.7 us
per token; extending by 1 / 4 / 16 tokens ~15 / 25 / 40 us; removing one document 1 ms at 1e5 tokens, 7-11
ms at 1e6; propose of 15 tokens over a request's own index plus a memory of 1e5 / 1e6
tokens: median 70 / 70-140 us on a context with a long match, 130-190 us (max ~0.5 ms) on
random common tokens (short matches with hundreds of occurrences), 40-80 us when nothing
matches.

Why not a suffix automaton or tree: in pure Python every state is a dict (hundreds of
bytes per token), and counting occurrences online or removing a document is awkward.
Arctic Inference's C++ suffix tree fits the job but ships as a source distribution that
builds against torch with cmake, nanobind and protobuf; this index needs numpy only.
"""

from __future__ import annotations

import bisect
import sys
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

SENTINEL = -1
DEFAULT_LEVELS = (1, 4, 16)
DEFAULT_TAIL = 8192  # (key, position) pairs a level keeps unsorted before sorting them into a run
_MASK = (1 << 64) - 1
_BASE = 0x9E3779B97F4A7C15  # odd: the hash is sum((t_i + 1) * BASE^(k-1-i)) mod 2^64
_MAX_TOKEN = (1 << 31) - 2
_EMPTY = np.empty(0, dtype=np.int64)
_PY_KEYS = 8  # new tokens up to which a document's keys are hashed in plain Python
_PY_ROWS = 24  # occurrences left when the walk goes from numpy to plain Python
_PY_BACK = 4  # occurrences up to which a match is extended backwards in plain Python
_DOC_BYTES = 120  # estimate per document of the Python table (dict slot, [start, length] list, ints)
_RECENT_MAX = 1024  # pairs a level's dict of recent pairs holds at most (~200 bytes each) before a flush
_RECENT_KEY_BYTES = 170  # estimate per key of a level's dict of recent pairs (its slot, the int, the list)
_RECENT_POS_BYTES = 36  # estimate per position there (the int, its list slot); both checked with tracemalloc


class _Level:
    """The positions of one n-gram length k, keyed by the hash of the k tokens before them."""

    __slots__ = ("k", "pow", "runs", "tail_k", "tail_p", "tail_n", "tail_max", "recent", "recent_n")

    def __init__(self, k: int, tail_max: int):
        self.k = k
        self.pow = np.array([pow(_BASE, k - 1 - i, 1 << 64) for i in range(k)], dtype=np.uint64)
        self.runs: list[tuple[np.ndarray, np.ndarray]] = []  # oldest first; each sorted by (key, position)
        self.tail_k = np.empty(0, dtype=np.uint64)
        self.tail_p = np.empty(0, dtype=np.int32)
        self.tail_n = 0
        self.tail_max = tail_max
        # A step's few new pairs go to a dict instead (key -> positions, oldest first), part of
        # the tail: a request's own index grows by a token or two every step and is looked up
        # every step, and a dict append and a dict get cost a fraction of the numpy calls of an
        # array push and a scan (in the engine's loop, right after the target's forward, numpy's
        # small calls run several times slower than alone). Whole documents stay on the arrays: a
        # dict takes several times as long to fill and an order of magnitude more memory.
        self.recent: dict[int, list[int]] = {}
        self.recent_n = 0

    def hash(self, gram: Sequence[int]) -> int:
        if self.k == 1:
            return gram[0] + 1
        h = 0
        for t in gram:
            h = (h * _BASE + t + 1) & _MASK
        return h

    def keys(self, tok: np.ndarray, p0: int, p1: int) -> np.ndarray:
        """Keys of positions p0 .. p1 - 1 (each with k document tokens before it)."""
        if self.k == 1:
            return tok[p0 - 1:p1 - 1].astype(np.uint64) + np.uint64(1)
        seg = tok[p0 - self.k:p1 - 1].astype(np.uint64) + np.uint64(1)
        return sliding_window_view(seg, self.k) @ self.pow

    def push_recent(self, keys: list[int], pos: list[int]) -> None:
        """A few new pairs (plain ints; positions above every one held), into the dict."""
        if self.tail_n + self.recent_n + len(keys) > self.tail_max or self.recent_n + len(keys) > _RECENT_MAX:
            self._flush()
        recent = self.recent
        for h, p in zip(keys, pos):
            got = recent.get(h)
            if got is None:
                recent[h] = [p]
            else:
                got.append(p)
        self.recent_n += len(keys)

    def push(self, keys: np.ndarray, pos: np.ndarray) -> None:
        m = len(keys)
        if self.tail_n + self.recent_n + m > self.tail_max:
            self._flush()
        if m >= self.tail_max:
            order = np.argsort(keys, kind="stable")
            self._add_run(keys[order], pos[order])
            return
        need = self.tail_n + m
        if need > len(self.tail_k):
            cap = min(self.tail_max, max(64, 2 * need))
            self.tail_k = np.resize(self.tail_k, cap)
            self.tail_p = np.resize(self.tail_p, cap)
        self.tail_k[self.tail_n:need] = keys
        self.tail_p[self.tail_n:need] = pos
        self.tail_n = need

    def _flush(self) -> None:
        keys, pos = self.tail_k[:self.tail_n], self.tail_p[:self.tail_n]
        if self.recent_n:
            rk, rp = self._recent_arrays()
            keys, pos = np.concatenate((keys, rk)), np.concatenate((pos, rp))
            self.recent, self.recent_n = {}, 0
        if len(keys):
            order = np.lexsort((pos, keys))  # by key, then position (the arrays' and the dict's interleave)
            self._add_run(keys[order], pos[order])
            self.tail_n = 0

    def _recent_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        keys = np.fromiter((h for h, ps in self.recent.items() for _ in ps), dtype=np.uint64, count=self.recent_n)
        pos = np.fromiter((p for ps in self.recent.values() for p in ps), dtype=np.int32, count=self.recent_n)
        return keys, pos

    def _add_run(self, keys: np.ndarray, pos: np.ndarray) -> None:
        self.runs.append((keys, pos))
        self._settle()

    def _settle(self) -> None:
        # Positions only grow with time (a document is appended at the arena's end), so an older
        # run's positions are all below a newer one's: a stable sort of the concatenated keys
        # (timsort: a linear merge of the two sorted runs) keeps (key, position) order.
        runs = self.runs
        while len(runs) >= 2 and len(runs[-2][0]) <= len(runs[-1][0]):
            (ka, pa), (kb, pb) = runs[-2], runs[-1]
            keys = np.concatenate((ka, kb))
            order = np.argsort(keys, kind="stable")
            runs[-2:] = [(keys[order], np.concatenate((pa, pb))[order])]

    def lookup(self, h: int, limit: int) -> np.ndarray:
        """The positions keyed h, oldest first, at most the `limit` most recent."""
        parts = []
        got = 0
        recent = self.recent.get(h)
        if self.tail_n:
            hit = np.flatnonzero(self.tail_k[:self.tail_n] == np.uint64(h))
            if hit.size:
                if recent is not None:  # both hold some: one list, in position order
                    parts.append(np.sort(np.concatenate((self.tail_p[hit], np.array(recent, dtype=np.int32)))))
                    recent = None
                else:
                    parts.append(self.tail_p[hit])
                got += len(parts[0])
        if recent is not None:
            parts.append(np.array(recent, dtype=np.int32))
            got += len(recent)
        if got < limit and self.runs:
            probe = np.array([h, h + 1] if h < _MASK else [h], dtype=np.uint64)
            for keys, pos in reversed(self.runs):
                lohi = keys.searchsorted(probe)
                lo, hi = int(lohi[0]), (int(lohi[1]) if h < _MASK else len(keys))
                if hi > lo:
                    take = min(hi - lo, limit - got)
                    parts.append(pos[hi - take:hi])
                    got += take
                    if got >= limit:
                        break
        if not parts:
            return _EMPTY
        parts.reverse()
        out = np.concatenate(parts) if len(parts) > 1 else parts[0]
        return out[-limit:].astype(np.int64)

    def cut(self, fix) -> None:
        """Drop the positions of removed documents and shift the rest: fix(pos) -> (keep, new pos)."""
        runs = []
        for keys, pos in self.runs:
            keep, new = fix(pos)
            if keep.all():
                runs.append((keys, new))
            elif keep.any():
                runs.append((keys[keep], new[keep]))
        self.runs = runs
        self._settle()
        if self.tail_n:
            keep, new = fix(self.tail_p[:self.tail_n])
            n = int(keep.sum())
            self.tail_k[:n] = self.tail_k[:self.tail_n][keep]
            self.tail_p[:n] = new[keep]
            self.tail_n = n
        if len(self.tail_k) > 64 and 4 * self.tail_n < len(self.tail_k):
            cap = max(64, 2 * self.tail_n)
            self.tail_k = self.tail_k[:cap].copy()
            self.tail_p = self.tail_p[:cap].copy()
        if self.recent_n:
            keys, pos = self._recent_arrays()
            keep, new = fix(pos)
            self.recent, self.recent_n = {}, 0
            self.push_recent(keys[keep].tolist(), new[keep].tolist())

    def nbytes(self) -> int:
        return (sum(k.nbytes + p.nbytes for k, p in self.runs) + self.tail_k.nbytes + self.tail_p.nbytes
                + _RECENT_KEY_BYTES * len(self.recent) + _RECENT_POS_BYTES * self.recent_n)


class SuffixIndex:
    """Token-id documents, searchable for the continuation of a context's longest match.

    `levels`: the n-gram lengths indexed (1 is always added); a lookup costs a binary search
    per level tried, memory 12 bytes per token per level. `tail_max`: pairs kept unsorted per
    level (a lookup scans them linearly; small values exercise the merging in tests).
    """

    def __init__(self, levels: Iterable[int] = DEFAULT_LEVELS, tail_max: int = DEFAULT_TAIL):
        ks = sorted({1, *(int(k) for k in levels)})
        if ks[0] < 1:
            raise ValueError(f"levels must be positive n-gram lengths, got {ks}")
        if tail_max < 1:
            raise ValueError("tail_max must be >= 1")
        self._levels = [_Level(k, tail_max) for k in ks]
        self._tok = np.full(64, SENTINEL, dtype=np.int32)  # arena; [0] and each document's end: SENTINEL
        self._used = 1  # arena length in use (the next document starts here)
        self._docs: dict[Hashable, list[int]] = {}  # doc_id -> [start, length], in arena order
        self._ntok = 0

    # ---- contents ---------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._docs)

    def __contains__(self, doc_id: Hashable) -> bool:
        return doc_id in self._docs

    @property
    def num_tokens(self) -> int:
        return self._ntok

    @property
    def levels(self) -> tuple[int, ...]:
        return tuple(lev.k for lev in self._levels)

    def doc_ids(self) -> list[Hashable]:
        """Document ids, oldest (least recently added or moved) first."""
        return list(self._docs)

    def tokens(self, doc_id: Hashable) -> list[int]:
        start, n = self._docs[doc_id]
        return self._tok[start:start + n].tolist()

    def size_bytes(self) -> int:
        """Memory held: the arena's and every level's numpy arrays (allocated capacity, not
        only what is used) plus an estimate for the document table. Not counted: the
        transient copies while runs merge (at most the size of the largest level)."""
        return (self._tok.nbytes + sum(lev.nbytes() for lev in self._levels)
                + sys.getsizeof(self._docs) + _DOC_BYTES * len(self._docs) + 512)

    # ---- updates ----------------------------------------------------------------------

    def add(self, doc_id: Hashable, tokens: Sequence[int]) -> None:
        """Add a whole document (replacing one of the same id). Amortised O(len * log n)."""
        arr = _as_tokens(tokens)
        if doc_id in self._docs:
            self.remove(doc_id)
        start, m = self._used, len(arr)
        self._reserve(start + m + 1)
        self._tok[start:start + m] = arr
        self._tok[start + m] = SENTINEL
        self._used = start + m + 1
        self._docs[doc_id] = [start, m]
        self._ntok += m
        self._index(start, 0, m)

    def extend(self, doc_id: Hashable, tokens: Sequence[int]) -> None:
        """Append tokens to a document (creating it if new). O(new tokens) amortised for the
        most recently added document; an older one is moved to the end first (O(n))."""
        if doc_id not in self._docs:
            self.add(doc_id, tokens)
            return
        arr = _few_tokens(tokens)
        if arr is None:
            arr = _as_tokens(tokens)
        if not len(arr):
            return
        start, n = self._docs[doc_id]
        if start + n + 1 != self._used:  # not the last document: move it to the end
            old = self._tok[start:start + n].copy()
            self.remove(doc_id)
            self.add(doc_id, np.concatenate((old, arr)))
            return
        m = len(arr)
        self._reserve(self._used + m)
        self._tok[start + n:start + n + m] = arr
        self._tok[start + n + m] = SENTINEL
        self._used += m
        self._docs[doc_id][1] = n + m
        self._ntok += m
        self._index(start, n, n + m)

    def remove(self, doc_id: Hashable) -> None:
        """Drop a document; KeyError if absent. O(n) vectorised; size_bytes falls at once."""
        self.remove_many([doc_id])

    def remove_many(self, doc_ids: Iterable[Hashable]) -> None:
        """Drop several documents in one pass over the index (KeyError if one is absent)."""
        ids = list(dict.fromkeys(doc_ids))
        for d in ids:
            if d not in self._docs:
                raise KeyError(d)
        if not ids:
            return
        spans = sorted((self._docs[d][0], self._docs[d][0] + self._docs[d][1] + 1) for d in ids)
        for d in ids:
            self._ntok -= self._docs.pop(d)[1]
        # the arena: keep what lies between the removed spans
        old_used = self._used
        pieces, prev = [], 0
        for a, b in spans:
            pieces.append(self._tok[prev:a])
            prev = b
        pieces.append(self._tok[prev:old_used])
        kept = np.concatenate(pieces)
        self._used = len(kept)
        cap = len(self._tok)
        while cap > 64 and 4 * (self._used + 1) < cap:
            cap //= 2
        tok = np.full(cap, SENTINEL, dtype=np.int32)
        tok[:self._used] = kept
        self._tok = tok
        starts = [a for a, _ in spans]
        shift = [0]
        for a, b in spans:
            shift.append(shift[-1] + b - a)
        for entry in self._docs.values():
            entry[0] -= shift[bisect.bisect_right(starts, entry[0])]
        if len(spans) == 1:  # one span (the common eviction): a comparison per position
            (a, b), = spans
            n = np.int32(b - a)

            def fix(pos):
                after = pos >= b
                return after | (pos < a), np.where(after, pos - n, pos)
        else:  # a map from old to new positions (-1: removed)
            mask = np.ones(old_used, dtype=bool)
            for a, b in spans:
                mask[a:b] = False
            newpos = (np.cumsum(mask, dtype=np.int32) - 1).astype(np.int32)
            newpos[~mask] = -1

            def fix(pos):
                new = newpos[pos]
                return new >= 0, new
        for lev in self._levels:
            lev.cut(fix)

    def evict_oldest(self, max_bytes: int, keep: Iterable[Hashable] = ()) -> list[Hashable]:
        """Remove the oldest documents (except those in `keep`) until size_bytes() <= max_bytes,
        in as few passes as the estimate allows (usually one: removal is O(n) whatever its
        size, so a caller evicting to below its cap, e.g. 90% of it, evicts rarely).
        Returns the removed ids."""
        keep = set(keep)
        removed: list[Hashable] = []
        while self.size_bytes() > max_bytes:
            size, base = self.size_bytes(), SuffixIndex().size_bytes()
            units = self._ntok + len(self._docs)
            per = (size - base) / units if units else 0.0
            need, drop = size - max_bytes, []
            for d, (_, n) in self._docs.items():
                if need <= 0:
                    break
                if d not in keep:
                    drop.append(d)
                    need -= per * (n + 1)
            if not drop:
                break
            self.remove_many(drop)
            removed += drop
        return removed

    def clear(self) -> None:
        self.__init__(self.levels, self._levels[0].tail_max)

    def _reserve(self, n: int) -> None:
        """Room for n arena entries plus one spare sentinel (gathers clamp to used - 1)."""
        if n + 1 > len(self._tok):
            cap = len(self._tok)
            while cap < n + 1:
                cap *= 2
            tok = np.full(cap, SENTINEL, dtype=np.int32)
            tok[:self._used] = self._tok[:self._used]
            self._tok = tok

    def _index(self, start: int, old_len: int, new_len: int) -> None:
        """Key the positions new to a document that grew from old_len to new_len tokens."""
        small = new_len - old_len <= _PY_KEYS  # a step's few tokens: hashing in Python is cheaper
        if small:
            lo = start + max(0, old_len + 1 - self._levels[-1].k)
            seq = self._tok[lo:start + new_len].tolist()
        for lev in self._levels:
            p0 = start + max(old_len + 1, lev.k)
            p1 = start + new_len + 1
            if p0 >= p1:
                continue
            if small:
                k = lev.k
                lev.push_recent([lev.hash(seq[p - k - lo:p - lo]) for p in range(p0, p1)], list(range(p0, p1)))
            else:
                lev.push(lev.keys(self._tok, p0, p1), np.arange(p0, p1, dtype=np.int32))

    # ---- queries ----------------------------------------------------------------------

    def propose(self, context: Sequence[int], max_tokens: int, min_match: int = 1, max_context: int = 32,
                max_occurrences: int = 256, prior: float = 1.0,
                per_context: bool = False) -> tuple[list[int], list[float], int]:
        """(tokens, confidence per token, match length) continuing `context`; see the module
        docstring. Nothing ([], [], 0) when the longest match is shorter than min_match."""
        return propose_from([self], context, max_tokens, min_match, max_context, max_occurrences, prior,
                            per_context)

    def _match(self, ctx: list[int], rev: np.ndarray, limit: int, floor: int = 0) -> tuple[int, np.ndarray]:
        """(longest match length, the positions after its occurrences that have a next token);
        (0, none) when it is shorter than `floor` (another index's match) may be all it says."""
        L = len(ctx)
        back = np.arange(1, L + 1)
        for lev in reversed(self._levels):
            if lev.k > L:
                continue
            best, pos = self._match_at(lev, ctx, rev, back, limit)
            if best >= lev.k:
                return best, pos
            if lev.k <= floor:  # every match of floor tokens or more was among this level's
                break
        return 0, _EMPTY

    def _match_at(self, lev: _Level, ctx: list[int], rev: np.ndarray, back: np.ndarray,
                  limit: int) -> tuple[int, np.ndarray]:
        """The longest match among the occurrences of ctx's last lev.k tokens (0 if none)."""
        k = lev.k
        pos = lev.lookup(lev.hash(ctx[len(ctx) - k:]), limit)
        if pos.size <= _PY_BACK:  # a few occurrences (the usual at the longer levels): plain Python
            best, found = self._extend_back_few(pos.tolist(), ctx)
            return best, np.array(found, dtype=np.int64)
        pos = pos[self._tok[pos] >= 0]
        if not pos.size:
            return 0, _EMPTY
        ext = self._extend_back(pos, rev, back, max(8, k))
        best = int(ext.max())
        return best, pos[ext == best]

    def _extend_back_few(self, pos: list[int], ctx: list[int]) -> tuple[int, list[int]]:
        """_extend_back for a few positions, in plain Python: (the longest run of tokens before
        a position that equals the end of ctx, the positions with that run), positions
        without a next token left out."""
        tok, L = self._tok, len(ctx)
        best, found = 0, []
        for p in pos:
            if tok[p] < 0:
                continue
            n = 0
            for a, b in zip(reversed(tok[max(0, p - L):p].tolist()), reversed(ctx)):
                if a != b:
                    break
                n += 1
            if n > best:
                best, found = n, [p]
            elif n == best:
                found.append(p)
        return best, found

    def _extend_back(self, pos: np.ndarray, rev: np.ndarray, back: np.ndarray, first: int) -> np.ndarray:
        """How many tokens before each position equal rev (the context reversed), capped at
        len(rev): compared in blocks of doubling width (the first `first` wide), only rows
        still matching go on."""
        tok, L = self._tok, len(rev)
        ext = np.zeros(len(pos), dtype=np.int64)
        rows = np.arange(len(pos))
        j0, w = 0, first
        while rows.size and j0 < L:
            j1 = min(L, j0 + w)
            idx = pos[rows, None] - back[j0:j1]
            np.maximum(idx, 0, out=idx)
            eq = tok[idx] == rev[j0:j1]
            full = eq.all(axis=1)
            ext[rows] = j0 + np.where(full, j1 - j0, eq.argmin(axis=1))
            rows = rows[full]
            j0, w = j1, 2 * w
        return ext

    def _window(self, pos: np.ndarray, width: int) -> np.ndarray:
        idx = pos[:, None] + np.arange(width)
        np.minimum(idx, self._used - 1, out=idx)  # past the arena: its last sentinel
        return self._tok[idx]


class Continuations:
    """What followed every occurrence of a match: one row per occurrence, the `width` tokens
    after it (SENTINEL past its document's end), walked into a chain by `walk`. Kept by a
    caller that may choose the first token itself (the suffix proposer, when the next-token
    head has a say: dflash.engine.proposers.suffix)."""

    __slots__ = ("win", "match", "prior", "per_context")

    def __init__(self, win: np.ndarray, match: int, prior: float, per_context: bool):
        self.win = win
        self.match = match  # the match's length
        self.prior = prior
        self.per_context = per_context

    def pseudo(self, i: int) -> float:
        """The pseudo-count at chain position i (0-based): module docstring, Confidence."""
        return self.prior / (self.match + i) if self.per_context else self.prior

    def first(self) -> tuple[np.ndarray, np.ndarray]:
        """The tokens that followed at the first position (ascending) and how often each did."""
        col = self.win[:, 0]
        return np.unique(col[col >= 0], return_counts=True)

    def walk(self, max_tokens: int, first: int | None = None,
             first_confidence: float | None = None) -> tuple[list[int], list[float]]:
        """The chain of at most `max_tokens` (the most frequent next token at each position,
        module docstring) and each position's confidence; `first` (one of `first()`'s tokens)
        instead of the most frequent at the first position, with `first_confidence`."""
        win = self.win
        tokens: list[int] = []
        conf: list[float] = []
        i = 0
        if first is not None and max_tokens > 0:
            tokens.append(int(first))
            conf.append(float(first_confidence))
            win = win[win[:, 0] == first]
            i = 1
        while i < max_tokens and len(win) > _PY_ROWS:  # many occurrences: numpy column by column
            col = win[:, i]
            nxt = col[col >= 0]
            if not nxt.size:
                return tokens, conf
            vals, counts = np.unique(nxt, return_counts=True)
            j = int(counts.argmax())  # the first maximum: the smallest token id
            t = int(vals[j])
            tokens.append(t)
            conf.append(int(counts[j]) / (nxt.size + self.pseudo(i)))
            win = win[col == t]
            i += 1
        rows = win[:, i:].tolist()  # few: plain Python
        for j in range(max_tokens - i):
            if len(rows) == 1:  # one occurrence left: its tokens up to its document's end
                for t in rows[0][j:]:
                    if t < 0:
                        break
                    conf.append(1.0 / (1.0 + self.pseudo(len(tokens))))
                    tokens.append(t)
                break
            counts = Counter(r[j] for r in rows if r[j] >= 0)
            if not counts:
                break
            c = max(counts.values())
            t = min(t for t, n in counts.items() if n == c)
            tokens.append(t)
            conf.append(c / (counts.total() + self.pseudo(len(tokens) - 1)))
            rows = [r for r in rows if r[j] == t]
        return tokens, conf


def continuations_from(indexes: Sequence[SuffixIndex], context: Sequence[int], max_tokens: int,
                       min_match: int = 1, max_context: int = 32, max_occurrences: int = 256,
                       prior: float = 1.0, per_context: bool = False) -> Continuations | None:
    """The longest match of `context`'s suffix over several indexes as if their documents
    were one set, and the `max_tokens` tokens after each of its occurrences (at most
    `max_occurrences` per index); None when it is shorter than `min_match`."""
    if max_tokens <= 0 or max_context <= 0:
        return None
    ctx = [int(t) for t in context[-max_context:]]
    neg = [i for i, t in enumerate(ctx) if t < 0]
    if neg:  # a negative id is no token (and would match the sentinel): match after it only
        ctx = ctx[neg[-1] + 1:]
    if not ctx:
        return None
    rev = np.array(ctx[::-1], dtype=np.int64)
    best, found = 0, []
    for ix in indexes:
        n, pos = ix._match(ctx, rev, max_occurrences, best)
        if n > best:
            best, found = n, [(ix, pos)]
        elif n == best and n:
            found.append((ix, pos))
    if best < max(1, min_match):
        return None
    wins = [ix._window(pos, max_tokens) for ix, pos in found]
    return Continuations(np.concatenate(wins) if len(wins) > 1 else wins[0], best, prior, per_context)


def propose_from(indexes: Sequence[SuffixIndex], context: Sequence[int], max_tokens: int, min_match: int = 1,
                 max_context: int = 32, max_occurrences: int = 256,
                 prior: float = 1.0, per_context: bool = False) -> tuple[list[int], list[float], int]:
    """`SuffixIndex.propose` over several indexes as if their documents were one set: the
    longest match over all of them, the counts summed over the occurrences in each.
    `max_occurrences` bounds the occurrences looked at per index; `per_context`: the
    pseudo-count shrinks with the context agreed on (module docstring)."""
    found = continuations_from(indexes, context, max_tokens, min_match, max_context, max_occurrences, prior,
                               per_context)
    if found is None:
        return [], [], 0
    tokens, conf = found.walk(max_tokens)
    return tokens, conf, found.match


def _few_tokens(tokens) -> list[int] | None:
    """A list of a few valid token ids as it is (checked in plain Python, cheaper than numpy
    for a step's tokens); None for anything else."""
    if type(tokens) is list and len(tokens) <= _PY_KEYS and all(
            type(t) is int and 0 <= t <= _MAX_TOKEN for t in tokens):
        return tokens
    return None


def _as_tokens(tokens: Sequence[int]) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"a document is a 1-d sequence of token ids, got shape {arr.shape}")
    if not arr.size:
        return np.empty(0, dtype=np.int32)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN:
        raise ValueError(f"token ids must lie in [0, {_MAX_TOKEN}]")
    return arr.astype(np.int32, copy=False)
