"""The DFlash training objective (dflash-spec.md section 4), with the choices that decide τ.

For one sequence: anchors among response positions (every one, up to a cap; fresh random
subsets when capped), each opening a block [x_p, MASK * (L-1)] at positions p..p+L-1;
a block sees the context features strictly before its anchor and its own block
bidirectionally, never other blocks. Block slot k (1..L-1) is labelled with x_{p+k}
(same-position prediction). The loss is a weighted mean over slots of cross-entropy
through the target's frozen LM head, optionally mixed with a KL term against the
target's own top-k distribution (soft targets).

Position weights (`weighting`):
- "decay": the published exp(-(k-1)/gamma) (gamma 7 for block 16);
- "dpace": D-PACE (arXiv 2605.18810, SpecForge/TorchSpec/ModelOpt's option): per block,
  from the drafter's own detached confidences q_k = exp(-CE_k), smoothed
  q~ = (1-a) q + a, w_k = sum_{m>=k} prod_{i<=m} q~_i: each slot weighted by its share
  of the expected accepted length, which is what τ measures;
- "uniform".
`loss_positions` keeps only slots 1..n (the LM head then runs only there: slots the bench
almost never reaches cost the most and add the least).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

WEIGHTINGS = ("decay", "dpace", "uniform")


def default_gamma(block_size: int) -> float:
    """7 for block 16, 5 for 10, 4 for 8 (SpecForge's values), linear in between."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size * 7.0 / 16.0))


def sample_anchors(n_tokens: int, response_start: int, max_anchors: int, gen: torch.Generator | None = None,
                   loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Anchor positions of one sequence, sorted: every position p whose anchor token is a
    response token (as at inference, where the anchor is always a generated token) and
    whose first label x_{p+1} is a loss token; a random subset of `max_anchors` of them
    when there are more (fresh per call)."""
    if loss_mask is None:
        loss_mask = torch.zeros(n_tokens, dtype=torch.bool)
        loss_mask[response_start:] = True
    p = torch.arange(n_tokens - 1)
    ok = loss_mask[:-1] & loss_mask[1:]
    candidates = p[ok]
    if len(candidates) > max_anchors:
        candidates = candidates[torch.randperm(len(candidates), generator=gen)[:max_anchors]].sort().values
    return candidates


def slot_weights(block_size: int, weighting: str, gamma: float | None, loss_positions: int | None) -> torch.Tensor:
    """[L] static weight per block slot (slot 0 never has a label). For "dpace" these are
    ones over the kept slots: the per-block weights are computed from confidences."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    k = torch.arange(block_size, dtype=torch.float32)
    if weighting == "decay":
        w = torch.exp(-(k - 1) / (gamma or default_gamma(block_size)))
    else:
        w = torch.ones(block_size)
    w[0] = 0.0
    if loss_positions:
        w[loss_positions + 1 :] = 0.0
    return w


@dataclass
class SeqBlocks:
    """The blocks of one sequence: what the drafter sees and what it is scored on."""

    anchors: torch.Tensor  # [A] anchor positions
    block_ids: torch.Tensor  # [A, L] anchor token then mask ids
    labels: torch.Tensor  # [A, L] target token per slot (-100: no loss)
    weights: torch.Tensor  # [A, L] static slot weight (0 where no label)
    n_ctx: int  # context rows (the sequence's length)

    @property
    def positions(self) -> torch.Tensor:
        """[A, L] absolute position of every block slot."""
        return self.anchors[:, None] + torch.arange(self.block_ids.shape[1], device=self.anchors.device)[None, :]

    def dense_mask(self) -> torch.Tensor:
        """[A*L, T + A*L] bool, True = visible: the reference layout for the engine drafter's
        `attn_mask` (context strictly before the anchor; own block only). Tests compare the
        fast attention against it; training never builds it."""
        A, L = self.block_ids.shape
        T = self.n_ctx
        q_anchor = self.anchors.repeat_interleave(L)
        ctx = torch.arange(T, device=self.anchors.device)[None, :] < q_anchor[:, None]
        q_block = torch.arange(A, device=self.anchors.device).repeat_interleave(L)
        return torch.cat((ctx, q_block[:, None] == q_block[None, :]), dim=-1)


def build_blocks(ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_id: int,
                 slot_w: torch.Tensor, loss_mask: torch.Tensor | None = None) -> SeqBlocks:
    T, L, A = len(ids), block_size, len(anchors)
    offs = torch.arange(L)
    pos = anchors[:, None] + offs[None, :]
    block_ids = torch.full((A, L), mask_id, dtype=torch.long)
    block_ids[:, 0] = ids[anchors]
    valid = (offs[None, :] >= 1) & (pos < T) & (slot_w[None, :] > 0)
    if loss_mask is not None:
        valid &= loss_mask[pos.clamp(max=T - 1)]
    labels = torch.where(valid, ids[pos.clamp(max=T - 1)], torch.full_like(pos, -100))
    weights = torch.where(valid, slot_w[None, :].expand(A, L), torch.zeros(A, L))
    return SeqBlocks(anchors, block_ids, labels, weights, T)


def dpace_weights(ce: torch.Tensor, valid: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """[A, K] D-PACE weights from per-slot CE [A, K] (slots 1..K): detached suffix sums of
    the smoothed confidence prefix products; slots without a label end the block."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"D-PACE alpha must be in (0, 1], got {alpha}")
    with torch.no_grad():
        q = torch.where(valid, torch.exp(-ce.float()), torch.zeros_like(ce, dtype=torch.float32))
        q = torch.where(valid, (1 - alpha) * q + alpha, q)
        prefix = torch.cumprod(q, dim=-1)
        return torch.flip(torch.cumsum(torch.flip(prefix, [-1]), -1), [-1]) * valid


def soft_kl(logits: torch.Tensor, topk_ids: torch.Tensor, topk_logits: torch.Tensor,
            temperature: float = 1.0) -> torch.Tensor:
    """[N] KL(p_T || q_S) over the teacher's top-k tokens: p_T = softmax(teacher top-k
    logits / T) renormalised over those k, q_S the student's softmax over the whole
    vocabulary (so mass the student puts elsewhere is penalised through its normaliser).
    The reference formula; training uses the fused `HeadLoss`, which a test holds equal."""
    log_q = F.log_softmax(logits.float(), dim=-1).gather(-1, topk_ids.long())
    log_p = F.log_softmax(topk_logits.float() / temperature, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


class HeadLoss(torch.autograd.Function):
    """Per-row loss through the frozen LM head, fused: (1 - m) * CE(label) + m * KL(p_T || q)
    over the teacher's top-k, with the gradient written out (softmax minus the target
    mixture). On a CPU the head's cost is mostly passes over [rows, vocab] memory, so they
    are few and in the logits' dtype (bf16 under autocast): exp(logits - rowmax) is
    computed once, summed in fp32 for the normaliser and kept for backward (or recomputed
    there when `recompute`, for large GPU batches)."""

    @staticmethod
    def _exp(hidden, weight, labels, soft_ids):
        logits = hidden @ weight.t()
        picked = logits.gather(-1, labels[:, None])[:, 0].float()
        soft = logits.gather(-1, soft_ids.long()).float() if soft_ids is not None else None
        m = logits.max(-1).values
        e = logits.sub_(m[:, None]).exp_()  # in place: the logits are not needed again
        return e, m.float(), picked, soft

    @staticmethod
    def forward(ctx, hidden, weight, labels, soft_ids, soft_p, mix, recompute):
        use_soft = soft_ids is not None and mix > 0
        e, m, picked, soft = HeadLoss._exp(hidden, weight, labels, soft_ids if use_soft else None)
        lse = m + torch.log(e.sum(-1).float())  # summed with float accumulation, rounded once
        ce = lse - picked
        loss = ce
        if use_soft:
            kl = (soft_p * (torch.log(soft_p.clamp_min(1e-30)) - (soft - lse[:, None]))).sum(-1)
            loss = (1 - mix) * ce + mix * kl
        ctx.mix, ctx.use_soft = mix, use_soft
        ctx.save_for_backward(hidden, weight, labels, lse, m, soft_ids, soft_p, None if recompute else e)
        return loss, ce.detach()

    @staticmethod
    def backward(ctx, grad_loss, grad_ce):
        hidden, weight, labels, lse, m, soft_ids, soft_p, e = ctx.saved_tensors
        if e is None:
            e, m, _, _ = HeadLoss._exp(hidden, weight, labels, None)
        # softmax = e * exp(m - lse); scaled by the row's incoming gradient in the same pass
        g = e * (grad_loss * torch.exp(m - lse))[:, None].to(e.dtype)
        hard = 1.0 - ctx.mix if ctx.use_soft else 1.0
        g.scatter_add_(-1, labels[:, None], (-hard * grad_loss)[:, None].to(g.dtype))
        if ctx.use_soft:
            g.scatter_add_(-1, soft_ids.long(), (-ctx.mix * soft_p * grad_loss[:, None]).to(g.dtype))
        return (g.to(weight.dtype) @ weight).to(hidden.dtype), None, None, None, None, None, None


def token_losses(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor,
                 soft: tuple[torch.Tensor, torch.Tensor] | None = None, soft_mix: float = 0.0,
                 chunk_rows: int | None = None, accuracy: bool = False) -> dict[str, torch.Tensor]:
    """Per-row loss through the frozen head for rows with labels: {"loss": [N] CE, or
    (1 - soft_mix) * CE + soft_mix * KL against the teacher's top-k logits when `soft`
    = (ids, logits) is given; "ce": [N] the hard-label CE (detached); "correct": [N]
    whether the row's argmax is its label (when `accuracy`)}. `chunk_rows` computes the
    head in row chunks and recomputes their logits in backward, so a large GPU batch never
    holds [N, vocab] logits at once. Run under bf16 autocast, pass a bf16 head."""
    use_soft = soft is not None and soft_mix > 0
    if torch.is_autocast_enabled(hidden.device.type):
        hidden = hidden.to(torch.get_autocast_dtype(hidden.device.type))
    weight = head_weight.to(hidden.dtype)
    ids = soft[0] if use_soft else None
    p_t = F.softmax(soft[1].float(), dim=-1) if use_soft else None
    step = chunk_rows or max(1, len(hidden))
    losses, ces, correct = [], [], []
    with torch.autocast(hidden.device.type, enabled=False):
        for s in range(0, len(hidden), step):
            sl = slice(s, s + step)
            loss, ce = HeadLoss.apply(hidden[sl], weight, labels[sl], None if ids is None else ids[sl],
                                      None if p_t is None else p_t[sl], soft_mix if use_soft else 0.0,
                                      chunk_rows is not None)
            losses.append(loss)
            ces.append(ce)
            if accuracy:
                with torch.no_grad():
                    correct.append((hidden[sl].detach() @ weight.t()).argmax(-1) == labels[sl])
    out = {"loss": torch.cat(losses), "ce": torch.cat(ces)}
    if accuracy:
        out["correct"] = torch.cat(correct)
    return out


def cosine_lr(step: int, total: int, base: float, warmup: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
