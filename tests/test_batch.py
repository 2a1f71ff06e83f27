"""The batched engine step: several requests in one target forward, each as if alone.

`step(states)` against per-state steps, ragged batches (prefill chunks beside verify blocks
of different lengths), chunked prefill within a token budget, the packed drafter pass,
prices by batch, and the sampling law of batched steps (chi-square, end to end)."""

import math

import pytest
import torch

from dflash.engine.costs import CostCurve
from dflash.engine.engine import GenerationRequest
from dflash.engine.target import TargetRow
from tests.conftest import cpu_like_costs
from tests.test_sampling import chi_square_ok

PROMPTS = [[5, 6, 7], [9, 3, 11, 2, 30, 31, 17], [40], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]


def _req(ids, block, **kw):
    return GenerationRequest(input_ids=list(ids), max_new_tokens=kw.pop("max_new_tokens", 24), block_size=block, **kw)


@pytest.mark.parametrize("block", [1, 3, 8])
def test_step_of_a_batch_equals_each_state_alone(tiny_engine, block):
    """Fixed block sizes: the same drafts, acceptances and outputs, step for step."""
    reqs = [_req(p, block) for p in PROMPTS]
    alone = [tiny_engine.generate(r) for r in reqs]
    together = tiny_engine.generate_many(reqs)
    for a, b in zip(alone, together):
        assert b.output_ids == a.output_ids
        assert [s.draft_ids for s in b.stats.steps] == [s.draft_ids for s in a.stats.steps]
        assert [s.accepted for s in b.stats.steps] == [s.accepted for s in a.stats.steps]


def test_a_ragged_batch_equals_each_alone(tiny_engine):
    """Different block sizes, auto among them, prompts of different lengths, and states
    joining mid-way (one prefills while others verify): every output is its solo output."""
    reqs = [_req(PROMPTS[0], 1), _req(PROMPTS[1], 8), _req(PROMPTS[2], None), _req(PROMPTS[3], 3),
            _req(PROMPTS[1], None, max_new_tokens=5)]
    alone = [tiny_engine.generate(r).output_ids for r in reqs]
    states = [tiny_engine.admit(r) for r in reqs[:2]]
    pending = [tiny_engine.admit(r) for r in reqs[2:]]
    steps = 0
    while any(not s.done for s in states) or pending:
        if steps % 3 == 2 and pending:  # a newcomer joins a batch that is already decoding
            states.append(pending.pop(0))
        tiny_engine.step([s for s in states if not s.done])
        steps += 1
    assert [tiny_engine.finish(s).output_ids for s in states] == alone


def test_chunked_prefill_within_the_budget(tiny_engine):
    """A long prompt is cached in chunks of what the budget leaves after the decoding rows;
    the decoding request commits a token every step meanwhile, and both outputs are as alone."""
    long = [(7 * i) % 40 + 4 for i in range(60)]
    short = _req(PROMPTS[0], 1, max_new_tokens=40)
    alone = [tiny_engine.generate(short).output_ids, tiny_engine.generate(_req(long, 4)).output_ids]
    a = tiny_engine.start(short)
    b = tiny_engine.admit(_req(long, 4))
    budget, chunks = 24, []
    while b.prefilling:
        before = len(a.output_ids)
        res = tiny_engine.step([a, b], budget=budget)
        assert len(a.output_ids) == before + 1  # the decoding state was not held up
        chunks.append(res[1].prefilled)
    assert sum(chunks) == len(long) and max(chunks) <= budget - 1
    while not (a.done and b.done):
        tiny_engine.step([s for s in (a, b) if not s.done], budget=budget)
    assert [tiny_engine.finish(a).output_ids, tiny_engine.finish(b).output_ids] == alone


def test_a_prefill_always_progresses_when_the_budget_is_spent(tiny_engine):
    decoding = [tiny_engine.start(_req(p, 8)) for p in PROMPTS]
    newcomer = tiny_engine.admit(_req([4] * 40, 1))
    res = tiny_engine.step(decoding + [newcomer], budget=20)  # 4 x 8 verify rows > budget
    assert res[-1].prefilled == 16  # min_chunk
    for s in decoding + [newcomer]:
        tiny_engine.release(s)


