import sys, time
from pathlib import Path
import dflash.convert.onnx_target as ot
from dflash.model_files import default_target_dir
from dflash.engine.target.ort import OrtTarget
from dflash.bench.backends import time_target
hf = default_target_dir()
res = {}
for prec, bs in [(sys.argv[1], int(sys.argv[2]))]:
    ot.PRECISION, ot.BLOCK_SIZE = prec, bs
    out = Path(f"/tmp/s7/exp-{prec}-{bs}")
    t = time.time()
    mf = ot.ensure_export(hf, out, quiet=False)
    print("export", time.time() - t, "s", flush=True)
for name, mf in [("int8-64", Path(str(__import__("dflash.model_files", fromlist=["x"]).onnx_export_dir(hf)) ) / "model.onnx"), (f"{sys.argv[1]}-{sys.argv[2]}", mf)]:
    tgt = OrtTarget(mf, hf, threads=2)
    r = time_target(tgt, (1, 5, 9), 9)
    print(name, {k: round(v * 1000, 1) for k, v in r.items()}, flush=True)
    tgt.close(); del tgt
