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
    methods = ["ar-hf", "ar", "dflash-4", "dflash-8", "dflash-auto", "prompt-lookup"]
    report = run_bench(tiny_text_engine, ["code", "chat", "agent"], methods, limit=2, max_new=6)
    write_report(report, tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["results"]) == 3 * len(methods)
    for r in saved["results"]:
        for key in ("suite", "method", "prompts", "new_tokens", "tokens_per_s", "tau", "speedup_vs_ar",
                    "speedup_vs_ar_hf", "greedy_mismatches"):
            assert key in r
        assert r["prompts"] == 2 and r["greedy_mismatches"] == 0  # lossless, and HF agrees
        assert (r["tau"] is None) == (r["method"] in ("ar-hf", "ar"))
    md = (tmp_path / "report.md").read_text()
    assert "| code | dflash-4 | " in md and "Drafts kept, by position" in md
    pos_rows = [line for line in md.splitlines() if line.startswith("| code | dflash-4 | ") and line.count("|") == 8]
    assert len(pos_rows) == 1 and pos_rows[0].endswith("| - |")  # a block of 4 drafts 3 positions
    for f in ("report.md", "speedup.png", "tau_by_block_size.png", "acceptance_histogram.png",
              "auto_block_sizes.png"):
        assert (tmp_path / f).stat().st_size > 0
    for key in ("torch", "threads", "dtype", "cpu", "date"):
        assert saved[key]
    # dflash-auto: the chosen verify lengths, one count per step, within the drafter's block.
    for r in (r for r in saved["results"] if r["method"] == "dflash-auto"):
        hist = {int(k): v for k, v in r["verify_length_histogram"].items()}
        assert sum(hist.values()) == sum(r["acceptance_length_histogram"].values())
        assert set(hist) <= set(range(1, tiny_text_engine.block_size + 1))
    assert "Verify lengths chosen by dflash-auto" in md


def test_step_profile_reports_every_length_and_its_parts(tiny_text_engine, tmp_path):
    from dflash.bench.step_profile import PARTS, profile, table

    result = profile(tiny_text_engine, lengths=(1, 2, 4, 16), repeats=2)
    assert result["ar_step_s"] > 0 and list(result["L"]) == ["1", "2", "4"]  # 16 > the drafter's 8
    for L, row in result["L"].items():
        assert row["total_vs_ar"] == pytest.approx(row["total_s"] / result["ar_step_s"])
        for part in PARTS:
            assert row[f"{part}_vs_ar"] >= 0
        drafted = int(L) > 1
        assert (row["drafter_forward_s"] > 0) == drafted and (row["drafter_lm_head_s"] > 0) == drafted
    assert "| 4 |" in table(result)


def test_unknown_method_or_missing_assistant(tiny_text_engine):
    with pytest.raises(SystemExit, match="unknown method"):
        run_bench(tiny_text_engine, ["chat"], ["nope"], 1, 2)
    with pytest.raises(SystemExit, match="--assistant"):
        run_bench(tiny_text_engine, ["chat"], ["assisted-ar"], 1, 2)


def test_assisted_ar_with_a_stored_assistant(tiny_text_engine, tmp_path, monkeypatch):
    """A stored assistant (layers only) is materialised once with the target's embedding
    and then runs transformers' assisted generation, greedy-identical to ar-hf."""
    from dflash.train.assistant import assistant_dir
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


def test_hf_speculative_methods_report_tau_from_the_target_calls(tiny_text_engine):
    """prompt-lookup's steps are read from the target's forward calls: they commit exactly
    the tokens it generated, each step at least one, and tau is their mean."""
    report = run_bench(tiny_text_engine, ["code", "agent"], ["ar-hf", "prompt-lookup"], 2, 12)
    for r in report["results"]:
        if r["method"] != "prompt-lookup":
            continue
        hist = {int(k): v for k, v in r["acceptance_length_histogram"].items()}
        assert sum(k * v for k, v in hist.items()) == r["new_tokens"] and min(hist) >= 1
        assert r["tau"] == pytest.approx(r["new_tokens"] / sum(hist.values()))
        assert 0 <= r["acceptance_rate"] <= 1 and r["greedy_mismatches"] == 0


def test_verify_log_reads_commits_from_cache_lengths():
    from dflash.bench.run import VerifyLog

    log = VerifyLog.__new__(VerifyLog)
    # prompt of 5; call 1 = prefill + 3 candidates, 2 kept (+1) -> cache 7 at call 2, which
    # feeds 1 + 4 candidates and keeps 0 -> cache 8; call 3 feeds 1 + 2 and the output ends
    # at 6 new tokens, so the last call committed 2.
    log.calls = [(0, 8), (7, 5), (8, 3)]
    assert log.steps(prompt_len=5, new_tokens=6) == ([2, 0, 1], 3 + 4 + 2)


def test_journal_resumes_an_interrupted_run(tiny_text_engine, tmp_path, monkeypatch):
    from dflash.bench.run import Runner

    journal = tmp_path / "samples.jsonl"
    full = run_bench(tiny_text_engine, ["chat"], ["ar", "dflash-4"], 3, 5, journal=journal)
    lines = journal.read_text().splitlines()
    assert len(lines) == 1 + 2 * 3
    journal.write_text("\n".join(lines[:4]) + "\n" + lines[4][:10])  # stopped mid-write
    calls = []
    real = Runner.run
    monkeypatch.setattr(Runner, "run", lambda self, m, ids, *a: calls.append(m) or real(self, m, ids, *a))
    resumed = run_bench(tiny_text_engine, ["chat"], ["ar", "dflash-4"], 3, 5, journal=journal, resume=True)
    # warm-ups, then only what was missing: prompt 1's dflash-4 (cut mid-line) and prompt 2
    assert calls == ["ar", "dflash-4"] + ["dflash-4", "ar", "dflash-4"]
    # the cut line is gone, and every generation is in the journal once, readable
    records = [json.loads(line) for line in journal.read_text().splitlines()[1:]]
    assert sorted((r["method"], r["index"]) for r in records) == sorted(
        (m, i) for m in ("ar", "dflash-4") for i in range(3))
    for a, b in zip(full["results"], resumed["results"]):
        assert (a["method"], a["new_tokens"], a["tau"], a["greedy_mismatches"]) == \
               (b["method"], b["new_tokens"], b["tau"], b["greedy_mismatches"])
    with pytest.raises(SystemExit, match="max_new_tokens"):
        run_bench(tiny_text_engine, ["chat"], ["ar"], 3, 6, journal=journal, resume=True)


@pytest.mark.slow
def test_the_gpu_check_dry_run_writes_every_part(tmp_path):
    """`make gpu-check-dry`: the GPU check's own code on the CPU with tiny sizes, so the one
    script a lent GPU runs has run end to end before (bench, step profile, load)."""
    from dflash.bench import gpu_check

    assert gpu_check.main(["--dry-run", "--out", str(tmp_path), "--threads", "2"]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(report["parts"]) == {"bench", "step_profile", "load"}
    assert report["sizes"] == gpu_check.DRY and report["machine"]["device"] == "cpu"
    assert {r["method"] for r in report["parts"]["bench"]["results"]} >= {"ar", "dflash-auto", "dflash-16"}
    assert "Load through the socket" in (tmp_path / "gpu_check.md").read_text()
