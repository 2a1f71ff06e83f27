"""The `suffix` method replayed without the target (dflash.bench.replay): the real proposer
and policy over plain decoding's outputs, priced by a cost curve."""

import json

import pytest

from dflash.bench.ceiling import suffix_ceiling
from dflash.bench.replay import replay_run, replay_suffix, replay_table

FLAT = [0.01] * 16  # verifying any length costs one plain step
DEAR = [0.01] + [1.0] * 15  # any verify block costs a hundred plain steps


def test_new_text_is_decoded_plainly():
    out = replay_suffix([[1, 2, 3]], [list(range(500, 560))], FLAT)
    # the first token comes with the prefill; nothing ever matches, so a plain step per token
    assert out["tokens"] == 60 and out["steps"] == 59
    assert out["decode_speedup"] == pytest.approx(1.0)


def test_an_answer_that_copies_its_prompt_is_drafted_in_few_steps():
    prompt = list(range(100, 160))
    out = replay_suffix([prompt], [prompt[:40]], FLAT)
    assert out["steps"] < 20 and out["decode_speedup"] > 2
    # never better than the oracle that knows every answer (its steps include the first token)
    assert out["steps"] >= suffix_ceiling([prompt], [prompt[:40]], FLAT)["steps"] - 1


def test_the_workload_memory_drafts_a_repeated_answer():
    """Two requests of one workload with the same answer: the second drafts it from the first."""
    answer = list(range(700, 760))
    one = replay_suffix([[1, 2]], [answer], FLAT)
    two = replay_suffix([[1, 2], [3, 4]], [answer, answer], FLAT)
    assert one["steps"] == 59
    assert two["steps"] - one["steps"] < 20


def test_no_measured_price_enters_the_replay(monkeypatch):
    """The lookup's measured price is left out, so the same inputs replay the same, however
    slow the machine's lookups were."""
    from dflash.engine.proposers.protocol import RunningPrice

    prompt = list(range(100, 160)) + [7, 8, 9] * 10
    args = ([prompt, prompt], [prompt[5:70], prompt[20:90]], [0.01 * (1 + 0.1 * L) for L in range(16)])
    fast = replay_suffix(*args)
    monkeypatch.setattr(RunningPrice, "add", lambda self, seconds: setattr(self, "s", 1.0))
    assert replay_suffix(*args) == fast


def test_where_verifying_costs_more_than_it_can_keep_nothing_is_drafted():
    prompt = list(range(100, 160))
    out = replay_suffix([prompt], [prompt[:40]], DEAR)
    assert out["steps"] == 39 and out["decode_speedup"] == pytest.approx(1.0)


def test_timings_scale_only_the_decoding_part():
    prompt = list(range(100, 160))
    out = replay_suffix([prompt], [prompt[:40]], FLAT, timings=[(2.0, 1.0)])
    # prefill (1 s) kept, decoding (1 s) shrunk by the decode speedup
    assert out["speedup"] == pytest.approx(2.0 / (1.0 + 1.0 / out["decode_speedup"]))


def test_one_output_and_timing_per_prompt():
    with pytest.raises(ValueError):
        replay_suffix([[1]], [], FLAT)
    with pytest.raises(ValueError):
        replay_suffix([[1]], [[2]], FLAT, timings=[])


def test_a_bench_run_is_replayed_from_its_folder(tmp_path, smol_dir):
    """From a run's results.json (its command, its cost curve) and journal (`ar`'s outputs)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_dir)
    texts = ["Repeat after me: the quick brown fox jumps over the lazy dog.",
             "Repeat after me: the quick brown fox jumps over the lazy cat."]
    prompts_file = tmp_path / "mine.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    run = tmp_path / "run"
    run.mkdir()
    command = f"dflash bench --suites none --prompts {prompts_file} --methods ar,suffix --max-new-tokens 32"
    (run / "results.json").write_text(json.dumps({
        "command": command, "verify_s": FLAT,
        "results": [{"suite": "mine", "method": "suffix", "speedup_vs_ar": 1.4}]}))
    rows = []
    for i, t in enumerate(texts):
        ids = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        answer = tok(t.split(": ")[1]).input_ids
        rows.append({"suite": "mine", "method": "ar", "index": i, "prompt_len": len(ids), "output_ids": answer,
                     "wall_s": 1.0, "prefill_s": 0.1})
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = replay_run(run)
    assert [r["suite"] for r in got] == ["mine"] and got[0]["suffix_reached"] == 1.4
    assert got[0]["tokens"] == sum(len(r["output_ids"]) for r in rows)
    assert got[0]["steps"] < got[0]["tokens"] - 2  # the answers copy their prompts
    assert "| mine |" in replay_table(got)
    (run / "samples.jsonl").write_text(json.dumps(rows[0]) + "\n")  # a prompt without its output
    with pytest.raises(SystemExit, match="no `ar` output"):
        replay_run(run)
    with pytest.raises(SystemExit, match="no results.json"):
        replay_run(tmp_path)
