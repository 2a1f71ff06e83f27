"""What each target backend and each drafter precision costs on this machine.

    python -m tools.backends [--threads 2] [--repeats 9] [--out DIR]
                             [--target NAME|FOLDER|GGUF] [--backends hf,llamacpp,ort,...] [--no-batches]

For every target backend that runs here (hf: transformers fp32, the reference; llamacpp:
the target's GGUF; ort: the int8 ONNX export; ort-q4_1 / ort-q4_k_m: the export with the
GGUF's blocks exactly, where the target's file has such blocks; ort-int4: the 4-bit export,
where it was made), all loaded at once and
timed in turn (each round times every shape on every backend, so a slow moment of a
shared machine touches them alike): one forward of T new tokens after a 64-token context
in one sequence, T in 1, 2, 3, 4, 8, 16, and of one token in each of B sequences, B in 2,
4, 8, all with the drafter's feature layers, logits for every new row; the prefill of a
128-token prompt (P128, logits of its last row); and, for the embedded target, the
drafter's pass over a block of D in every precision `auto` may choose, over the whole
vocabulary and over the draft vocabulary. Medians of the rounds. Writes DIR/backends.json
and prints Markdown tables (milliseconds, and multiples of a plain step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from dflash.engine.costs import PREFILL_TOKENS
from dflash.engine.target.protocol import TargetRow

CONTEXT = 64
LENGTHS = (1, 2, 3, 4, 8, 16)
BATCHES = (2, 4, 8)
DRAFTS = (2, 4, 8, 16)
PREFILL = PREFILL_TOKENS  # the prompt a typical request prefills
STATISTICS = {"median": "targets", "fastest": "fastest"}  # of the rounds: the report's key holding it


def _ids(n: int, offset: int = 0) -> list[int]:
    return [(1000 + 37 * i + offset) % 49000 for i in range(n)]


def time_targets(targets: dict, layers: tuple[int, ...], repeats: int, batches: bool = True) -> dict:
    """Each shape's seconds per backend and round, the backends timed in turn in every round."""
    seqs = {}
    for name, target in targets.items():
        seqs[name] = [target.new_sequence() for _ in range(max(BATCHES))]
        for k, s in enumerate(seqs[name]):
            target.forward_batch([TargetRow(s, _ids(CONTEXT, k), 1)], layers)
    shapes = [("T", T) for T in LENGTHS] + ([("B", B) for B in BATCHES] if batches else []) + [("P", PREFILL)]
    samples = {name: {f"{kind}{n}": [] for kind, n in shapes} for name in targets}
    for _ in range(repeats + 1):
        for kind, n in shapes:
            for name, target in targets.items():
                samples[name][f"{kind}{n}"].append(_time_shape(target, seqs[name], kind, n, layers))
    for name, target in targets.items():
        for s in seqs[name]:
            target.free(s)
    return {name: {k: v[1:] for k, v in by.items()} for name, by in samples.items()}  # the first round warms up


