"""Block length `auto`: the policy's arithmetic, its choices at the extremes, priors, the
cost curve cache, and that output stays the target's (greedy equality, sampling law)."""

import json
import math

import pytest
import torch

from dflash.engine.knobs import SpeculativeConfig
from dflash.engine.costs import CostCurve, cache_path, load_or_measure
from dflash.engine.engine import Engine, GenerationRequest
from dflash.engine.policy import BlockPolicy, Prior, expected_tokens
from dflash.engine.proposers.protocol import Offer

CFG = SpeculativeConfig()
# A CPU-like curve: verifying more tokens costs more, drafting is not free.
CPU = CostCurve(verify_s=[1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35], draft_s=[0.0] + [0.2 + 0.02 * d for d in range(7)])


def test_expected_tokens():
    assert expected_tokens([0.5, 0.5, 0.5], 1) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 2) == 1.5
    assert expected_tokens([0.5, 0.5, 0.5], 4) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens([1.0] * 7, 8) == 8.0


def _policy(prior_rate: float | None, costs=CPU, strength=1000.0) -> BlockPolicy:
    width = costs.max_block - 1
    prior = (Prior.default(width, CFG) if prior_rate is None
             else Prior([prior_rate * strength] * width, [strength] * width))
    return BlockPolicy.drafting(costs, costs.max_block, prior, CFG, name="drafter")


def _drafter(pending: int = 0) -> Offer:
    """The drafter's offer (deferred: it drafts only when chosen)."""
    return Offer("drafter", None, pending=pending)


def _observe(policy: BlockPolicy, conf: list[float], verify_len: int, accepted: int, draft_len: int) -> None:
    """A step's outcome: the drafter's where it drafted, else a plain step's."""
    policy.observe(_drafter() if draft_len > 1 else None, conf, verify_len, accepted, draft_len)


def test_never_kept_means_plain_steps_and_rare_cheap_probes():
    policy = _policy(0.0)
    lengths = []
    for _ in range(400):
        D = policy.draft_length()
        conf = [0.3] * (D - 1)
        L = policy.verify_length(conf) if D > 1 else 1
        lengths.append(D)
        _observe(policy, conf, L, 0, D)
    assert lengths[0] == 1
    probes = [d for d in lengths if d > 1]
    assert all(d <= CFG.probe_len for d in probes)
    assert len(probes) <= 400 / CFG.probe_after  # and they back off
    assert lengths[-200:].count(1) >= 200 - 200 / CFG.probe_max_gap - 1


def _first_probe(policy: BlockPolicy, steps: int = 200) -> int | None:
    for i in range(steps):
        D = policy.draft_length()
        if D > 1:
            return i
        _observe(policy, [], 1, 0, 1)
    return None


def test_an_informed_prior_that_drafting_does_not_pay_starts_with_a_long_gap():
    """Evidence already in the prior (never kept, judged 1000 times) replaces the early
    probes; a thin prior (a few judged drafts, never kept) probes at probe_after."""
    informed, thin = _policy(0.0), _policy(0.0, strength=CFG.informed_prior_steps / 2)
    floor = informed._probe_floor(informed.prices)  # what a failed probe's price allows (probe_overhead)
    assert _first_probe(informed) == max(CFG.informed_gap, floor)
    assert _first_probe(thin) == max(CFG.probe_after, floor) <= max(CFG.informed_gap, floor)
    assert _first_probe(_policy(None)) == 0  # a default prior (a first draft kept half the time) drafts at once


