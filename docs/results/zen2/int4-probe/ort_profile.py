"""ONNX Runtime's own profiler over 40 calls of N rows of one export: kernel time per op type, the
remainder's nodes apart. usage: python ort_profile.py EXPORT_DIR/model.onnx N"""
import sys, json, collections, onnxruntime as ort
from pathlib import Path
_SO = ort.SessionOptions
class SO(_SO):
    def __init__(self):
        super().__init__(); self.enable_profiling = True; self.profile_file_prefix = "/tmp/s10/ortprof"
ort.SessionOptions = SO
from dflash.model_files import default_target_dir
from dflash.engine.target.ort import OrtTarget
from dflash.engine.target.protocol import TargetRow
hf = default_target_dir()
t = OrtTarget(Path(sys.argv[1]), hf, threads=2)
s = t.new_sequence()
t.forward_batch([TargetRow(s, list(range(100, 164)), 1)], (1, 5, 9))
n = int(sys.argv[2])
for _ in range(40):
    t.forward_batch([TargetRow(s, list(range(200, 200 + n)), n)], (1, 5, 9)); t.rollback(s, 64)
f = t.session.end_profiling()
ev = json.load(open(f))
by = collections.defaultdict(float); cnt = collections.Counter()
for e in ev:
    if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"): continue
    nm = e["name"][:-12]; op = e["args"].get("op_name")
    key = op + (" rem" if ("/rem" in nm or "/add" in nm and "MatMul_Q4" in nm) else "") + (" blk" if "blocks" in nm or "blocksum" in nm else "")
    by[key] += e["dur"]; cnt[key] += 1
tot = sum(by.values())
for k, v in sorted(by.items(), key=lambda x: -x[1])[:20]:
    print(f"{k:35s} {v/41/1000:7.3f} ms/call  {cnt[k]//41:4d} nodes  {v/tot*100:5.1f}%")
print("total kernel", tot/41/1000, "ms/call")
