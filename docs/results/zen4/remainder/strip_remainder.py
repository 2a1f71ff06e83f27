"""Copy a q4_1 export without its remainder nodes (wrong numbers; an upper bound of what the
remainder costs). usage: python strip_remainder.py SRC_DIR DST_DIR (docs/results/zen4/remainder/speed3.md)"""
import shutil, sys
from pathlib import Path
import onnx
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
shutil.copytree(src, dst, dirs_exist_ok=True)
m = onnx.load(str(src / "model.onnx"))
g = m.graph
rename = {}
keep = []
for n in g.node:
    if n.name.endswith("/add") and n.op_type == "Add" and n.input[0].endswith("/blocks_part"):
        rename[n.output[0]] = n.input[0]
        continue
    if n.name.endswith("/remainder") and n.op_type == "MatMul":
        continue
    if n.op_type in ("Reshape", "ReduceSum") and (n.name.endswith("/blocks") or n.name.endswith("/block_sums")):
        continue
    keep.append(n)
for n in keep:
    for i, x in enumerate(n.input):
        if x in rename:
            n.input[i] = rename[x]
for o in g.output:
    if o.name in rename:
        print("output renamed?", o.name)
print(len(g.node), "->", len(keep))
del g.node[:]
g.node.extend(keep)
(dst / "model.onnx").unlink()
for f in dst.glob("model.onnx.data"):
    f.unlink()
onnx.save(m, str(dst / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
          location="model.onnx.data", size_threshold=1024)
from dflash.convert.onnx_target import write_batch_graph
from dflash.onnx_export_files import BATCH_GRAPHS, batch_file
for k in BATCH_GRAPHS:
    for f in dst.glob(batch_file(k) + "*"):
        f.unlink()
    write_batch_graph(dst / "model.onnx", dst / batch_file(k), k)
print("done")
