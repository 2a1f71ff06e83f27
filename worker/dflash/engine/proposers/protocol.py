"""What proposes draft tokens: the `Proposer` protocol, the offer it makes, the draft.

A proposer is one file in this folder plus one line in registry.py. It keeps its own
per-request state (in `DecodeState.proposals[name]`), its calibration (calibration.py: how
its confidences become acceptance estimates, learned per request) and its price. Each step,
for every decoding state of block length `auto` with room for a draft, it may make an
`Offer`:

- a *ready* offer carries its draft (tokens, a confidence per position, point masses or
  distributions): proposers whose drafts cost nothing or a lookup (the suffix proposer's
  chains, the next-token head's guess, a grammar's forced tokens) draft before the policy
  chooses, which then sees what they propose;
- a *deferred* offer carries no draft: a model drafter (DFlash, a small draft model) drafts
  only when chosen, for the number of positions the policy picks at the step's prices, in
  one pass for every state that chose it (`propose`); the policy then picks how many of its
  drafts to verify from its confidences.

A deferred proposer owns its price: `priced(prices)` gives the step's prices with its drafts
at what they cost (the DFlash drafter's passes are what the device's cost curve times; a draft
model measures its own forwards), and the policy of a request it joined weighs its drafts by
that. The policy (dflash.engine.policy) chooses among the offers, by name only; the step never
names a proposer. After the target verifies, `observe` hands a feature-reading proposer the
target features of the rows that entered the target's cache for good (the anchor and the
accepted drafts, or a prefill chunk), and `outcome` tells the proposer that made a chosen
offer how it fared (a proposer learning across requests keeps that).

A draft carries, per proposed token, the proposer's distribution when it sampled from one
(`probs`, for the probabilistic verify rule) or None for a point mass (a deterministic
proposal, verified by the strict rule when sampling), a confidence per position, and how
many of its first tokens are certain (forced by the request's grammar).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from dflash.engine.costs import Prices
    from dflash.engine.state import DecodeState


@dataclass
class Draft:
    tokens: torch.Tensor  # [D - 1] proposed token ids
    probs: torch.Tensor | None  # [D - 1, V] the distribution each was drawn from; None: point masses
    confidence: list[float] | None  # per position, in [0, 1]; None when nobody asked
    # Its first `certain` tokens are the only ones the request's answer form allows there (a
    # grammar's forced run): kept every time, so the policy counts them as such instead of
    # calibrating them, and leaves them out of the rate at which the request finds tokens.
    certain: int = 0


class RunningPrice:
    """A proposer's measured price per call, seconds: the mean of its first WINDOW calls,
    then a mean that follows the last WINDOW or so."""

    WINDOW = 100

    def __init__(self, start_s: float):
        self.s = start_s
        self.calls = 0

    def add(self, seconds: float) -> None:
        self.calls += 1
        self.s += (seconds - self.s) / min(self.calls, self.WINDOW)


@dataclass
class Offer:
    """One proposer's offer for one state this step."""

    name: str  # whose draft: the key of its calibration and of the statistics' drafts by proposer
    source: "Proposer"  # the proposer that made it (drafts a deferred offer; told its outcome)
    draft: Draft | None = None  # a ready offer's draft; None: deferred, drafted only if chosen
    price: RunningPrice | None = None  # a ready draft's price, already paid (read when it is verified)
    pending: int = 0  # deferred: rows of context the drafter must take in before its draft

    @property
    def deferred(self) -> bool:
        return self.draft is None


class Proposer(Protocol):
    name: str  # what requests' `proposers`, the statistics and status call it
    deferred: bool  # True: drafts only when chosen (a model drafter); False: offers ready drafts
    parts: tuple[str, ...]  # the names its offers carry (a composed proposer: its parts')

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """Target layers whose features a state started now will need (empty: none)."""

    def join(self, state: "DecodeState", request, allowed: set[str]) -> None:
        """Join a new request where it may (`allowed`: the names that may draft in it): put
        its per-request state in `state.proposals` under its name (its parts' names)."""

    def leave(self, state: "DecodeState") -> None:
        """The request is done with it: free what it holds outside Python (a draft model's
        sequence), if anything."""

    def priced(self, prices: "Prices") -> "Prices":
        """A deferred proposer's: this step's prices with its drafts (`draft_s`, by positions
        drafted) and each context row its next pass must take in (`context_row_s`) at what
        they cost it."""

    def calibrations(self, state: "DecodeState", request, prior) -> dict[str, object]:
        """Per offer name it may make in this request, a new calibration (calibration.py:
        PointMass or Drafter; `prior`: the request's per-position prior, policy.Prior)."""

    def layers_of(self, state: "DecodeState") -> tuple[int, ...]:
        """The target layers this state's proposer state reads (empty where it has none)."""

    def observe(self, state: "DecodeState", features: torch.Tensor | None) -> None:
        """Rows entered the target's cache for good; `features` are theirs."""

    def offer(self, items: list[tuple["DecodeState", int]]) -> list[Offer | None]:
        """Per (state, most): an offer of at most `most` positions (anchor included), or None."""

    def propose(self, items: list[tuple["DecodeState", int]]) -> list[Draft]:
        """One draft of D positions (anchor included) for each (state, D)."""

    def outcome(self, state: "DecodeState", offer: Offer, confidence: list[float], verify_len: int,
                accepted: int) -> None:
        """A chosen offer was verified: `verify_len` tokens, `accepted` drafts kept (past its
        certain drafts, which the step leaves out: `Draft.certain`)."""

    def status(self) -> dict | None:
        """What the worker's status shows of it (None: nothing)."""

    def part(self, name: str) -> "Proposer | None":
        """Itself, or its part (a composed proposer), of that name; None if neither."""


class BaseProposer:
    """The protocol's defaults, for a proposer that needs none of them: no features, nothing
    learned across requests, nothing to show."""

    deferred = False
    layer_ids: tuple[int, ...] = ()

    @property
    def parts(self) -> tuple[str, ...]:
        return (self.name,)

    def layers_of(self, state) -> tuple[int, ...]:
        return ()

    def leave(self, state) -> None:
        pass

    def priced(self, prices):
        """The cost curve's draft prices, which are the DFlash drafter's (the curve times its
        passes); a deferred proposer with another price gives its own."""
        return prices

    def observe(self, state, features) -> None:
        pass

    def outcome(self, state, offer, confidence, verify_len, accepted) -> None:
        pass

    def status(self) -> dict | None:
        return None

    def part(self, name: str):
        return self if name == self.name else None
