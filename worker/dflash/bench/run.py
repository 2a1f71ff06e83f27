"""`dflash bench`: the engine at block size 1 (`ar`, the baseline) against DFlash block sizes.

Honest timing: models are loaded before timing, one warm-up generation runs first, all
methods run in this one process on the same prompts with the same thread count, and
greedy outputs are compared with the `ar` baseline (mismatches are reported).
"""

from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path

import torch

from dflash.engine.engine import Engine, GenerationRequest

PROMPT_DIR = Path(__file__).parent / "prompts"


def load_suite(name: str, limit: int | None) -> list[str]:
    path = PROMPT_DIR / f"{name}.txt"
    if not path.is_file():
        raise SystemExit(f"dflash bench: unknown suite '{name}' (have: {', '.join(p.stem for p in PROMPT_DIR.glob('*.txt'))})")
    prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    return prompts[:limit] if limit else prompts


def block_size_of(method: str) -> int:
    if method == "ar":
        return 1
    if method.startswith("dflash-") and method[7:].isdigit():
        return int(method[7:])
    raise SystemExit(f"dflash bench: unknown method '{method}' (ar, dflash-N)")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_bench(engine: Engine, suites: list[str], methods: list[str], limit: int | None, max_new: int) -> dict:
    engine.generate(GenerationRequest(prompt="Warm up.", chat=True, max_new_tokens=8))
    results = []
    for suite in suites:
        prompts = load_suite(suite, limit)
        outputs: dict[str, list[list[int]]] = {}
        for method in methods:
            stats = []
            for prompt in prompts:
                res = engine.generate(
                    GenerationRequest(prompt=prompt, chat=True, max_new_tokens=max_new, block_size=block_size_of(method))
                )
                outputs.setdefault(method, []).append(res.output_ids)
                stats.append(res.stats)
            new = sum(s.new_tokens for s in stats)
            decode = sum(s.decode_s for s in stats)
            steps = sum(s.num_steps for s in stats)
            per_pos = [sum(col) for col in zip(*(s.accepted_per_position for s in stats))]
            results.append(
                {
                    "suite": suite,
                    "method": method,
                    "block_size": block_size_of(method),
                    "prompts": len(prompts),
                    "new_tokens": new,
                    "decode_s": decode,
                    "tokens_per_s": new / decode if decode else None,
                    "tau": (sum(s.accepted for s in stats) + steps) / steps if steps and method != "ar" else None,
                    "acceptance_rate": (sum(s.accepted for s in stats) / max(sum(s.drafted for s in stats), 1))
                    if method != "ar"
                    else None,
                    "accepted_per_position": per_pos,
                    "overhead_fraction": sum(s.overhead_s for s in stats) / decode if decode else None,
                }
            )
        base = outputs.get("ar")
        ar_tps = next((r["tokens_per_s"] for r in results if r["suite"] == suite and r["method"] == "ar"), None)
        for r in results:
            if r["suite"] != suite:
                continue
            r["speedup_vs_ar"] = r["tokens_per_s"] / ar_tps if ar_tps and r["tokens_per_s"] else None
            r["greedy_mismatches"] = (
                sum(a != b for a, b in zip(outputs[r["method"]], base)) if base is not None else None
            )
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": str(engine.target.dtype).replace("torch.", ""),
        "device": str(engine.target.device),
        "cpu": cpu_model(),
        "target": engine.target.name,
        "drafter": engine.drafter_name,
        "random_drafter": engine.random_drafter,
        "max_new_tokens": max_new,
        "results": results,
    }


def markdown(report: dict) -> str:
    head = (
        f"target {report['target']}, drafter {report['drafter']}"
        f"{' (random weights)' if report['random_drafter'] else ''}, {report['dtype']} on {report['device']}, "
        f"{report['threads']} threads, {report['cpu']}, torch {report['torch']}, {report['date']}\n\n"
    )
    rows = ["| suite | method | prompts | new tokens | tok/s | speedup vs ar | tau | acceptance | overhead | greedy mismatches |",
            "|---|---|---|---|---|---|---|---|---|---|"]

    def f(x, spec):
        return "-" if x is None else format(x, spec)

    for r in report["results"]:
        rows.append(
            f"| {r['suite']} | {r['method']} | {r['prompts']} | {r['new_tokens']} | {f(r['tokens_per_s'], '.1f')} | "
            f"{f(r['speedup_vs_ar'], '.2f')} | {f(r['tau'], '.2f')} | {f(r['acceptance_rate'], '.3f')} | "
            f"{f(r['overhead_fraction'], '.1%')} | {r['greedy_mismatches']} |"
        )
    return head + "\n".join(rows) + "\n"


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(markdown(report))
