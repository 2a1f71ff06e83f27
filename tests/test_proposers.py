"""The proposer seam: a proposer is one file plus one registry line, and the engine, the
policy, the statistics, `status` and the bench take it up with no other edit; an engine
runs with no drafter at all (the free proposers only)."""

import pytest

from dflash.engine.costs import CostCurve
from dflash.engine.engine import Engine, GenerationRequest
from dflash.engine.proposers import registry
from dflash.errors import DFlashError

FLAT = CostCurve([1.0] * 8, [0.0] * 8)  # verifying more rows costs nothing: any draft that may be kept pays


@pytest.fixture
def toy_registered(monkeypatch):
    """tests/toy_proposer.py registered (the registry's one list) for engines built from now on."""
    monkeypatch.setattr(registry, "PROPOSERS", list(registry.PROPOSERS))
    registry.register("tests.toy_proposer")


@pytest.fixture
def toy_engine(tiny_text_engine, toy_registered):
    """The tiny target with SmolLM2's tokenizer (text prompts for the bench), and the toy."""
    return Engine(tiny_text_engine.target, tiny_text_engine.drafter, "tiny-drafter", cost_curve=FLAT)


def test_a_proposer_from_one_file_drafts_counts_and_shows(toy_engine, tiny_text_engine, tmp_path):
    from dflash.bench.run import run_bench
    from dflash.serve.server import Worker

    assert [p.name for p in toy_engine.proposers][-1] == "toy"
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    plain = tiny_text_engine.generate(GenerationRequest(input_ids=prompt, max_new_tokens=16, block_size=1))
    # the policy chooses its offers (the only ones this request allows), the output stays the target's
    res = toy_engine.generate(GenerationRequest(input_ids=prompt, max_new_tokens=16, proposers=("toy",)))
    assert res.output_ids == plain.output_ids
    toy = res.stats.by_proposer["toy"]
    assert set(res.stats.by_proposer) == {"toy"} and toy["steps"] > 0 and toy["drafted"] >= toy["steps"]
    # outside the drafter's per-position counts: its drafts are point masses
    assert sum(res.stats.judged_per_position) == 0
    # status (the worker's, from the engine core's) shows it
    worker = Worker(toy_engine, socket_path=str(tmp_path / "w.sock"))
    assert worker.status()["proposers"]["toy"] == {"verified": toy["steps"]}
    # and the bench's dflash-auto, which lets every proposer draft, counts its drafts
    report = run_bench(toy_engine, ["chat"], ["dflash-auto"], limit=1, max_new=8)
    assert report["results"][0]["proposers"]["toy"]["steps"] > 0


def test_a_request_may_leave_a_registered_proposer_out(tiny_engine, toy_registered):
    """(The tiny 48-token vocabulary: its greedy answers repeat, so the suffix proposer drafts.)"""
    engine = Engine(tiny_engine.target, tiny_engine.drafter, "tiny-drafter", cost_curve=FLAT)
    assert "toy" in engine.proposer("toy").parts
    req = GenerationRequest(input_ids=[5, 6, 7, 5, 6, 7, 5, 6], max_new_tokens=24, proposers=("suffix",))
    res = engine.generate(req)
    assert "toy" not in res.stats.by_proposer and res.stats.by_proposer.get("suffix", {}).get("steps", 0) > 0


def test_an_engine_without_a_drafter_runs_the_free_proposers(tiny_engine):
    """No DFlash drafter: block length auto drafts with the suffix proposer alone, priced on a
    curve measured without one (every draft free); the output is the target's greedy."""
    engine = Engine(tiny_engine.target, None)
    assert engine.dflash is None and "dflash" not in [p.name for p in engine.proposers]
    assert engine.cost_curve.draft_s == [0.0] * engine.block_size == [0.0] * engine.config.max_block
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    plain = tiny_engine.generate(GenerationRequest(input_ids=prompt, max_new_tokens=20, block_size=1))
    free = Engine(tiny_engine.target, None, cost_curve=CostCurve([1.0] * 16, [0.0] * 16))
    res = free.generate(GenerationRequest(input_ids=prompt, max_new_tokens=20))
    assert res.output_ids == plain.output_ids and set(res.stats.by_proposer) <= {"suffix"}
    assert res.stats.by_proposer["suffix"]["steps"] > 0
    assert free.status()["drafter_sha256"] is None and free.in_use().name is None
    with pytest.raises(DFlashError) as err:
        free.admit(GenerationRequest(input_ids=prompt, max_new_tokens=4, block_size=4))
    assert err.value.code == "bad_block_size"
    assert free.generate(GenerationRequest(input_ids=prompt, max_new_tokens=4, block_size=1)).output_ids == \
        plain.output_ids[:4]
