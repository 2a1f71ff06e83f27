"""One engine step for a batch of requests: plan, propose, ONE target forward, verify, commit.

Every state in the batch is either prefilling (its next prompt chunk joins the forward,
within the step's token budget) or decoding. A decoding state's step: the anchor is its
last committed token; the policy (or the fixed block size) picks how many positions D to
draft, the proposer drafts D - 1 tokens after the anchor for every state that drafts (one
drafter pass for all of them), the policy picks how many L <= D to verify, and the target
verifies every state's `[anchor, drafts]` rows in one packed forward. The verify rule then
keeps a prefix of each state's drafts and adds one token of the target's own; D = L = 1 is
a plain autoregressive step through the same code. Greedy output equals the target's own
greedy output because every committed token is the target's choice, given the committed
prefix, in the forward that verified it.

The verify rules and the commit are per state and pure (`verify`, `commit`): a state's
output never depends on which other states shared its step, except through the rounding
of a batched matmul (measured by `dflash.bench.load`; a top-2 gap of the target's logits
below 1e-4 at the first difference is rounding).
"""

from __future__ import annotations

import time

import torch

from dflash.engine.proposers.dflash import NAME as DFLASH
from dflash.engine.proposers.head import NAME as HEAD
from dflash.engine.proposers.suffix import NAME as SUFFIX
from dflash.engine.sampling import argmax_rows, sample, verify_greedy, verify_probabilistic, verify_strict, warp
from dflash.engine.state import DecodeState, StepResult
from dflash.engine.target import TargetRow


def first_token(logits: torch.Tensor, state: DecodeState) -> int:
    if state.params.greedy:
        return int(argmax_rows(logits))
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


def verify(logits: torch.Tensor, drafts: torch.Tensor, draft_probs, state: DecodeState) -> tuple[int, int]:
    """(accepted drafts, the target's next token) by the state's verify rule. Drafts without
    a distribution (point masses) are verified by the strict rule when sampling."""
    mode = state.params.verify_mode
    if mode == "greedy":
        return verify_greedy(drafts, logits)
    p = warp(logits, state.params)
    if mode == "strict" or draft_probs is None:
        return verify_strict(drafts, p, state.generator)
    if len(drafts) == 0:
        return 0, int(sample(p[0], state.generator))
    return verify_probabilistic(drafts, draft_probs, p, state.generator)


_NO_DRAFTS = torch.empty(0, dtype=torch.long)  # shared, never written: a tensor per plan costs ~5 us a step


class _Plan:
    """One decoding state's part of the step."""

    def __init__(self, state: DecodeState, draft_len: int, proposer: str | None):
        self.state = state
        self.anchor = state.output_ids[-1]
        self.draft_len = draft_len
        self.proposer = proposer if draft_len > 1 else None  # who drafts: dflash, suffix, head, or nobody
        self.drafts = _NO_DRAFTS
        self.probs = None
        self.confidence: list[float] = []


def _look(state: DecodeState, engine) -> tuple[int, object | None]:
    """Before a state is priced: how many tokens it may verify this step (0: no room left in
    the context) and the suffix proposer's chain, free to look at, so seen before choosing."""
    start = state.length - 1  # position of the anchor (the last committed token)
    # The sequence may not grow past the context: the last verify ends at position ctx - 2.
    room = engine.target.context_length - 1 - start
    if room < 1:
        return 0, None
    policy = state.policy
    if policy is None:
        return min(state.block_size, room), None
    # auto never drafts what it could not commit
    most = min(room, state.max_new_tokens - len(state.output_ids), policy.max_block)
    if most < 2 or SUFFIX not in state.proposals:
        return most, None
    chain = engine.suffix.propose([(state, most)])[0]
    return most, chain if len(chain.tokens) else None


def _ask_head(looked: list[tuple[DecodeState, int, object | None]], engine) -> tuple[list, dict[int, object]]:
    """The next-token head, all in one call, where it has a say: a guess where a state has
    no chain, and the first token of a chain whose earlier occurrences went more than one
    way (SuffixProposer.rechoose). `looked` with those chains chosen again, and the guesses
    by id of the state."""
    guess_for, choose_for = [], []
    for state, most, chain in looked:
        if most > 1 and HEAD in state.proposals:
            if chain is None:
                guess_for.append(state)
            elif (tokens := engine.suffix.choices(state)) is not None:
                choose_for.append((state, tokens))
    if not guess_for and not choose_for:
        return looked, {}
    head = engine.head
    probs = head.distributions(guess_for + [state for state, _ in choose_for])
    guesses = {}
    for state, p in zip(guess_for, probs):
        if p is not None:
            guesses[id(state)] = head.guess(p)
    rechosen = {id(state): engine.suffix.rechoose(state, head.probability_of(p, tokens))
                for (state, tokens), p in zip(choose_for, probs[len(guess_for):]) if p is not None}
    if rechosen:
        looked = [(s, most, rechosen.get(id(s), chain)) for s, most, chain in looked]
    return looked, guesses


