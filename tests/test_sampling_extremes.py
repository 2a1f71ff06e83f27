"""Sampling parameters at the edge of float range: valid, and never an internal error.

A temperature of 1e-300 rounds to 0 in float32 (0 / 0 is NaN), one of 1e300 to inf, and a
top_p of 1e-300 to 0 (which dropped every token). All are valid parameters: the first and
the last behave as greedy decoding (the top token kept), a huge temperature as uniform
sampling. These tests call `warp` and `sample` directly, the verify rules with such
distributions, and the engine; property tests cover the whole valid range, and the engine
must answer any parameters, valid or not, with a result or a DFlashError.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash.engine.sampling import SamplingParams
from dflash.engine.engine import GenerationRequest
from dflash.engine.sampling import sample, verify_probabilistic, verify_strict, warp
from dflash.errors import DFlashError

LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0], [-3.0, 4.0, 4.5, 0.5], [0.0, 0.5, -7.0, 1.0]])
TOP = LOGITS.argmax(-1)


def assert_distribution(p: torch.Tensor) -> None:
    assert p.dtype == torch.float32
    assert torch.isfinite(p).all() and (p >= 0).all(), p
    assert torch.allclose(p.sum(-1), torch.ones(p.shape[:-1]), atol=1e-5), p.sum(-1)


def one_hot_top(p: torch.Tensor) -> bool:
    return bool((p.argmax(-1) == TOP).all() and (p.max(-1).values == 1.0).all())


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-46, 1e-45])
def test_tiny_temperature_is_greedy(temperature):
    p = warp(LOGITS, SamplingParams(temperature=temperature, seed=1))
    assert_distribution(p)
    assert one_hot_top(p)
    gen = torch.Generator().manual_seed(1)
    assert torch.equal(sample(p, gen), TOP)


def test_tiny_temperature_keeps_exact_ties():
    p = warp(torch.tensor([1.0, 3.0, 3.0, -2.0]), SamplingParams(temperature=1e-300))
    assert p.tolist() == [0.0, 0.5, 0.5, 0.0]


def test_tiny_top_p_keeps_the_top_token():
    for top_p in (1e-300, 5e-324, 1e-45, 1e-8):
        p = warp(LOGITS, SamplingParams(temperature=1.0, top_p=top_p, seed=1))
        assert_distribution(p)
        assert one_hot_top(p)
        gen = torch.Generator().manual_seed(1)
        assert torch.equal(sample(p, gen), TOP)


def test_huge_temperature_is_uniform_over_what_top_k_keeps():
    p = warp(LOGITS, SamplingParams(temperature=1e300))
    assert_distribution(p)
    assert torch.allclose(p, torch.full_like(p, 0.25))
    p = warp(LOGITS, SamplingParams(temperature=1e300, top_k=2))  # top-k chooses before the temperature flattens
    assert_distribution(p)
    expect = torch.zeros_like(p).scatter(-1, LOGITS.topk(2, dim=-1).indices, 0.5)
    assert torch.equal(p, expect)
    masked = torch.tensor([0.0, float("-inf"), 1.0, -2.0])  # -inf / inf would be NaN
    assert warp(masked, SamplingParams(temperature=1e300)).tolist() == pytest.approx([1 / 3, 0, 1 / 3, 1 / 3])


def test_ordinary_values_unchanged():
    """The fix leaves ordinary temperatures exactly as before: shift, then divide in float32."""
    for t in (0.1, 0.7, 1.0, 3.0):
        shifted = LOGITS - LOGITS.max(-1, keepdim=True).values
        assert torch.equal(warp(LOGITS, SamplingParams(temperature=t)), (shifted / t).softmax(-1))


def matched(drafts: torch.Tensor, greedy: torch.Tensor) -> int:
    return int((drafts == greedy[: len(drafts)]).to(torch.int32).cumprod(0).sum())


def test_verify_rules_with_extreme_distributions():
    """Target and draft distributions from warp at the extremes: the rules return a valid
    (accepted, token) and, with one-hot distributions, exactly the greedy answer."""
    target_logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    draft_logits = torch.randn(4, 11, generator=torch.Generator().manual_seed(1))
    greedy = target_logits.argmax(-1)
    for params in (SamplingParams(temperature=1e-300, seed=1), SamplingParams(temperature=1.0, top_p=1e-300),
                   SamplingParams(temperature=5e-324, top_p=1e-300, top_k=3)):
        p, q = warp(target_logits, params), warp(draft_logits, params)
        assert_distribution(p) and assert_distribution(q)
        gen = torch.Generator().manual_seed(2)
        for drafts in (greedy[:4], sample(q, gen), torch.tensor([], dtype=torch.long)):
            a, tok = verify_strict(drafts, p[: len(drafts) + 1], gen)
            assert a == matched(drafts, greedy) and tok == int(greedy[a])
        # Drafts sampled from q, for a q unlike p and for q = p (every draft kept, then the bonus).
        for q in (q, p[:4]):
            drafts = sample(q, gen)
            a, tok = verify_probabilistic(drafts, q, p, gen)
            assert a == matched(drafts, greedy) and tok == int(greedy[a])
        assert verify_probabilistic(greedy[:4], p[:4], p, gen) == (4, int(greedy[4]))
    params = SamplingParams(temperature=1e300, top_k=5)
    p, q = warp(target_logits, params), warp(draft_logits, params)
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        drafts = sample(q, gen)
        a, tok = verify_probabilistic(drafts, q, p, gen)
        assert 0 <= a <= 4 and p[a, tok] > 0
        a, tok = verify_strict(drafts, p, gen)
        assert 0 <= a <= 4 and p[a, tok] > 0


@pytest.mark.parametrize("verify", [None, "strict", "probabilistic"])
@pytest.mark.parametrize("block_size", [None, 1, 4])
def test_engine_tiny_temperature(tiny_engine, verify, block_size):
    greedy = tiny_engine.generate(GenerationRequest(input_ids=[5, 6, 7], max_new_tokens=4, block_size=block_size))
    res = tiny_engine.generate(GenerationRequest(input_ids=[5, 6, 7], max_new_tokens=4, temperature=1e-300, seed=1,
                                                 verify=verify, block_size=block_size))
    assert res.output_ids == greedy.output_ids  # the tiny target has no exact ties here


@pytest.mark.parametrize("verify", [None, "strict", "probabilistic"])
def test_engine_tiny_top_p(tiny_engine, verify):
    greedy = tiny_engine.generate(GenerationRequest(input_ids=[5, 6, 7], max_new_tokens=4))
    res = tiny_engine.generate(GenerationRequest(input_ids=[5, 6, 7], max_new_tokens=4, temperature=1, top_p=1e-300,
                                                 seed=1, verify=verify))
    assert res.output_ids == greedy.output_ids


def test_engine_huge_temperature(tiny_engine):
    res = tiny_engine.generate(GenerationRequest(input_ids=[5, 6, 7], max_new_tokens=4, temperature=1e300, seed=1))
    assert len(res.output_ids) == 4


# Finite temperatures across the whole float range: 0, subnormals, tiny, ordinary, huge.
temperatures = st.one_of(
    st.sampled_from([0.0, 5e-324, 1e-320, 1e-300, 1e-46, 1e-45, 1e-38, 1e-10, 1e300, 1.7976931348623157e308]),
    st.floats(min_value=0.0, allow_nan=False, allow_infinity=False),
    st.floats(min_value=1e-3, max_value=1e3),
)
top_ps = st.one_of(
    st.sampled_from([5e-324, 1e-300, 1e-45, 1e-8, 0.5, 1.0]),
    st.floats(min_value=0.0, max_value=1.0, exclude_min=True, allow_nan=False),
)
top_ks = st.one_of(st.integers(min_value=0, max_value=12), st.just(10**30))
logit_values = st.one_of(st.floats(min_value=-1e4, max_value=1e4, allow_nan=False), st.sampled_from([0.0, 30.0]))


@settings(max_examples=300, deadline=None)
@given(
    temperature=temperatures,
    top_p=top_ps,
    top_k=top_ks,
    rows=st.lists(st.lists(logit_values, min_size=6, max_size=6), min_size=1, max_size=3),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_warp_is_a_distribution_for_every_valid_parameter(temperature, top_p, top_k, rows, seed):
    if temperature == 0:
        temperature = 5e-324  # warp is only called with temperature > 0 (0 is greedy, no warp)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    logits = torch.tensor(rows)
    p = warp(logits, params)
    assert_distribution(p)
    is_max = logits == logits.max(-1, keepdim=True).values
    assert ((p * is_max).sum(-1) > 0).all()  # a most likely token always survives
    assert torch.equal((p * is_max).max(-1).values, p.max(-1).values)  # and none is likelier
    if top_k and top_k < 6:
        # top-k keeps the k likeliest and every token tied with the k-th
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        assert ((p > 0).sum(-1) <= (logits >= kth).sum(-1)).all()
    gen = torch.Generator().manual_seed(seed)
    tokens = sample(p, gen)
    assert (p[torch.arange(len(rows)), tokens] > 0).all()
    if len(rows) > 1:
        k = len(rows) - 1
        drafts = sample(p[:k], gen)
        for a, tok in (verify_probabilistic(drafts, p[:k], p, gen), verify_strict(drafts, p, gen)):
            assert 0 <= a <= k and p[a, tok] > 0


def _any_number():
    return st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(min_value=-5, max_value=10**400),
                     st.none(), st.just("1"))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    temperature=st.one_of(temperatures, _any_number()),
    top_p=st.one_of(top_ps, _any_number()),
    top_k=st.one_of(top_ks, st.integers(min_value=-3, max_value=3), st.just(2.5)),
    seed=st.one_of(st.none(), st.integers(min_value=-1, max_value=2**64)),
    verify=st.sampled_from([None, "greedy", "strict", "probabilistic", "nope"]),
    block_size=st.sampled_from([None, 1, 3, 8]),
)
def test_engine_answers_any_sampling_parameters(tiny_engine, temperature, top_p, top_k, seed, verify, block_size):
    request = GenerationRequest(input_ids=[5, 6, 7], max_new_tokens=3, temperature=temperature, top_p=top_p,
                                top_k=top_k, seed=seed, verify=verify, block_size=block_size)
    try:
        res = tiny_engine.generate(request)
    except DFlashError:
        return
    assert 1 <= len(res.output_ids) <= 3
    assert isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0
