"""Per-request decode state and the result of one step: data, no behaviour.

A `DecodeState` holds everything one request is between steps: its ids, its target
sequence (a handle: the KV memory belongs to the target backend), each proposer's state,
its random generator, its block-length policy and statistics. Nothing is global, so the
engine steps any set of states together, each as if it ran alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from dflash.engine.sampling import SamplingParams
from dflash.engine.policy import BlockPolicy
from dflash.engine.stats import GenerationStats
from dflash.engine.stops import StopStrings


class AnswerConstraint(Protocol):
    """What a request's answer may be, as the step applies it (dflash.engine.grammar.Matcher
    implements it for json_schema, regex and choices): a constraint on verification, the
    same for every proposer's drafts. It never changes during `cut` or `masks`; only
    `advance` moves it, over committed tokens."""

    seconds: float  # the time its calls below took so far (the statistics' constraint_s)

    def cut(self, draft: list[int], sampled: bool) -> int:
        """How many of `draft`'s tokens to verify: a chosen chain stops before its first
        forbidden token; one `sampled` from a drafter's law for the probabilistic rule keeps
        it, to be rejected at its row."""

    def masks(self, draft: list[int]) -> torch.Tensor:
        """bool [len(draft) + 1, V]: the tokens allowed at each row a verify of `draft` scores."""

    def advance(self, tokens: list[int]) -> None:
        """The step committed these tokens."""

    def end_token(self) -> int | None:
        """The one token that must come next, where it ends the answer (the step commits it
        without a forward); None: the target's row decides."""

    def accepts_eos(self) -> bool:
        """Whether the output so far is a whole answer (else a cut output is truncated)."""

    def forced(self) -> list[int]:
        """The tokens that must come next, whatever the target prefers (empty: a choice)."""


@dataclass
class DecodeState:
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    stop_ids: frozenset[int]
    block_size: int  # the fixed verify length, or the largest one `auto` may choose
    policy: BlockPolicy | None  # None: every step verifies block_size tokens
    seq: object  # the target's sequence handle (its KV memory)
    generator: torch.Generator | None
    stats: GenerationStats
    stops: StopStrings | None = None
    workload: str | None = None  # whose past outputs it may draft from, and will join
    proposals: dict[str, object] = field(default_factory=dict)  # proposer name -> its state for this request
    output_ids: list[int] = field(default_factory=list)  # committed new tokens
    prefilled: int = 0  # prompt tokens in the target's cache
    finish_reason: str | None = None  # "stop" | "length" | "context" once done
    # What the answer may be (a json_schema, regex or choices); None: anything.
    constraint: AnswerConstraint | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt_ids)

    @property
    def length(self) -> int:
        """Committed tokens, prompt included; the last one is the next step's anchor."""
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass
class StepResult:
    anchor: int  # the last committed token before the step (-1: a prefill chunk)
    draft_ids: list[int]  # the drafts that were verified (verify_len - 1 of them)
    accepted: int
    next_token: int | None  # the target's own token after the accepted drafts (None: none yet)
    committed: list[int]  # what the step appended to the output (a stop may cut it short)
    draft_len: int  # block positions the drafter computed, anchor included (1: none)
    verify_len: int
    finish_reason: str | None
    prefilled: int = 0  # prompt tokens this step cached (a prefill chunk)
    proposer: str | None = None  # who drafted (None: a plain step)

    @property
    def is_prefill(self) -> bool:
        return self.prefilled > 0
