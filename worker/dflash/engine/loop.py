"""The speculative loop as two functions over a DecodeState: prefill, and one step.

One step: the drafter runs once over `[anchor, MASK * (D-1)]`, seeing the features of
every token committed since its last call; the target verifies `[anchor, drafts]` (L
tokens) in one forward; a verify rule keeps a prefix of the drafts and adds one token of
the target's own. D = L = 1 is a plain autoregressive step through the same code. Greedy
output equals the target's own greedy output because every committed token is the
target's choice given the committed prefix.
"""

from __future__ import annotations

import time

import torch

from dflash.engine.sampling import sample, verify_greedy, verify_probabilistic, verify_strict, warp
from dflash.engine.state import DecodeState, DrafterInUse, StepResult
from dflash.engine.target import TargetModel


def _first_token(logits: torch.Tensor, state: DecodeState) -> int:
    if state.params.greedy:
        return int(logits.argmax())
    return int(sample(warp(logits, state.params), state.generator))


def commit(state: DecodeState, tokens: list[int]) -> list[int]:
    """Append tokens until a stop id, a stop string or max_new_tokens; returns those kept."""
    kept = []
    for tok in tokens:
        state.output_ids.append(tok)
        kept.append(tok)
        if tok in state.stop_ids or (state.stops is not None and state.stops.feed(tok)):
            state.finish_reason = "stop"
        elif len(state.output_ids) >= state.max_new_tokens:
            state.finish_reason = "length"
        if state.finish_reason:
            break
    return kept


def prefill(target: TargetModel, state: DecodeState) -> None:
    """Cache the prompt, take the first token, keep the prompt's features for the drafter."""
    t = time.perf_counter()
    logits, feats = target.forward(
        torch.tensor(state.prompt_ids, device=target.device), state.target_cache, state.layer_ids, last_only=True
    )
    if feats is not None:
        state.pending.append(feats)
    commit(state, [_first_token(logits[-1], state)])
    state.stats.prefill_s = time.perf_counter() - t


def _draft(target, drafting: DrafterInUse, state: DecodeState, anchor: torch.Tensor, draft_len: int, start: int):
    """One drafter forward over [anchor, MASK * (draft_len - 1)]. Returns the drafts, their
    distributions (probabilistic verify only) and each position's confidence (the draft
    distribution's peak; auto only)."""
    ctx = torch.cat(state.pending) if len(state.pending) > 1 else state.pending[0]
    state.pending.clear()
    positions = torch.arange(state.draft_cache.length, start + draft_len, device=anchor.device)
    logits = drafting.logits(ctx, target.embed(anchor), draft_len, positions, state.draft_cache)
    probs = None
    if state.params.verify_mode == "probabilistic":
        probs = warp(logits, state.params)
        drafts = sample(probs, state.generator)
        confidence = probs.max(-1).values if state.policy is not None else None
    else:
        drafts = logits.argmax(-1)
        confidence = logits.softmax(-1).max(-1).values if state.policy is not None else None
    return drafts, probs, confidence


def _verify(logits: torch.Tensor, drafts: torch.Tensor, draft_probs, state: DecodeState) -> tuple[int, int]:
    mode = state.params.verify_mode
    if mode == "greedy":
        return verify_greedy(drafts, logits)
    p = warp(logits, state.params)
    if mode == "strict":
        return verify_strict(drafts, p, state.generator)
    if len(drafts) == 0:
        return 0, int(sample(p[0], state.generator))
    return verify_probabilistic(drafts, draft_probs, p, state.generator)


def step(target: TargetModel, drafting: DrafterInUse, state: DecodeState) -> StepResult:
    """Draft, verify and commit once. The state must not be done. A state that carries its
    own drafter (it was started before a hot swap) drafts with that one, not the given one."""
    if state.drafter is not None:
        drafting = state.drafter
    t_step = time.perf_counter()
    device = target.device
    start = state.length - 1  # position of the anchor (the last committed token)
    anchor_id = state.output_ids[-1]
    # The sequence may not grow past the context: the last verify ends at position ctx - 2.
    room = target.context_length - 1 - start
    if room < 1:
        state.finish_reason = "context"
        return StepResult(anchor_id, [], 0, anchor_id, [], 1, 1, "context")
    policy = state.policy
    if policy is None:
        draft_len = min(state.block_size, room)
    else:  # auto never drafts what it could not commit
        draft_len = min(policy.draft_length(), room, state.max_new_tokens - len(state.output_ids))
    anchor = torch.tensor([anchor_id], device=device)

    t = time.perf_counter()
    drafts = torch.empty(0, dtype=torch.long, device=device)
    draft_probs, confidence = None, []
    if draft_len > 1:
        drafts, draft_probs, conf = _draft(target, drafting, state, anchor, draft_len, start)
        if policy is not None:
            confidence = conf.tolist()
            verify_len = policy.verify_length(confidence)
            drafts = drafts[: verify_len - 1]
            draft_probs = draft_probs[: verify_len - 1] if draft_probs is not None else None
    state.stats.draft_s += time.perf_counter() - t

    t = time.perf_counter()
    logits, feats = target.forward(torch.cat((anchor, drafts)), state.target_cache, state.layer_ids)
    accepted, nxt = _verify(logits, drafts, draft_probs, state)
    state.stats.verify_s += time.perf_counter() - t

    draft_list = drafts.tolist()
    verify_len = len(draft_list) + 1
    state.stats.record(draft_list, accepted, draft_len if draft_len > 1 else 0)
    if policy is not None:
        policy.observe(confidence, verify_len, accepted, draft_len)
    # Commit: the anchor and the kept drafts are now in the target's cache; their features
    # are what the drafter sees next.
    target.crop(state.target_cache, start + accepted + 1)
    if feats is not None:
        state.pending.append(feats[: accepted + 1])
    committed = commit(state, draft_list[:accepted] + [nxt])
    state.stats.decode_s += time.perf_counter() - t_step
    return StepResult(anchor_id, draft_list, accepted, nxt, committed, draft_len, verify_len, state.finish_reason)