def test_probes_are_spaced_by_what_a_failed_one_costs():
    """Where a probe costs little (verifying 3 for 1.1 plain steps) it comes after a few plain
    steps; where verifying pays every row in full (llama.cpp's Q4_1 on an AVX2 CPU) failed
    probes are kept under probe_overhead of the time; where even drafts that are always kept
    cannot pay, there are none."""
    import math

    rowwise = CostCurve([1.0 + 0.9 * i for i in range(8)], [0.0] + [0.3] * 7)
    policy = _policy(0.0, costs=rowwise, strength=CFG.informed_prior_steps / 2)
    excess = rowwise.step_s(CFG.probe_len, CFG.probe_len) / rowwise.verify_s[0] - 1
    assert policy.probe_gap == math.ceil(excess / CFG.probe_overhead) > CFG.informed_gap
    assert _first_probe(policy, steps=400) == policy.probe_gap
    hopeless = CostCurve([1.0 + 1.1 * i for i in range(8)], [0.0] + [0.1] * 7)
    assert _first_probe(_policy(0.0, costs=hopeless, strength=4), steps=400) is None
    assert _policy(0.0, costs=hopeless).probe_gap == math.inf


def _first_planned_probe(policy: BlockPolicy, prompt_rows: int, steps: int = 400) -> int | None:
    """The step of the drafter's first probe when every step leaves one more target row it
    has not seen, after a prompt of `prompt_rows` (what step.py passes as pending rows)."""
    for i in range(steps):
        who, D = policy.choose([_drafter(prompt_rows + i)])
        if who is not None:
            return i
        _observe(policy, [], 1, 0, 1)
    return None


def test_a_probe_is_priced_with_the_rows_the_drafter_must_catch_up_on():
    """A probe's drafter pass also takes every target row it has not seen (at a request's
    first probe, the prompt and the answer so far): priced with them, the gap before a probe
    grows with them and failed probes stay under probe_overhead; where catching up on one
    row costs that share of a plain step already, no probe ever pays for itself."""
    def curve(row_s):
        return CostCurve(list(CPU.verify_s), list(CPU.draft_s), context_row_s=row_s)

    thin = CFG.informed_prior_steps / 2
    policy = _policy(0.0, costs=curve(0.002), strength=thin)
    base = policy.probe_gap
    policy.pending_rows = 100
    excess = CPU.step_s(CFG.probe_len, CFG.probe_len) / CPU.verify_s[0] - 1 + 100 * 0.002 / CPU.verify_s[0]
    assert policy.probe_gap == math.ceil(excess / CFG.probe_overhead) > base
    free = _first_planned_probe(_policy(0.0, costs=curve(0.0), strength=thin), 100)
    short, long = (_first_planned_probe(_policy(0.0, costs=curve(0.002), strength=thin), n) for n in (10, 100))
    assert free is not None and short is not None and long is not None and free < short < long
    assert _first_planned_probe(_policy(0.0, costs=curve(CFG.probe_overhead), strength=thin), 10) is None


def test_the_drafter_sits_out_a_request_it_would_never_run_in():
    """Until the drafter has an outcome in the request, drafting only gets dearer as it goes
    on (the rate never falls below plain decoding's, pending rows grow): where plain beats
    every draft length at the start and no probe falls within the request's steps, the
    drafter sits the request out; one step more (the probe inside) or a prior that says
    drafts pay keeps it."""
    costs = CostCurve(list(CPU.verify_s), list(CPU.draft_s), context_row_s=0.002)
    thin = CFG.informed_prior_steps / 2
    probe_at = _first_planned_probe(_policy(0.0, costs=costs, strength=thin), 100)
    assert probe_at is not None and probe_at > 0
    assert _policy(0.0, costs=costs, strength=thin).drafter_sits_out(100, probe_at)
    assert not _policy(0.0, costs=costs, strength=thin).drafter_sits_out(100, probe_at + 1)
    assert not _policy(None, costs=costs).drafter_sits_out(100, 2)  # the default prior drafts at once
    never = _policy(0.0, costs=CostCurve(list(CPU.verify_s), list(CPU.draft_s), context_row_s=CFG.probe_overhead),
                    strength=thin)
    assert never.drafter_sits_out(10, 10_000) and never.pending_rows == 10


