import sys, os
from pathlib import Path
os.environ["DFLASH_COST_DIR"] = "/tmp/s7/costs-" + sys.argv[1]
if sys.argv[1] != "int8":
    import dflash.model_files as mf, dflash.convert.onnx_target as ot
    d = Path(sys.argv[2])
    mf.onnx_export_dir = lambda target_dir: d
    ot.ensure_export = lambda hf, out, quiet=True: Path(out) / "model.onnx"
    ot.is_current = lambda a, b: True
    ot.BUILD = {"format": 4, "precision": sys.argv[1], "block_size": 32}
from dflash.cli import main
sys.exit(main(["bench", "--threads", "2", "--target-backend", "ort", "--suites", "code,chat,agent", "--limit", "6",
               "--methods", "ar,ar-reference", "--max-new-tokens", "64", "--out", f"/tmp/s7/agree-{sys.argv[1]}"]))