def _plan(state: DecodeState, engine, most: int, chain, guess) -> _Plan | None:
    """What a decoding state drafts this step (None when it has no room left: context)."""
    if most < 1:
        return None
    policy = state.policy
    if policy is None:
        return _Plan(state, most, DFLASH)
    pending = sum(t.shape[0] for t in state.proposals[DFLASH].pending) if DFLASH in state.proposals else 0
    who, n = policy.plan(chain.confidence if chain is not None else None, engine.suffix.lookup_s,
                         DFLASH in state.proposals, pending, guess.confidence if guess is not None else None)
    if who in (SUFFIX, HEAD):
        got = chain if who == SUFFIX else guess
        n = min(n, most)
        plan = _Plan(state, n, who)
        plan.drafts, plan.confidence = got.tokens[: n - 1], got.confidence[: n - 1]
        return plan
    return _Plan(state, min(n, most), DFLASH if who == "dflash" else None)


def _prefill_chunks(prefilling: list[DecodeState], budget: int | None) -> list[tuple[DecodeState, int]]:
    """Prompt chunks for this step, first come first served within the budget."""
    chunks = []
    for state in prefilling:
        left = len(state.prompt_ids) - state.prefilled
        n = left if budget is None else min(left, budget)
        if n <= 0:
            break
        chunks.append((state, n))
        if budget is not None:
            budget -= n
    return chunks


def _features(out, i: int, layers: tuple[int, ...], union: tuple[int, ...]):
    """Row i's features of `layers`, from a forward that computed `union`."""
    feats = out.features[i]
    if feats is None or not layers or layers == union:
        return feats
    h = feats.shape[-1] // len(union)
    return torch.cat([feats[:, union.index(j) * h : (union.index(j) + 1) * h] for j in layers], dim=-1)


