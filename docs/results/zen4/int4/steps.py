"""Paired step timings of several ort exports of the 1.5B: rows 1,2,4,8 at 64 cached tokens."""
import sys, time
import torch; torch.set_num_threads(2)
from pathlib import Path
from dflash.engine.target import ort
from dflash.engine.target.protocol import TargetRow
hf = Path.home() / ".cache/pg_dflash/qwen2.5-coder-1.5b-instruct"
names = sys.argv[1:]
ts = {n: ort.OrtTarget(Path(n) / "model.onnx", hf, threads=2) for n in names}
ctx = [(1000 + 37 * i) % 49000 for i in range(64)]
res = {n: {} for n in names}
for rnd in range(5):
    for n, t in ts.items():
        for k in (1, 2, 4, 8):
            best = 1e9
            for _ in range(3):
                s = t.new_sequence(); t.forward_batch([TargetRow(s, ctx, 1)], ())
                a = time.perf_counter()
                t.forward_batch([TargetRow(s, ctx[:k], k)], ())
                best = min(best, time.perf_counter() - a)
                t.free(s)
            res[n][k] = min(res[n].get(k, 1e9), best)
for n in names:
    times = " ".join(f"T{k}={v*1e3:.1f}" for k, v in res[n].items())
    print(n.split("/")[-1][:40], times, "min_rows", ts[n].min_rows, flush=True)
