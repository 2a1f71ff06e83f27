"""One prepared drafter run on a borrowed accelerator, bounded by wall-clock deadlines.

    python -m dflash.train.oneshot --out RUN --export OUT --train-min 10

`--target` is the embedded default (SmolLM2) unless given: a Hugging Face folder, a GGUF file
or a model name (`--target qwen2.5-coder-1.5b-instruct`). It starts from the shipped
training corpus (corpus.py: the default target's answers, so no minute goes to regenerating
them; `--answer-min M` answers missing prompts first; for another target, whose token ids
differ, those minutes answer the corpus's prompts with that target first), puts
every answer's target features (and top-k soft targets with `--topk`) in device memory,
and trains the drafter alone on the whole device: bf16, the block-sparse attention of
blockwise.py, batches of `--block-tokens` block slots, the LM head only at weighted
slots and in recomputed chunks. For the default target it starts from the shipped drafter
(`--init-from`; `--init target` starts afresh) and continues its lineage; for another target
from a new drafter with the target's layers copied in (its mask token an embedding row no
text is tokenised to, dflash.train.pipeline.default_mask_token_id). Every `--eval-min` minutes a
τ estimate on held-out answers (simulate.py) keeps the best drafter; loadable snapshots
land in `OUT/drafter` every minute and the best in `OUT/best`, so a lease cut short
still leaves its work behind. `OUT/summary.json` reports sequences, tokens/s and achieved
TFLOP/s against the card's peak. `--with-assistant` also trains the AR assistant (the
`assisted-ar` baseline) in a child process, as the earlier runs did.
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

from dflash.engine.target.hf import HFTarget
from dflash.errors import DFlashError

# Dense bf16 peak TFLOP/s of common cards (vendor figures, no sparsity), for the utilisation line.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "B200": 2250.0, "RTX 4090": 165.0}


def _log(msg: str) -> None:
    print(f"[oneshot {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def peak_tflops(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def assistant_main(args) -> None:
    from dflash.train.assistant import build_assistant, train_assistant
    from dflash.train.corpus import load_corpus

    target = HFTarget.from_pretrained(args.target, device=args.device)
    records = load_corpus(Path(args.corpus)) if args.corpus else load_corpus()
    model = build_assistant(target.model, args.assistant_layers)
    state = train_assistant(model, records, Path(args.out) / "assistant", lr=args.lr,
                            seqs_per_step=args.assistant_seqs, epochs=1000, time_budget_s=args.train_min * 60,
                            snapshot_dir=str(Path(args.export) / "assistant"), seed=args.seed)
    _log(f"assistant: {state['step']} steps, {state['sequences']} sequences, {state['elapsed_s']:.0f} s")


def parser() -> argparse.ArgumentParser:
    from dflash.train.corpus import ANSWER_TOKENS, CORPUS_FILE

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="run directory (checkpoints)")
    p.add_argument("--export", required=True, help="where drafter/, best/ and summary.json go")
    p.add_argument("--target", help="the target: a Hugging Face folder, a GGUF file or a model name (dflash models "
                   "--list) (default: the embedded SmolLM2)")
    p.add_argument("--corpus", default=str(CORPUS_FILE), help="packed answers (.jsonl.xz with its manifest)")
    p.add_argument("--answer-min", type=float, default=0.0,
                   help="first answer prompts missing from the corpus (a corpus of another target's answers: its "
                        "prompts first, with this target)")
    p.add_argument("--answer-tokens", type=int, default=ANSWER_TOKENS, help="the longest answer --answer-min makes")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--train-min", type=float, default=10.0)
    p.add_argument("--init-from", help="drafter folder to continue (default: the shipped drafter, for the default "
                   "target)")
    p.add_argument("--init", choices=["from", "target", "random"],
                   help="'from': continue --init-from; 'target'/'random': a new drafter (default: 'from' where there "
                        "is a drafter to continue, else 'target')")
    p.add_argument("--layers", type=int, default=4, help="new drafters only")
    p.add_argument("--block-size", type=int, default=16, help="new drafters only")
    p.add_argument("--target-layer-ids", type=lambda s: [int(x) for x in s.split(",")], help="new drafters only")
    p.add_argument("--mask-token-id", type=int,
                   help="new drafters only (default: an embedding row no text is tokenised to; SmolLM2: 16)")
    p.add_argument("--max-anchors", type=int, default=512)
    p.add_argument("--seqs-per-step", type=int, default=64)
    p.add_argument("--block-tokens", type=int, default=131072, help="block slots per forward (fill the card)")
    p.add_argument("--head-chunk-rows", type=int, default=32768)
    p.add_argument("--weighting", default="dpace", choices=["decay", "dpace", "uniform"])
    p.add_argument("--loss-positions", type=int, help="only block slots 1..n carry loss")
    p.add_argument("--train-block", type=int, help="train at this block length (default: the drafter's)")
    p.add_argument("--topk", type=int, default=0, help="store the target's top-k logits as soft targets")
    p.add_argument("--soft-mix", type=float, default=0.0, help="weight of the KL-to-top-k term")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--heldout", type=int, default=32, help="held-out answers per group (code, chat)")
    p.add_argument("--eval-min", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--with-assistant", action="store_true", help="also train the AR assistant (shares the device)")
    p.add_argument("--assistant-layers", type=int, default=4)
    p.add_argument("--assistant-seqs", type=int, default=32)
    p.add_argument("--assistant-only", action="store_true", help=argparse.SUPPRESS)
    return p


def starting_point(args, target_dir: Path) -> None:
    """Fill in --init and --init-from: the shipped drafter is continued for the default target
    (it fits no other); a new drafter, its layers copied from the target, otherwise."""
    from dflash.model_files import SHIPPED_DRAFTER, default_target_dir

    if args.init_from is None and target_dir.resolve() == default_target_dir().resolve():
        args.init_from = str(SHIPPED_DRAFTER)
    if args.init is None:
        args.init = "from" if args.init_from else "target"
    if args.init == "from" and not args.init_from:
        raise DFlashError("bad_params", f"--init from needs --init-from DIR: no drafter ships for {target_dir.name}")


def answers(args, target, out: Path) -> list[dict]:
    """The corpus's answers where they are this target's; otherwise (another target's corpus)
    none, and `--answer-min` minutes go to answering its prompts with this target first. Either
    way the prompts still unanswered are answered within those minutes."""
    from dflash.train.corpus import load_corpus
    from dflash.train.data import collect_prompts, load_records, regenerate
    from dflash.train.pipeline import corpus_fits

    corpus = load_corpus(Path(args.corpus))
    records = corpus if corpus_fits(target, corpus) else []
    if not records:
        if args.answer_min <= 0:
            raise DFlashError("bad_corpus", f"{args.corpus} holds another target's answers (its prompt ids are not "
                              f"{target.name}'s): give --answer-min M to answer its prompts with this target first, "
                              "or --corpus of this target's answers")
        if args.with_assistant:
            raise DFlashError("bad_params", "--with-assistant trains on the corpus as given: it needs this target's "
                              "answers (--corpus)")
    if args.answer_min > 0:
        extra, deadline = out / "answers.jsonl", time.monotonic() + args.answer_min * 60
        have = {r["prompt"] for r in records}
        how = {"max_new_tokens": args.answer_tokens, "batch_size": 1024 if target.device.type == "cuda" else 8,
               "deadline": deadline}
        # The corpus's prompts first (none left where it holds this target's answers), then the others.
        regenerate(target, [r["prompt"] for r in corpus if r["prompt"] not in have], extra, **how)
        if time.monotonic() < deadline:
            regenerate(target, [p for p in collect_prompts() if p not in have], extra, **how)
        records += load_records(extra)
    return records


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from dflash.model_files import resolve_target

    try:
        target_dir = resolve_target(args.target).folder
        args.target = str(target_dir)
        if args.assistant_only:
            assistant_main(args)
            return 0
        starting_point(args, target_dir)
        return run(args)
    except DFlashError as exc:
        print(f"dflash: error: {exc.message}", file=sys.stderr)
        return 2


def run(args) -> int:
    from dflash.engine.drafter_config import DrafterConfig
    from dflash.engine.engine import check_compatible
    from dflash.train.features import DeviceFeatures
    from dflash.train.pipeline import drafter_config_for, select, starting_drafter
    from dflash.train.simulate import with_groups
    from dflash.train.trainer import TrainConfig, save_with_lineage, train, training_block

    t0 = time.monotonic()
    out, export = Path(args.out), Path(args.export)
    out.mkdir(parents=True, exist_ok=True)
    export.mkdir(parents=True, exist_ok=True)
    target = HFTarget.from_pretrained(args.target, device=args.device)
    _log(f"target {target.name} on {target.device} ({time.monotonic() - t0:.0f} s)")
    records = answers(args, target, out)
    _log(f"answers: {len(records)} ({sum(len(r['response_ids']) for r in records)} response tokens)")

    if args.init == "from":
        dcfg = DrafterConfig.from_file(Path(args.init_from) / "config.json")
    else:
        dcfg = drafter_config_for(target, args.layers, args.block_size, args.target_layer_ids, args.mask_token_id)
    check_compatible(target, dcfg)  # a drafter made for another target fails now, not after the features
    cfg = TrainConfig(epochs=1000, lr=args.lr, max_anchors=args.max_anchors, seqs_per_step=args.seqs_per_step,
                      block_tokens=args.block_tokens, head_chunk_rows=args.head_chunk_rows, weighting=args.weighting,
                      loss_positions=args.loss_positions, train_block=args.train_block, soft_mix=args.soft_mix,
                      time_budget_s=args.train_min * 60,
                      schedule_by_budget=True, checkpoint_minutes=1.0, eval_minutes=args.eval_min,
                      snapshot_dir=str(export / "drafter"), seed=args.seed,
                      stage=f"oneshot on {args.device}: {args.weighting} weighting, soft mix {args.soft_mix}")
    training_block(cfg, dcfg)  # a bad block length fails before the features
    picked, held = select(records, None, args.heldout)
    t = time.monotonic()
    store = DeviceFeatures().build(target, picked, dcfg.target_layer_ids, topk=args.topk,
                                   batch_tokens=65536 if target.device.type == "cuda" else 4096)
    feat_s = time.monotonic() - t
    _log(f"features: {len(store.sequences)} sequences, {store.rows} rows on {target.device} ({feat_s:.0f} s)")

    child = None
    if args.with_assistant:
        cmd = [sys.executable, "-m", "dflash.train.oneshot", "--assistant-only", "--out", str(out), "--export",
               str(export), "--target", args.target, "--device", args.device, "--train-min", str(args.train_min),
               "--corpus", args.corpus, "--assistant-layers", str(args.assistant_layers),
               "--assistant-seqs", str(args.assistant_seqs), "--lr", str(args.lr), "--seed", str(args.seed)]
        child = subprocess.Popen(cmd, env=dict(os.environ, TQDM_MININTERVAL="20"))
    drafter, lineage = starting_drafter(target, dcfg, args.init, Path(args.init_from) if args.init == "from" else None,
                                        args.seed)
    heldout = with_groups(store.sequences, held)
    state = train(drafter, target, store, out / "train", cfg, heldout=heldout, lineage=lineage)
    if (out / "train" / "best").is_dir():
        import shutil

        shutil.copytree(out / "train" / "best", export / "best", dirs_exist_ok=True)
    else:
        save_with_lineage(drafter, export / "best", state["lineage"])
    _log(f"drafter: {state['step']} steps, {state['sequences']} sequences, {state['blocks']} blocks, "
         f"{state['elapsed_s']:.0f} s, best held-out τ {state['best_tau']}")
    if child is not None:
        child.wait(timeout=max(60.0, args.train_min * 60))
    train_s = max(state["elapsed_s"], 1e-9)
    achieved = state.get("flops", 0.0) / train_s / 1e12
    peak = peak_tflops(args.device)
    summary = {
        "target": target.name,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
        "torch": torch.__version__, "answers": len(records), "sequences_in_memory": len(store.sequences),
        "feature_seconds": round(feat_s, 1), "drafter_steps": state["step"], "sequence_passes": state["sequences"],
        "blocks": state["blocks"], "train_seconds": round(train_s, 1),
        "sequence_passes_per_s": round(state["sequences"] / train_s, 2),
        "block_tokens_per_s": round(state["blocks"] * dcfg.block_size / train_s, 1),
        "achieved_tflops": round(achieved, 6), "peak_tflops": peak,
        "utilisation": round(achieved / peak, 4) if peak else None,
        "best_heldout_tau": state["best_tau"], "evals": state["evals"],
        "final_loss": state["losses"][-1][2] if state["losses"] else None,
        "total_s": round(time.monotonic() - t0, 1), "args": dict(vars(args)),
    }
    (export / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for name in ("losses.json", "loss.png"):
        if (out / "train" / name).is_file():
            (export / f"drafter-{name}").write_bytes((out / "train" / name).read_bytes())
    _log(f"done in {summary['total_s']:.0f} s: {summary['sequence_passes_per_s']} sequence passes/s, "
         f"{summary['achieved_tflops']} TFLOP/s" + (f" of {peak}" if peak else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