def _time_shape(target, seqs, kind: str, n: int, layers) -> float:
    """One forward of the shape (`T`: n new rows of one sequence, `B`: one row of each of n,
    `P`: a fresh sequence's n-token prompt), its seconds; the caches put back after it."""
    if kind == "P":
        fresh = target.new_sequence()
        t = time.perf_counter()
        target.forward_batch([TargetRow(fresh, _ids(n, 3), 1)], layers)
        took = time.perf_counter() - t
        target.free(fresh)
        return took
    rows = [TargetRow(seqs[0], _ids(n, 7), n)] if kind == "T" else [TargetRow(s, _ids(1, 7), 1) for s in seqs[:n]]
    t = time.perf_counter()
    target.forward_batch(rows, layers)
    took = time.perf_counter() - t
    for s in seqs:
        target.rollback(s, CONTEXT)
    return took


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
    from dflash.model_files import default_drafter_dir, default_target_dir, resolve_target

    p = argparse.ArgumentParser(prog="python -m tools.backends", description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out", default="bench-out")
    p.add_argument("--target", help="the target (a model name, folder or GGUF; default: the embedded one); one "
                   "without the project's drafter is timed with no feature layers, and no drafter")
    p.add_argument("--backends", help="comma-separated backends (default: every one that runs here)")
    p.add_argument("--no-batches", action="store_true", help="skip the several-sequence shapes (B2-B8)")
    p.add_argument("--doc", help="also write the target table into this page's section backends-TARGET "
                   "(<!-- backends-TARGET:start --> ... :end -->)")
    p.add_argument("--statistic", choices=tuple(STATISTICS), default="median",
                   help="what --doc's table shows of each shape's rounds (default: the median)")
    p.add_argument("--note", default="", help="a line said with the table in --doc (how the machine was shared)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    files = resolve_target(args.target, quiet=True)
    own_drafter = files.folder.resolve() == default_target_dir().resolve()
    drafter_dir = default_drafter_dir()[0]
    drafter, sha = load_versioned(drafter_dir) if own_drafter else (None, None)
    layers = tuple(drafter.config.target_layer_ids) if drafter is not None else ()
    report = {"command": "python -m tools.backends " + " ".join(sys.argv[1:] if argv is None else argv),
              "cpu": cpu_name(), "threads": args.threads, "context": CONTEXT, "target": files.folder.name,
              "gguf": str(files.gguf) if files.gguf else None, "layers": list(layers),
              "repeats": args.repeats, "load_average": list(os.getloadavg()), "targets": {}, "drafter": {}, "not_run": {}}
    builders = target_builders(files.folder, gguf=files.gguf)
    # (by default not a build auto never chooses unless its export is there: ort-int4's takes minutes)
    wanted = args.backends.split(",") if args.backends else [n for n, b in builders.items() if b.auto or b.ready]
    targets = {}
    for name in wanted:
        build = builders[name]
        if build.why_not is not None:
            report["not_run"][name] = build.why_not
            continue
        targets[name] = build()
    samples = time_targets(targets, layers, args.repeats, batches=not args.no_batches)
    report["targets"] = {name: {k: statistics.median(v) for k, v in by.items()} for name, by in samples.items()}
    # The fastest round too: on a machine other jobs share, a slow moment only ever adds time
    # (there llama.cpp's plain step on the 1.5B took 40 ms in quiet rounds and 3.1 s in busy ones).
    report["fastest"] = {name: {k: min(v) for k, v in by.items()} for name, by in samples.items()}
    report["rounds"] = samples
    report["load_average_after"] = list(os.getloadavg())
    for name, t in report["targets"].items():
        print(f"{name}: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in t.items()) + " ms", file=sys.stderr)
    first = targets.get("hf")  # the drafter's prices do not depend on the target backend
    vocab = draft_vocab.for_drafter(drafter_dir) if drafter is not None else None
    for dtype, runtime in draft_candidates(first) if drafter is not None and first is not None else ():
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
    if args.doc:
        write_section(report, Path(args.doc), out / "backends.json", args.note, args.statistic)
    return 0


def write_section(report: dict, doc: Path, source: Path, note: str = "", statistic: str = "median") -> Path:
    """The target backends' table (`statistic` of the rounds, STATISTICS) as the generated
    section backends-TARGET of `doc`."""
    from dflash.bench.sections import markers, replace_section

    start, end = markers(f"backends-{report['target']}")
    load = ", ".join(f"{x:.1f}" for x in report["load_average"][:1] + report["load_average_after"][:1])
    body = (f"{start}\n_Generated from `{report.get('command', 'python -m tools.backends')}` "
            f"([{source.name}]({os.path.relpath(source, doc.parent)})); load average before, after: {load}. {note}_\n\n"
            + markdown(report, drafter=False, statistic=statistic) + end)
    return replace_section(doc, start, end, body)


def markdown(report: dict, drafter: bool = True, statistic: str = "median") -> str:
    by_backend = report[STATISTICS[statistic]]
    first = next(iter(by_backend.values()), {})
    shapes = [s for s in [f"T{T}" for T in LENGTHS] + [f"B{B}" for B in BATCHES] + [f"P{PREFILL}"] if s in first]
    label = {"T": lambda n: f"B1 T{n}", "B": lambda n: f"B{n} T1", "P": lambda n: f"prefill {n}"}
    head = ("| backend | " + " | ".join(label[s[0]](s[1:]) for s in shapes) + " |\n"
            + "|---" * (len(shapes) + 1) + "|\n")
    rows = []
    for name, t in by_backend.items():
        plain = t["T1"]
        rows.append(f"| {name} | " + " | ".join(f"{t[s] * 1e3:.1f} ({t[s] / plain:.2f})" for s in shapes) + " |")
    text = (f"{report['cpu']}, {report['threads']} threads, {report['context']}-token context; ms, the {statistic} of "
            f"{report.get('repeats', '')} rounds (multiple of the backend's plain step)\n\n" + head + "\n".join(rows) + "\n")
    if drafter and report["drafter"]:
        drafts = sorted({k for d in report["drafter"].values() for k in d}, key=lambda k: int(k[1:]))
        text += ("\n| drafter | " + " | ".join(drafts) + " |\n" + "|---" * (len(drafts) + 1) + "|\n"
                 + "\n".join(f"| {k} | " + " | ".join(f"{d[x] * 1e3:.1f}" for x in drafts) + " |"
                              for k, d in report["drafter"].items()) + "\n")
    return text


if __name__ == "__main__":
    sys.exit(main())