def test_a_request_the_drafter_sits_out_decodes_the_same_without_it(cpu_like_engine, tiny_engine):
    """The engine leaves the drafter (and the target's features for it) out of such a
    request: only suffix drafts and plain steps, the same greedy output as plain decoding."""
    never = {"accepted": [0] * 7, "judged": [1000] * 7}
    prompt = [5, 6, 7, 8, 5, 6, 7]
    ref = tiny_engine.generate(GenerationRequest(input_ids=prompt, max_new_tokens=12, block_size=1)).output_ids
    req = GenerationRequest(input_ids=prompt, max_new_tokens=12, prior=never)
    state = cpu_like_engine.admit(req)
    assert "dflash" not in state.proposals and "suffix" in state.proposals
    cpu_like_engine.release(state)
    res = cpu_like_engine.generate(req)
    assert res.output_ids == ref and "dflash" not in res.stats.by_proposer
    drafting = cpu_like_engine.admit(GenerationRequest(input_ids=prompt, max_new_tokens=12,
                                                       prior={"accepted": [1000] * 7, "judged": [1000] * 7}))
    assert "dflash" in drafting.proposals
    cpu_like_engine.release(drafting)


def test_the_drafter_plans_over_what_recent_requests_took(cpu_like_engine):
    """Most requests stop at an end token long before max_new_tokens: once enough auto
    generations have finished, a request plans its drafter's probes over their median
    length (a seeded one over max_new_tokens, so the same seed gives the same output)."""
    engine, saved = cpu_like_engine, list(cpu_like_engine.recent_counts)
    try:
        engine.recent_counts.clear()
        req = GenerationRequest(input_ids=[5, 6], max_new_tokens=100)
        for n in range(CFG.typical_after - 1):
            engine.recent_counts.append({"accepted": [], "judged": [], "steps": 10 + n})
        assert engine.steps_expected(req) == 100  # too few finished yet
        engine.recent_counts.append({"accepted": [], "judged": [], "steps": 40})
        assert engine.steps_expected(req) == sorted([10 + n for n in range(CFG.typical_after - 1)] + [40])[
            CFG.typical_after // 2]
        assert engine.steps_expected(GenerationRequest(input_ids=[5, 6], max_new_tokens=12)) == 12
        assert engine.steps_expected(GenerationRequest(input_ids=[5, 6], max_new_tokens=100, seed=3)) == 100
        res = engine.generate(GenerationRequest(input_ids=[5, 6], max_new_tokens=5, block_size=None))
        assert engine.recent_counts[-1]["steps"] == len(res.stats.steps)
    finally:
        engine.recent_counts.clear()
        engine.recent_counts.extend(saved)


def test_always_kept_means_the_full_block():
    policy = _policy(1.0)
    assert policy.draft_length() == CPU.max_block
    for _ in range(20):
        D = policy.draft_length()
        conf = [0.99] * (D - 1)
        L = policy.verify_length(conf)
        _observe(policy, conf, L, L - 1, D)
    assert policy.draft_length() == CPU.max_block
    assert policy.verify_length([0.99] * (CPU.max_block - 1)) == CPU.max_block


def test_confidence_decides_the_verify_length():
    """Same history, different confidences: verify confident drafts, not doubtful ones."""
    policy = _policy(0.4, strength=8)
    assert policy.verify_length([0.97, 0.95, 0.9, 0.05, 0.05, 0.05, 0.05]) >= 3
    assert policy.verify_length([0.02] * 7) == 1


def test_calibration_learns_an_overconfident_drafter():
    policy = _policy(None)
    before = policy.drafter.acceptance([0.95])[0]
    for _ in range(60):
        _observe(policy, [0.95, 0.95, 0.95], 4, 0, 4)  # confident, never right
    assert policy.drafter.acceptance([0.95])[0] < before / 4
    assert policy.verify_length([0.95] * 7) == 1


def test_certain_drafts_are_priced_as_kept():
    """A grammar's forced run (`Draft.certain`) is kept whatever the calibration says of its
    confidences. (That the rate and the calibration leave it out is the step's part:
    tests/test_constrained.py.)"""
    from dflash.engine.calibration import PointMass

    # a row costs 0.6 of a plain step: a point mass of unknown trust (half its confidence) is not worth one
    dear = CostCurve(verify_s=[1.0 + 0.6 * i for i in range(8)], draft_s=[0.0] * 8)
    policy = BlockPolicy(dear, dear.max_block, CFG, {"p": PointMass(CFG, dear.max_block - 1)})
    conf = [1.0, 1.0, 1.0, 0.02]
    assert policy.ready_verify("p", conf) == (1, pytest.approx(0.0))
    L, value = policy.ready_verify("p", conf, certain=3)
    assert L == 4 and value == pytest.approx(4 - 2.8)


def test_prior_from_counts_is_capped_and_falls_back():
    p = Prior.from_counts([100, 5], [1000, 50], 3, CFG)
    rates = p.rates()
    assert rates[0] == pytest.approx(0.1, abs=0.1)
    assert p.judged[0] <= CFG.max_prior_strength + CFG.prior_strength  # never outweighs a request
    assert rates[2] == pytest.approx(Prior.default(3, CFG).rates()[2])  # nobody judged position 3


def test_flat_costs_always_draft_everything_that_may_be_kept():
    """On a GPU-like device (verifying 16 costs what 1 does, drafting free) drafting pays
    whenever anything can be kept."""
    flat = CostCurve.flat(8)
    policy = _policy(0.3, costs=flat, strength=8)
    assert policy.draft_length() == 8


# --- the engine ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_like_engine():
    """The tiny engine with a CPU-like cost curve, so auto makes real choices."""
    from dflash.engine.drafter import init_random_drafter
    from tests.conftest import cpu_like_costs, make_tiny_target, tiny_drafter_config

    return Engine(make_tiny_target(), init_random_drafter(tiny_drafter_config(), seed=1, std=0.3), "tiny",
                  cost_curve=cpu_like_costs())


def test_auto_is_lossless_greedy(cpu_like_engine, tiny_engine):
    for prompt in ([5, 6, 7], [11, 2, 9, 30], [4]):
        ref = tiny_engine.generate(GenerationRequest(input_ids=prompt, max_new_tokens=40, block_size=1)).output_ids
        for engine in (cpu_like_engine, tiny_engine):
            res = engine.generate(GenerationRequest(input_ids=prompt, max_new_tokens=40))
            assert res.output_ids == ref
            assert res.stats.policy == "auto"


def test_auto_sampling_follows_the_target_law(cpu_like_engine):
    """Sampled continuations of a fixed prompt, thousands of times, under auto (which
    truncates verify lengths by the draft distributions' peaks): the joint law of the first
    two tokens must be the target's p(x1) p(x2 | x1) (chi-square)."""
    from tests.test_sampling import chi_square_ok

    engine = cpu_like_engine
    prompt = [5, 6, 7]
    params = dict(temperature=1.5, top_k=3)
    n = 2000
    counts: dict = {}
    lengths = set()
    # Batches of 4 seeds (small enough that drafting still pays at the batch's prices); 4 tokens, so
    # that auto may draft 3 and verify fewer.
    for first in range(0, n, 4):
        for res in engine.generate_many([GenerationRequest(input_ids=prompt, max_new_tokens=4, seed=seed, **params)
                                         for seed in range(first, first + 4)]):
            key = tuple(res.output_ids[:2])
            counts[key] = counts.get(key, 0) + 1
            lengths.update(len(s.draft_ids) + 1 for s in res.stats.steps)
    assert lengths - {1}, "auto never verified a draft: the test would not test it"
    # The exact law, from the target's own forward passes.
    from dflash.engine.sampling import SamplingParams
    from dflash.engine.sampling import warp

    sp = SamplingParams(**params)
    t = engine.target
    with torch.inference_mode():
        p1 = warp(t.forward(torch.tensor(prompt), t.new_cache())[0][-1], sp)
        law = {}
        for x1 in p1.nonzero()[:, 0].tolist():
            p2 = warp(t.forward(torch.tensor(prompt + [x1]), t.new_cache())[0][-1], sp)
            for x2 in p2.nonzero()[:, 0].tolist():
                law[(x1, x2)] = float(p1[x1] * p2[x2])
    assert set(counts) <= set(law), "a pair the target cannot produce"
    keys = sorted(law)
    ok, detail = chi_square_ok(torch.tensor([float(counts.get(k, 0)) for k in keys]),
                               torch.tensor([law[k] for k in keys]))
    assert ok, detail


def test_copy_drafter_makes_auto_draft_the_full_block(copy_engine):
    """A drafter that is always right (with flat, low confidence: calibration must learn to
    trust it) ramps up to the full block within a few steps and stays there."""
    res = copy_engine.generate(GenerationRequest(input_ids=[5, 6, 7], max_new_tokens=80))
    assert res.output_ids == [0] * 80
    lengths = [len(s.draft_ids) + 1 for s in res.stats.steps]
    full = copy_engine.block_size
    assert full in lengths[:8], lengths
    assert all(n == full for n in lengths[lengths.index(full) : -1]), lengths


def test_engine_prior_and_explanation():
    """On given prices (a curve timed on a busy machine would make the choice arbitrary): a
    never-kept drafter starts plain, an always-kept one at the whole block."""
    from dflash.engine.drafter import init_random_drafter
    from dflash.engine.engine import Engine
    from tests.conftest import cpu_like_costs, make_tiny_target, tiny_drafter_config

    tiny_engine = Engine(make_tiny_target(), init_random_drafter(tiny_drafter_config(), seed=1, std=0.3),
                         "tiny-drafter", cost_curve=cpu_like_costs(tiny_drafter_config().block_size))
    never = {"accepted": [0] * 7, "judged": [500] * 7}
    always = {"accepted": [500] * 7, "judged": [500] * 7}
    assert tiny_engine.explain_policy(never)["start_block_size"] == 1 or tiny_engine.cost_curve.relative()[
        "step"][1] < 1.0  # only when drafting is free could a never-kept drafter pay
    ex = tiny_engine.explain_policy(always)
    assert ex["start_block_size"] == tiny_engine.block_size
    assert [r["block_size"] for r in ex["lengths"]] == list(range(1, tiny_engine.block_size + 1))
    assert ex["lengths"][-1]["expected_tau"] > 7


def test_bad_priors_and_block_sizes(tiny_engine):
    from dflash.errors import DFlashError

    for bad in ({"accepted": [1]}, {"accepted": [-1], "judged": [1]}, {"accepted": ["x"], "judged": [1]}, [1, 2]):
        with pytest.raises(DFlashError) as err:
            tiny_engine.generate(GenerationRequest(input_ids=[5], max_new_tokens=2, prior=bad))
        assert err.value.code == "bad_prior"
    for bad in (0, 9, -1):
        with pytest.raises(DFlashError) as err:
            tiny_engine.generate(GenerationRequest(input_ids=[5], max_new_tokens=2, block_size=bad))
        assert err.value.code == "bad_block_size"


# --- the cost curve ---------------------------------------------------------------------


def test_cost_curve_is_measured_once_and_cached(tmp_path, tiny_engine, monkeypatch):
    import dflash.engine.costs as costs

    calls = []
    real = costs.measure
    monkeypatch.setattr(costs, "measure", lambda e, *a: calls.append(1) or real(e, *a))
    # timing noise on a tiny model must not decide this test; the spot check has its own
    monkeypatch.setattr(costs, "is_stale", lambda checks: False)
    first = load_or_measure(tiny_engine, tmp_path)
    again = load_or_measure(tiny_engine, tmp_path)
    assert len(calls) == 1 and again == first
    assert first.max_block == tiny_engine.block_size
    assert all(v > 0 for v in first.verify_s) and first.draft_s[0] == 0 and all(d > 0 for d in first.draft_s[1:])
    assert cache_path(first.key, tmp_path).is_file()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)  # another thread count: another curve
    load_or_measure(tiny_engine, tmp_path)
    assert len(calls) == 2
    rel = first.relative()
    assert rel["step"][0] == 1.0 and math.isclose(rel["verify"][0], 1.0)


