"""`dflash bench` end to end on the tiny engine: every method and suite, the results file's
fields, greedy agreement between methods, and the plots."""

import json

import pytest

from dflash.bench.run import load_suite, run_bench, write_report


def test_suites_have_their_prompts():
    assert len(load_suite("code", None)) == 164
    assert len(load_suite("chat", None)) >= 60
    assert len(load_suite("agent", None)) >= 40
    assert len(load_suite("chat", 5)) == 5


def test_bench_all_methods(tiny_text_engine, tmp_path):
    methods = ["ar-hf", "ar", "dflash-4", "dflash-8", "prompt-lookup"]
    report = run_bench(tiny_text_engine, ["code", "chat", "agent"], methods, limit=2, max_new=6)
    write_report(report, tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["results"]) == 3 * len(methods)
    for r in saved["results"]:
        for key in ("suite", "method", "prompts", "new_tokens", "tokens_per_s", "tau", "speedup_vs_ar",
                    "speedup_vs_ar_hf", "greedy_mismatches"):
            assert key in r
        assert r["prompts"] == 2 and r["greedy_mismatches"] == 0  # lossless, and HF agrees
        assert (r["tau"] is None) == (r["method"] in ("ar-hf", "ar", "prompt-lookup"))
    for f in ("report.md", "speedup.png", "tau_by_block_size.png", "acceptance_histogram.png"):
        assert (tmp_path / f).stat().st_size > 0
    for key in ("torch", "threads", "dtype", "cpu", "date"):
        assert saved[key]


def test_unknown_method_or_missing_assistant(tiny_text_engine):
    with pytest.raises(SystemExit, match="unknown method"):
        run_bench(tiny_text_engine, ["chat"], ["nope"], 1, 2)
    with pytest.raises(SystemExit, match="--assistant"):
        run_bench(tiny_text_engine, ["chat"], ["assisted-ar"], 1, 2)


def test_assisted_ar_with_a_stored_assistant(tiny_text_engine, tmp_path, monkeypatch):
    """A stored assistant (layers only) is materialised once with the target's embedding
    and then runs transformers' assisted generation, greedy-identical to ar-hf."""
    from dflash.models import assistant_dir
    from dflash.train.assistant import build_assistant, save_assistant

    monkeypatch.setenv("PG_DFLASH_CACHE", str(tmp_path / "cache"))
    model = tiny_text_engine.target.model
    save_assistant(build_assistant(model, layers=2), tmp_path / "stored")
    hf = assistant_dir(tmp_path / "stored", model, target_is_default=False)
    assert (hf / "config.json").is_file() and hf.parent == tmp_path / "cache" / "assistants"
    mtime = (hf / "config.json").stat().st_mtime_ns
    assert assistant_dir(tmp_path / "stored", model, False) == hf and (hf / "config.json").stat().st_mtime_ns == mtime
    assert assistant_dir(None, model, target_is_default=False) is None  # no default for other targets
    report = run_bench(tiny_text_engine, ["chat"], ["ar-hf", "assisted-ar"], 2, 6, str(hf))
    rows = {r["method"]: r for r in report["results"]}
    assert rows["assisted-ar"]["greedy_mismatches"] == 0 and rows["assisted-ar"]["new_tokens"] > 0


def test_readme_section_is_generated_from_results(tiny_text_engine, tmp_path):
    from dflash.bench.readme import END, START, update

    report = run_bench(tiny_text_engine, ["chat"], ["ar", "dflash-4"], 1, 4)
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{START}\nold numbers\n{END}\n\nafter\n")
    update(readme, report, "dflash bench --limit 1")
    text = readme.read_text()
    assert "old numbers" not in text and "`dflash bench --limit 1`" in text and text.endswith("after\n")
    assert "| chat | dflash-4 | 1 |" in text
    update(readme, report, "dflash bench --limit 1")  # idempotent
    assert readme.read_text() == text
    readme.write_text("no markers")
    with pytest.raises(SystemExit, match="markers"):
        update(readme, report, "x")
