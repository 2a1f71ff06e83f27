"""The speculative loop: prefill, then draft a block / verify it / keep the agreeing prefix.

Block size 1 runs the same loop with no drafts, i.e. plain autoregressive
decoding; that is the speed baseline. Greedy output equals the target's own
greedy output because every committed token is the target's choice given the
committed prefix.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dflash.engine.config import SamplingParams
from dflash.engine.drafter import DFlashDrafter
from dflash.engine.sampling import sample, verify_greedy, verify_probabilistic, verify_strict, warp
from dflash.engine.stats import GenerationStats
from dflash.engine.target import TargetModel


@dataclass
class LoopOutput:
    output_ids: list[int]  # new tokens only, truncated at the first stop
    finish_reason: str  # "stop" | "length" | "context" | whatever on_step returned
    stats: GenerationStats


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def speculative_generate(
    target: TargetModel,
    drafter: DFlashDrafter | None,
    prompt_ids: list[int],
    *,
    block_size: int,
    params: SamplingParams,
    max_new_tokens: int,
    stop_ids: frozenset[int] = frozenset(),
    mask_embeds: torch.Tensor | None = None,
    on_step: Callable[[list[int]], str | None] | None = None,
) -> LoopOutput:
    """Generate up to `max_new_tokens` after `prompt_ids` (already validated).

    `mask_embeds` [>= block_size-1, H] are the target embeddings of the mask token,
    computed once by the caller. `on_step(output_ids)` runs after every step and may
    return a finish reason (a stop string was seen) or raise (cancelled, deadline).
    """
    device = target.device
    stats = GenerationStats(block_size=block_size, prompt_tokens=len(prompt_ids))
    gen = None
    if not params.greedy:
        gen = torch.Generator(device=device)
        gen.manual_seed(params.seed if params.seed is not None else torch.seed())
    mode = params.verify_mode
    speculative = block_size > 1

    # --- prefill: cache the prompt, take the first token and the prompt's features
    t0 = time.perf_counter()
    target.reset(drafter.config.target_layer_ids if speculative else [])
    logits, pending = target.forward(torch.tensor(prompt_ids, device=device), last_only=True)
    first = int(logits[-1].argmax()) if params.greedy else int(sample(warp(logits[-1], params), gen))
    stats.prefill_s = time.perf_counter() - t0

    out = [first]
    finish = "stop" if first in stop_ids else None
    if finish is None and on_step is not None:
        finish = on_step(out)
    draft_cache = drafter.new_cache() if speculative else None
    t_decode = time.perf_counter()

    while finish is None and len(out) < max_new_tokens:
        start = len(prompt_ids) + len(out) - 1  # position of the anchor (last committed token)
        # The sequence may not grow past the context: the last verify ends at position ctx - 2.
        L = min(block_size, target.context_length - 1 - start)
        if L < 1:
            finish = "context"
            break
        anchor = torch.tensor([out[-1]], device=device)

        # --- draft: one drafter forward over [anchor, MASK * (L-1)]
        t = time.perf_counter()
        if L > 1:
            block = torch.cat((target.embed(anchor), mask_embeds[: L - 1]))[None]
            positions = torch.arange(draft_cache.length, start + L, device=device)
            with torch.inference_mode():
                hidden = drafter(pending[None], block, positions, draft_cache)
            draft_logits = target.logits(hidden[0, 1:])
            if mode == "probabilistic":
                draft_probs = warp(draft_logits, params)
                drafts = sample(draft_probs, gen)
            else:
                drafts = draft_logits.argmax(-1)
        else:
            drafts = torch.empty(0, dtype=torch.long, device=device)
        _sync(device)
        stats.draft_s += time.perf_counter() - t

        # --- verify: one target forward over the whole block
        t = time.perf_counter()
        logits, feats = target.forward(torch.cat((anchor, drafts)))
        _sync(device)
        stats.verify_s += time.perf_counter() - t

        if mode == "greedy":
            a, nxt = verify_greedy(drafts, logits)
        elif mode == "strict":
            a, nxt = verify_strict(drafts, warp(logits, params), gen)
        else:
            p = warp(logits, params)
            a, nxt = (verify_probabilistic(drafts, draft_probs, p, gen) if L > 1 else (0, int(sample(p[0], gen))))
        draft_list = drafts.tolist()
        stats.record(draft_list, a)

        # --- commit: anchor + a drafts are now in the target cache; feed their features next
        target.crop(start + a + 1)
        if speculative:
            pending = feats[: a + 1]
        for tok in draft_list[:a] + [nxt]:
            out.append(tok)
            if tok in stop_ids:
                finish = "stop"
                break
            if len(out) >= max_new_tokens:
                break
        if finish is None and on_step is not None:
            finish = on_step(out)

    stats.decode_s = time.perf_counter() - t_decode
    stats.new_tokens = len(out)
    return LoopOutput(out, finish or "length", stats)