def test_a_draft_is_priced_with_what_it_adds_to_the_verify_after_it():
    """A drafter whose runtime slows the target's next forward (threads left spinning, a
    pool to wake) costs the step more than its own time: the curve's draft price includes it,
    and is never below the draft's own time."""
    import time

    from dflash.engine.costs import _StepBench

    bench = object.__new__(_StepBench)
    bench.device = torch.device("cpu")
    after_draft = {"slow": False}

    def draft(D, context_rows=1):
        time.sleep(0.002)
        after_draft["slow"] = True

    def verify(L):
        time.sleep(0.004 + (0.006 if after_draft["slow"] else 0.0))
        after_draft["slow"] = False

    bench.draft, bench.verify = draft, verify
    alone = bench.draft_s(2, repeats=3)
    assert 0.002 <= alone < 0.0075
    assert bench.drafted_s(2, repeats=3) >= 0.0075  # 2 ms of its own + 6 ms more in the verify after it
    bench.verify = lambda L: time.sleep(0.004)  # a drafter that leaves nothing behind
    assert 0.002 <= bench.drafted_s(2, repeats=3) < 0.0075


def _scaled(curve: CostCurve, factor: float) -> CostCurve:
    return CostCurve([v * factor for v in curve.verify_s], [d * factor for d in curve.draft_s], dict(curve.key),
                     curve.measured_at)


