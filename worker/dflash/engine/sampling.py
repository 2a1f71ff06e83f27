"""Sampling and the three verify rules, as small pure functions on tensors.

Notation follows the papers: p = target distribution, q = draft distribution.
For one step with K drafted tokens d_1..d_K the target gives K+1 rows p_1..p_{K+1}
(row i scores position i given the context and d_<i). Every rule returns
(accepted, next_token): the number of drafts kept, then the token the target adds
after them (the recovered token at the first rejection, or the bonus token from
p_{K+1} when every draft is kept). A step therefore commits accepted + 1 tokens.
"""

from __future__ import annotations

import torch

from dflash.engine.config import SamplingParams


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p; returns fp32 probabilities over the last dim."""
    # Shift before dividing: with a tiny temperature (1e-40 is valid) the quotient of raw
    # logits overflows to inf and inf - inf is NaN; shifted logits are <= 0, so the top
    # stays 0 and the rest can only run to -inf (probability 0).
    logits = logits.float()
    logits = (logits - logits.max(-1, keepdim=True).values) / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p (the first token always stays).
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """One token per row of `probs` [..., V]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=gen).reshape(probs.shape[:-1])


def uniforms(n: int, gen: torch.Generator | None, device) -> torch.Tensor:
    # float64: float32 rand can return exactly 0, which would accept a zero-probability draft.
    return torch.rand(n, dtype=torch.float64, generator=gen, device=device)


def _accepted_prefix(matches: torch.Tensor) -> int:
    return int(matches.to(torch.int32).cumprod(0).sum()) if matches.numel() else 0


def verify_greedy(draft_ids: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Keep drafts while they equal the target's argmax; then the target's own argmax."""
    pred = target_logits.argmax(-1)
    a = _accepted_prefix(draft_ids == pred[:-1])
    return a, int(pred[a])


def verify_strict(draft_ids: torch.Tensor, target_probs: torch.Tensor, gen) -> tuple[int, int]:
    """Sample the target at every position; keep drafts while the samples match them.

    Each emitted token is a plain target sample, so this is lossless for any drafter
    whose proposal does not look at these draws (q is treated as a point mass)."""
    y = sample(target_probs, gen)
    a = _accepted_prefix(draft_ids == y[:-1])
    return a, int(y[a])


def verify_probabilistic(
    draft_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, gen
) -> tuple[int, int]:
    """Leviathan/Chen rejection sampling with the stored draft distribution.

    Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
    emit y ~ norm(max(0, p_i - q_i)); after K acceptances emit the bonus y ~ p_{K+1}."""
    k = draft_ids.shape[0]
    idx = draft_ids[:, None]
    p_d = target_probs[:k].gather(-1, idx)[:, 0].double()
    q_d = draft_probs.gather(-1, idx)[:, 0].double()
    u = uniforms(k, gen, target_probs.device)
    # q(d) = 0 cannot happen for a token sampled from q, but reject rather than divide by 0.
    accept = (q_d > 0) & (u * q_d <= p_d)
    a = _accepted_prefix(accept)
    if a == k:
        return a, int(sample(target_probs[k], gen))
    residual = (target_probs[a] - draft_probs[a]).clamp_min(0)
    total = residual.sum()
    # p == q (up to rounding) leaves no residual mass; then p itself is the right law.
    dist = residual / total if total > 1e-12 else target_probs[a]
    return a, int(sample(dist, gen))
