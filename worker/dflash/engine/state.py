"""Per-request decode state and the result of one step.

A `DecodeState` owns everything one request needs between steps: its ids, the target's
and the drafter's caches, the target features not yet fed to the drafter, its random
generator, its block-length policy and statistics. Nothing is global, so several
requests can take turns on one engine (the worker interleaves them step by step), and a
later batched forward can serve several states at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash.engine.config import SamplingParams
from dflash.engine.drafter import DFlashDrafter, DraftCache
from dflash.engine.policy import BlockPolicy
from dflash.engine.stats import GenerationStats
from dflash.engine.stops import StopStrings


@dataclass(frozen=True)
class DrafterInUse:
    """The drafter a state was started with, and what the loop needs of it. A hot swap
    (`Engine.swap_drafter`) replaces the engine's; a state already started keeps its own,
    with its cache, to the end."""

    model: DFlashDrafter
    mask_embeds: torch.Tensor  # the target's embedding of the mask token, one row per block slot
    name: str
    version: str | None  # dflash.engine.versions: a digest of the weights
    # The target's LM head in the drafter's dtype (the drafter borrows it). Drafts are only
    # proposals, so they may be computed in a cheaper dtype than the target's (bf16 on a
    # CPU with native bf16, for instance) without changing the output.
    head: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.mask_embeds.dtype

    def logits(self, context: torch.Tensor, anchor_embed: torch.Tensor, draft_len: int, positions: torch.Tensor,
               cache) -> torch.Tensor:
        """One drafter forward over [anchor, MASK * (draft_len - 1)] after the new context
        features [S, F]; returns fp32 logits of the draft_len - 1 drafted rows (the LM head runs
        on those rows only)."""
        block = torch.cat((anchor_embed.to(self.dtype), self.mask_embeds[: draft_len - 1]))[None]
        with torch.inference_mode():
            hidden = self.model(context.to(self.dtype)[None], block, positions, cache)
            return torch.nn.functional.linear(hidden[0, 1:], self.head).float()


@dataclass
class DecodeState:
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    stop_ids: frozenset[int]
    block_size: int  # the fixed verify length, or the largest one `auto` may choose
    policy: BlockPolicy | None  # None: every step verifies block_size tokens
    layer_ids: tuple[int, ...]  # target features to collect (empty: no drafter at all)
    target_cache: object
    draft_cache: DraftCache | None
    generator: torch.Generator | None
    stats: GenerationStats
    stops: StopStrings | None = None
    drafter: DrafterInUse | None = None  # None: the engine's current drafter
    output_ids: list[int] = field(default_factory=list)  # committed new tokens
    pending: list[torch.Tensor] = field(default_factory=list)  # features the drafter has not seen
    finish_reason: str | None = None  # "stop" | "length" | "context" once done

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def length(self) -> int:
        """Committed tokens, prompt included; the last one is the next step's anchor."""
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass
class StepResult:
    anchor: int  # the last committed token before the step
    draft_ids: list[int]  # the drafts that were verified (verify_len - 1 of them)
    accepted: int
    next_token: int  # the target's own token after the accepted drafts
    committed: list[int]  # what the step appended to the output (a stop may cut it short)
    draft_len: int  # block positions the drafter computed, anchor included (1: none)
    verify_len: int
    finish_reason: str | None
