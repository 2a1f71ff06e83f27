"""The DFlash drafter as a proposer: one drafter forward drafts a whole block, for several
requests at once.

Per request it keeps the drafter it started with (a hot swap changes the drafter of
requests started afterwards only), the drafter's KV cache of committed context and the
target features not yet fed to the drafter. A draft runs the drafter over
[anchor, MASK * (D - 1)] after those pending features; the LM head (borrowed from the
target) runs over the drafted rows only, one matmul for every request in the pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash.engine.drafter import DraftCache, DraftPart
from dflash.engine.proposers.protocol import Draft
from dflash.engine.sampling import sample, warp
from dflash.engine.versions import label as version_label
from dflash.engine.versions import model_digest

NAME = "dflash"


@dataclass(frozen=True)
class DrafterInUse:
    """A drafter and what drafting with it needs."""

    model: object  # DFlashDrafter or OnnxDrafter
    mask_embeds: torch.Tensor  # the target's embedding of the mask token, one row per block slot
    name: str
    version: str | None  # dflash.engine.versions: a digest of the weights
    # The target's LM head in the drafter's dtype (the drafter borrows it). Drafts are only
    # proposals, so they may be computed in a cheaper dtype than the target's (bf16 on a
    # CPU with native bf16, for instance) without changing the output.
    head: torch.Tensor
    layer_ids: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.mask_embeds.dtype

    def block(self, anchor_embed: torch.Tensor, draft_len: int) -> torch.Tensor:
        return torch.cat((anchor_embed.to(self.dtype), self.mask_embeds[: draft_len - 1]))

    def logits(self, context: torch.Tensor, anchor_embed: torch.Tensor, draft_len: int, positions: torch.Tensor,
               cache) -> torch.Tensor:
        """One drafter forward over [anchor, MASK * (draft_len - 1)] after the new context
        features [S, F]; returns fp32 logits of the draft_len - 1 drafted rows."""
        with torch.inference_mode():
            hidden = self.model(context.to(self.dtype)[None], self.block(anchor_embed, draft_len)[None], positions,
                                cache)
            return torch.nn.functional.linear(hidden[0, 1:], self.head).float()


@dataclass
class DFlashState:
    drafter: DrafterInUse
    cache: DraftCache
    pending: list[torch.Tensor] = field(default_factory=list)  # features the drafter has not seen


class DFlashProposer:
    name = NAME

    def __init__(self, target, drafter, name: str, sha256: str | None, dtype: torch.dtype):
        self.target = target
        self.dtype = dtype
        w = target.head_weight()
        self.head = w if w.dtype == dtype else w.to(dtype)
        self.install(drafter, name, sha256)

    def install(self, drafter, name: str, sha256: str | None) -> None:
        """Draft with this drafter from now on (requests already started keep theirs)."""
        target = self.target
        model = drafter.to(device=target.device, dtype=self.dtype)
        cfg = drafter.config
        # The mask rows of every block are the same: embed them once.
        mask = target.embed(torch.full((cfg.block_size,), cfg.mask_token_id, device=target.device)).to(self.dtype)
        self.sha256 = sha256 if sha256 is not None else model_digest(drafter)
        self.current = DrafterInUse(model, mask, name, version_label(self.sha256), self.head,
                                    tuple(cfg.target_layer_ids))

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.current.layer_ids

    def start(self, state) -> DFlashState:
        return DFlashState(self.current, self.current.model.new_cache())

    @staticmethod
    def layers_of(state) -> tuple[int, ...]:
        return state.proposals[NAME].drafter.layer_ids

    @staticmethod
    def observe(state, features: torch.Tensor | None) -> None:
        if features is not None:
            state.proposals[NAME].pending.append(features)

    def propose(self, items: list[tuple[object, int]]) -> list[Draft]:
        """Drafts for (state, D) pairs, in one drafter pass per drafter in use."""
        jobs = []
        for state, D in items:
            ps = state.proposals[NAME]
            ctx = torch.cat(ps.pending) if len(ps.pending) > 1 else ps.pending[0]
            ps.pending.clear()
            jobs.append((ps, ctx, state.output_ids[-1], state.length - 1, D))
        logits = self.draft_logits(jobs)
        return [_draft(rows, state) for rows, (state, _) in zip(logits, items)]

    def draft_logits(self, jobs: list[tuple[DFlashState, torch.Tensor, int, int, int]]) -> list[torch.Tensor]:
        """fp32 logits [D - 1, V] of the drafted rows for each (proposer state, new context
        features, anchor id, anchor position, D); the context enters each state's cache."""
        out: dict[int, torch.Tensor] = {}
        groups: dict[int, list[int]] = {}
        for i, job in enumerate(jobs):
            groups.setdefault(id(job[0].drafter), []).append(i)
        with torch.inference_mode():
            for members in groups.values():
                for i, rows in zip(members, self._forward([jobs[i] for i in members])):
                    out[i] = rows
        return [out[i] for i in range(len(jobs))]

    def _forward(self, jobs) -> list[torch.Tensor]:
        target = self.target
        drafter = jobs[0][0].drafter
        ids = torch.tensor([job[2] for job in jobs], device=target.device)
        anchors = target.embed(ids)
        parts = []
        for (ps, ctx, _, start, D), anchor in zip(jobs, anchors):
            positions = torch.arange(ps.cache.length, start + D, device=target.device)
            parts.append(DraftPart(ctx.to(drafter.dtype), drafter.block(anchor[None], D), positions, ps.cache))
        if len(parts) == 1 or not hasattr(drafter.model, "forward_packed"):
            hidden = [drafter.model(p.context[None], p.block[None], p.positions, p.cache)[0, 1:] for p in parts]
        else:
            packed = drafter.model.forward_packed(parts)
            hidden = [packed[p.q_at + 1 : p.q_at + p.L] for p in parts]
        rows = torch.nn.functional.linear(torch.cat(hidden) if len(hidden) > 1 else hidden[0], drafter.head).float()
        return list(rows.split([p.L - 1 for p in parts]))


def _draft(logits: torch.Tensor, state) -> Draft:
    """Tokens from the drafter's logits as the request's verify rule needs them, and each
    position's confidence (the draft distribution's peak; block length auto only)."""
    want_confidence = state.policy is not None
    if state.params.verify_mode == "probabilistic":
        probs = warp(logits, state.params)
        tokens = sample(probs, state.generator)
        confidence = probs.max(-1).values.tolist() if want_confidence else None
        return Draft(tokens, probs, confidence)
    confidence = logits.softmax(-1).max(-1).values.tolist() if want_confidence else None
    return Draft(logits.argmax(-1), None, confidence)
