"""The target's matrix products alone, as one chain, in ONNX Runtime and in OpenVINO: what
each runtime's int8 kernels cost for 1 to 16 rows on this CPU (issue 27's runtime comparison).

SmolLM2-135M's shapes: 30 layers of q 576x576, k and v 192x576, o 576x576, gate and up
1536x576, down 576x1536 (RMS norms and residual adds between them, no attention), then the
49,152 x 576 LM head; random weights (std 0.02), quantized to int8 per block.

  python chain.py ort                         # MatMulNBits, 8 bits, blocks of 64, int8 activations
  python chain.py ov KIND:GROUP:DQ[,...]      # OpenVINO, KIND i8|u8|u4, GROUP 0 = per channel,
                                              # DQ its dynamic-quantization group size (def: default)
  python chain.py ov-static KIND:GROUP        # the same compiled for each row count apart

Prints the median ms of 15 interleaved rounds per row count, the multiples of 2 rows, and
whether row 0's logits are bit-identical alone, in 2 rows and in 16 (the engine's
losslessness needs that). Run each alone on the machine, 2 threads. Scratch measurement:
no engine code uses it.
"""
import statistics
import sys
import time

import numpy as np

H, I, KV, V, LAYERS = 576, 1536, 192, 49152, 30
ROWS = [1, 2, 3, 4, 8, 16]


def quantize(w, kind, group):
    """(codes [n, k/g, g], scales [n, k/g, 1], zero points or None)."""
    n, k = w.shape
    b = w.reshape(n, k // (group or k), group or k)
    if kind == "i8":
        s = np.abs(b).max(2, keepdims=True) / 127
        return np.clip(np.round(b / s), -127, 127).astype(np.int8), s.astype(np.float32), None
    top = {"u8": 255, "u4": 15}[kind]
    lo, hi = b.min(2, keepdims=True), b.max(2, keepdims=True)
    s = (hi - lo) / top
    z = np.round(-lo / s)
    return np.clip(np.round(b / s) + z, 0, top).astype(np.uint8), s.astype(np.float32), z.astype(np.uint8)


def chain(fc, norm, add, mul):
    """The network over a runtime's operations: returns (logits, k+v accumulated)."""
    rng = np.random.default_rng(0)
    W = lambda n, k: (rng.standard_normal((n, k)) * 0.02).astype(np.float32)  # noqa: E731
    y, acc = None, None
    for _ in range(LAYERS):
        h = norm(y)
        q, k, v = fc(h, W(H, H)), fc(h, W(KV, H)), fc(h, W(KV, H))
        kv = add(k, v)
        acc = kv if acc is None else add(acc, kv)
        y2 = add(fc(q, W(H, H)), y)
        h2 = norm(y2)
        y = add(fc(mul(fc(h2, W(I, H)), fc(h2, W(I, H))), W(H, I)), y2)
    return fc(norm(y), W(V, H)), acc


def timed(run, label):
    xs = {m: np.random.default_rng(m).standard_normal((m, H)).astype(np.float32) for m in ROWS}
    for m in ROWS:
        run(xs[m])
    times = {m: [] for m in ROWS}
    for _ in range(15):
        for m in ROWS:
            t = time.perf_counter()
            run(xs[m])
            times[m].append(time.perf_counter() - t)
    med = {m: statistics.median(v) * 1e3 for m, v in times.items()}
    a, b, c = run(xs[16][:2])[0].copy(), run(xs[16])[0].copy(), run(xs[16][:1])[0].copy()
    print(f"{label:18s} " + "  ".join(f"{m}: {med[m]:5.2f}" for m in ROWS) + "  | x2 rows: "
          + " ".join(f"{med[m] / med[2]:.2f}" for m in ROWS)
          + f"  | row 0 same in 2 and 16 rows: {bool((a == b).all())}, alone and in 2: {bool((a == c).all())}",
          flush=True)


def ort_chain():
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    nodes, inits, n = [], [numpy_helper.from_array(np.ones(H, np.float32), "ones")], [0]

    def name(p):
        n[0] += 1
        return f"{p}{n[0]}"

    def op(t, *ins, **kw):
        out = name(t)
        nodes.append(helper.make_node(t, list(ins), [out], **kw))
        return out

    def fc(x, w):
        q, s, _ = quantize(w, "i8", 64)
        b, sc = name("B"), name("S")
        inits.append(numpy_helper.from_array((q.astype(np.int16) + 128).astype(np.uint8), b))  # zero point 128
        inits.append(numpy_helper.from_array(s.reshape(q.shape[0], q.shape[1]), sc))
        return op("MatMulNBits", x, b, sc, domain="com.microsoft", K=w.shape[1], N=w.shape[0], bits=8,
                  block_size=64, accuracy_level=4)

    def norm(x):
        return op("SimplifiedLayerNormalization", x or "x", "ones", axis=-1, epsilon=1e-5)

    logits, acc = chain(fc, norm, lambda a, b: op("Add", a, b or "x"), lambda a, b: op("Mul", a, b))
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", H])],
                              [helper.make_tensor_value_info(logits, TensorProto.FLOAT, ["M", V]),
                               helper.make_tensor_value_info(acc, TensorProto.FLOAT, ["M", KV])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = 2, 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    timed(lambda x: sess.run(None, {"x": x})[0], f"ort {ort.__version__}")


def ov_model(kind, group):
    import openvino as ov
    import openvino.opset13 as ops

    x = ops.parameter([-1, H], np.float32, name="x")
    et = {"i8": None, "u8": None, "u4": ov.Type.u4}[kind]

    def const(a):
        return ops.constant(a) if et is None else ops.constant(a, dtype=et)

    def fc(h, w):
        q, s, z = quantize(w, kind, group)
        c = ops.convert(const(q), "f32")
        if z is not None:
            c = ops.subtract(c, ops.convert(const(z), "f32"))
        wt = ops.reshape(ops.multiply(c, ops.constant(s)), ops.constant(np.array(w.shape, np.int64)), False)
        return ops.matmul(h, wt, False, True)

    def norm(h):
        return ops.mvn(h if h is not None else x, ops.constant(np.array([1], np.int64)), True, 1e-5, "inside_sqrt")

    logits, acc = chain(fc, norm, lambda a, b: ops.add(a, b if b is not None else x), ops.multiply)
    return ov.Model([ops.result(logits), ops.result(acc)], [x], "chain")


def ov_config(dq):
    cfg = {"INFERENCE_NUM_THREADS": "2", "NUM_STREAMS": "1", "PERFORMANCE_HINT": "LATENCY",
           "INFERENCE_PRECISION_HINT": "f32"}
    if dq != "def":
        cfg["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = dq
    return cfg


def ov_chain(variants, static):
    import openvino as ov

    core = ov.Core()
    for v in variants.split(","):
        kind, group, dq = (v.split(":") + ["def"])[:3]
        label = f"ov {kind} g{group} dq {dq}" + (" static" if static else "")
        if not static:
            req = core.compile_model(ov_model(kind, int(group)), "CPU", ov_config(dq)).create_infer_request()
            timed(lambda x: req.infer({0: x})[0], label)
            continue
        reqs = {}
        for m in ROWS:
            model = ov_model(kind, int(group))
            model.reshape({0: [m, H]})
            reqs[m] = core.compile_model(model, "CPU", ov_config(dq)).create_infer_request()
        timed(lambda x: reqs[x.shape[0]].infer({0: x})[0], label)


if __name__ == "__main__":
    if sys.argv[1] == "ort":
        ort_chain()
    else:
        ov_chain(sys.argv[2], sys.argv[1] == "ov-static")
