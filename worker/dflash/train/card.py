"""Ship a trained drafter as the default and write its model card from its lineage.

    python -m dflash.train.card --drafter RUN/train/best --bench BENCH_OUT [--ship]

The card is generated, never hand-edited: geometry from config.json; every training
stage from training.json (device, time, sequences, blocks, settings); the τ-against-
compute table from the stages' held-out τ estimates (simulate.py) and the yardstick
(`dflash bench --methods dflash-16 --suites code,chat --limit 40`, read from the bench's
results.json and recorded into training.json, so the next card keeps it). `--ship`
copies config.json, model.safetensors and training.json into the asset folder first.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from dflash.train.trainer import LINEAGE_FILE

ASSET_DIR = Path(__file__).parents[1] / "assets" / "drafters" / "smollm2-135m-instruct-dflash-b16"
YARDSTICK = "dflash bench --methods dflash-16 --suites code,chat --limit 40 --max-new-tokens 128"
MAX_BYTES = 40_000_000


def read_bench(path: Path) -> dict:
    """{suite: τ} of the dflash-16 rows of a bench results.json (or its folder)."""
    path = Path(path)
    report = json.loads((path / "results.json" if path.is_dir() else path).read_text())
    rows = [r for r in report["results"] if r["method"] == "dflash-16" and r["tau"] is not None]
    out = {r["suite"]: round(r["tau"], 4) for r in rows}  # 4 places: the card rounds to 2 once
    out["prompts"] = {r["suite"]: r["prompts"] for r in rows}
    out["command"] = report.get("command", YARDSTICK)
    return out


def compute_rows(lineage: list[dict]) -> list[dict]:
    """One row per τ measurement along the lineage, with the compute spent before it."""
    rows, gpu_s, cpu_core_h, blocks = [], 0.0, 0.0, 0
    for stage in lineage:
        for e in stage.get("evals", []):
            gpu = gpu_s + (e.get("seconds", 0) if stage.get("device_type") == "cuda" else 0)
            cpu = cpu_core_h + (e.get("cpu_seconds", 0) / 3600 if stage.get("device_type") == "cpu" else 0)
            rows.append({"stage": stage.get("stage", ""), "gpu_min": gpu / 60, "cpu_core_h": cpu,
                         "blocks": blocks + e.get("blocks", 0), "sim": e.get("by_group") or {},
                         "bench": e.get("bench") or {}})
        if stage.get("device_type") == "cuda":
            gpu_s += stage.get("seconds", 0)
        elif stage.get("device_type") == "cpu":
            cpu_core_h += stage.get("cpu_seconds", 0) / 3600
        blocks += stage.get("blocks", 0)
        if stage.get("yardstick"):
            if rows and rows[-1]["stage"] == stage.get("stage", "") and rows[-1]["blocks"] == blocks \
                    and not rows[-1]["bench"]:
                rows[-1]["bench"] = stage["yardstick"]  # measured at the stage's last estimate
            else:
                rows.append({"stage": stage.get("stage", ""), "gpu_min": gpu_s / 60, "cpu_core_h": cpu_core_h,
                             "blocks": blocks, "sim": {}, "bench": stage["yardstick"]})
    return rows


def _fmt(v, spec=".2f"):
    return "–" if v is None else format(v, spec)


def card(drafter_dir: Path) -> str:
    cfg = json.loads((drafter_dir / "config.json").read_text())
    lineage = json.loads((drafter_dir / LINEAGE_FILE).read_text()) if (drafter_dir / LINEAGE_FILE).is_file() else []
    size = (drafter_dir / "model.safetensors").stat().st_size
    last = next((s for s in reversed(lineage) if s.get("yardstick")), {})
    yard = last.get("yardstick", {})
    stages = "\n".join(
        f"| {i} | {s.get('stage', '')} | {s.get('device', '–')} | "
        f"{_fmt(s.get('seconds', 0) / 60, '.1f') if 'seconds' in s else '–'} | "
        f"{_fmt(s.get('cpu_seconds', 0) / 3600, '.2f') if s.get('device_type') == 'cpu' else '–'} | "
        f"{s.get('sequences', '–')} | {s.get('blocks', '–')} | {_settings(s)} |"
        for i, s in enumerate(lineage))
    table = "\n".join(
        f"| {r['stage']} | {_fmt(r['gpu_min'], '.1f')} | {_fmt(r['cpu_core_h'], '.2f')} | {r['blocks']:,} | "
        f"{_fmt(r['sim'].get('code'))} | {_fmt(r['sim'].get('chat'))} | "
        f"{_fmt(r['bench'].get('code'))} | {_fmt(r['bench'].get('chat'))} |"
        for r in compute_rows(lineage))
    dc = cfg["dflash_config"]
    return f"""# DFlash drafter for SmolLM2-135M-Instruct

