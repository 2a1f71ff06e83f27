import statistics
from pathlib import Path
from dflash.model_files import default_target_dir, onnx_export_dir
from dflash.engine.target.ort import OrtTarget
from dflash.bench.backends import time_target
hf = default_target_dir()
exports = {"int8-64 (shipped)": onnx_export_dir(hf) / "model.onnx", "q4_1 exact (+remainder)": Path("/tmp/s7/exact-q41/model.onnx"),
           "int4-32 builder (approx)": Path("/tmp/s7/exp-int4-32/model.onnx")}
targets = {k: OrtTarget(v, hf, threads=2) for k, v in exports.items()}
runs = {k: [] for k in exports}
for rnd in range(3):
    for k, t in (targets.items() if rnd % 2 == 0 else reversed(list(targets.items()))):
        runs[k].append(time_target(t, (1, 5, 9), 5))
print("| export | " + " | ".join(runs[next(iter(runs))][0]) + " |")
for k, rs in runs.items():
    med = {s: statistics.median(r[s] for r in rs) for s in rs[0]}
    print(f"| {k} | " + " | ".join(f"{v*1000:.1f}" for v in med.values()) + " |")
