"""The shipped int8 export beside other exports (folders given), timed in alternating rounds in one process
(dflash.bench.backends.time_target: T = rows of one sequence, B = sequences of one row; ms, 64-token context).
usage: python speed_rounds.py EXPORT_DIR ..."""
import statistics, sys
from pathlib import Path
from dflash.model_files import default_target_dir, onnx_export_dir
from dflash.engine.target.ort import OrtTarget
from dflash.bench.backends import time_target
hf = default_target_dir()
exports = {"int8-64": onnx_export_dir(hf) / "model.onnx"}
for a in sys.argv[1:]:
    exports[Path(a).name] = Path(a) / "model.onnx"
targets = {k: OrtTarget(v, hf, threads=2) for k, v in exports.items()}
runs = {k: [] for k in exports}
for rnd in range(3):
    for k, t in (targets.items() if rnd % 2 == 0 else reversed(list(targets.items()))):
        runs[k].append(time_target(t, (1, 5, 9), 5))
print("| export | " + " | ".join(runs[next(iter(runs))][0]) + " |")
for k, rs in runs.items():
    med = {s: statistics.median(r[s] for r in rs) for s in rs[0]}
    print(f"| {k} | " + " | ".join(f"{v*1000:.1f}" for v in med.values()) + " |", flush=True)
