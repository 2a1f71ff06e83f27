"""The suffix proposer: drafts for free from what is already there.

It finds the longest suffix of a request's committed tokens that occurred before, in the
request's own prompt and output so far or in its workload's past outputs (the workload
memory, dflash.engine.workloads), and proposes what followed there, as a chain, with a
per-position confidence from the match counts (how many occurrences continued that way).
No model runs: its price is the lookup, which it measures. A proposal is a point mass
(`probs` None): the strict rule verifies it when sampling, so the target's law is kept.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from dflash.engine.calibration import bin_of, judged, shrink
from dflash.engine.knobs import SpeculativeConfig
from dflash.engine.proposers.protocol import BaseProposer, Draft, RunningPrice
from dflash.engine.proposers.suffix_index import Continuations, SuffixIndex, continuations_from

NAME = "suffix"
SELF = 0  # the document id of the request's own tokens in its index
MAX_CONTEXT = 32  # the longest suffix looked up
# The shortest match that proposes. 1: even a one-token match proposes what most often
# followed that token (in the request's text and its workload's memory), a bigram guess that
# the policy trusts only as far as its calibrated outcomes say, at a verify price that is
# nearly nothing for a row or two (ort: a plain step runs two rows anyway). Measured on a
# 2-core Zen 5 (ort, 128 new tokens; priced by the cost curve, steps replayed by the policy):
# 1 instead of 2 raised the `suffix` method's speedup over plain steps from 1.70 to 1.83 on
# agent, 2.05 to 2.15 on code, 1.25 to 1.30 on chat and 2.11 to 2.25 on `repetitive`.
MIN_MATCH = 1
SPEC_FACTOR = 2  # a chain is at most this many times as long as the match it continues
MAX_POOLS = 256  # workloads whose pooled calibration is kept (least recently used dropped)


# Where a match's occurrences went different ways at the first position and the next-token
# head (dflash.engine.proposers.head) is asked, the first token is the candidate with the most
# occurrences times (the head's probability + HEAD_FLOOR), and its confidence that score's
# share of all candidates' times n / (n + pseudo-count): the head breaks ties and overrules a
# thin majority, the floor keeps a token the head does not know (outside its vocabulary) in
# the running. Replayed on one bench run's greedy outputs (ort, Zen 4, 128 new tokens, the
# head's probabilities from the target's own features): the suffix policy's speedup over
# plain steps rose from 1.56 to 1.62 on code, 1.18 to 1.22 on chat, 1.51 to 1.54 on agent and
# 1.61 to 1.64 on `repetitive` (floor 0.05: 1.63 / 1.21 / 1.54 / 1.64; keeping the counts'
# confidence and only the head's pick: 1.59 / 1.20 / 1.52 / 1.62).
HEAD_FLOOR = 0.01


def _lookup(indexes: list[SuffixIndex], prompt_ids: list[int], output_ids: list[int],
            max_tokens: int) -> Continuations | None:
    out_n = len(output_ids)
    context = output_ids[-MAX_CONTEXT:] if out_n >= MAX_CONTEXT else (
        prompt_ids[-(MAX_CONTEXT - out_n):] + output_ids)
    # Confidences shrink with the context agreed on (suffix_index, `per_context`): a chain after a
    # one-token match and one after a match of 16 tokens, each from one earlier occurrence, were
    # kept 21-44 % and 87-98 % of the time, and both said 0.5 before.
    return continuations_from(indexes, context, max_tokens, min_match=MIN_MATCH, max_context=MAX_CONTEXT,
                              per_context=True)


def chain(indexes: list[SuffixIndex], prompt_ids: list[int], output_ids: list[int],
          max_tokens: int) -> tuple[list[int], list[float]]:
    """The proposal after prompt + output so far: the continuation of the longest earlier
    match of its last MAX_CONTEXT tokens (at least MIN_MATCH), at most SPEC_FACTOR times
    as long as the match, and each position's confidence. (The bench's ceiling replays it.)"""
    found = _lookup(indexes, prompt_ids, output_ids, max_tokens)
    most = _longest(found, max_tokens)
    return found.walk(most) if most > 0 else ([], [])


def _longest(found: Continuations | None, max_tokens: int) -> int:
    """The longest chain a lookup may propose: at most SPEC_FACTOR times its match (0: none)."""
    return 0 if found is None else min(max_tokens, SPEC_FACTOR * found.match)


def head_choice(tokens: np.ndarray, counts: np.ndarray, probs: np.ndarray, pseudo: float) -> tuple[int, float]:
    """The first token among `tokens` (that followed `counts` times each) given the head's
    probability of each, and its confidence (HEAD_FLOOR says how and why)."""
    score = counts * (probs + HEAD_FLOOR)
    j = int(score.argmax())
    n = int(counts.sum())
    return int(tokens[j]), float(score[j] / score.sum() * n / (n + pseudo))


@dataclass
class SuffixState:
    own: SuffixIndex  # the request's prompt and output so far
    indexed: int  # tokens of the request in `own`
    workload: object | None  # its workload's memory (dflash.engine.workloads.Workload), if any
    found: Continuations | None = None  # the last proposal's occurrences, for `choices` / `rechoose`
    most: int = 0  # the last proposal's longest chain (0: none)
    first: tuple[np.ndarray, np.ndarray] | None = None  # its first position's tokens and counts (when asked)


class SuffixProposer(BaseProposer):
    """The suffix proposer's part of a composed proposer (suffix_head.py): its chains are
    ready offers, point masses priced by their lookup."""

    name = NAME
    layer_ids: tuple[int, ...] = ()

    def __init__(self, workloads, cfg: SpeculativeConfig = SpeculativeConfig()):
        self.workloads = workloads
        self.cfg = cfg
        self.bins = cfg.calibration_bins
        self.price = RunningPrice(2e-4)  # one proposal's
        # Outcomes of its drafts by confidence bin, pooled over a workload's requests (decayed,
        # so they follow it): the start of each new request's calibration. Per workload (None:
        # requests without one), because how often a memory's continuation is right is a
        # property of the workload: a sampled workload's misses must not stop another's
        # repeated answers from being drafted.
        self.pools: OrderedDict[object, tuple[list[float], list[float]]] = OrderedDict()

    def outcome(self, state, offer, confidences: list[float], verify_len: int, accepted: int) -> None:
        """A chain was verified: its workload's pooled calibration learns from it."""
        self.learn(state.workload, confidences, verify_len, accepted)

    def start(self, state) -> SuffixState:
        own = SuffixIndex()
        own.add(SELF, list(state.prompt_ids))
        memory = self.workloads.get(state.workload) if state.workload is not None else None
        return SuffixState(own, len(state.prompt_ids), memory)

    @staticmethod
    def catch_up(state) -> None:
        """Index the tokens committed since the last call."""
        ps = state.proposals[NAME]
        new = state.output_ids[ps.indexed - len(state.prompt_ids):]
        if new:
            ps.own.extend(SELF, list(new))
            ps.indexed += len(new)

    def propose(self, items: list[tuple[object, int]]) -> list[Draft]:
        """For each (state, D): up to D - 1 tokens continuing the longest earlier match of
        its committed suffix, from its own tokens or its workload's past outputs."""
        out = []
        for state, D in items:
            t = time.perf_counter()
            ps = state.proposals[NAME]
            self.catch_up(state)
            indexes = [ps.own] if ps.workload is None else [ps.own, ps.workload.index]
            ps.found = found = _lookup(indexes, state.prompt_ids, state.output_ids, D - 1)
            ps.first = None
            ps.most = _longest(found, D - 1)
            tokens, confidence = found.walk(ps.most) if ps.most > 0 else ([], [])
            self.price.add(time.perf_counter() - t)
            out.append(_draft(tokens, confidence))
        return out

    @staticmethod
    def choices(state) -> np.ndarray | None:
        """The tokens that followed the state's last proposal's match at the first position,
        where its occurrences went more than one way (else None)."""
        ps = state.proposals[NAME]
        if ps.found is None or not ps.most:
            return None
        if ps.first is None:
            ps.first = ps.found.first()
        return ps.first[0] if len(ps.first[0]) > 1 else None

    @staticmethod
    def rechoose(state, probs: np.ndarray) -> Draft:
        """The state's last proposal again, its first token chosen with the head's
        probability of each of `choices(state)` (`head_choice`)."""
        ps = state.proposals[NAME]
        tokens, counts = ps.first
        first, confidence = head_choice(tokens, counts, probs, ps.found.pseudo(0))
        return _draft(*ps.found.walk(ps.most, first, confidence))

    def _pool(self, workload) -> tuple[list[float], list[float]]:
        pool = self.pools.get(workload)
        if pool is None:
            pool = self.pools[workload] = ([0.0] * self.bins, [0.0] * self.bins)
            while len(self.pools) > MAX_POOLS:
                self.pools.popitem(last=False)
        self.pools.move_to_end(workload)
        return pool

    def learn(self, workload, confidences: list[float], verify_len: int, accepted: int,
              decay: float = 0.999) -> None:
        """A suffix-drafted step's outcome, for its workload's pooled calibration."""
        acc, n = self._pool(workload)
        for i in range(judged(accepted, verify_len)):
            b = bin_of(confidences[i], self.bins)
            n[b] = n[b] * decay + 1
            acc[b] = acc[b] * decay + (i < accepted)

    def prior(self, workload, strength: float) -> tuple[list[float], list[float]]:
        """The workload's pooled calibration, shrunk to at most `strength` outcomes per bin."""
        acc, n = self.pools.get(workload) or ([0.0] * self.bins, [0.0] * self.bins)
        return shrink(acc, n, strength)


def _draft(tokens: list[int], confidence: list[float]) -> Draft:
    # (from numpy: torch.tensor of a short list took ~55 us a step in the loop, this ~18)
    return Draft(torch.from_numpy(np.array(tokens, dtype=np.int64)), None, list(confidence))
