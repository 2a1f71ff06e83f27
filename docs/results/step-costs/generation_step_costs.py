"""Step cost per fixed block length, averaged over whole generations, as multiples of the
same engine's plain (L = 1) step: the before/after measurement of the step-cost table in
docs/benchmarks.md. It uses only what both the engine before the step API (commit 026bb26) and after
it offer (`Engine.load`, `generate` with a fixed block size, the statistics' draft /
verify / decode timers), so the same script times both:

    git worktree add /tmp/before 026bb26
    PYTHONPATH=/tmp/before/worker .venv/bin/python docs/results/step-costs/generation_step_costs.py 2 1 old.json
    .venv/bin/python docs/results/step-costs/generation_step_costs.py 2 1 new.json
    DRAFT_DTYPE=bfloat16 .venv/bin/python docs/results/step-costs/generation_step_costs.py 2 1 new-bf16.json

Arguments: threads, repeats, output JSON. The files in ab/ are three alternating rounds
(old, new, new with a bf16 drafter) run back to back on an otherwise idle machine.
"""

import json
import os
import statistics
import sys

import torch

from dflash.engine.engine import GenerationRequest
from dflash.loading import load_engine
from dflash.model_files import resolve_models

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and tests."
LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16)


def main() -> None:
    threads, repeats, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(threads)
    target, drafter, _ = resolve_models(None, None)
    dtype = os.environ.get("DRAFT_DTYPE")
    engine = load_engine(target, drafter, **({"draft_dtype": dtype} if dtype else {}))
    rows = {L: {"step": [], "draft": [], "verify": []} for L in LENGTHS}
    for _ in range(repeats):
        for L in LENGTHS:
            s = engine.generate(GenerationRequest(prompt=PROMPT, chat=True, max_new_tokens=48, block_size=L)).stats
            rows[L]["step"].append(s.decode_s / s.num_steps)
            rows[L]["draft"].append(s.draft_s / s.num_steps)
            rows[L]["verify"].append(s.verify_s / s.num_steps)
    ar = statistics.median(rows[1]["step"])
    out = {"ar_step_s": ar, "L": {}}
    for L in LENGTHS:
        m = {k: statistics.median(v) for k, v in rows[L].items()}
        out["L"][str(L)] = {"total_vs_ar": m["step"] / ar, "draft_vs_ar": m["draft"] / ar,
                            "verify_vs_ar": m["verify"] / ar, "other_vs_ar": (m["step"] - m["draft"] - m["verify"]) / ar}
    print(json.dumps(out, indent=1))
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
