"""Are a sequence's rows bit-identical however a call is cut, for an export (min_rows 1)?"""
import sys, numpy as np, torch
torch.set_num_threads(2)
from pathlib import Path
from dflash.engine.target import ort
from dflash.engine.target.protocol import TargetRow
hf = Path.home() / ".cache/pg_dflash/qwen2.5-coder-1.5b-instruct"
t = ort.OrtTarget(Path(sys.argv[1]) / "model.onnx", hf, threads=2)
print("min_rows", t.min_rows)
ctx = [(1000 + 37 * i) % 49000 for i in range(40)]
new = [(7 + 91 * i) % 49000 for i in range(16)]
def run(cuts):
    s = t.new_sequence(); t.forward_batch([TargetRow(s, ctx, 1)], ())
    out, i = [], 0
    for c in cuts:
        out.append(t.forward_batch([TargetRow(s, new[i:i + c], c)], ()).logits[0]); i += c
    t.free(s); return np.concatenate(out)
ref = run([1] * 16)
for cuts in ([2] * 8, [4] * 4, [16], [3, 5, 8], [1, 2, 1, 4, 8]):
    x = run(cuts)
    print(cuts, "bit-identical" if np.array_equal(x, ref) else f"DIFF max {np.abs(x - ref).max():.3g}")
