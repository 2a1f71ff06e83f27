"""Make a drafter's draft vocabulary from the training corpus (dflash.engine.draft_vocab).

    python -m dflash.train.draft_vocab --drafter DIR [--coverage 0.99] [--k K] [--dry-run]

The K most frequent tokens of the target's own answers (the shipped corpus), as FR-Spec and
EAGLE-3 do; K is chosen by measured coverage: the smallest multiple of 1,024 whose tokens
cover at least `--coverage` of a held-out tenth of the answers when counted on the other
nine tenths (so the figure is not flattered by counting and measuring on the same text).
The target's stop tokens are always in. Writes DIR/draft_vocab.json with the coverage curve.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from dflash.engine import draft_vocab
from dflash.errors import DFlashError

STEP = 1024
HELD_OUT_EVERY = 10  # record i is held out when i % 10 == 0


def counts(records: list[dict]) -> tuple[Counter, Counter]:
    """Token counts of the answers: (counted on, held out)."""
    seen, held = Counter(), Counter()
    for i, r in enumerate(records):
        (held if i % HELD_OUT_EVERY == 0 else seen).update(r["response_ids"])
    return seen, held


def coverage(order: list[int], held: Counter, k: int) -> float:
    total = sum(held.values())
    return sum(held[t] for t in order[:k]) / total if total else 0.0


def choose(records: list[dict], target_coverage: float, always: list[int], k: int | None = None) -> dict:
    """The draft vocabulary (token ids, most frequent first) and the measurements behind K."""
    seen, held = counts(records)
    order = [t for t, _ in seen.most_common()]
    curve = {n: round(coverage(order, held, n), 5) for n in range(STEP, len(order) + STEP, STEP)}
    if k is None:
        k = next((n for n, c in curve.items() if c >= target_coverage), max(curve))
    everything = Counter(seen) + held
    ids = [t for t, _ in everything.most_common(k)]
    ids += [t for t in always if t not in ids]
    return {"token_ids": ids, "k": len(ids), "held_out_coverage": coverage(order, held, k),
            "target_coverage": target_coverage, "coverage_curve": {str(n): c for n, c in curve.items()},
            "distinct_tokens": len(everything)}


def main(argv=None) -> int:
    from dflash.model_files import default_drafter_dir, ensure_default_target
    from dflash.train.corpus import CORPUS_FILE, load_corpus

    p = argparse.ArgumentParser(prog="python -m dflash.train.draft_vocab", description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", help="drafter folder to write draft_vocab.json into (default: the shipped one)")
    p.add_argument("--corpus", default=str(CORPUS_FILE), help="packed corpus (.jsonl.xz) of the target's answers")
    p.add_argument("--coverage", type=float, default=0.99, help="held-out coverage K must reach (default 0.99)")
    p.add_argument("--k", type=int, help="take exactly this many tokens instead")
    p.add_argument("--dry-run", action="store_true", help="print the choice, write nothing")
    args = p.parse_args(argv)
    try:
        if not 0 < args.coverage <= 1:
            raise DFlashError("bad_params", f"--coverage must be in (0, 1], got {args.coverage}")
        if args.k is not None and args.k < 1:
            raise DFlashError("bad_params", f"--k must be >= 1, got {args.k}")
        folder = Path(args.drafter) if args.drafter else default_drafter_dir()[0]
        if not (folder / "config.json").is_file():
            raise DFlashError("bad_drafter", f"{folder} is not a drafter folder (no config.json)")
        gen = json.loads((ensure_default_target(quiet=True) / "generation_config.json").read_text())
        eos = gen.get("eos_token_id")
        always = [eos] if isinstance(eos, int) else list(eos or [])
        got = choose(load_corpus(Path(args.corpus)), args.coverage, always, args.k)
    except DFlashError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    info = {k: v for k, v in got.items() if k not in ("token_ids", "k")}
    info["source"] = Path(args.corpus).name
    print(f"draft vocabulary: {got['k']} tokens of {got['distinct_tokens']} seen, held-out coverage "
          f"{got['held_out_coverage']:.4f} (asked {args.coverage})")
    if not args.dry_run:
        print(draft_vocab.write(folder, got["token_ids"], info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
