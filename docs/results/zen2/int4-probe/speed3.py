"""The shipped int8 export beside other exports, timed in alternating rounds in one process
(dflash.bench.backends.time_target: T = rows of one sequence, B = sequences of one row; ms,
64-token context). usage: python speed3.py [EXPORT_DIR ...] (default: the 18:42 run's two)"""
import statistics
import sys
from pathlib import Path
from dflash.model_files import default_target_dir, onnx_export_dir
from dflash.engine.target.ort import OrtTarget
from dflash.bench.backends import time_target
hf = default_target_dir()
exports = {"int8-64 (shipped)": onnx_export_dir(hf) / "model.onnx"}
for folder in sys.argv[1:] or ["/tmp/s7/exact-q41", "/tmp/s7/exp-int4-32"]:
    exports[Path(folder).name] = Path(folder) / "model.onnx"
targets = {k: OrtTarget(v, hf, threads=2) for k, v in exports.items()}
runs = {k: [] for k in exports}
for rnd in range(3):
    for k, t in (targets.items() if rnd % 2 == 0 else reversed(list(targets.items()))):
        runs[k].append(time_target(t, (1, 5, 9), 5))
print("| export | " + " | ".join(runs[next(iter(runs))][0]) + " |")
for k, rs in runs.items():
    med = {s: statistics.median(r[s] for r in rs) for s in rs[0]}
    print(f"| {k} | " + " | ".join(f"{v*1000:.1f}" for v in med.values()) + " |")
