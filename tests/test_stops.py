"""Stops: eos and extra stop ids, stop strings, max_new_tokens, the context length."""

import pytest

from dflash.engine.engine import GenerationRequest


def _free_run(engine, block_size=4, n=40):
    return engine.generate(GenerationRequest(input_ids=[5, 6, 7], max_new_tokens=n, block_size=block_size)).output_ids


@pytest.mark.parametrize("block_size", [1, 4, 8])
def test_extra_stop_id_truncates_at_first_occurrence(tiny_engine, block_size):
    free = _free_run(tiny_engine, block_size)
    stop = next(t for t in free[3:] if t not in tiny_engine.target.eos_ids)
    cut = free.index(stop)
    res = tiny_engine.generate(
        GenerationRequest(input_ids=[5, 6, 7], max_new_tokens=40, block_size=block_size, stop_ids=[stop])
    )
    assert res.output_ids == free[: cut + 1]
    assert res.finish_reason == "stop"


def test_eos_stops(tiny_engine, monkeypatch):
    free = _free_run(tiny_engine)
    eos = free[5]
    monkeypatch.setattr(tiny_engine.target, "eos_ids", [eos])
    res = tiny_engine.generate(GenerationRequest(input_ids=[5, 6, 7], max_new_tokens=40, block_size=4))
    assert res.output_ids == free[: free.index(eos) + 1] and res.finish_reason == "stop"


@pytest.mark.parametrize("n", [1, 2, 7])
def test_max_new_tokens_is_exact(tiny_engine, n):
    res = tiny_engine.generate(GenerationRequest(input_ids=[5, 6, 7], max_new_tokens=n, block_size=8))
    assert len(res.output_ids) == n and res.output_ids == _free_run(tiny_engine, 8)[:n]
    assert res.finish_reason in ("length", "stop")


def test_generation_fills_the_context_exactly(tiny_engine):
    ctx = tiny_engine.target.context_length
    prompt = [5] * (ctx - 10)
    res = tiny_engine.generate(GenerationRequest(input_ids=prompt, max_new_tokens=10, block_size=8))
    assert len(prompt) + len(res.output_ids) <= ctx
    assert len(res.output_ids) == 10


def test_stop_string_on_real_model(quick_engine):
    free = quick_engine.generate(GenerationRequest(prompt="List three colors.", chat=True, max_new_tokens=24))
    words = free.text.split()
    stop = words[3]
    res = quick_engine.generate(
        GenerationRequest(prompt="List three colors.", chat=True, max_new_tokens=24, stop=[stop])
    )
    assert res.finish_reason == "stop"
    assert res.text == free.text[: free.text.find(stop)]
    assert res.output_ids == free.output_ids[: len(res.output_ids)]
    assert stop in quick_engine.decode(res.output_ids) and stop not in quick_engine.decode(res.output_ids[:-1])
