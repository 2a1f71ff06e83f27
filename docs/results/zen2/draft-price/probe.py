"""Price of drafting on the ort target: draft alone, verify alone, both (Zen 2 probe).
usage: probe.py [torch|onnx]"""
import os, sys
import torch
from dflash.loading import load_engine, load_versioned
from dflash.model_files import ensure_default_target, default_drafter_dir, default_target_gguf
from dflash.engine import costs
from dflash.engine.proposers.dflash import DFlashProposer

runtime = sys.argv[1] if len(sys.argv) > 1 else "torch"
backend = sys.argv[2] if len(sys.argv) > 2 else "ort"
target_dir, drafter_dir = ensure_default_target(quiet=True), default_drafter_dir()[0]
eng = load_engine(target_dir, drafter_dir, target_backend=backend, draft_dtype="int8", cost_dir=None, target_gguf=default_target_gguf())
if runtime != eng.draft_runtime:
    drafter, sha = load_versioned(drafter_dir)
    eng.dflash = DFlashProposer(eng.target, drafter, "probe", sha, eng.draft_dtype, eng.draft_vocab, runtime)
print("draft", eng.draft_dtype, eng.dflash.runtime, "OMP_WAIT_POLICY=", os.environ.get("OMP_WAIT_POLICY"), flush=True)
with torch.inference_mode():
    b = costs._StepBench(eng, context=192)
    b.warm_up()
    for L in (2, 4, 8, 16):
        v = costs._best_s(lambda: b.verify(L), b.device, 15)
        d = costs._best_s(lambda: b.draft(L), b.device, 15)
        both = costs._best_s(lambda: (b.draft(L), b.verify(L)), b.device, 15)
        print(f"L{L}: verify {v*1e3:.2f} draft {d*1e3:.2f} both {both*1e3:.2f} -> drafting adds {(both-v)*1e3:.2f} ms",
              flush=True)
