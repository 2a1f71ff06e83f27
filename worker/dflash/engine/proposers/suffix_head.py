"""The suffix proposer and the next-token head, composed: one proposer offering ready drafts.

Where the suffix proposer has a chain for a state, the chain is offered ("suffix"); where
the match's earlier occurrences went more than one way at its first position, the head's
distribution picks that first token (suffix.head_choice: the head says which continuation,
not whether one). Where it has none, the head's one-token guess is offered ("head"). The
head answers every state that needs it in one call (HeadProposer.distributions says why).
Each part joins a request on its own terms (`proposers` may name either; `proposals` false
keeps the suffix proposer out), is calibrated on its own outcomes and counted under its own
name in the statistics.
"""

from __future__ import annotations

from dflash.engine.calibration import PointMass
from dflash.engine.proposers import head as head_mod
from dflash.engine.proposers.head import HeadProposer
from dflash.engine.proposers.protocol import BaseProposer, Offer
from dflash.engine.proposers.suffix import SuffixProposer

NAME = "suffix_head"


def build(engine) -> "SuffixHead":
    return SuffixHead(SuffixProposer(engine.workloads, engine.config),
                      head_mod.for_target(engine.target, engine.head_dir), engine.config)


class SuffixHead(BaseProposer):
    name = NAME

    def __init__(self, suffix: SuffixProposer, head: HeadProposer | None, cfg):
        self.suffix, self.head, self.cfg = suffix, head, cfg

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(p.name for p in (self.suffix, self.head) if p is not None)

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.head.layer_ids if self.head is not None else ()

    def join(self, state, request, allowed: set[str]) -> None:
        if self.suffix.name in allowed and request.proposals:
            state.proposals[self.suffix.name] = self.suffix.start(state)
        if self.head is not None and self.head.name in allowed:
            state.proposals[self.head.name] = self.head.start(state)

    def calibrations(self, state, request, prior, width: int) -> dict:
        out = {}
        if self.suffix.name in state.proposals:
            # a seeded sample starts from no pooled outcomes, so the same seed gives the same output
            pooled = None if request.seed is not None else self.suffix.prior(request.workload,
                                                                              self.cfg.max_prior_strength)
            out[self.suffix.name] = PointMass(self.cfg, width, pooled)
        if self.head is not None and self.head.name in state.proposals:
            out[self.head.name] = PointMass(self.cfg, width)
        return out

    def layers_of(self, state) -> tuple[int, ...]:
        return self.head.layers_of(state) if self.head is not None else ()

    def observe(self, state, features) -> None:
        if self.head is not None and self.head.name in state.proposals:
            self.head.observe(state, features)

    def offer(self, items: list[tuple[object, int]]) -> list[Offer | None]:
        suffix, head = self.suffix, self.head
        out: list[Offer | None] = [None] * len(items)
        asked = [i for i, (state, most) in enumerate(items) if most > 1 and suffix.name in state.proposals]
        for i, chain in zip(asked, suffix.propose([items[i] for i in asked])):
            if len(chain.tokens):
                out[i] = Offer(suffix.name, suffix, chain, suffix.price)
        if head is None:
            return out
        guess_for, choose_for = [], []
        for i, (state, most) in enumerate(items):
            if most > 1 and head.name in state.proposals:
                if out[i] is None:
                    guess_for.append(i)
                elif (tokens := suffix.choices(state)) is not None:
                    choose_for.append((i, tokens))
        if not guess_for and not choose_for:
            return out
        probs = head.distributions([items[i][0] for i in guess_for] + [items[i][0] for i, _ in choose_for])
        for i, p in zip(guess_for, probs):
            if p is not None:
                out[i] = Offer(head.name, head, head.guess(p), head.price)
        for (i, tokens), p in zip(choose_for, probs[len(guess_for):]):
            if p is not None:
                out[i] = Offer(suffix.name, suffix, suffix.rechoose(items[i][0], head.probability_of(p, tokens)),
                               suffix.price)
        return out

    def part(self, name: str):
        return next((p for p in (self, self.suffix, self.head) if p is not None and p.name == name), None)

    def status(self) -> dict:
        return {p.name: p.status() for p in (self.suffix, self.head) if p is not None}
