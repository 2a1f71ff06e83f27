"""One prepared run on a borrowed accelerator: data, features, drafter and AR assistant,
each stage bounded by a wall-clock deadline, so the whole run fits a fixed lease.

    python -m dflash.train.oneshot --out RUN --export OUT --prompt-file prompts.jsonl \
        --data-min 3 --features-min 1 --train-min 4

Stages (each resumable, as in `dflash train`): regenerate responses with the target until
the data deadline, cache target features until the features deadline, then train the
DFlash drafter and the autoregressive assistant (the `assisted-ar` baseline) side by side
on the same GPU for the same wall-clock budget: the assistant in a child process, so each
gets its own CUDA stream of work and neither waits for the other's Python. Loadable
snapshots land in `--export` every minute, so a run cut short still leaves its latest
drafter and assistant behind.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from dflash.engine.target import TargetModel


def _log(msg: str) -> None:
    print(f"[oneshot {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def assistant_main(args) -> None:
    from dflash.train.assistant import build_assistant, train_assistant
    from dflash.train.data import load_records

    target = TargetModel.from_pretrained(args.target, device=args.device)
    records = load_records(Path(args.out) / "data.jsonl")
    model = build_assistant(target.model, args.assistant_layers)
    state = train_assistant(model, records, Path(args.out) / "assistant", lr=args.lr,
                            seqs_per_step=args.assistant_seqs, epochs=1000, time_budget_s=args.train_min * 60,
                            snapshot_dir=str(Path(args.export) / "assistant"), seed=args.seed)
    _log(f"assistant: {state['step']} steps, {state['sequences']} sequences, {state['elapsed_s']:.0f} s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="run directory (data, features, checkpoints)")
    p.add_argument("--export", required=True, help="where the loadable drafter/ and assistant/ go")
    p.add_argument("--target", help="target folder (default: the embedded SmolLM2)")
    p.add_argument("--features-dir", help="feature cache location (default RUN/features; /dev/shm is fastest)")
    p.add_argument("--prompt-file", help="JSONL of prompts (default: collect them here)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--data-min", type=float, default=3.0)
    p.add_argument("--features-min", type=float, default=1.0)
    p.add_argument("--train-min", type=float, default=4.0)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--gen-batch", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--target-layer-ids", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--mask-token-id", type=int, default=16, help="as `dflash train` (SmolLM2: an unused special)")
    p.add_argument("--num-anchors", type=int, default=48)
    p.add_argument("--seqs-per-step", type=int, default=16)
    p.add_argument("--pack", type=int, default=8, help="sequences per drafter forward")
    p.add_argument("--assistant-layers", type=int, default=4)
    p.add_argument("--assistant-seqs", type=int, default=32)
    p.add_argument("--no-assistant", action="store_true")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--assistant-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    from dflash.models import ensure_default_target

    args.target = args.target or str(ensure_default_target())
    if args.assistant_only:
        assistant_main(args)
        return 0

    from dflash.train.data import collect_prompts, read_prompt_file
    from dflash.train.pipeline import build_data, build_features, drafter_config_for, new_drafter
    from dflash.train.trainer import TrainConfig, train

    t0 = time.monotonic()
    out, export = Path(args.out), Path(args.export)
    out.mkdir(parents=True, exist_ok=True)
    export.mkdir(parents=True, exist_ok=True)
    target = TargetModel.from_pretrained(args.target, device=args.device)
    _log(f"target on {target.device} ({time.monotonic() - t0:.0f} s)")
    prompts = read_prompt_file(Path(args.prompt_file)) if args.prompt_file else collect_prompts()
    t = time.monotonic()
    records = build_data(target, prompts, out / "data.jsonl", max_new_tokens=args.max_new_tokens,
                         gen_batch=args.gen_batch, deadline=t0 + args.data_min * 60)
    _log(f"data: {len(records)} of {len(prompts)} prompts answered, "
         f"{sum(len(r['response_ids']) for r in records)} response tokens ({time.monotonic() - t:.0f} s)")

    dcfg = drafter_config_for(target, args.layers, args.block_size, args.target_layer_ids, args.mask_token_id)
    t = time.monotonic()
    cache = build_features(target, records, dcfg.target_layer_ids,
                           Path(args.features_dir) if args.features_dir else out / "features",
                           batch_tokens=16384 if target.device.type == "cuda" else 4096,
                           deadline=t0 + (args.data_min + args.features_min) * 60)
    _log(f"features: {len(cache.sequences)} sequences, {cache.rows} rows ({time.monotonic() - t:.0f} s)")

    train_s = args.train_min * 60
    child = None
    if not args.no_assistant:
        cmd = [sys.executable, "-m", "dflash.train.oneshot", "--assistant-only", "--out", str(out), "--export",
               str(export), "--target", args.target, "--device", args.device, "--train-min", str(args.train_min),
               "--assistant-layers", str(args.assistant_layers), "--assistant-seqs", str(args.assistant_seqs),
               "--lr", str(args.lr), "--seed", str(args.seed)]
        child = subprocess.Popen(cmd, env=dict(os.environ, TQDM_MININTERVAL="20"))
    drafter = new_drafter(target, dcfg, "target", args.seed)
    cfg = TrainConfig(epochs=1000, lr=args.lr, num_anchors=args.num_anchors, seqs_per_step=args.seqs_per_step,
                      pack=args.pack, time_budget_s=train_s, schedule_by_time=True,
                      checkpoint_minutes=1.0, reduced_vocab=False, snapshot_dir=str(export / "drafter"),
                      seed=args.seed)
    state = train(drafter, target, cache, out / "train", cfg)  # its last checkpoint also writes the snapshot
    _log(f"drafter: {state['step']} steps, {state.get('sequences', 0)} sequences, {state['elapsed_s']:.0f} s")
    if child is not None:
        child.wait(timeout=max(60.0, train_s))
    summary = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
        "torch": torch.__version__, "prompts_answered": len(records), "sequences": len(cache.sequences),
        "response_tokens": sum(len(r["response_ids"]) for r in records), "drafter_steps": state["step"],
        "drafter_sequences": state.get("sequences", 0), "train_minutes": args.train_min,
        "drafter_final_loss": state["losses"][-1][2] if state["losses"] else None,
        "total_s": round(time.monotonic() - t0, 1), "args": dict(vars(args)),
    }
    (export / "summary.json").write_text(json.dumps(summary, indent=2))
    for name in ("losses.json", "loss.png"):
        if (out / "train" / name).is_file():
            (export / f"drafter-{name}").write_bytes((out / "train" / name).read_bytes())
        if (out / "assistant" / name).is_file():
            (export / f"assistant-{name}").write_bytes((out / "assistant" / name).read_bytes())
    _log(f"done in {summary['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
