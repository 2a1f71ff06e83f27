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
def _lookup(indexes: list[SuffixIndex], prompt_ids: list[int], output_ids: list[int],
            max_tokens: int, cfg: SpeculativeConfig) -> Continuations | None:
    n, out_n = cfg.suffix_max_context, len(output_ids)
    context = output_ids[-n:] if out_n >= n else prompt_ids[-(n - out_n):] + output_ids
    # Confidences shrink with the context agreed on (suffix_index, `per_context`): a chain after a
    # one-token match is kept far less often than one after a long match, though each may rest
    # on a single earlier occurrence.
    return continuations_from(indexes, context, max_tokens, min_match=cfg.suffix_min_match, max_context=n,
                              per_context=True)


def chain(indexes: list[SuffixIndex], prompt_ids: list[int], output_ids: list[int],
          max_tokens: int, cfg: SpeculativeConfig = SpeculativeConfig()) -> tuple[list[int], list[float]]:
    """The proposal after prompt + output so far: the continuation of the longest earlier
    match of its last `suffix_max_context` tokens (at least `suffix_min_match`), at most
    `suffix_spec_factor` times as long as the match, and each position's confidence. (The
    bench's ceiling replays it.)"""
    found = _lookup(indexes, prompt_ids, output_ids, max_tokens, cfg)
    most = _longest(found, max_tokens, cfg)
    return found.walk(most) if most > 0 else ([], [])


def _longest(found: Continuations | None, max_tokens: int, cfg: SpeculativeConfig) -> int:
    """The longest chain a lookup may propose: at most `suffix_spec_factor` times its match (0: none)."""
    return 0 if found is None else min(max_tokens, cfg.suffix_spec_factor * found.match)


def head_choice(tokens: np.ndarray, counts: np.ndarray, probs: np.ndarray, pseudo: float,
                floor: float = SpeculativeConfig.suffix_head_floor) -> tuple[int, float]:
    """The first token among `tokens` (that followed `counts` times each) given the head's
    probability of each: the most occurrences × (probability + `floor`); its confidence that
    score's share of all candidates' times n / (n + `pseudo`) (SpeculativeConfig says why)."""
    score = counts * (probs + floor)
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
    lead: int = 0  # the forced tokens it starts with (the lookup went on from after them)
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
        """A chain was verified: its workload's pooled calibration learns from it (past the
        forced run it started with, if any, which the step leaves out: those are certain)."""
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
        its committed suffix, from its own tokens or its workload's past outputs. Where the
        state's answer form forces a run of tokens from here (a JSON key), the chain starts
        with that run, at confidence 1, and continues what followed the run's earlier
        occurrences (the value a table's rows repeat after that key)."""
        out = []
        for state, D in items:
            t = time.perf_counter()
            ps = state.proposals[NAME]
            self.catch_up(state)
            lead = state.constraint.forced()[: D - 1] if state.constraint is not None else []
            room = D - 1 - len(lead)
            indexes = [ps.own] if ps.workload is None else [ps.own, ps.workload.index]
            ps.found = found = _lookup(indexes, state.prompt_ids, state.output_ids + lead if lead else state.output_ids,
                                       room, self.cfg) if room > 0 else None
            ps.first = None
            ps.most = _longest(found, room, self.cfg)
            tokens, confidence = found.walk(ps.most) if ps.most > 0 else ([], [])
            # A forced run alone is the forced proposer's offer; a chain carries it only where
            # something follows it.
            ps.lead = len(lead) if tokens else 0
            self.price.add(time.perf_counter() - t)
            out.append(_draft(lead + tokens, [1.0] * len(lead) + confidence, len(lead)) if tokens else _draft([], []))
        return out

    @staticmethod
    def choices(state) -> np.ndarray | None:
        """The tokens that followed the state's last proposal's match at the first position,
        where its occurrences went more than one way (else None; and where a forced run comes
        first, whose first token is no choice)."""
        ps = state.proposals[NAME]
        if ps.found is None or not ps.most or ps.lead:
            return None
        if ps.first is None:
            ps.first = ps.found.first()
        return ps.first[0] if len(ps.first[0]) > 1 else None

    def rechoose(self, state, probs: np.ndarray) -> Draft:
        """The state's last proposal again, its first token chosen with the head's
        probability of each of `choices(state)` (`head_choice`)."""
        ps = state.proposals[NAME]
        tokens, counts = ps.first
        first, confidence = head_choice(tokens, counts, probs, ps.found.pseudo(0), self.cfg.suffix_head_floor)
        return _draft(*ps.found.walk(ps.most, first, confidence))

    def _pool(self, workload) -> tuple[list[float], list[float]]:
        pool = self.pools.get(workload)
        if pool is None:
            pool = self.pools[workload] = ([0.0] * self.bins, [0.0] * self.bins)
            while len(self.pools) > self.cfg.suffix_max_pools:
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


def _draft(tokens: list[int], confidence: list[float], certain: int = 0) -> Draft:
    # (through numpy: torch.tensor of a short Python list costs several times as much, every step)
    return Draft(torch.from_numpy(np.array(tokens, dtype=np.int64)), None, list(confidence), certain)
