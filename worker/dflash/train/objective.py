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
    """The blocks of one or more sequences (packed), with compact descriptors from which
    the dense attention mask is built on whichever device the tensors live on."""

    positions: torch.Tensor  # [T + Q]: context positions, then every block's
    block_ids: torch.Tensor  # [Q]: anchor token then mask ids, per block
    labels: torch.Tensor  # [Q] (-100 where no loss)
    weights: torch.Tensor  # [Q]
    q_seq: torch.Tensor  # [Q] which sequence a block row belongs to
    q_anchor: torch.Tensor  # [Q] its block's anchor position (in its sequence)
    q_block: torch.Tensor  # [Q] global block number
    k_seq: torch.Tensor  # [T] which sequence a context row belongs to

    @property
    def attn_mask(self) -> torch.Tensor:
        """[Q, T + Q] bool, True = visible: the own sequence's context strictly before the
        anchor, and the own block (bidirectionally); never another block or sequence."""
        T = len(self.k_seq)
        ctx = (self.k_seq[None, :] == self.q_seq[:, None]) & (self.positions[None, :T] < self.q_anchor[:, None])
        return torch.cat((ctx, self.q_block[:, None] == self.q_block[None, :]), dim=-1)

    def to(self, device) -> "Blocks":
        return Blocks(*(getattr(self, f).to(device, non_blocking=True) for f in self.__dataclass_fields__))


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
    valid = (offs[None, :] >= 1) & (pos < T)
    labels = torch.where(valid, ids[pos.clamp(max=T - 1)], torch.full_like(pos, -100))
    w = torch.exp(-(offs.float() - 1) / gamma)
    weights = torch.where(valid, w[None, :].expand(A, L), torch.zeros(A, L))
    positions = torch.cat((torch.arange(T), pos.reshape(-1)))
    return Blocks(positions, block_ids.reshape(-1), labels.reshape(-1), weights.reshape(-1),
                  q_seq=torch.zeros(A * L, dtype=torch.long), q_anchor=anchors.repeat_interleave(L),
                  q_block=torch.arange(A).repeat_interleave(L), k_seq=torch.zeros(T, dtype=torch.long))


def pack_blocks(parts: list[Blocks]) -> Blocks:
    """Several sequences' blocks in one forward: contexts side by side, then all blocks; each
    block sees only its own sequence's context (and itself), so every block's loss is what
    it would be alone, and a GPU runs one large forward instead of many small ones."""
    ctx = [len(p.k_seq) for p in parts]
    blocks = 0
    q_block = []
    for p in parts:
        q_block.append(p.q_block + blocks)
        blocks += int(p.q_block.max()) + 1 if len(p.q_block) else 0
    return Blocks(
        torch.cat([p.positions[:t] for p, t in zip(parts, ctx)] + [p.positions[t:] for p, t in zip(parts, ctx)]),
        torch.cat([p.block_ids for p in parts]),
        torch.cat([p.labels for p in parts]),
        torch.cat([p.weights for p in parts]),
        q_seq=torch.cat([torch.full_like(p.q_seq, i) for i, p in enumerate(parts)]),
        q_anchor=torch.cat([p.q_anchor for p in parts]),
        q_block=torch.cat(q_block),
        k_seq=torch.cat([torch.full_like(p.k_seq, i) for i, p in enumerate(parts)]),
    )


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