def test_cached_curve_measured_under_load_is_measured_again(tmp_path, tiny_engine, monkeypatch):
    """A curve cached while the machine was busy prices everything too high; the spot check
    at load sees the machine is faster now and measures again. A cache that is cheaper than
    the spot check (the machine is busy now) is kept: interference only adds time."""
    import dflash.engine.costs as costs

    real = load_or_measure(tiny_engine, tmp_path)
    path = cache_path(real.key, tmp_path)
    calls = []
    measure = costs.measure
    monkeypatch.setattr(costs, "measure", lambda e, *a: calls.append(1) or measure(e, *a))

    path.write_text(json.dumps(_scaled(real, 20.0).to_dict()))  # measured while busy
    checks = costs.spot_check(tiny_engine, _scaled(real, 20.0))
    assert set(checks) == {"verify_1", "verify_4", f"draft_{tiny_engine.block_size}"}
    assert costs.is_stale(checks)
    fresh = load_or_measure(tiny_engine, tmp_path)
    assert len(calls) == 1 and fresh.verify_s[0] < 20.0 * real.verify_s[0] * costs.SPOT_TOLERANCE
    assert json.loads(path.read_text())["verify_s"] == fresh.verify_s  # the bad cache is replaced

    cheap = _scaled(real, 0.05)
    path.write_text(json.dumps(cheap.to_dict()))
    # (the tiny model's own ratios are timing noise: only the level is judged here)
    monkeypatch.setattr(costs, "SPOT_SHAPE_TOLERANCE", float("inf"))
    assert load_or_measure(tiny_engine, tmp_path) == cheap and len(calls) == 1


