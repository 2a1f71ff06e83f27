"""The DFlash drafter as a hand-written ONNX graph for ONNX Runtime's CPU kernels.

A drafter step is small (a block of up to 16 rows through 4 layers), so on a CPU its price
is mostly per-operation overhead: PyTorch runs ~130 operations per step from Python,
`torch.onnx.export`'s graph ~440 small ones. This graph is written with ONNX Runtime's fused
operations instead (`SimplifiedLayerNormalization`, `SkipSimplifiedLayerNormalization`,
`RotaryEmbedding`, `FusedMatMul`) and its projections quantized to 8-bit blocks
(`MatMulNBits`, int8 activations), about 110 operations in all. Same inputs, outputs and cache
discipline as dflash.convert.onnx_file's graph (dflash.engine.onnx_drafter runs either):

  inputs   context_features [1, S, F], block_embeds [1, L, H], positions [S + L] (int64),
           past_key_i / past_value_i [1, n_kv, P, head_dim] for every layer i
  outputs  hidden [1, L, H] (final-normed block states),
           new_key_i / new_value_i [1, n_kv, S, head_dim]

The arithmetic is the drafter's (drafter.py): context features projected once (`fc`,
`hidden_norm`) and, with the block rows after each layer's input norm, giving that layer's
keys and values; q/k norms per head, rotary positions, bidirectional attention of the block
over the cache, the new context and itself. Drafts are proposals, so quantized weights
change how often they are kept, never the output; `tests/test_drafter_graph.py` holds the
fp32 graph to the PyTorch drafter.

`runner(drafter)` is what the engine uses: the graph of a PyTorch drafter, built in memory
(a second or two: the weights are quantized on the way) and run by OnnxDrafter; built once
per drafter version in a process.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from dflash.engine.drafter_config import DrafterConfig
from dflash.engine.onnx_drafter import CONFIG_METADATA, DIGEST_METADATA, OnnxDrafter, io_names
from dflash.errors import DFlashError

OPSET = 21
MS = "com.microsoft"


class _Graph:
    """A small helper over onnx.helper: nodes, initializers, unique names."""

    def __init__(self):
        self.nodes, self.inits, self.n = [], [], 0

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", **attrs) -> list[str] | str:
        from onnx import helper

        self.n += 1
        outs = [f"t{self.n}_{k}" for k in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=f"n{self.n}_{op_type}", domain=domain, **attrs))
        return outs if n_out > 1 else outs[0]

    def init(self, name: str, array: np.ndarray) -> str:
        from onnx import numpy_helper

        self.inits.append(numpy_helper.from_array(np.array(array, order="C"), name))
        return name

    def const(self, values, dtype=np.int64) -> str:
        return self.init(f"c{len(self.inits)}", np.asarray(values, dtype=dtype))


def build(cfg: DrafterConfig, state: dict[str, torch.Tensor], bits: int | None = 8, block: int = 32):
    """The drafter's step as an onnx.ModelProto; `bits` 8 or 4 quantizes every projection to
    MatMulNBits (None keeps fp32 weights)."""
    import json

    from onnx import TensorProto, helper

    if any(cfg.is_sliding(i) for i in range(cfg.num_hidden_layers)):
        raise DFlashError("bad_drafter", "the drafter graph does not take sliding-window layers")
    if cfg.attention_bias or cfg.hidden_act != "silu":
        raise DFlashError("bad_drafter", "the drafter graph takes bias-free SiLU drafters only")
    W = {k: v.detach().float().cpu().numpy() for k, v in state.items()}
    g = _Graph()
    H, hd, nq, nkv, eps = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rms_norm_eps
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    freqs = np.arange(cfg.max_position_embeddings, dtype=np.float64)[:, None] * inv[None]
    cos, sin = g.init("cos_cache", np.cos(freqs).astype(np.float32)), g.init("sin_cache", np.sin(freqs).astype(np.float32))

    def linear(x: str, name: str) -> str:  # x @ W.T (a MatMul with a constant: quantized below)
        return g.op("MatMul", [x, g.init(name, W[name].T)])

    def norm(x: str, name: str) -> str:
        return g.op("SimplifiedLayerNormalization", [x, g.init(name, W[name])], axis=-1, epsilon=eps)

    def heads(x: str, n: int) -> str:  # [1, R, n * hd] -> [1, R, n, hd]
        return g.op("Reshape", [x, g.const([1, -1, n, hd])])

    def rope(x: str, n: int, pos: str) -> str:  # [1, R, n * hd], positions [1, R]
        return g.op("RotaryEmbedding", [x, pos, cos, sin], domain=MS, num_heads=n, interleaved=0)

    inputs, outputs = io_names(cfg)
    feats, blk, positions = inputs[:3]
    S = g.op("Gather", [g.op("Shape", [feats]), g.const(1)], axis=0)
    pos_all = g.op("Unsqueeze", [positions, g.const([0])])
    pos_q = g.op("Slice", [pos_all, g.op("Unsqueeze", [S, g.const([0])]), g.const([1 << 30]), g.const([1])])
    ctx = norm(linear(feats, "fc.weight"), "hidden_norm.weight")
    h, new_kv = blk, []
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        a = norm(h, p + "input_layernorm.weight")
        kvx = g.op("Concat", [ctx, a], axis=1)
        q = heads(linear(a, p + "self_attn.q_proj.weight"), nq)
        q = rope(g.op("Reshape", [norm(q, p + "self_attn.q_norm.weight"), g.const([1, -1, nq * hd])]), nq, pos_q)
        k = heads(linear(kvx, p + "self_attn.k_proj.weight"), nkv)
        k = rope(g.op("Reshape", [norm(k, p + "self_attn.k_norm.weight"), g.const([1, -1, nkv * hd])]), nkv, pos_all)
        k = g.op("Transpose", [heads(k, nkv)], perm=[0, 2, 1, 3])  # [1, nkv, S + L, hd]
        v = g.op("Transpose", [heads(linear(kvx, p + "self_attn.v_proj.weight"), nkv)], perm=[0, 2, 1, 3])
        zero, s_end = g.const([0]), g.op("Unsqueeze", [S, g.const([0])])
        new_kv += [g.op("Slice", [k, zero, s_end, g.const([2])]), g.op("Slice", [v, zero, s_end, g.const([2])])]
        keys = g.op("Concat", [inputs[3 + 2 * i], k], axis=2)
        values = g.op("Concat", [inputs[4 + 2 * i], v], axis=2)
        # Queries grouped by the K/V head they share: [1, nkv, group * L, hd].
        q = g.op("Reshape", [g.op("Transpose", [heads(q, nq)], perm=[0, 2, 1, 3]), g.const([1, nkv, -1, hd])])
        probs = g.op("Softmax", [g.op("FusedMatMul", [q, keys], domain=MS, transB=1, alpha=hd ** -0.5)], axis=-1)
        att = g.op("Reshape", [g.op("MatMul", [probs, values]), g.const([1, nq, -1, hd])])
        att = g.op("Reshape", [g.op("Transpose", [att], perm=[0, 2, 1, 3]), g.const([1, -1, nq * hd])])
        o = linear(att, p + "self_attn.o_proj.weight")
        m, _, _, h = g.op("SkipSimplifiedLayerNormalization", [h, o, g.init(p + "post_attention_layernorm.weight",
                                                                            W[p + "post_attention_layernorm.weight"])],
                          n_out=4, domain=MS, epsilon=eps)
        gate = linear(m, p + "mlp.gate_proj.weight")
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), linear(m, p + "mlp.up_proj.weight")])
        h = g.op("Add", [h, linear(act, p + "mlp.down_proj.weight")])
    hidden = norm(h, "norm.weight")
    # Name the outputs.
    g.nodes.append(helper.make_node("Identity", [hidden], [outputs[0]], name="out_hidden"))
    for name, t in zip(outputs[1:], new_kv):
        g.nodes.append(helper.make_node("Identity", [t], [name], name=f"out_{name}"))
    kv = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, nkv, "P", hd]) for n in inputs[3:]]
    graph = helper.make_graph(
        g.nodes, "dflash_drafter_step",
        [helper.make_tensor_value_info(feats, TensorProto.FLOAT, [1, "S", cfg.num_features * H]),
         helper.make_tensor_value_info(blk, TensorProto.FLOAT, [1, "L", H]),
         helper.make_tensor_value_info(positions, TensorProto.INT64, ["SL"]), *kv],
        [helper.make_tensor_value_info(outputs[0], TensorProto.FLOAT, [1, "L", H]),
         *[helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, nkv, "S", hd]) for n in outputs[1:]]],
        initializer=g.inits)
    model = _quantized(_model(graph), bits, block)
    from dflash.engine.versions import digest

    helper.set_model_props(model, {CONFIG_METADATA: json.dumps(cfg.raw, sort_keys=True),
                                   DIGEST_METADATA: digest(cfg, state)})
    return model


def _model(graph):
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)],
                              producer_name="pg_dflash")
    model.ir_version = 10
    return model


def _quantized(model, bits: int | None, block: int):
    """`model` with every MatMul by a constant as MatMulNBits of `bits` (None: unchanged)."""
    if bits is None:
        return model
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quant = MatMulNBitsQuantizer(model, bits=bits, block_size=block, is_symmetric=True, accuracy_level=4)
    # Its INFO log names every node it passes over (~150 lines per build): keep it out
    # of the worker's log.
    log = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        quant.process()
    finally:
        log.setLevel(level)
    return quant.model.model


def head_graph(weight: np.ndarray, bits: int = 8, block: int = 32):
    """The draft head, hidden [N, H] -> logits [N, K] for a weight [K, H], as one 8-bit
    MatMulNBits (int8 activations): the head of the ONNX Runtime drafter."""
    from onnx import TensorProto, helper

    g = _Graph()
    out = g.op("MatMul", ["hidden", g.init("head.weight", np.asarray(weight, dtype=np.float32).T)])
    graph = helper.make_graph(g.nodes, "dflash_draft_head",
                              [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["N", weight.shape[1]])],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["N", weight.shape[0]])],
                              initializer=g.inits)
    return _quantized(_model(graph), bits, block)


def next_head_graph(proj: np.ndarray, bias: np.ndarray, gain: np.ndarray, out: np.ndarray, eps: float,
                    bits: int = 8, block: int = 32):
    """The next-token head (dflash.engine.proposers.head) after its input norm: x [N, 2H] ->
    logits [N, K], its projection and output embeddings as 8-bit MatMulNBits."""
    from onnx import TensorProto, helper

    g = _Graph()
    u = g.op("Add", [g.op("MatMul", ["x", g.init("proj.weight", np.asarray(proj, dtype=np.float32).T)]),
                     g.init("proj.bias", bias)])
    z = g.op("SimplifiedLayerNormalization", [u, g.init("gain", gain)], axis=-1, epsilon=eps)
    logits = g.op("MatMul", [z, g.init("out.weight", np.asarray(out, dtype=np.float32).T)])
    graph = helper.make_graph(g.nodes, "dflash_next_head",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", proj.shape[1]])],
                              [helper.make_tensor_value_info(logits, TensorProto.FLOAT, ["N", out.shape[0]])],
                              initializer=g.inits)
    return _quantized(_model(graph), bits, block)


class OnnxHead:
    """The draft head run by ONNX Runtime. Not PyTorch's int8 Linear: FBGEMM's OpenMP threads
    spin on after it, into the target's verify forward that follows every draft, which then
    runs markedly slower; ONNX Runtime's stop spinning when a call ends."""

    def __init__(self, weight: torch.Tensor):
        from dflash.engine.onnx_drafter import _session

        model = head_graph(weight.detach().float().cpu().numpy())
        self.session = _session(model.SerializeToString(), torch.device("cpu"))

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        x = np.ascontiguousarray(hidden.detach().float().cpu().numpy())
        return torch.from_numpy(self.session.run(None, {"hidden": x})[0])


_BUILT: dict[str, OnnxDrafter] = {}


def runner(drafter, sha256: str, bits: int = 8) -> OnnxDrafter:
    """The drafter (a DFlashDrafter) as this graph, run by ONNX Runtime (a fresh cache per
    request, as for any drafter; the session is shared)."""
    key = f"{sha256}/{bits}"
    if key not in _BUILT:
        state = {k: v for k, v in drafter.state_dict().items() if not k.startswith("rotary.")}
        model = build(drafter.config, state, bits=bits)
        _BUILT[key] = OnnxDrafter.from_bytes(model.SerializeToString(), drafter.config, sha256)
        while len(_BUILT) > 4:  # a worker that swaps drafters keeps only the recent ones
            _BUILT.pop(next(iter(_BUILT)))
    return _BUILT[key]
