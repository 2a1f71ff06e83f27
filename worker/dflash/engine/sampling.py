"""How a request samples (`SamplingParams`, validated), and sampling and the three verify
rules as small pure functions on tensors.

Notation follows the papers: p = target distribution, q = draft distribution.
For one step with K drafted tokens d_1..d_K the target gives K+1 rows p_1..p_{K+1}
(row i scores position i given the context and d_<i). Every rule returns
(accepted, next_token): the number of drafts kept, then the token the target adds
after them (the recovered token at the first rejection, or the bonus token from
p_{K+1} when every draft is kept). A step therefore commits accepted + 1 tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from dflash.errors import DFlashError

VERIFY_MODES = ("greedy", "strict", "probabilistic")


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen and verified for one request.

    temperature 0 means greedy decoding; then the verify mode is always
    `greedy` (the three rules coincide). With temperature > 0 the default rule
    is `probabilistic` (drafts sampled from the drafter, p/q acceptance).
    Every finite temperature >= 0 and every top_p in (0, 1] is valid, down to the
    limits (1e-300, subnormals, 1e300): `sampling.warp` takes them to a proper
    distribution.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    verify: str | None = None

    def __post_init__(self):
        t = self.temperature
        if not isinstance(t, (int, float)) or not self._finite(t) or t < 0:
            raise DFlashError("bad_temperature", f"temperature must be a finite number >= 0, got {t}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise DFlashError("bad_top_k", f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        p = self.top_p
        if not isinstance(p, (int, float)) or not self._finite(p) or not (0 < p <= 1):
            raise DFlashError("bad_top_p", f"top_p must be in (0, 1], got {p}")
        if self.verify is not None and self.verify not in VERIFY_MODES:
            raise DFlashError("bad_verify", f"verify must be one of {', '.join(VERIFY_MODES)}, got '{self.verify}'")
        if self.verify == "greedy" and t > 0:
            raise DFlashError("bad_verify", "verify 'greedy' needs temperature 0; use 'strict' or 'probabilistic'")
        if self.seed is not None and (not isinstance(self.seed, int) or not (0 <= self.seed < 2**63)):
            raise DFlashError("bad_seed", f"seed must be an integer in [0, 2^63), got {self.seed}")

    @staticmethod
    def _finite(x: int | float) -> bool:
        """A finite float, or an int that converts to one (math.isfinite raises
        OverflowError for an int past float range, such as a 400-digit JSON number)."""
        try:
            return math.isfinite(x)
        except OverflowError:
            return False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def verify_mode(self) -> str:
        if self.greedy:
            return "greedy"
        return self.verify or "probabilistic"

def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """`logits` [..., V] with the tokens `allowed` [..., V] (bool) does not hold set to -inf
    (a new tensor): a grammar's mask (dflash.engine.grammar) on the target's rows. Each row
    must allow at least one token. fp32 on a CPU through numpy, for the reason argmax_rows
    gives (torch's masked_fill opens an OpenMP region)."""
    if _through_numpy(logits) and allowed.device.type == "cpu":
        return torch.from_numpy(np.where(allowed.numpy(), logits.numpy(), np.float32(-np.inf)))
    return logits.masked_fill(~allowed.to(device=logits.device, dtype=torch.bool), float("-inf"))


def warp(logits: torch.Tensor, params: SamplingParams, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Top-k, temperature, then top-p; returns fp32 probabilities over the last dim.

    Every valid parameter gives a proper distribution (finite, >= 0, rows summing to 1),
    down to the limits: a temperature too small for float32 (1e-300) keeps only the
    maxima, one too large (1e300) leaves every surviving token equally likely, and a
    top_p too small for float32 (1e-300) keeps the single most likely token.

    With `allowed` (a grammar's mask, bool like logits) the other tokens are out before
    anything else: top-k and top-p choose among the allowed tokens and the result is the
    target's law restricted to them, renormalised (what constrained plain decoding samples)."""
    if allowed is not None:
        logits = mask_logits(logits, allowed)
    # Shift before dividing: with a tiny temperature (1e-40 is valid) the quotient of raw
    # logits overflows to inf and inf - inf is NaN; shifted logits are <= 0, so the top
    # stays 0 and the rest can only run to -inf (probability 0).
    logits = logits.float()
    # Top-k before the temperature: which tokens are the k largest does not depend on it,
    # and after a huge temperature every quotient rounds to 0, which would keep them all.
    # And before the shift: subtracting a large maximum rounds nearby logits together.
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    logits = logits - logits.max(-1, keepdim=True).values
    tempered = _divide(logits, float(params.temperature))
    if params.top_p < 1.0:
        # Rank by the logits before the temperature (the same order, but a huge temperature
        # rounds every quotient to 0 and would leave the ranking to chance).
        order = torch.sort(logits, dim=-1, descending=True).indices
        sorted_probs = tempered.gather(-1, order).softmax(-1)
        # Drop a token when the mass before it already reaches top_p. The first token always
        # stays: its mass before is 0, and a top_p below float32's range (1e-300) rounds to
        # 0 in the comparison, which would otherwise drop every token.
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        tempered = tempered.masked_fill(drop, float("-inf"))
    return tempered.softmax(-1)


def _divide(shifted: torch.Tensor, temperature: float) -> torch.Tensor:
    """shifted / temperature for shifted logits (<= 0, the maximum exactly 0), in float32.

    The division runs in the tensor's dtype, so the temperature is rounded to float32
    first: below about 7e-46 it becomes 0 (and 0 / 0 is NaN), above about 3.4e38 it
    becomes inf (and -inf / inf is NaN). Those two cases take the quotient's limit."""
    t32 = torch.tensor(float(temperature), dtype=torch.float32).item()
    if t32 == 0.0:
        # x / t for t -> 0+: 0 stays 0, every negative x goes to -inf.
        return torch.where(shifted == 0, 0.0, float("-inf")).to(shifted.dtype)
    if math.isinf(t32):
        # x / t for t -> inf: every finite x goes to 0, -inf (masked) stays -inf.
        return torch.where(torch.isfinite(shifted), 0.0, float("-inf")).to(shifted.dtype)
    return shifted / temperature


def sample(probs: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """One token per row of `probs` [..., V] (each row >= 0, not all 0), by inverting its
    cumulative sum (float64) at a uniform draw: the first token whose cumulative mass
    exceeds it, so a token of probability 0 is never drawn. For 4 rows of a 49k vocabulary
    on a 2-core CPU: ~2.2 ms, where torch.multinomial took ~6.6."""
    V = probs.shape[-1]
    flat = probs.reshape(-1, V)
    cdf = flat.to(torch.float64).cumsum(-1)
    u = torch.rand(cdf.shape[0], 1, dtype=torch.float64, generator=gen, device=cdf.device) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, u, right=True)[:, 0]
    over = idx >= V  # u rounded up to the total: the last token with mass
    if bool(over.any()):
        last = V - 1 - (flat > 0).flip(-1).to(torch.int8).argmax(-1)
        idx = torch.where(over, last, idx)
    return idx.reshape(probs.shape[:-1])


def uniforms(n: int, gen: torch.Generator | None, device) -> torch.Tensor:
    # float64: float32 rand can return exactly 0, which would accept a zero-probability draft.
    return torch.rand(n, dtype=torch.float64, generator=gen, device=device)


def _accepted_prefix(matches: torch.Tensor) -> int:
    return int(matches.to(torch.int32).cumprod(0).sum()) if matches.numel() else 0


def _through_numpy(logits: torch.Tensor) -> bool:
    """Whether the row-wise reductions below go through numpy: fp32 on a CPU (argmax_rows
    says why)."""
    return logits.device.type == "cpu" and logits.dtype == torch.float32


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of equal maxima, as torch's). fp32 on a CPU through numpy:
    ~15 us for 2 rows of a 49k vocabulary against torch's ~150, and no OpenMP region, whose
    threads would go on spinning into the target's next forward and slow it (measured: a
    verify of 2 on the ONNX Runtime backend 17 % dearer after a torch argmax)."""
    if _through_numpy(logits):
        return torch.from_numpy(np.asarray(logits.numpy().argmax(-1)))
    return logits.argmax(-1)


def peak_probs(logits: torch.Tensor) -> list[float]:
    """Each row's largest softmax probability (a draft's confidence), through numpy on a CPU
    for the reason argmax_rows gives: torch's softmax over a block of drafted rows opens an
    OpenMP region whose threads spin into the target's next forward."""
    if _through_numpy(logits):
        x = logits.numpy()
        return (1.0 / np.exp(x - x.max(-1, keepdims=True)).sum(-1)).tolist()
    return logits.softmax(-1).max(-1).values.tolist()


def verify_greedy(draft_ids: torch.Tensor, target_logits: torch.Tensor,
                  allowed: torch.Tensor | None = None) -> tuple[int, int]:
    """Keep drafts while they equal the target's argmax; then the target's own argmax. On a
    CPU the rows are read one at a time and only up to the first miss (a row's argmax over a
    49k vocabulary is ~10 us; the steps of a chain of 5 keep 2 drafts on average).

    With `allowed` (a grammar's masks, bool [K+1, V]: dflash.engine.grammar.Matcher.masks)
    each row's argmax is over its allowed tokens: a draft the grammar forbids is rejected and
    the target adds its best allowed token, as constrained plain decoding does."""
    if _through_numpy(target_logits):
        rows, drafts = target_logits.numpy(), draft_ids.tolist()
        if allowed is not None:  # masked row by row, as far as the rows are read
            rows = _MaskedRows(rows, allowed.numpy())
        for a, d in enumerate(drafts):
            top = int(rows[a].argmax())
            if top != d:
                return a, top
        return len(drafts), int(rows[len(drafts)].argmax())
    if allowed is not None:
        target_logits = mask_logits(target_logits, allowed)
    pred = argmax_rows(target_logits)
    a = _accepted_prefix(draft_ids == pred[:-1])
    return a, int(pred[a])


class _MaskedRows:
    """Rows of logits with a mask applied to a row when it is read (numpy)."""

    def __init__(self, rows: np.ndarray, allowed: np.ndarray):
        self.rows, self.allowed = rows, allowed

    def __getitem__(self, i: int) -> np.ndarray:
        return np.where(self.allowed[i], self.rows[i], np.float32(-np.inf))


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
