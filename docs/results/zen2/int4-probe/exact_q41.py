"""Prototype: the int4 export with the shipped Q4_1 weights exactly (integer zero points plus a
per-block remainder term). usage: exactq4.py SRC_EXPORT_DIR OUT_DIR"""
import sys, shutil, re
from pathlib import Path
import numpy as np, onnx
from onnx import helper, numpy_helper, TensorProto
from safetensors.numpy import load_file
from dflash.model_files import default_target_dir
from dflash.convert import onnx_target as ot

src, out = Path(sys.argv[1]), Path(sys.argv[2])
hf = load_file(str(default_target_dir() / "model.safetensors"))
BS = 32

def weight(name):
    m = re.match(r"/model/layers\.(\d+)/(attn|mlp)/(\w+)/MatMul_Q4", name)
    if name.startswith("/lm_head/"):
        return hf.get("lm_head.weight", hf["model.embed_tokens.weight"])
    i, part, proj = m.groups()
    p = f"model.layers.{i}"
    if proj == "qkv_proj":
        return np.concatenate([hf[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv"])
    if proj == "o_proj":
        return hf[f"{p}.self_attn.o_proj.weight"]
    return hf[f"{p}.mlp.{proj}.weight"]

def q41(W):
    N, K = W.shape
    b = W.reshape(N, K // BS, BS).astype(np.float32)
    mn, mx = b.min(-1), b.max(-1)
    d = ((mx - mn) / 15).astype(np.float16).astype(np.float32)
    d = np.where(d == 0, 1.0, d)
    q = np.clip(np.rint((b - mn[..., None]) / d[..., None]), 0, 15).astype(np.uint8)
    exact = (d[..., None] * q + mn[..., None]).astype(np.float32) == b
    z = np.clip(np.rint(-mn / d), 0, 15).astype(np.uint8)
    r = (mn + d * z).astype(np.float32)
    return q, d, z, r, exact.mean()

model = onnx.load(str(src / "model.onnx"))
g = model.graph
inits = {i.name: i for i in g.initializer}
new_nodes, sums, stats = [], {}, []
for n in g.node:
    new_nodes.append(n)
    if n.op_type != "MatMulNBits":
        continue
    W = weight(n.name)
    if n.name.startswith("/lm_head/"):  # the tied embedding ships as Q8_0: w = d * q, q in [-127, 127]
        N, K = W.shape
        b = W.reshape(N, K // BS, BS).astype(np.float32)
        d = (np.abs(b).max(-1) / 127).astype(np.float16).astype(np.float32)
        d = np.where(d == 0, 1.0, d)
        q8 = np.clip(np.rint(b / d[..., None]), -127, 127)
        stats.append((n.name, ((d[..., None] * q8).astype(np.float32) == b).mean()))
        inits[n.input[1]].CopyFrom(numpy_helper.from_array((q8 + 128).astype(np.uint8), n.input[1]))
        inits[n.input[2]].CopyFrom(numpy_helper.from_array(d, n.input[2]))
        for a in n.attribute:
            if a.name == "bits":
                a.i = 8
        continue
    q, d, z, r, ex = q41(W)
    stats.append((n.name, ex))
    N, nb = d.shape
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    zz = z if nb % 2 == 0 else np.concatenate([z, np.zeros((N, 1), np.uint8)], 1)
    zp = (zz[:, 0::2] | (zz[:, 1::2] << 4)).astype(np.uint8).reshape(-1)
    base = n.input[1].rsplit(".", 1)[0]
    for name, arr in ((n.input[1], packed), (n.input[2], d)):
        inits[name].CopyFrom(numpy_helper.from_array(arr, name))
    zname = base + ".zero_points"
    g.initializer.append(numpy_helper.from_array(zp, zname))
    n.input.append(zname)
    # remainder: block sums of the input times r^T, added to the output
    if len(sys.argv) > 3 and sys.argv[3] == "--no-remainder":
        continue
    a = n.input[0]
    two_d = n.name.startswith("/lm_head/")
    if a not in sums:
        shp = a + "/blk_shape"
        g.initializer.append(numpy_helper.from_array(np.array([0, nb, BS] if two_d else [0, 0, nb, BS], np.int64), shp))
        ax = a + "/blk_axes"
        g.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), ax))
        new_nodes.append(helper.make_node("Reshape", [a, shp], [a + "/blocks"], name=a + "/blocks"))
        new_nodes.append(helper.make_node("ReduceSum", [a + "/blocks", ax], [a + "/blocksum"], keepdims=0, name=a + "/blocksum"))
        sums[a] = a + "/blocksum"
    rname = base + ".remainder"
    g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(r.T), rname))
    y = n.output[0]
    n.output[0] = y + "/main"
    new_nodes.append(helper.make_node("MatMul", [sums[a], rname], [y + "/rem"], name=n.name + "/rem"))
    new_nodes.append(helper.make_node("Add", [y + "/main", y + "/rem"], [y], name=n.name + "/add"))
for n in new_nodes:  # the embedding gathers from the lm_head's weight: 8 bits there too
    if n.op_type == "GatherBlockQuantized" and n.input[0] == "/model/embed_tokens/Reshape/output_0":
        for a in n.attribute:
            if a.name == "bits":
                a.i = 8
    if n.name == "/model/embed_tokens/Reshape":
        g.initializer.append(numpy_helper.from_array(np.array([49152, 576], np.int64), "dflash/embed_shape"))
        n.input[1] = "dflash/embed_shape"
del g.node[:]
g.node.extend(new_nodes)
print("exact fraction min", min(s[1] for s in stats), [s for s in stats if s[1] < 1][:4])
if out.exists():
    shutil.rmtree(out)
out.mkdir(parents=True)
onnx.save_model(model, str(out / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                location="model.onnx.data", size_threshold=1024)
for k in ot.BATCH_GRAPHS:
    ot.write_batch_graph(out / "model.onnx", out / ot.batch_file(k), k)
shutil.copy(src / ot.MANIFEST, out / ot.MANIFEST)
print("written", out)