def test_the_packed_drafter_pass_equals_one_pass_per_request(tiny_engine):
    """One drafter forward for several requests gives each the hidden states (and so the
    drafts) of its own forward."""
    from dflash.engine.drafter import DraftPart

    drafter = tiny_engine.drafter
    cfg = drafter.config
    gen = torch.Generator().manual_seed(3)
    parts, solo = [], []
    with torch.inference_mode():
        for S, L, done in ((5, 4, 0), (1, 8, 9), (3, 2, 4)):
            cache_a, cache_b = drafter.new_cache(), drafter.new_cache()
            if done:  # some context already in the cache
                ctx0 = torch.randn(1, done, cfg.num_features * cfg.hidden_size, generator=gen)
                blk0 = torch.randn(1, 1, cfg.hidden_size, generator=gen)
                for c in (cache_a, cache_b):
                    drafter(ctx0, blk0, torch.arange(0, done + 1), c)
            ctx = torch.randn(S, cfg.num_features * cfg.hidden_size, generator=gen)
            blk = torch.randn(L, cfg.hidden_size, generator=gen)
            pos = torch.arange(done, done + S + L)
            solo.append(drafter(ctx[None], blk[None], pos, cache_a)[0])
            parts.append(DraftPart(ctx, blk, pos, cache_b))
        packed = drafter.forward_packed(parts)
    for p, ref in zip(parts, solo):
        assert torch.allclose(packed[p.q_at : p.q_at + p.L], ref, atol=1e-5, rtol=1e-4)
        assert p.cache.length == p.positions[0] + p.S


def test_a_packed_target_forward_equals_each_sequence_alone(tiny_engine):
    """Rows of several sequences in one packed forward: each row's logits and features are
    those of its sequence alone (a transformers DynamicCache forward)."""
    target = tiny_engine.target
    layers = tiny_engine.layer_ids
    seqs = [target.new_sequence() for _ in PROMPTS]
    out = target.forward_batch([TargetRow(q, p, len(p)) for q, p in zip(seqs, PROMPTS)], layers)
    step = target.forward_batch([TargetRow(q, [3, 4][: i % 2 + 1], i % 2 + 1) for i, q in enumerate(seqs)], layers)
    for i, p in enumerate(PROMPTS):
        cache = target.new_cache()
        ref_logits, ref_feats = target.forward(torch.tensor(p), cache, layers)
        assert torch.allclose(out.logits[i], ref_logits, atol=1e-4, rtol=1e-4)
        assert torch.allclose(out.features[i], ref_feats, atol=1e-4, rtol=1e-4)
        ref2, _ = target.forward(torch.tensor([3, 4][: i % 2 + 1]), cache, layers)
        assert torch.allclose(step.logits[i], ref2, atol=1e-4, rtol=1e-4)
        assert seqs[i].length == len(p) + i % 2 + 1
        target.rollback(seqs[i], len(p))
        assert seqs[i].length == len(p)


# --- prices by batch -------------------------------------------------------------------------


def test_prices_of_one_request_are_the_single_request_curve():
    curve = cpu_like_costs(8)
    solo = curve.prices(1)
    assert list(solo.verify_s) == curve.verify_s and list(solo.draft_s) == curve.draft_s
    assert solo.plain_rate == pytest.approx(1 / curve.verify_s[0])
    assert curve.prices(1) is solo  # cached: the policy keeps decisions while prices stand


def _loaded_curve() -> CostCurve:
    """A plain step of 8 requests costs 1.7 of one; past that every row costs compute (0.1
    of a plain step each, as when a batch saturates the device)."""
    solo = [1.0, 1.5, 1.55, 1.6, 1.65, 1.7, 1.75, 1.8]
    batch = {"8": [1.7 + 0.8 * i for i in range(8)], "4": [1.45 + 0.4 * i for i in range(8)]}
    draft = [0.0] + [0.3 + 0.03 * i for i in range(7)]
    return CostCurve(solo, draft, {}, "", batch, {"8": [0.0] + [0.9 + 0.1 * i for i in range(7)],
                                                  "4": [0.0] + [0.6 + 0.06 * i for i in range(7)]})


