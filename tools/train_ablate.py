"""Objective ablations: which training setting raises τ most per unit of compute.

Every arm continues the same drafter on the same answers and the same feature cache
(built once, with the target's top-k logits so that soft-target arms can use them), for the
same budget of process CPU time, with the cosine ending when the budget does. Arms run one
after another (two torch jobs at once would skew each other's time), and each is scored by
the held-out τ estimate (simulate.py) before and after: the gain per CPU-hour decides.

    python -m tools.train_ablate --out RUN --init-from DRAFTER --cpu-minutes 16 --threads 1
    python -m tools.train_ablate --out RUN --report          # the table again, from RUN

An arm whose folder holds a finished drafter is not run again; an interrupted arm starts
over (its budget must be spent in one call to compare with the others).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from dflash.plots import pyplot

# name -> `dflash train` options. Items 3 and 4 of the drafter issue: the acceptance-aware
# weighting against the paper's decay, fewer loss slots, soft targets, and training at block 8.
DEFAULT_ARMS = {
    "dpace slots 1-4": "--weighting dpace --loss-positions 4",
    "dpace slots 1-16": "--weighting dpace",
    "decay slots 1-16": "--weighting decay",
    "dpace slots 1-4, soft 0.5": "--weighting dpace --loss-positions 4 --soft-mix 0.5",
    "dpace slots 1-4, block 8": "--weighting dpace --loss-positions 4 --train-block 8",
}
NO_PERIODIC_EVAL_MIN = 1e9  # evaluate at the start and the end only


def arm_folder(out: Path, name: str) -> Path:
    return out / "".join(c if c.isalnum() else "-" for c in name).strip("-")


def arm_argv(out: Path, name: str, options: str, common: list[str]) -> list[str]:
    return common + shlex.split(options) + [
        "--out", str(arm_folder(out, name)), "--features", str(out / "features"),
        "--schedule-by-budget", "--eval-minutes", str(NO_PERIODIC_EVAL_MIN), "--stage", f"ablation: {name}"]


def arm_result(folder: Path) -> dict | None:
    """The arm's finished stage from its drafter's lineage: τ before and after, compute spent."""
    from dflash.train.trainer import read_lineage

    lineage = read_lineage(folder / "train" / "drafter")  # written last, when the arm is done
    if not lineage:
        return None
    stage = lineage[-1]
    first, last = stage["evals"][0], stage["evals"][-1]
    cpu_h = stage["cpu_seconds"] / 3600
    return {"tau_start": first["tau"], "tau_end": last["tau"], "by_group_start": first["by_group"],
            "by_group_end": last["by_group"], "cpu_seconds": stage["cpu_seconds"], "seconds": stage["seconds"],
            "steps": stage["steps"], "blocks": stage["blocks"],
            "tau_gain_per_cpu_hour": round((last["tau"] - first["tau"]) / cpu_h, 3) if cpu_h else None}


def report(out: Path, arms: dict[str, str]) -> dict:
    results = {name: {"options": opts, **(arm_result(arm_folder(out, name)) or {"missing": True})}
               for name, opts in arms.items()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "ablation.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, out / "ablation.png")
    return results


def plot(results: dict, path: Path) -> None:
    """Held-out τ gain per CPU-hour of each finished arm, by group."""
    done = {n: r for n, r in results.items() if not r.get("missing")}
    if not done:
        return
    plt = pyplot()
    if plt is None:
        return

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, group in enumerate(("code", "chat")):
        gains = [(r["by_group_end"].get(group, 0) - r["by_group_start"].get(group, 0)) / (r["cpu_seconds"] / 3600)
                 for r in done.values()]
        ax.bar([j + (i - 0.5) * 0.38 for j in range(len(done))], gains, width=0.38, label=group)
    ax.set_xticks(range(len(done)), list(done), fontsize=8)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_ylabel("held-out τ gain per CPU-hour")
    ax.set_title("objective ablation: same drafter, data and CPU budget per arm")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(results: dict) -> str:
    rows = ["| arm | `dflash train` options | CPU min | steps | held-out τ before → after (code / chat) | "
            "τ gain per CPU-hour |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        if r.get("missing"):
            rows.append(f"| {name} | `{r['options']}` | not run | | | |")
            continue
        g0, g1 = r["by_group_start"], r["by_group_end"]
        rows.append(f"| {name} | `{r['options']}` | {r['cpu_seconds'] / 60:.1f} | {r['steps']} | "
                    f"{r['tau_start']:.3f} → **{r['tau_end']:.3f}** ({g0.get('code', 0):.3f} → {g1.get('code', 0):.3f}"
                    f" / {g0.get('chat', 0):.3f} → {g1.get('chat', 0):.3f}) | {r['tau_gain_per_cpu_hour']:+.3f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the ablation's folder (shared features, one folder per arm)")
    p.add_argument("--init-from", help="the drafter every arm starts from")
    p.add_argument("--cpu-minutes", type=float, default=16.0, help="process CPU time per arm")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--topk", type=int, default=32, help="the target's top-k logits kept for soft-target arms")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--sequences", type=int,
                   help="train every arm on the first N answers (default: all; the corpus grows, so pin N "
                        "to add an arm to an earlier run)")
    p.add_argument("--arm", action="append", metavar="NAME=OPTIONS",
                   help="an arm (repeatable; default: every arm of DEFAULT_ARMS)")
    p.add_argument("--report", action="store_true", help="only write ablation.json and print the table")
    args = p.parse_args(argv)
    out = Path(args.out)
    arms = dict(a.split("=", 1) for a in args.arm) if args.arm else dict(DEFAULT_ARMS)
    if not args.report:
        if not args.init_from:
            p.error("--init-from is required to run arms")
        common = ["train", "--init-from", args.init_from, "--threads", str(args.threads), "--topk", str(args.topk),
                  "--lr", str(args.lr), "--warmup-steps", "10", "--cpu-budget-min", str(args.cpu_minutes)]
        common += ["--sequences", str(args.sequences)] if args.sequences else []
        for name, opts in arms.items():
            folder = arm_folder(out, name)
            if arm_result(folder):
                continue
            shutil.rmtree(folder, ignore_errors=True)
            argv = arm_argv(out, name, opts, common)
            print(f"[ablate] {name}: dflash {shlex.join(argv)}", flush=True)
            if run_dflash(argv):
                raise SystemExit(f"arm {name!r} failed")
    print(table(report(out, arms)))
    return 0


def run_dflash(argv: list[str]) -> int:
    """`dflash ARGV` (an arm's `dflash train`) in a process of its own; its exit status."""
    return subprocess.run([sys.executable, "-m", "dflash.cli", *argv]).returncode


if __name__ == "__main__":
    raise SystemExit(main())