def test_a_cached_curve_of_the_wrong_shape_is_stale():
    """A curve that is not too high but prices a verify of 4 at 1.13 plain steps where the
    spot check says 1.40 would steer the policy into drafting too much: measured again.
    Ratios within the tolerance, at any level, are kept."""
    import dflash.engine.costs as costs

    def checks(now_1, now_4, cached_1, cached_4):
        return {"verify_1": (now_1, cached_1), "verify_4": (now_4, cached_4), "draft_16": (0.004, 0.004),
                "batch_8_verify_1": (0.02, 0.002)}  # a batch's and the draft's levels play no part in the shape

    assert costs.is_stale(checks(0.0065, 0.0091, 0.0079, 0.0090))  # flat cache: 1.13 against 1.40
    assert costs.is_stale(checks(0.0065, 0.0070, 0.0065, 0.0091))  # steep cache: 1.40 against 1.08
    assert not costs.is_stale(checks(0.0065, 0.0091, 0.0066, 0.0090))  # the same shape
    assert not costs.is_stale(checks(0.0130, 0.0182, 0.0066, 0.0090))  # busy now, same shape: kept
    assert costs.is_stale(checks(0.0040, 0.0056, 0.0066, 0.0090))  # faster now: the level rule
    assert not costs.is_stale({"verify_1": (0.0065, 0.0079)})  # one length: no shape to judge


