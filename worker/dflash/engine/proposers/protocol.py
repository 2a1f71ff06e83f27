"""What proposes draft tokens: the `Proposer` protocol and the draft it returns.

A proposer keeps its own per-request state (in `DecodeState.proposals[name]`): the DFlash
drafter its pending target features and draft cache, a suffix proposer its index. Each
step the policy asks some states for a draft of D block positions (the anchor, the last
committed token, plus D - 1 proposed tokens); the proposer answers for all of them at once,
so a model proposer can run one forward for several requests. After the target verifies,
`observe` hands it the target features of the rows that entered the target's cache for
good (the anchor and the accepted drafts, or a prefill chunk).

A draft carries, per proposed token, the proposer's distribution when it sampled from one
(`probs`, for the probabilistic verify rule) or None for a point mass (a deterministic
proposal, verified by the strict rule when sampling), and a confidence per position (the
block-length policy's input).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from dflash.engine.state import DecodeState


@dataclass
class Draft:
    tokens: torch.Tensor  # [D - 1] proposed token ids
    probs: torch.Tensor | None  # [D - 1, V] the distribution each was drawn from; None: point masses
    confidence: list[float] | None  # per position, in [0, 1]; None when nobody asked


class RunningPrice:
    """A proposer's measured price per call, seconds: the mean of its first 100 calls, then a
    mean that follows the last hundred or so."""

    def __init__(self, start_s: float):
        self.s = start_s
        self.calls = 0

    def add(self, seconds: float) -> None:
        self.calls += 1
        self.s += (seconds - self.s) / min(self.calls, 100)


class Proposer(Protocol):
    name: str

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """Target layers whose features a state started now will need (empty: none)."""

    def start(self, state: "DecodeState") -> object:
        """A new request's proposer state."""

    def layers_of(self, state: "DecodeState") -> tuple[int, ...]:
        """The target layers this state's proposer state reads."""

    def observe(self, state: "DecodeState", features: torch.Tensor | None) -> None:
        """Rows entered the target's cache for good; `features` are theirs."""

    def propose(self, items: list[tuple["DecodeState", int]]) -> list[Draft]:
        """One draft of D positions (anchor included) for each (state, D)."""