The engine's and the worker's default drafter for the embedded target. Output is exactly
the target's whatever the drafter (the loop is lossless); the drafter decides only how
many tokens each target forward commits: τ, the mean acceptance length.

| | |
|---|---|
| layout | published DFlash layout: `config.json` + bf16 `model.safetensors` ({size / 1e6:.0f} MB), loads with any DFlash implementation; `training.json`: its lineage |
| geometry | {cfg['num_hidden_layers']} Qwen3-style layers, hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} query / {cfg['num_key_value_heads']} KV heads, head dim {cfg['head_dim']}, intermediate {cfg['intermediate_size']}, block size {cfg['block_size']}, mask token {dc['mask_token_id']}, target layers {dc['target_layer_ids']} |
| data | the shipped corpus (`worker/dflash/train/corpus/`, its card gives sources and counts): the target's own greedy answers; benchmark prompts excluded |
| yardstick | `{yard.get('command', YARDSTICK)}`: τ **{_fmt(yard.get('code'))}** on the first {yard.get('prompts', {}).get('code', 40)} HumanEval prompts, **{_fmt(yard.get('chat'))}** on the first {yard.get('prompts', {}).get('chat', 40)} chat prompts (greedy, block 16, chat template, 128 new tokens) |

## Training stages (from `training.json`)

| # | stage | device | minutes | CPU core-hours | sequence passes | blocks | settings |
|---|---|---|---|---|---|---|---|
{stages}

## τ against training compute

Cumulative compute before each measurement. "held-out" is the fast estimate
(`python -m dflash.train.simulate`: the greedy loop replayed from teacher-forced drafts
on held-out answers of the corpus: HumanEval-shaped stubs for code, topic prompts for
chat); "bench" is the yardstick above. CPU core-hours are the training process's CPU time
(all threads), which does not grow when other work shares the machine.

| stage | GPU minutes | CPU core-hours | blocks seen | held-out code | held-out chat | bench code | bench chat |
|---|---|---|---|---|---|---|---|
{table}

The goal (issue 15) is τ ≥ 3 on code and ≥ 2.5 on chat; the table says how far this
drafter is. The published DFlash drafters see about 10⁹ blocks; `python -m
dflash.train.oneshot` continues this drafter on a GPU from the shipped corpus.
"""


def _settings(stage: dict) -> str:
    c = stage.get("config") or {}
    if not c:
        return stage.get("note", "")
    parts = [f"{stage['answers']:,} training answers"] if stage.get("answers") else []
    parts += [f"lr {c.get('lr')} ({c.get('schedule')})", f"{c.get('weighting')} weighting",
              f"anchors ≤ {c.get('max_anchors')}"]
    if c.get("loss_positions"):
        parts.append(f"loss at slots 1–{c['loss_positions']}")
    if c.get("soft_mix"):
        parts.append(f"soft mix {c['soft_mix']}")
    parts.append("bf16 autocast" if c.get("autocast") else "fp32")
    return ", ".join(parts)


def main(argv=None) -> int:
    from dflash.engine.draft_vocab import FILE as DRAFT_VOCAB

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", required=True, help="drafter folder with training.json")
    p.add_argument("--bench", help="bench output folder (or results.json) of the yardstick run on this drafter")
    p.add_argument("--ship", action="store_true", help="copy the drafter into the asset folder first")
    p.add_argument("--dest", default=str(ASSET_DIR))
    args = p.parse_args(argv)
    src, dest = Path(args.drafter), Path(args.dest)
    if (src / "model.safetensors").stat().st_size > MAX_BYTES:
        raise SystemExit(f"{src / 'model.safetensors'} is over {MAX_BYTES / 1e6:.0f} MB")
    if args.bench:
        lineage = json.loads((src / LINEAGE_FILE).read_text())
        lineage[-1]["yardstick"] = read_bench(Path(args.bench))
        (src / LINEAGE_FILE).write_text(json.dumps(lineage, indent=1) + "\n")
    target = dest if args.ship else src
    if args.ship and src.resolve() != dest.resolve():
        dest.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "model.safetensors", LINEAGE_FILE):
            shutil.copy(src / name, dest / name)
        if (src / DRAFT_VOCAB).is_file():  # else the shipped draft vocabulary stays (a vocabulary fits any drafter)
            shutil.copy(src / DRAFT_VOCAB, dest / DRAFT_VOCAB)
    (target / "README.md").write_text(card(target))
    print(f"model card written to {target / 'README.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