def step(engine, states: list[DecodeState], budget: int | None = None, min_chunk: int = 16) -> list[StepResult]:
    """One step for every state given (none may be done). `budget`: the most tokens the
    target forward may take (None: no limit); decoding rows come first, prefill chunks take
    what is left, but at least `min_chunk` (or the budget, if smaller) so a prefill always
    progresses."""
    target, dflash = engine.target, engine.dflash
    t_step = time.perf_counter()
    decoding = [s for s in states if not s.prefilling]
    prefilling = [s for s in states if s.prefilling]
    results: dict[int, StepResult] = {}

    # 1. Plan: what each decoding state drafts, priced for this batch: the prefill chunks it
    #    shares the forward with, and the extra rows the states planned before it take, so
    #    each state pays what its own rows add to the step (not what they would add alone).
    auto = any(s.policy is not None for s in decoding)
    if auto:
        chunks = _prefill_chunks(prefilling, None if budget is None else max(budget - len(decoding), min(min_chunk, budget)))
        prefill_tokens = sum(n for _, n in chunks)
    plans, extra = [], 0
    # The free proposers first: every state's suffix chain, then the head, in one call
    # (HeadProposer.distributions says why), for guesses and chains' first tokens.
    looked = [(state, *_look(state, engine)) for state in decoding]
    looked, guesses = _ask_head(looked, engine)
    for state, most, chain in looked:
        if state.policy is not None:
            state.policy.price(engine.prices(len(decoding), len(chunks), prefill_tokens + extra))
        plan = _plan(state, engine, most, chain, guesses.get(id(state)))
        if plan is None:
            state.finish_reason = "context"
            anchor = state.output_ids[-1]
            results[id(state)] = StepResult(anchor, [], 0, anchor, [], 1, 1, "context")
            continue
        plans.append(plan)
        extra += plan.draft_len - 1

    # 2. Draft: one drafter pass for every state the drafter drafts for.
    t = time.perf_counter()
    drafting = [p for p in plans if p.proposer == DFLASH]
    if drafting:
        for p, d in zip(drafting, dflash.propose([(p.state, p.draft_len) for p in drafting])):
            p.drafts, p.probs = d.tokens, d.probs
            if p.state.policy is not None:
                p.confidence = d.confidence
                L = p.state.policy.verify_length(p.confidence)
                p.drafts = p.drafts[: L - 1]
                p.probs = p.probs[: L - 1] if p.probs is not None else None
    draft_s = time.perf_counter() - t
    engine.note_drafting(len(drafting))
    decode_rows = sum(len(p.drafts) + 1 for p in plans)
    chunks = _prefill_chunks(prefilling, None if budget is None else max(budget - decode_rows, min(min_chunk, budget)))

    # 3. One target forward: every decoding state's [anchor, drafts], then prefill chunks.
    t = time.perf_counter()
    rows, layers = [], {}
    for p in plans:
        p.draft_list = p.drafts.tolist()
        ids = [p.state.output_ids[-1]] + p.draft_list
        rows.append(TargetRow(p.state.seq, ids, len(ids)))
        layers[id(p.state)] = _layers(p.state, engine)
    for state, n in chunks:
        last = state.prefilled + n == len(state.prompt_ids)
        rows.append(TargetRow(state.seq, state.prompt_ids[state.prefilled : state.prefilled + n], 1 if last else 0))
        layers[id(state)] = _layers(state, engine)
    union = tuple(dict.fromkeys(j for ls in layers.values() for j in ls))
    out = target.forward_batch(rows, union) if rows else None
    verify_s = time.perf_counter() - t

    # 4. Per state: verify, roll back, commit (pure, per state).
    for i, p in enumerate(plans):
        state = p.state
        t = time.perf_counter()
        accepted, nxt = verify(out.logits[i], p.drafts.to(out.logits[i].device), p.probs, state)
        start = state.length - 1
        draft_list = p.draft_list
        verify_len = len(draft_list) + 1
        state.stats.record(draft_list, accepted, p.proposer)
        if state.policy is not None:
            if p.proposer == SUFFIX:
                state.policy.observe_suffix(p.confidence, verify_len, accepted, engine.suffix.lookup_s)
                engine.suffix.learn(state.workload, p.confidence, verify_len, accepted)
            elif p.proposer == HEAD:
                state.policy.observe_guess(p.confidence, verify_len, accepted, engine.head.guess_s)
            else:
                state.policy.observe(p.confidence, verify_len, accepted, p.draft_len)
        # The anchor and the kept drafts are now in the target's cache; their features are
        # what the drafter sees next.
        target.rollback(state.seq, start + accepted + 1)
        _observe(engine, state, out, i, union, accepted + 1)
        committed = commit(state, draft_list[:accepted] + [nxt])
        if p.proposer == DFLASH:
            state.stats.draft_s += draft_s
        state.stats.verify_s += verify_s + time.perf_counter() - t
        results[id(state)] = StepResult(p.anchor, draft_list, accepted, nxt, committed, p.draft_len, verify_len,
                                        state.finish_reason, proposer=p.proposer)
    for j, (state, n) in enumerate(chunks):
        i = len(plans) + j
        _observe(engine, state, out, i, union, None)
        state.prefilled += n
        committed = []
        if not state.prefilling:  # the prompt is cached: its last row gives the first token
            committed = commit(state, [first_token(out.logits[i][-1], state)])
        results[id(state)] = StepResult(-1, [], 0, committed[0] if committed else None, committed, 0, 0,
                                        state.finish_reason, prefilled=n)

    wall = time.perf_counter() - t_step
    for state in states:
        if id(state) not in results:  # a prefill that got no room this step
            results[id(state)] = StepResult(-1, [], 0, None, [], 0, 0, None)
        elif results[id(state)].is_prefill:
            state.stats.prefill_s += wall
        else:
            state.stats.decode_s += wall
    return [results[id(s)] for s in states]


def _proposers(state: DecodeState, engine) -> list:
    """The state's proposers that read target features."""
    return [p for name, p in ((DFLASH, engine.dflash), (HEAD, engine.head)) if name in state.proposals]


def _layers(state: DecodeState, engine) -> tuple[int, ...]:
    return tuple(dict.fromkeys(j for p in _proposers(state, engine) for j in p.layers_of(state)))


def _observe(engine, state: DecodeState, out, i: int, union: tuple[int, ...], rows: int | None) -> None:
    """Hand each feature-reading proposer its layers' features of the first `rows` rows of
    forward row i (None: all), the rows that entered the target's cache for good."""
    for proposer in _proposers(state, engine):
        feats = _features(out, i, proposer.layers_of(state), union)
        proposer.observe(state, feats[:rows] if feats is not None and rows is not None else feats)
