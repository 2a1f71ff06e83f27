"""Where a speculative step's time goes, as multiples of one plain autoregressive step.

    python -m dflash.bench.step_profile [--out DIR] [--threads N] [--repeats R]

For each verify length L in 1, 2, 3, 4, 6, 8, 12, 16 (those the drafter allows; L = 1 is
`auto`'s plain step, which also collects the drafter's features) it times,
at the same committed context: the whole engine step at fixed block size L; and its parts
on their own: the target's forward over L tokens without features ("target verify"), the
same forward's extra cost for collecting the drafter's features ("feature extraction"),
the drafter's forward over the block, the drafter's LM head over the L - 1 drafted rows
with the argmax, the verify rule, and the target cache crop. "Bookkeeping" is what the
whole step costs beyond those parts (building inputs, commit, statistics). The plain AR
step is the engine's step at block size 1 (no features, no drafter). Every number is the
median of interleaved repeats (each repeat runs every measurement once), so a machine
that slows down for a while slows all of them alike.

Writes DIR/step_profile.json: {"ar_step_s": ..., "L": {"1": {"total_vs_ar": ..., parts...}}}
and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from dflash.engine.engine import Engine, GenerationRequest, dtype_name
from dflash.engine.proposers.dflash import NAME as DFLASH
from dflash.engine.sampling import argmax_rows, verify_greedy
from dflash.engine.target import TargetRow

LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16)
PARTS = ("target_verify", "feature_extraction", "drafter_forward", "drafter_lm_head", "verify_rule", "cache_crop",
         "bookkeeping")
PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and tests."


class Point:
    """A decode state frozen after prefill and a few steps, that a measurement can run from
    and be put back to."""

    def __init__(self, engine: Engine, block_size: int, features: bool = True, warm_steps: int = 4):
        self.engine = engine
        self.state = engine.start(GenerationRequest(prompt=PROMPT, chat=True, max_new_tokens=warm_steps * 20,
                                                    block_size=block_size))
        if block_size == 1 and features:  # auto's plain step: it keeps the drafter's features current
            self.state.proposals[DFLASH] = engine.dflash.start(self.state)
        for _ in range(warm_steps):
            engine.step([self.state])
        s = self.state
        self.length = s.length
        self.output = list(s.output_ids)
        ps = s.proposals.get(DFLASH)
        self.pending = list(ps.pending) if ps else []
        self.draft_len = ps.cache.length if ps else 0

    @property
    def proposal(self):
        return self.state.proposals.get(DFLASH)

    def restore(self) -> None:
        s = self.state
        self.engine.target.rollback(s.seq, self.length - 1)
        s.output_ids[:] = self.output
        s.finish_reason = None
        if self.proposal is not None:
            self.proposal.pending[:] = self.pending
            self.proposal.cache.length = self.draft_len


def _timer(device):
    def run(fn) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t
    return run


@torch.inference_mode()
def profile(engine: Engine, lengths=LENGTHS, repeats: int = 15) -> dict:
    lengths = [L for L in lengths if L <= engine.block_size]
    target, drafting = engine.target, engine.in_use()
    timed = _timer(target.device)
    ar = Point(engine, 1, features=False)
    points = {L: Point(engine, L) for L in lengths}
    samples: dict = {"ar": []}
    for L in lengths:
        samples[L] = {k: [] for k in ("total", "forward", "forward_features", "drafter_forward", "drafter_lm_head",
                                      "verify_rule", "cache_crop")}

    def forward(s, ids, layers, logits):
        return target.forward_batch([TargetRow(s.seq, ids, logits)], layers)

    for _ in range(repeats + 1):  # the first round warms up and is dropped
        samples["ar"].append(timed(lambda: engine.step([ar.state])))
        ar.restore()
        for L, pt in points.items():
            s, row = pt.state, samples[L]
            row["total"].append(timed(lambda: engine.step([s])))
            pt.restore()
            n = s.length - 1  # committed tokens in the target cache
            ids = ([s.output_ids[-1]] + s.output_ids[-L:])[:L]
            row["forward"].append(timed(lambda: forward(s, ids, (), L)))
            target.rollback(s.seq, n)
            row["forward_features"].append(timed(lambda: forward(s, ids, engine.layer_ids, L)))
            out = forward(s, ids[:1], (), 1)  # a longer cache to roll back
            logits = out.logits[0]
            row["cache_crop"].append(timed(lambda: target.rollback(s.seq, n)))
            if L > 1:  # the parts of a DFlash draft, timed one by one
                ps = pt.proposal
                ctx = torch.cat(ps.pending).to(drafting.dtype)
                block = drafting.block(target.embed(torch.tensor(ids[:1], device=target.device)), L)[None]
                positions = torch.arange(ps.cache.length, n + L, device=target.device)
                hidden = None

                def draft():
                    nonlocal hidden
                    hidden = drafting.model(ctx[None], block, positions, ps.cache)

                row["drafter_forward"].append(timed(draft))
                pt.restore()
                drafts = None

                def head():
                    nonlocal drafts
                    drafts = drafting.head.token_ids(argmax_rows(drafting.head(hidden[0, 1:])))

                row["drafter_lm_head"].append(timed(head))
                logits = forward(s, ids[:1] + drafts.tolist(), (), L).logits[0]
                row["verify_rule"].append(timed(lambda: verify_greedy(drafts, logits)))
                target.rollback(s.seq, n)
            else:
                row["verify_rule"].append(timed(lambda: int(logits[-1].argmax())))
    return summarize(samples, lengths)


def summarize(samples: dict, lengths) -> dict:
    def med(xs):
        return statistics.median(xs[1:]) if len(xs) > 1 else (xs[0] if xs else 0.0)

    ar = med(samples["ar"])
    out = {"ar_step_s": ar, "L": {}}
    for L in lengths:
        row = samples[L]
        parts = {
            "target_verify": med(row["forward"]),
            "feature_extraction": max(med(row["forward_features"]) - med(row["forward"]), 0.0),
            "drafter_forward": med(row["drafter_forward"]) if row["drafter_forward"] else 0.0,
            "drafter_lm_head": med(row["drafter_lm_head"]) if row["drafter_lm_head"] else 0.0,
            "verify_rule": med(row["verify_rule"]),
            "cache_crop": med(row["cache_crop"]),
        }
        total = med(row["total"])
        parts["bookkeeping"] = max(total - sum(parts.values()), 0.0)
        out["L"][str(L)] = {"total_s": total, "total_vs_ar": total / ar,
                            **{f"{k}_vs_ar": v / ar for k, v in parts.items()}, **{f"{k}_s": v for k, v in parts.items()}}
    return out


def table(result: dict) -> str:
    head = "| L | step / AR step | " + " | ".join(p.replace("_", " ") for p in PARTS) + " |"
    rows = [head, "|---" * (len(PARTS) + 2) + "|"]
    for L, r in result["L"].items():
        rows.append(f"| {L} | {r['total_vs_ar']:.2f} | " + " | ".join(f"{r[p + '_vs_ar']:.2f}" for p in PARTS) + " |")
    return (f"plain AR step: {result['ar_step_s'] * 1000:.1f} ms "
            f"({result.get('device', '')}, {result.get('dtype', '')}, {result.get('threads', '')} threads)\n\n"
            + "\n".join(rows) + "\n")


def main(argv=None) -> int:
    from dflash.loading import add_model_args, engine_from_args as load_engine

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default="bench-out")
    args = p.parse_args(argv)
    engine = load_engine(args)
    result = profile(engine, repeats=args.repeats)
    from dflash.engine.costs import cpu_name

    result.update(device=str(engine.target.device), dtype=str(engine.target.dtype).replace("torch.", ""),
                  draft_dtype=dtype_name(engine.draft_dtype),
                  threads=torch.get_num_threads(), torch=torch.__version__, target=engine.target.name,
                  drafter=engine.drafter_name, repeats=args.repeats,
                  cpu=cpu_name() if engine.target.device.type == "cpu" else torch.cuda.get_device_name())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_profile.json").write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"written: {out / 'step_profile.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
