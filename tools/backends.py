"""What each target backend and each drafter precision costs on this machine.

    python -m tools.backends [--threads 2] [--repeats 9] [--out DIR]

For every target backend that runs here (hf: transformers fp32, the reference; llamacpp:
the shipped Q4_1 GGUF; ort: the int8 ONNX export): one forward of T new tokens after a
64-token context in one sequence, T in 1, 2, 3, 4, 8, 16, and of one token in each of B
sequences, B in 2, 4, 8, all with the drafter's four feature layers, logits for every new
row; and the drafter's pass over a block of D in every precision `auto` may choose, over
the whole vocabulary and over the draft vocabulary. Medians of interleaved repeats (each
repeat times every shape once, so a slow moment of the machine spreads out). Writes
DIR/backends.json and prints Markdown tables (milliseconds, and multiples of a plain step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dflash.engine.target.protocol import TargetRow

CONTEXT = 64
LENGTHS = (1, 2, 3, 4, 8, 16)
BATCHES = (2, 4, 8)
DRAFTS = (2, 4, 8, 16)


def _ids(n: int, offset: int = 0) -> list[int]:
    return [(1000 + 37 * i + offset) % 49000 for i in range(n)]


def time_target(target, layers: tuple[int, ...], repeats: int) -> dict:
    seqs = [target.new_sequence() for _ in range(max(BATCHES))]
    for k, s in enumerate(seqs):
        target.forward_batch([TargetRow(s, _ids(CONTEXT, k), 1)], layers)
    shapes = [("T", T) for T in LENGTHS] + [("B", B) for B in BATCHES]
    samples: dict = {f"{kind}{n}": [] for kind, n in shapes}
    for _ in range(repeats + 1):
        for kind, n in shapes:
            rows = ([TargetRow(seqs[0], _ids(n, 7), n)] if kind == "T"
                    else [TargetRow(s, _ids(1, 7), 1) for s in seqs[:n]])
            t = time.perf_counter()
            target.forward_batch(rows, layers)
            samples[f"{kind}{n}"].append(time.perf_counter() - t)
            for s in seqs:
                target.rollback(s, CONTEXT)
    for s in seqs:
        target.free(s)
    return {k: statistics.median(v[1:]) for k, v in samples.items()}  # the first round warms up


def time_drafter(engine, repeats: int) -> dict:
    from dflash.engine.costs import _StepBench

    bench = _StepBench(engine)
    bench.draft(max(DRAFTS))
    out = {f"D{D}": bench.draft_s(D, repeats) for D in DRAFTS if D <= engine.block_size}
    bench.close()
    return out


def main(argv=None) -> int:
    from dflash.engine import draft_vocab
    from dflash.engine.costs import cpu_name
    from dflash.engine.engine import Engine, draft_candidates, dtype_name
    from dflash.loading import load_versioned, target_builders
    from dflash.model_files import default_drafter_dir, default_target_gguf, ensure_default_target

    p = argparse.ArgumentParser(prog="python -m tools.backends", description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out", default="bench-out")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target_dir, (drafter_dir, _) = ensure_default_target(quiet=True), default_drafter_dir()
    drafter, sha = load_versioned(drafter_dir)
    layers = tuple(drafter.config.target_layer_ids)
    report = {"cpu": cpu_name(), "threads": args.threads, "context": CONTEXT, "targets": {}, "drafter": {},
              "not_run": {}}
    builders = target_builders(target_dir, gguf=default_target_gguf())
    first = None
    for name, build in builders.items():
        if build.why_not is not None:
            report["not_run"][name] = build.why_not
            continue
        target = build()
        report["targets"][name] = time_target(target, layers, args.repeats)
        print(f"{name}: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in report["targets"][name].items()) + " ms",
              file=sys.stderr)
        if name == "hf":
            first = target  # the drafter's prices do not depend on the target backend
        else:
            del target
    vocab = draft_vocab.for_drafter(drafter_dir)
    for dtype, runtime in draft_candidates(first):
        for label, v in (("full", None), (f"{len(vocab)}", vocab)) if vocab else (("full", None),):
            engine = Engine(first, drafter, "drafter", drafter_sha256=sha, draft_dtype=dtype, draft_vocab=v,
                            draft_runtime=runtime)
            key = f"{dtype_name(dtype)} ({runtime}), vocab {label}"
            report["drafter"][key] = time_drafter(engine, args.repeats)
            print(f"drafter {key}: " + ", ".join(f"{k} {s * 1e3:.1f}" for k, s in report["drafter"][key].items())
                  + " ms", file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "backends.json").write_text(json.dumps(report, indent=1) + "\n")
    print(markdown(report))
    return 0


def markdown(report: dict) -> str:
    shapes = [f"T{T}" for T in LENGTHS] + [f"B{B}" for B in BATCHES]
    head = ("| backend | " + " | ".join(f"B1 T{s[1:]}" if s[0] == "T" else f"B{s[1:]} T1" for s in shapes) + " |\n"
            + "|---" * (len(shapes) + 1) + "|\n")
    rows = []
    for name, t in report["targets"].items():
        plain = t["T1"]
        rows.append(f"| {name} | " + " | ".join(f"{t[s] * 1e3:.1f} ({t[s] / plain:.2f})" for s in shapes) + " |")
    drafts = sorted({k for d in report["drafter"].values() for k in d}, key=lambda k: int(k[1:]))
    dhead = "\n\n| drafter | " + " | ".join(drafts) + " |\n" + "|---" * (len(drafts) + 1) + "|\n"
    drows = [f"| {k} | " + " | ".join(f"{d[x] * 1e3:.1f}" for x in drafts) + " |" for k, d in report["drafter"].items()]
    return (f"{report['cpu']}, {report['threads']} threads, {report['context']}-token context; ms (multiple of the "
            f"backend's plain step)\n\n" + head + "\n".join(rows) + dhead + "\n".join(drows) + "\n")


if __name__ == "__main__":
    sys.exit(main())
