"""The suffix proposer's ceiling (dflash.bench.ceiling): an oracle over plain decoding's outputs."""

import pytest

from dflash.bench.ceiling import ceiling_table, suffix_ceiling

FLAT = [0.01] * 16  # verifying any length costs one plain step
LINEAR = [0.01 * L for L in range(1, 17)]  # every verified row costs a plain step


def test_an_answer_that_copies_its_prompt_is_drafted_whole_at_flat_prices():
    prompt = list(range(100, 140))
    out = suffix_ceiling([prompt], [prompt[:30]], FLAT)
    assert out["tokens"] == 30
    # The first two tokens must be decoded plainly (a match needs two tokens), then chains as
    # long as twice the match, at most 15 drafts: far fewer steps than tokens.
    assert out["steps"] < 8
    assert out["tau"] == pytest.approx(30 / out["steps"])
    assert out["speedup"] == pytest.approx(out["tau"])  # flat prices: speedup is τ


def test_new_text_gains_nothing():
    out = suffix_ceiling([[1, 2, 3]], [list(range(500, 560))], FLAT)
    assert out["steps"] == 60 and out["tau"] == 1.0 and out["speedup"] == pytest.approx(1.0)
    assert out["kept_histogram"][0] == 60


def test_when_every_row_costs_a_step_right_chains_gain_nothing():
    prompt = list(range(100, 140))
    out = suffix_ceiling([prompt], [prompt[:30]], LINEAR)
    assert out["speedup"] == pytest.approx(1.0)
    assert out["kept_histogram"][0] < 30  # the chains were right, they just could not pay


def test_dearer_than_plain_steps_is_never_verified():
    prompt = list(range(100, 140))
    dear = [0.01] + [1.0] * 15  # any verify block costs a hundred plain steps
    out = suffix_ceiling([prompt], [prompt[:30]], dear)
    assert out["steps"] == 30 and out["speedup"] == pytest.approx(1.0)


def test_whole_generations_keep_plain_decodings_prefill():
    prompt = list(range(100, 140))
    decode = suffix_ceiling([prompt], [prompt[:30]], FLAT)
    # Plain decoding took 1 s, half of it the prefill: only the other half shrinks.
    whole = suffix_ceiling([prompt], [prompt[:30]], FLAT, timings=[(1.0, 0.5)])
    assert whole["decode_speedup"] == pytest.approx(decode["speedup"])
    assert whole["speedup"] == pytest.approx(1.0 / (0.5 + 0.5 / decode["speedup"]))


def test_later_prompts_draft_from_earlier_outputs():
    answer = list(range(700, 740))
    alone = suffix_ceiling([[1, 2]], [answer], FLAT)
    repeated = suffix_ceiling([[1, 2], [1, 2]], [answer, answer], FLAT)
    second_steps = repeated["steps"] - alone["steps"]
    assert alone["tau"] == 1.0  # nothing to copy from the first time
    assert second_steps < len(answer) / 4  # the workload memory has it the second time


def test_one_output_and_timing_per_prompt():
    with pytest.raises(ValueError):
        suffix_ceiling([[1]], [], FLAT)
    with pytest.raises(ValueError):
        suffix_ceiling([[1]], [[2]], FLAT, timings=[])


def test_table_sets_the_ceiling_beside_what_was_reached():
    results = [{"suite": "code", "method": "ar", "speedup_vs_ar": 1.0,
                "suffix_ceiling": {"tau": 2.4, "speedup": 1.77}},
               {"suite": "code", "method": "suffix", "speedup_vs_ar": 1.31}]
    table = ceiling_table(results)
    assert "| code | 2.40 | 1.77 | - | 1.31 | - |" in table
    results[0]["suffix_replay"] = {"speedup": 1.52}
    assert "| code | 2.40 | 1.77 | 1.52 | 1.31 | - |" in ceiling_table(results)
    assert ceiling_table([{"suite": "code", "method": "ar"}]) == ""
