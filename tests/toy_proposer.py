"""A toy proposer, the whole of it in one file (tests/test_proposers.py registers it): for
every state it offers the last committed token again, as many times as the step allows,
each position at confidence 1. Rarely right; it shows what a proposer is: `build`, and a
class offering drafts, calibrated like every other point mass."""

from __future__ import annotations

import torch

from dflash.engine.calibration import PointMass
from dflash.engine.proposers.protocol import BaseProposer, Draft, Offer, RunningPrice

NAME = "toy"


def build(engine) -> "Toy":
    return Toy(engine.config)


class Toy(BaseProposer):
    name = NAME

    def __init__(self, cfg):
        self.cfg = cfg
        self.price = RunningPrice(0.0)  # it looks nothing up
        self.verified = 0

    def join(self, state, request, allowed: set[str]) -> None:
        if NAME in allowed:
            state.proposals[NAME] = None  # nothing to keep per request

    def calibrations(self, state, request, prior, width: int) -> dict:
        return {NAME: PointMass(self.cfg, width)} if NAME in state.proposals else {}

    def offer(self, items):
        return [Offer(NAME, self, Draft(torch.full((most - 1,), state.output_ids[-1]), None, [1.0] * (most - 1)),
                      self.price) if NAME in state.proposals else None for state, most in items]

    def outcome(self, state, offer, confidence, verify_len, accepted) -> None:
        self.verified += 1

    def status(self) -> dict:
        return {"verified": self.verified}
