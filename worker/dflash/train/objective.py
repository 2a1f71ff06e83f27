"""The DFlash training objective, as published (SpecForge's recipe; dflash-spec.md section 4).

For one sequence: random anchors among response positions (fresh every epoch), each
opening a block [x_p, MASK * (L-1)] at positions p..p+L-1; every block sees the context
features strictly before its anchor and its own block bidirectionally, never other
blocks; all blocks of a sequence run in one forward. Block slot k (1..L-1) is labelled
with x_{p+k} (same-position prediction) and weighted exp(-(k-1)/gamma); the loss is the
weighted mean cross-entropy through the target's frozen LM head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def default_gamma(block_size: int) -> float:
    """7 for block 16, 5 for 10, 4 for 8 (SpecForge's values), linear in between."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size * 7.0 / 16.0))


@dataclass
class Blocks:
    positions: torch.Tensor  # [T + A*L]: context positions, then every block's
    block_ids: torch.Tensor  # [A*L]: anchor token then mask ids, per block
    attn_mask: torch.Tensor  # [A*L, T + A*L] bool, True = visible
    labels: torch.Tensor  # [A*L] (-100 where no loss)
    weights: torch.Tensor  # [A*L]


def sample_anchors(n_tokens: int, response_start: int, block_size: int, num_anchors: int, gen) -> torch.Tensor:
    lo = max(response_start - 1, 1)  # the last prompt token may anchor the first response block
    hi = n_tokens - 2  # at least one label
    if hi < lo:
        return torch.empty(0, dtype=torch.long)
    candidates = torch.arange(lo, hi + 1)
    pick = torch.randperm(len(candidates), generator=gen)[: min(num_anchors, len(candidates))]
    return candidates[pick].sort().values


def build_blocks(ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_id: int, gamma: float) -> Blocks:
    T, L, A = len(ids), block_size, len(anchors)
    offs = torch.arange(L)
    pos = anchors[:, None] + offs[None, :]  # [A, L]
    block_ids = torch.full((A, L), mask_id, dtype=torch.long)
    block_ids[:, 0] = ids[anchors]
    label_pos = pos.clone()
    valid = (offs[None, :] >= 1) & (label_pos < T)
    labels = torch.where(valid, ids[label_pos.clamp(max=T - 1)], torch.full_like(label_pos, -100))
    w = torch.exp(-(offs.float() - 1) / gamma)
    weights = torch.where(valid, w[None, :].expand(A, L), torch.zeros(A, L))
    ctx_visible = torch.arange(T)[None, :] < anchors[:, None]  # [A, T]: strictly before the anchor
    same_block = torch.eye(A, dtype=torch.bool)  # [A, A]
    mask = torch.cat(
        (
            ctx_visible[:, None, :].expand(A, L, T),
            same_block[:, None, :, None].expand(A, L, A, L).reshape(A, L, A * L),
        ),
        dim=-1,
    ).reshape(A * L, T + A * L)
    positions = torch.cat((torch.arange(T), pos.reshape(-1)))
    return Blocks(positions, block_ids.reshape(-1), mask, labels.reshape(-1), weights.reshape(-1))


def weighted_loss(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                  vocab: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted mean CE through the frozen head; `vocab` restricts the softmax to a token
    subset (labels must be remapped into it) to cut the head's cost on CPU."""
    keep = labels >= 0
    h, y, w = hidden[keep], labels[keep], weights[keep]
    if vocab is not None:
        head_weight = head_weight[vocab]
    logits = h @ head_weight.t()
    ce = F.cross_entropy(logits.float(), y, reduction="none")
    return (ce * w).sum() / w.sum().clamp_min(1e-9)


def cosine_lr(step: int, total: int, base: float, warmup: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
