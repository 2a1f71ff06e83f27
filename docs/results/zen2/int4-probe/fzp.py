import numpy as np, onnx, onnxruntime as ort, time
from onnx import helper, TensorProto, numpy_helper
K, N, bs = 576, 1536, 32
rng = np.random.default_rng(0)
nb = K // bs
q = rng.integers(0, 16, size=(N, nb, bs), dtype=np.uint8)
d = rng.uniform(0.001, 0.02, size=(N, nb)).astype(np.float32)
m = rng.uniform(-0.2, 0.0, size=(N, nb)).astype(np.float32)
W = (d[..., None] * q + m[..., None]).reshape(N, K)  # Q4_1: w = d*q + m
packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)  # [N, nb, 16]
def graph(zp_kind, acc):
    inits = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(d.reshape(-1), "scales")]
    if zp_kind == "float":
        inits.append(numpy_helper.from_array((-m / d).reshape(-1).astype(np.float32), "zp"))
    else:
        zpi = np.full((N, nb), 8, np.uint8); zpk = (zpi[:, 0::2] | (zpi[:, 1::2] << 4)).reshape(-1) if nb % 2 == 0 else None
        inits.append(numpy_helper.from_array(zpk, "zp"))
    node = helper.make_node("MatMulNBits", ["A", "B", "scales", "zp"], ["Y"], domain="com.microsoft", K=K, N=N, bits=4,
                            block_size=bs, accuracy_level=acc)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", K])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", N])], inits)
    mdl = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return mdl.SerializeToString()
A = rng.standard_normal((4, K)).astype(np.float32)
ref = A @ W.T
for acc in (0, 4):
    try:
        so = ort.SessionOptions(); so.intra_op_num_threads = 2
        s = ort.InferenceSession(graph("float", acc), so, providers=["CPUExecutionProvider"])
        y = s.run(None, {"A": A})[0]
        err = np.abs(y - ref).max() / np.abs(ref).max()
        A1 = A[:1]
        t = time.perf_counter(); [s.run(None, {"A": A1}) for _ in range(200)]; dt = (time.perf_counter() - t) / 200
        print("float zp acc", acc, "rel err", err, f"{dt*1e6:.0f} us/call M=1")
    except Exception as e:
        print("float zp acc", acc, "FAILED", str(e)[:300])
for acc in (4,):
    so = ort.SessionOptions(); so.intra_op_num_threads = 2
    s = ort.InferenceSession(graph("u8", acc), so, providers=["CPUExecutionProvider"])
    A1 = A[:1]; s.run(None, {"A": A1})
    t = time.perf_counter(); [s.run(None, {"A": A1}) for _ in range(200)]; dt = (time.perf_counter() - t) / 200
    print("uint8 zp acc", acc, f"{dt*1e6:.0f} us/call M=1")
