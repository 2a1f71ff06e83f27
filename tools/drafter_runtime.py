"""Does ONNX Runtime draft faster than PyTorch here? One drafter, both runtimes, same calls.

`python -m tools.drafter_runtime [--drafter DIR] [--threads N] [--steps N]
[--engine-prompts N] [--out DIR]`

Replays the drafter calls of a generation: a prompt's context rows first, then one call
per step with the rows that step committed (1 to 3: what our drafters accept) and a
block of `--block` positions, the cache growing as in the engine. Each step runs both
runtimes back to back on the same inputs (order alternating), so a busy machine slows
both alike; times are per call, cache update included. The ONNX file is exported into a
temporary folder first. Then (`--engine-prompts`) the same two drafters inside the engine
on the default target, chat prompts, block size 16, alternating prompt by prompt. Writes
DIR/drafter_runtime.json (per-call milliseconds: median, mean, p90; the ratio; the largest
relative difference of their outputs; the engine's tokens/s and drafting ms per step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


class InDtype:
    """A PyTorch drafter run in another dtype, called as the engine calls it (inputs cast
    in, logits-side hidden states cast back to fp32)."""

    def __init__(self, drafter, dtype: torch.dtype):
        self.drafter, self.dtype, self.config = drafter.to(dtype), dtype, drafter.config

    def new_cache(self):
        return self.drafter.new_cache()

    def __call__(self, feats, embeds, positions, cache):
        return self.drafter(feats.to(self.dtype), embeds.to(self.dtype), positions, cache).float()


def replay(drafters: dict, cfg, prompt_rows: int, steps: int, block: int, seed: int = 0) -> tuple[dict, float]:
    gen = torch.Generator().manual_seed(seed)
    feat_dim = cfg.num_features * cfg.hidden_size
    caches = {name: d.new_cache() for name, d in drafters.items()}
    times: dict[str, list[float]] = {name: [] for name in drafters}
    worst = 0.0
    start = 0
    names = list(drafters)
    for step in range(steps + 1):
        rows = prompt_rows if step == 0 else 1 + int(torch.randint(0, 3, (1,), generator=gen))
        feats = torch.randn(1, rows, feat_dim, generator=gen)
        embeds = torch.randn(1, block, cfg.hidden_size, generator=gen)
        positions = torch.arange(start, start + rows + block)
        outs = {}
        for name in names if step % 2 else list(reversed(names)):
            t = time.perf_counter()
            with torch.inference_mode():
                outs[name] = drafters[name](feats, embeds, positions, caches[name])
            elapsed = time.perf_counter() - t
            if step:  # the prompt call is prefill-sized; the steps are what decoding repeats
                times[name].append(elapsed)
        # ONNX Runtime against PyTorch in the same dtype (fp32): the conversion's exactness
        a, b = outs["onnxruntime"], outs["pytorch"]
        worst = max(worst, ((a - b).norm() / b.norm()).item())
        start += rows
    return times, worst


def engine_replay(drafters: dict, prompts: int, max_new: int, block: int) -> dict:
    """The same drafters inside the engine (default target, dflash-`block`, greedy), prompt
    by prompt in turn: whole-generation tokens/s and drafting time per step."""
    from dflash.suites import load_suite
    from dflash.engine.engine import Engine, GenerationRequest
    from dflash.engine.target.hf import HFTarget
    from dflash.model_files import ensure_default_target

    target = HFTarget.from_pretrained(ensure_default_target(quiet=True))
    engines = {name: Engine(target, d.drafter if isinstance(d, InDtype) else d, name,
                            draft_dtype=d.dtype if isinstance(d, InDtype) else None)
               for name, d in drafters.items()}
    texts = load_suite("chat", prompts)
    tally = {name: {"new_tokens": 0, "wall_s": 0.0, "draft_s": 0.0, "steps": 0, "outputs": []} for name in engines}
    for i, text in enumerate(["Warm up."] + texts):
        for name in (list(engines) if i % 2 else list(reversed(engines))):
            req = GenerationRequest(prompt=text, chat=True, max_new_tokens=max_new, block_size=block)
            t = time.perf_counter()
            res = engines[name].generate(req)
            wall = time.perf_counter() - t
            if i:
                row = tally[name]
                row["new_tokens"] += len(res.output_ids)
                row["wall_s"] += wall
                row["draft_s"] += res.stats.draft_s
                row["steps"] += res.stats.num_steps
                row["outputs"].append(res.output_ids)
    out = {}
    for name, row in tally.items():
        out[name] = {"prompts": len(texts), "new_tokens": row["new_tokens"],
                     "tokens_per_s": row["new_tokens"] / row["wall_s"],
                     "draft_ms_per_step": 1000 * row["draft_s"] / max(row["steps"], 1)}
    first, *rest = (tally[n]["outputs"] for n in tally)
    out["same_outputs"] = all(o == first for o in rest)
    return out


def summary(ts: list[float]) -> dict:
    ms = sorted(t * 1000 for t in ts)
    return {"calls": len(ms), "median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms),
            "p90_ms": ms[int(0.9 * (len(ms) - 1))]}


def main(argv: list[str] | None = None) -> int:
    from dflash.engine.costs import cpu_name
    from dflash.convert import convert_drafter
    from dflash.loading import load_drafter
    from dflash.model_files import default_drafter_dir

    ap = argparse.ArgumentParser(prog="python -m tools.drafter_runtime", description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", help="drafter folder (default: the shipped one)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-rows", type=int, default=120)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--block", type=int, help="block positions per call (default: the drafter's block size)")
    ap.add_argument("--engine-prompts", type=int, default=10,
                    help="also generate this many chat prompts with each drafter in the engine (0: skip)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = Path(args.drafter) if args.drafter else default_drafter_dir()[0]
    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = convert_drafter(folder, "onnx", Path(tmp) / "drafter.onnx")
        # PyTorch as the engine runs it by default here (bf16 where the CPU has native bf16
        # matmuls), PyTorch in fp32, and the fp32 ONNX graph.
        drafters = {"pytorch": load_drafter(folder), "onnxruntime": load_drafter(onnx_path),
                    "pytorch-bf16": InDtype(load_drafter(folder), torch.bfloat16)}
        cfg = drafters["pytorch"].config
        block = args.block or cfg.block_size
        replay(drafters, cfg, args.prompt_rows, 10, block, seed=1)  # warm-up: allocators, kernels, graph
        times, worst = replay(drafters, cfg, args.prompt_rows, args.steps, block)
        engine = engine_replay(drafters, args.engine_prompts, args.max_new_tokens, block) if args.engine_prompts else None
    import onnxruntime

    report = {
        "drafter": folder.name, "threads": args.threads, "block": block, "prompt_rows": args.prompt_rows,
        "cpu": cpu_name(), "torch": torch.__version__, "onnxruntime": onnxruntime.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **{name: summary(ts) for name, ts in times.items()},
        "max_relative_difference": worst,
        "engine": engine,
    }
    report["onnxruntime_over_pytorch_median"] = report["onnxruntime"]["median_ms"] / report["pytorch"]["median_ms"]
    report["onnxruntime_over_pytorch_bf16_median"] = (report["onnxruntime"]["median_ms"]
                                                      / report["pytorch-bf16"]["median_ms"])
    report["faster"] = min(times, key=lambda name: report[name]["median_ms"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "drafter_runtime.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    print(f"results: {out / 'drafter_runtime.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
