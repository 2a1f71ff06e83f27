"""The objective ablation: every arm starts from the same drafter, shares one feature cache
(with top-k for the soft arms), spends the same CPU budget with the cosine ending at it, is
not run again once finished, starts over when interrupted, and is scored by τ per CPU-hour."""

import json
from pathlib import Path

import pytest

from tools import train_ablate as ablate
from dflash.train.trainer import LINEAGE_FILE


def _fake_train(calls, tau_after):
    """Stands in for `dflash train`: records its options and writes the drafter's lineage
    the way the trainer does (start and end τ estimates, compute spent)."""

    def run(argv):
        opts = dict(zip(argv[1::2], argv[2::2]))
        calls.append(argv)
        stage = argv[argv.index("--stage") + 1]
        name = stage.removeprefix("ablation: ")
        drafter = Path(opts["--out"]) / "train" / "drafter"
        drafter.mkdir(parents=True)
        evals = [{"step": 0, "tau": 1.40, "by_group": {"code": 1.5, "chat": 1.3}},
                 {"step": 90, "tau": tau_after[name], "by_group": {"code": tau_after[name], "chat": 1.3}}]
        lineage = [{"stage": "before"}, {"stage": stage, "cpu_seconds": 1800.0, "seconds": 1900.0, "steps": 90,
                                         "blocks": 9000, "evals": evals}]
        (drafter / LINEAGE_FILE).write_text(json.dumps(lineage))
        return 0

    return run


def test_arms_share_data_and_budget_and_are_scored_per_cpu_hour(tmp_path, monkeypatch, capsys):
    calls = []
    tau_after = {"dpace slots 1-4": 1.46, "decay slots 1-16": 1.43}
    monkeypatch.setattr(ablate, "run_dflash", _fake_train(calls, tau_after))
    arms = ["--arm", "dpace slots 1-4=--weighting dpace --loss-positions 4",
            "--arm", "decay slots 1-16=--weighting decay"]
    ablate.main(["--out", str(tmp_path), "--init-from", "D", "--cpu-minutes", "30", "--sequences", "784", *arms])
    assert len(calls) == 2
    for argv in calls:
        opts = dict(zip(argv[1::2], argv[2::2]))
        assert argv[0] == "train" and opts["--init-from"] == "D" and opts["--cpu-budget-min"] == "30.0"
        assert opts["--features"] == str(tmp_path / "features") and opts["--topk"] == "32"
        assert opts["--sequences"] == "784"  # every arm on the same answers, however the corpus grew
        assert "--schedule-by-budget" in argv
    assert calls[1][calls[1].index("--weighting") + 1] == "decay"
    results = json.loads((tmp_path / "ablation.json").read_text())
    assert (tmp_path / "ablation.png").stat().st_size > 0
    # (1.46 - 1.40) τ in 1800 CPU-seconds = 0.12 per CPU-hour
    assert results["dpace slots 1-4"]["tau_gain_per_cpu_hour"] == pytest.approx(0.12)
    assert results["decay slots 1-16"]["tau_gain_per_cpu_hour"] == pytest.approx(0.06)
    assert "| dpace slots 1-4 | `--weighting dpace --loss-positions 4` | 30.0 | 90 | 1.400 → **1.460**" \
        in capsys.readouterr().out

    # Finished arms are not run again; an interrupted one (no drafter yet) starts over.
    calls.clear()
    stale = tmp_path / "soft" / "train"
    stale.mkdir(parents=True)
    (stale / "checkpoint.pt").write_text("half-way")
    tau_after["soft"] = 1.41
    ablate.main(["--out", str(tmp_path), "--init-from", "D", *arms, "--arm", "soft=--soft-mix 0.5"])
    assert [c[c.index("--stage") + 1] for c in calls] == ["ablation: soft"]
    assert not (stale / "checkpoint.pt").exists()


def test_report_marks_arms_not_run(tmp_path, capsys):
    ablate.main(["--out", str(tmp_path), "--report"])
    out = capsys.readouterr().out
    assert out.count("not run") == len(ablate.DEFAULT_ARMS)
