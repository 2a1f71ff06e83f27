"""The forced-token proposer: where a request's answer has a form (json_schema, regex,
choices), the tokens its grammar forces from here are drafted for free.

After `{"name": "` of a schema's object, after an enum value's first letters, between a
date's digits, the grammar allows exactly one token, or one run of them: the state's
constraint (dflash.engine.state.AnswerConstraint) names that run, as the target's tokenizer
writes it (dflash.engine.grammar: LLGuidance's forced tokens, the one token its mask leaves
at each of their rows). They are offered as a ready draft with confidence 1: the verify's
mask there holds that token only, so the target takes it, greedy or sampled, and the
draft costs its verify rows and the lookup, nothing else: a certain draft (`Draft.certain`),
counted as kept by the policy and in the statistics' `forced_tokens`. A point mass (the
strict rule verifies it when sampling), so the target's masked law is kept.

It competes with the other proposers' offers at the policy's prices like any of them: the
suffix proposer's chain starts with the same run where one is forced and goes on past it
(the value a table's rows repeat after that key), so where it has a continuation it is
worth more and wins.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from dflash.engine.calibration import PointMass
from dflash.engine.proposers.protocol import BaseProposer, Draft, Offer, RunningPrice

NAME = "forced"


def build(engine) -> "Forced":
    return Forced(engine.config)


class Forced(BaseProposer):
    name = NAME

    def __init__(self, cfg):
        self.cfg = cfg
        self.price = RunningPrice(2e-5)  # one lookup of the forced run (LLGuidance: tens of microseconds)

    def join(self, state, request, allowed: set[str]) -> None:
        if NAME in allowed and state.constraint is not None:
            state.proposals[NAME] = None  # the state's constraint holds all it reads

    def calibrations(self, state, request, prior, width: int) -> dict:
        # (its drafts are certain: the policy counts them kept without asking the calibration)
        return {NAME: PointMass(self.cfg, width)} if NAME in state.proposals else {}

    def offer(self, items):
        out = []
        for state, most in items:
            if NAME not in state.proposals or most < 2:
                out.append(None)
                continue
            t = time.perf_counter()
            run = state.constraint.forced()[: most - 1]
            self.price.add(time.perf_counter() - t)
            out.append(Offer(NAME, self, Draft(torch.from_numpy(np.array(run, dtype=np.int64)), None,
                                               [1.0] * len(run), len(run)), self.price) if run else None)
        return out
