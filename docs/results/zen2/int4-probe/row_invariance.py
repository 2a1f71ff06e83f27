"""One MatMulNBits node (K 576, N 1536, blocks of 32, random weights), 2 threads: are the first m rows of a
16-row call bit-identical to a call of m rows alone? Per bits (4, 8), accuracy_level (0, 4), zero points or not.
usage: python row_invariance.py"""
import numpy as np, onnxruntime as ort
from onnx import helper, TensorProto, numpy_helper
K, N, BS = 576, 1536, 32
rng = np.random.default_rng(0)
def graph(bits, acc, zp):
    nb = K // BS
    q = rng.integers(0, 2**bits, (N, nb, BS)).astype(np.uint8)
    if bits == 4: packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    else: packed = q
    sc = (rng.random((N, nb)) * 0.01 + 0.001).astype(np.float32)
    inits = [numpy_helper.from_array(packed, "w"), numpy_helper.from_array(sc.reshape(-1), "s")]
    ins = ["x", "w", "s"]
    if zp:
        z = rng.integers(0, 2**bits, (N, nb)).astype(np.uint8)
        if bits == 4: z = (z[:, 0::2] | (z[:, 1::2] << 4))
        inits.append(numpy_helper.from_array(z.reshape(-1).astype(np.uint8), "z")); ins.append("z")
    node = helper.make_node("MatMulNBits", ins, ["y"], domain="com.microsoft", K=K, N=N, bits=bits, block_size=BS, accuracy_level=acc)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "M", K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "M", N])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    o = ort.SessionOptions(); o.intra_op_num_threads = 2
    return ort.InferenceSession(m.SerializeToString(), o, providers=["CPUExecutionProvider"])
x = rng.standard_normal((1, 16, K)).astype(np.float32)
for bits in (4, 8):
    for acc in (0, 4):
        for zp in (False, True):
            s = graph(bits, acc, zp)
            ref = s.run(None, {"x": x})[0]
            same = [int(np.array_equal(s.run(None, {"x": x[:, :m]})[0], ref[:, :m])) for m in (1, 2, 3, 4, 8)]
            # row 0 alone vs inside
            print(f"bits {bits} acc {acc} zp {zp}: prefix-of-16 equal for M=1,2,3,4,8: {same}; max diff M=1 {np.abs(s.run(None, {'x': x[:, :1]})[0]-ref[:, :1]).max():.2e}")
