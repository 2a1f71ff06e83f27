"""One engine step for a batch of requests, in phases: plan, propose, forward, verify and
commit, observe.

Every state in the batch is either prefilling (its next prompt chunk joins the forward,
within the step's token budget) or decoding. A decoding state's step: the anchor is its
last committed token. Plan: every proposer (the registry's, dflash.engine.proposers) offers
what it can for the state, and the policy chooses one offer at this batch's prices (with a
fixed block size: the model drafter, for that many positions). Propose: each model drafter
drafts for every state that chose it, in one pass, and the policy picks how many of those
drafts L to verify. Forward: the target verifies every state's `[anchor, drafts]` rows and
takes the prefill chunks in one packed forward. The verify rule then
keeps a prefix of each state's drafts and adds one token of the target's own; D = L = 1 is
a plain autoregressive step through the same code. Greedy output equals the target's own
greedy output because every committed token is the target's choice, given the committed
prefix, in the forward that verified it.

The verify rules and the commit are per state and pure (`verify`, `commit`): a state's
output never depends on which other states shared its step, except through the rounding
of a batched matmul (measured by `dflash.bench.load`; a top-2 gap of the target's logits
below 1e-4 at the first difference is rounding).

A state's `constraint` (its answer's form: dflash.engine.state.AnswerConstraint) is a
constraint on verification, whoever drafted: every draft is cut where the constraint
forbids it before it is priced or verified, every verified row is masked to the tokens it
allows (greedy: the best allowed token; sampling: the masked, renormalised law), and it
advances over the committed tokens only. So a constrained state's output is constrained
plain decoding's, token for token (greedy) or in law (sampling).
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from dflash.engine.proposers.protocol import Draft, Offer
from dflash.engine.sampling import (argmax_rows, mask_logits, sample, verify_greedy, verify_probabilistic,
                                    verify_strict, warp)
from dflash.engine.state import DecodeState, StepResult
from dflash.engine.target import TargetRow


def allowed(state: DecodeState, draft: list[int]) -> torch.Tensor | None:
    """The tokens the state's constraint allows at each row a verify of `draft` scores
    (bool [len(draft) + 1, V]); None: any."""
    return state.constraint.masks(draft) if state.constraint is not None else None


def first_token(logits: torch.Tensor, state: DecodeState) -> int:
    rows = allowed(state, [])
    mask = rows[0] if rows is not None else None
    if state.params.greedy:
        return int(argmax_rows(logits if mask is None else mask_logits(logits, mask)))
    return int(sample(warp(logits, state.params, mask), state.generator))


def commit(state: DecodeState, tokens: list[int]) -> list[int]:
    """Append tokens until a stop id, a stop string or max_new_tokens; returns those kept.
    The state's constraint advances over them; where it then leaves one token that ends the
    answer, that token is committed too, without a forward (the target's masked row could
    give nothing else)."""
    kept = _append(state, tokens)
    if state.constraint is not None:
        state.constraint.advance(kept)
        end = None if state.finish_reason else state.constraint.end_token()
        if end is not None:
            state.constraint.advance(_append(state, [end]))
            kept.append(end)
    return kept


def _append(state: DecodeState, tokens: list[int]) -> list[int]:
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


def verify(logits: torch.Tensor, drafts: torch.Tensor, draft_probs, state: DecodeState,
           allowed_rows: torch.Tensor | None = None) -> tuple[int, int]:
    """(accepted drafts, the target's next token) by the state's verify rule, over the
    tokens `allowed_rows` allows at each row (None: all). Drafts without a distribution
    (point masses) are verified by the strict rule when sampling."""
    mode = state.params.verify_mode
    if mode == "greedy":
        return verify_greedy(drafts, logits, allowed_rows)
    p = warp(logits, state.params, allowed_rows)
    if mode == "strict" or draft_probs is None:
        return verify_strict(drafts, p, state.generator)
    if len(drafts) == 0:
        return 0, int(sample(p[0], state.generator))
    return verify_probabilistic(drafts, draft_probs, p, state.generator)


_NO_DRAFTS = torch.empty(0, dtype=torch.long)  # shared, never written: no new tensor per plan in the hot loop


def _sampled(state: DecodeState, probs) -> bool:
    """Whether drafts with these distributions are verified by the probabilistic rule (drawn
    from the drafter's law: a forbidden one must stay, to be rejected at its row)."""
    return probs is not None and state.params.verify_mode == "probabilistic"


def _cut(state: DecodeState, tokens: torch.Tensor, probs) -> int:
    """How many of the drafts the state's constraint lets a verify take (all: none)."""
    if state.constraint is None or not len(tokens):
        return len(tokens)
    return state.constraint.cut(tokens.tolist(), _sampled(state, probs))


def _within(state: DecodeState, offer: Offer) -> Offer | None:
    """A ready offer cut where the state's constraint forbids its chain, before the policy
    prices it (None: nothing of it is allowed)."""
    d = offer.draft
    n = _cut(state, d.tokens, d.probs)
    if n == len(d.tokens):
        return offer
    if n == 0:
        return None
    return replace(offer, draft=Draft(d.tokens[:n], None if d.probs is None else d.probs[:n],
                                      None if d.confidence is None else d.confidence[:n], min(d.certain, n)))


class _Plan:
    """One decoding state's part of the step: the offer it takes (None: a plain step), the
    positions drafted for it (anchor included) and the drafts it verifies."""

    def __init__(self, state: DecodeState, draft_len: int, offer: Offer | None):
        self.state = state
        self.anchor = state.output_ids[-1]
        self.draft_len = draft_len
        self.offer = offer if draft_len > 1 else None
        self.drafts, self.probs, self.confidence = _NO_DRAFTS, None, []
        self.certain = 0  # of the drafts, those the state's grammar forces
        if self.offer is not None and not self.offer.deferred:  # a ready draft: verify as chosen
            self.drafts = offer.draft.tokens[: draft_len - 1]
            self.confidence = offer.draft.confidence[: draft_len - 1]
            self.certain = min(offer.draft.certain, draft_len - 1)

    @property
    def name(self) -> str | None:
        return self.offer.name if self.offer is not None else None

    @property
    def deferred(self) -> bool:
        return self.offer is not None and self.offer.deferred

    def take(self, draft) -> None:
        """A deferred offer's draft; auto verifies as far as its confidences say, and never
        past where the state's constraint cuts it (the confidences stay the drafter's own,
        for its calibration)."""
        self.drafts, self.probs = draft.tokens, draft.probs
        policy = self.state.policy
        L = len(self.drafts) + 1
        if policy is not None:
            self.confidence = draft.confidence
            L = policy.verify_length(self.confidence)
        L = min(L, _cut(self.state, self.drafts, self.probs) + 1)
        self.drafts = self.drafts[: L - 1]
        self.probs = self.probs[: L - 1] if self.probs is not None else None


def _most(state: DecodeState, engine) -> int:
    """How many tokens a decoding state may verify this step (0: no room left in the context)."""
    start = state.length - 1  # position of the anchor (the last committed token)
    # The sequence may not grow past the context: the last verify ends at position ctx - 2.
    room = engine.target.context_length - 1 - start
    if room < 1 or state.policy is None:
        return max(min(state.block_size, room), 0)
    # auto never drafts what it could not commit
    return min(room, state.max_new_tokens - len(state.output_ids), state.policy.max_block)


def _offers(engine, decoding: list[DecodeState], mosts: list[int]) -> list[list[Offer]]:
    """Every proposer's offers for each auto state with room for a draft, in registry order."""
    asked = [i for i, (s, most) in enumerate(zip(decoding, mosts)) if s.policy is not None and most > 1]
    offered: list[list[Offer]] = [[] for _ in decoding]
    for proposer in engine.proposers:
        for i, offer in zip(asked, proposer.offer([(decoding[i], mosts[i]) for i in asked])):
            if offer is not None and not offer.deferred:
                offer = _within(decoding[i], offer)
            if offer is not None:
                offered[i].append(offer)
    return offered


def _fixed(engine, state: DecodeState, most: int) -> _Plan:
    """A fixed block size: the state's model drafter drafts `most` positions."""
    drafter = next((p for p in engine.proposers if p.deferred and p.name in state.proposals), None)
    return _Plan(state, most, Offer(drafter.name, drafter) if drafter is not None else None)


def _plan(engine, decoding: list[DecodeState], mosts: list[int],
          chunks: list[tuple[DecodeState, int]]) -> list[_Plan | None]:
    """What each decoding state verifies (None: no room left), priced for this batch: the
    prefill chunks it shares the forward with, and the extra rows the states planned before
    it take, so each state pays what its own rows add to the step (not what they would add
    alone)."""
    offered = _offers(engine, decoding, mosts)
    plans: list[_Plan | None] = []
    extra, prefill_tokens = 0, sum(n for _, n in chunks)
    for state, most, offers in zip(decoding, mosts, offered):
        if most < 1:
            plans.append(None)
            continue
        if state.policy is None:
            plan = _fixed(engine, state, most)
        else:
            state.policy.price(engine.prices(len(decoding), len(chunks), prefill_tokens + extra))
            offer, n = state.policy.choose(offers)
            plan = _Plan(state, min(n, most), offer)
        plans.append(plan)
        extra += plan.draft_len - 1
    return plans


def _propose(engine, plans: list[_Plan]) -> float:
    """Each model drafter drafts for every state that took its offer, in one pass; seconds."""
    t = time.perf_counter()
    drafting = [p for p in plans if p.deferred]
    for proposer in engine.proposers:
        mine = [p for p in drafting if p.offer.source is proposer]
        if mine:
            for p, draft in zip(mine, proposer.propose([(p.state, p.draft_len) for p in mine])):
                p.take(draft)
    draft_s = time.perf_counter() - t
    engine.note_drafting(len(drafting))
    return draft_s


def _room(budget: int | None, rows: int, min_chunk: int) -> int | None:
    """Prefill tokens the forward may take beside `rows` decoding rows: what the budget
    leaves, but at least `min_chunk` (or the budget, if smaller) so a prefill always
    progresses (None: no limit)."""
    return None if budget is None else max(budget - rows, min(min_chunk, budget))


def _prefill_chunks(prefilling: list[DecodeState], room: int | None) -> list[tuple[DecodeState, int]]:
    """Prompt chunks for this step, first come first served within `room` tokens."""
    chunks = []
    for state in prefilling:
        left = len(state.prompt_ids) - state.prefilled
        n = left if room is None else min(left, room)
        if n <= 0:
            break
        chunks.append((state, n))
        if room is not None:
            room -= n
    return chunks


def _fit(chunks: list[tuple[DecodeState, int]], room: int | None) -> list[tuple[DecodeState, int]]:
    """The planned chunks cut to the `room` the decoding rows left once their drafts are
    known (never more than was planned: the plan counted one row per decoding state)."""
    return chunks if room is None else _prefill_chunks([s for s, _ in chunks], room)


def _forward(engine, plans: list[_Plan], chunks: list[tuple[DecodeState, int]]):
    """ONE target forward: every decoding state's [anchor, drafts], then the prefill chunks,
    with the features every proposer of theirs reads. (output, layers computed, seconds)."""
    t = time.perf_counter()
    rows, layers = [], []
    for p in plans:
        p.draft_list = p.drafts.tolist()
        ids = [p.anchor] + p.draft_list
        rows.append(TargetRow(p.state.seq, ids, len(ids)))
        layers.append(_layers(p.state, engine))
    for state, n in chunks:
        last = state.prefilled + n == len(state.prompt_ids)
        rows.append(TargetRow(state.seq, state.prompt_ids[state.prefilled : state.prefilled + n], 1 if last else 0))
        layers.append(_layers(state, engine))
    union = tuple(dict.fromkeys(j for ls in layers for j in ls))
    out = engine.target.forward_batch(rows, union) if rows else None
    return out, union, time.perf_counter() - t


def _verify_commit(engine, p: _Plan, out, i: int, union: tuple[int, ...], draft_s: float,
                   verify_s: float) -> StepResult:
    """Verify forward row i against the plan's drafts, roll back, commit, tell the policy
    and the proposer how the offer fared (pure per state)."""
    state = p.state
    t = time.perf_counter()
    accepted, nxt = verify(out.logits[i], p.drafts.to(out.logits[i].device), p.probs, state,
                           allowed(state, p.draft_list))
    start = state.length - 1
    verify_len = len(p.draft_list) + 1
    # Per-position counts are a model drafter's (block length auto's workload prior).
    state.stats.record(p.draft_list, accepted, p.name, positional=p.offer is None or p.deferred)
    state.stats.forced_tokens += min(accepted, p.certain)
    if state.policy is not None:
        # The grammar's certain drafts are kept whatever was chosen: the policy and the proposer
        # learn from the rest, as if the step had verified that alone (a JSON answer's keys
        # must not make its values' drafts look dear, nor teach a calibration anything).
        k = p.certain
        state.policy.observe(p.offer, p.confidence[k:], verify_len - k, accepted - k, p.draft_len)
        if p.offer is not None:
            p.offer.source.outcome(state, p.offer, p.confidence[k:], verify_len - k, accepted - k)
    # The anchor and the kept drafts are now in the target's cache; their features are
    # what the proposers reading features see next.
    engine.target.rollback(state.seq, start + accepted + 1)
    _observe(engine, state, out, i, union, accepted + 1)
    committed = commit(state, p.draft_list[:accepted] + [nxt])
    if p.deferred:
        state.stats.draft_s += draft_s
    state.stats.verify_s += verify_s + time.perf_counter() - t
    return StepResult(p.anchor, p.draft_list, accepted, nxt, committed, p.draft_len, verify_len,
                      state.finish_reason, proposer=p.name)


def _no_room(state: DecodeState) -> StepResult:
    """A decoding state at the end of the context: done."""
    state.finish_reason = "context"
    anchor = state.output_ids[-1]
    return StepResult(anchor, [], 0, anchor, [], 1, 1, "context")


def _prefilled(engine, state: DecodeState, n: int, out, i: int, union: tuple[int, ...]) -> StepResult:
    """A prefill chunk is cached; the prompt's last one gives the first token."""
    _observe(engine, state, out, i, union, None)
    state.prefilled += n
    committed = []
    if not state.prefilling:
        committed = commit(state, [first_token(out.logits[i][-1], state)])
    return StepResult(-1, [], 0, committed[0] if committed else None, committed, 0, 0, state.finish_reason,
                      prefilled=n)


def _results(states: list[DecodeState], filling: list[bool], decoded: list[StepResult],
             prefilled: list[StepResult], wall: float) -> list[StepResult]:
    """The step's results in the order of `states` (a prefill that got no room: an empty
    result), each state's wall time booked as prefill or decode time."""
    decoded_it, prefilled_it = iter(decoded), iter(prefilled)
    results = []
    for state, is_filling in zip(states, filling):
        res = next(prefilled_it, None) if is_filling else next(decoded_it)
        if res is None:
            res = StepResult(-1, [], 0, None, [], 0, 0, None)
        elif res.is_prefill:
            state.stats.prefill_s += wall
        else:
            state.stats.decode_s += wall
        results.append(res)
    return results


def step(engine, states: list[DecodeState], budget: int | None = None, min_chunk: int = 16) -> list[StepResult]:
    """One step for every state given (none may be done). `budget`: the most tokens the
    target forward may take (None: no limit); decoding rows come first, prefill chunks take
    what is left, but at least `min_chunk` (or the budget, if smaller) so a prefill always
    progresses."""
    t_step = time.perf_counter()
    filling = [s.prefilling for s in states]
    decoding = [s for s, f in zip(states, filling) if not f]
    mosts = [_most(s, engine) for s in decoding]
    room = _room(budget, sum(m > 0 for m in mosts), min_chunk)
    chunks = _prefill_chunks([s for s, f in zip(states, filling) if f], room)
    plans = _plan(engine, decoding, mosts, chunks)
    live = [p for p in plans if p is not None]
    draft_s = _propose(engine, live)
    chunks = _fit(chunks, _room(budget, sum(len(p.drafts) + 1 for p in live), min_chunk))
    out, union, verify_s = _forward(engine, live, chunks)
    rows = iter(range(len(live)))
    decoded = [_no_room(d) if p is None else _verify_commit(engine, p, out, next(rows), union, draft_s, verify_s)
               for d, p in zip(decoding, plans)]
    prefilled = [_prefilled(engine, s, n, out, len(live) + j, union) for j, (s, n) in enumerate(chunks)]
    return _results(states, filling, decoded, prefilled, time.perf_counter() - t_step)


def _features(out, i: int, layers: tuple[int, ...], union: tuple[int, ...]):
    """Row i's features of `layers`, from a forward that computed `union`."""
    feats = out.features[i]
    if feats is None or not layers or layers == union:
        return feats
    h = feats.shape[-1] // len(union)
    return torch.cat([feats[:, union.index(j) * h : (union.index(j) + 1) * h] for j in layers], dim=-1)


def _layers(state: DecodeState, engine) -> tuple[int, ...]:
    return tuple(dict.fromkeys(j for p in engine.proposers for j in p.layers_of(state)))


def _observe(engine, state: DecodeState, out, i: int, union: tuple[int, ...], rows: int | None) -> None:
    """Hand each feature-reading proposer its layers' features of the first `rows` rows of
    forward row i (None: all), the rows that entered the target's cache for good."""
    for proposer in engine.proposers:
        layers = proposer.layers_of(state)
        if layers:
            feats = _features(out, i, layers, union)
            proposer.observe(state, feats[:rows] if feats is not None and rows is not None else feats)