def test_pending_context_rows_are_priced_into_a_draft():
    """A request that decoded plainly for a while brings every row since to its next drafter
    pass: at a price per row, enough of them make a draft that would pay not pay."""
    priced = CostCurve(CPU.verify_s, CPU.draft_s, context_row_s=0.05)
    policy = _policy(0.6, costs=priced, strength=8)
    assert policy.choose([_drafter(pending=1)])[0].name == "drafter"
    assert policy.choose([_drafter(pending=200)]) == (None, 1)
    assert policy.choose([_drafter(pending=1)])[0].name == "drafter"  # fewer rows: decided afresh


def test_the_curve_times_lengths_in_rounds_and_prices_padded_lengths_alike():
    """A slow moment of the machine (here: its first dozen calls) costs every length one
    sample, not one length all of them; and on a target that pads a lone row to two, a
    verify of 1 is priced as a verify of 2 (the same call), whichever was timed faster."""
    import time

    from dflash.engine.costs import _curve, _StepBench

    bench = object.__new__(_StepBench)
    bench.device, bench.block_size = torch.device("cpu"), 4
    bench.seqs = [object()]  # one sequence: lengths under min_rows are one padded call
    calls = {"n": 0}

    def busy():
        calls["n"] += 1
        return 0.02 if calls["n"] <= 12 else 0.0

    bench.verify = lambda L: time.sleep(0.002 * max(L, 2) + busy())
    bench.draft = lambda D, context_rows=1: time.sleep(0.001 * D + busy())
    for min_rows in (1, 2):
        calls["n"] = 0
        bench.target = type("T", (), {"min_rows": min_rows})()
        verify_s, draft_s = _curve(bench, (1, 2, 3, 4), repeats=3)
        assert all(v < 0.002 * max(L, 2) + 0.0015 for L, v in enumerate(verify_s, 1)), verify_s  # no slow sample kept
        assert all(d < 0.001 * D + 0.0015 for D, d in enumerate(draft_s[1:], 2)), draft_s
        if min_rows == 2:
            assert verify_s[0] == verify_s[1]
    # In a batch of several sequences a call is not padded (each sequence's own rows go
    # through the weights): a verify of 2 rows keeps its own, dearer price.
    calls["n"] = 100
    bench.seqs = [object(), object()]
    bench.verify = lambda L: time.sleep(0.003 * L)
    verify_s, _ = _curve(bench, (1, 2, 3, 4), repeats=3)
    assert verify_s[1] > verify_s[0] + 0.002, verify_s


def test_each_length_is_timed_after_a_call_of_its_own_length():
    """A runtime whose call right after a much larger one runs slow (ONNX Runtime on a Zen 4:
    a plain step 6.4 ms alone, 7.7 ms after a verify of 16) must not have its plain step
    timed only in that state: the curve would price every short verify too flat. Here a
    verify costs 1 ms + 0.5 ms a row, and 4 ms more right after a verify of 8 rows or more
    (the warm-up's included); the curve keeps the true prices."""
    import time

    from dflash.engine.costs import MEASURED, _curve, _StepBench

    bench = object.__new__(_StepBench)
    bench.device, bench.block_size, bench.seqs = torch.device("cpu"), 16, [object()]
    bench.target = type("T", (), {"min_rows": 1})()
    last = {"rows": 16}  # the warm-up ends with the largest shapes

    def verify(L):
        time.sleep(0.001 + 0.0005 * L + (0.004 if last["rows"] >= 8 else 0.0))
        last["rows"] = L

    bench.verify, bench.draft = verify, lambda D, context_rows=1: time.sleep(0.0002)
    verify_s, _ = _curve(bench, MEASURED, 2)
    assert verify_s[0] < 0.0025 and verify_s[1] < 0.003  # 1.5 and 2 ms, not 5.5 and 6
    assert 1.5 < verify_s[3] / verify_s[0] < 2.4  # a verify of 4: 3 ms, twice a plain step