def test_under_load_speculation_backs_off():
    """Alone, verifying 4 costs 1.6 plain steps and good drafts pay; in a batch of 8 each
    extra row delays a step that commits eight tokens, so time is priced at the batch's rate
    and the same acceptance no longer pays."""
    from dflash.engine.knobs import SpeculativeConfig
    from dflash.engine.policy import BlockPolicy, Prior

    curve, cfg = _loaded_curve(), SpeculativeConfig()
    prior = Prior.from_counts([60, 45, 30, 20, 12, 7, 4], [80, 60, 45, 30, 20, 12, 7], 7, cfg)
    alone = BlockPolicy.drafting(curve, 8, prior, cfg)
    loaded = BlockPolicy.drafting(curve, 8, prior, cfg)
    loaded.price(curve.prices(8, drafting=8))
    assert alone.draft_length() > 1
    assert loaded.draft_length() == 1
    batch = curve.prices(8)
    assert batch.plain_rate == pytest.approx(8 / curve.forward_s(8, 8))
    assert math.isclose(sum(curve.prices(8).verify_s[:1]) * 8, curve.forward_s(8, 8))


def test_the_cost_curve_measures_batches(tiny_engine, tmp_path):
    from dflash.engine import costs

    curve = costs.measure(tiny_engine, max_batch=8)
    sizes = {str(b) for b in costs.BATCHES if b < 8} | {"8"}  # the grid below the largest batch, and it
    assert set(curve.batch_verify_s) == sizes == set(curve.batch_draft_s) and len(sizes) > 1
    for b in sizes:
        assert len(curve.batch_verify_s[b]) == tiny_engine.block_size
        assert all(x >= y for x, y in zip(curve.batch_verify_s[b], curve.verify_s))
    assert "batch_verify" in curve.relative() and curve.key["max_batch"] == 8 and curve.context_row_s >= 0
    again = CostCurve.from_dict(curve.to_dict())
    assert again.batch_verify_s == curve.batch_verify_s and again.prices(3).verify_s == curve.prices(3).verify_s
    assert again.context_row_s == curve.context_row_s == again.prices(3).context_row_s


# --- the sampling law, batched ----------------------------------------------------------------


@pytest.mark.parametrize("verify,vocab", [("strict", None), ("probabilistic", None),
                                          pytest.param("probabilistic", "half", marks=pytest.mark.slow)])
def test_batched_sampling_follows_the_targets_law(tiny_engine, verify, vocab):
    """Two tokens sampled by batches of 16 requests drafting 3 tokens each: the joint law of
    (x1, x2) is the target's p1(x1) p2(x2 | x1) under the same warp (chi-square). Also when
    the drafter drafts over half the vocabulary only (a draft vocabulary: its distribution
    is zero on the other half, which the target's law still reaches; slow: the rule with such
    zeros is checked in tests/test_sampling.py's "zeros" case, the mapping in
    tests/test_draft_vocab.py)."""
    from dflash.engine.engine import Engine
    from dflash.engine.sampling import warp

    if vocab is not None:
        tiny_engine = Engine(tiny_engine.target, tiny_engine.drafter, "tiny-half", draft_vocab=list(range(1, 48, 2)),
                             cost_curve=tiny_engine.cost_curve)

    prompt, kw = [5, 6, 7], dict(temperature=1.5, top_k=3, verify=verify)
    target = tiny_engine.target
    params = _req(prompt, 4, **kw).sampling()
    with torch.inference_mode():
        p1 = warp(target.forward(torch.tensor(prompt), target.new_cache())[0][-1], params)
        support = torch.nonzero(p1).flatten().tolist()
        joint = {}
        for x1 in support:
            p2 = warp(target.forward(torch.tensor(prompt + [x1]), target.new_cache())[0][-1], params)
            for x2 in torch.nonzero(p2).flatten().tolist():
                joint[(x1, x2)] = float(p1[x1] * p2[x2])
    cells = sorted(joint)
    counts = torch.zeros(len(cells) + 1)  # the last cell: anything the law says is impossible
    for _ in range(100):
        for res in tiny_engine.generate_many([_req(prompt, 4, max_new_tokens=2, **kw) for _ in range(16)]):
            key = tuple(res.output_ids[:2])
            counts[cells.index(key) if key in joint else -1] += 1
    probs = torch.tensor([joint[c] for c in cells] + [0.0])
    ok, why = chi_square_ok(counts, probs)
    assert ok, why
