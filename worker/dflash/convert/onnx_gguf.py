"""The ort backend's `q4_k_m` build: the int8 export (dflash.convert.onnx_target) rewritten to
hold a GGUF target's quantized blocks exactly, as ONNX Runtime's `MatMulNBits` blocks.

A Q4_K_M file (llama.cpp's usual 4-bit mix, the Qwen2.5-Coder releases among them) holds
its matrices in several block formats, each a scale s per block and small integer codes q:

| GGUF type | weight | as MatMulNBits |
|---|---|---|
| Q4_K (256 = 8 blocks of 32) | s * q - m, q in 0..15, s = d * sc, m = dmin * mc | 4 bits, blocks of 32 |
| Q5_K (8 blocks of 32) | s * q - m, q in 0..31 | 8 bits, blocks of 32 |
| Q6_K (256 = 16 blocks of 16) | s * (q - 32), q in 0..63, s = d * sc | 8 bits, blocks of 16, zero point 32 |
| Q4_0 / Q5_0 / Q8_0 (blocks of 32) | d * (q - 8 / 16 / 128) | 4 / 8 / 8 bits, that zero point |
| Q4_1 (blocks of 32) | d * q + m | 4 bits, blocks of 32 |

ONNX Runtime's kernels take w = s * (q - z) with an integer zero point z per block (float
zero points run a dequantizing fallback, dflash.convert.onnx_q41), so a block with a
minimum is written with z = round(m / s) and its remainder r = s * z - m beside it: the layer
adds r times each block's sum of its input (onnx_q41's construction). The codes and scales
are read from the file with the `gguf` package's own dequantization as the check: a block
is taken only where s, q and m rebuild the package's float32 weights bit for bit, and a
matrix in another format (Q2_K, Q3_K, IQ*) is a clean error naming the file, the tensor and
its type. A matrix of the builder's graph whose GGUF parts differ in format (Qwen's fused
q/k/v with v in Q6_K) becomes one node per format and a Concat.

The embedding, norms and biases stay the int8 export's (fp32, from the converted folder,
which is the same file dequantized). The 4-bit kernel rounds a call of one row differently
from a call of several, so, as in the q4_1 build, a lone row goes through the weights twice
(`min_rows` 2).
"""

from __future__ import annotations

from pathlib import Path

from dflash.convert import onnx_q41, onnx_target
from dflash.convert.onnx_q41 import Blocks
from dflash.convert.target_gguf import is_current as folder_is_from
from dflash.errors import DFlashError
from dflash.onnx_export_files import MODEL_FILE

PRECISION = "q4_k_m"
FORMAT = 1  # bump when the rewrite below changes
# What the export is made as; `min_rows`: the fewest rows a call runs (module doc).
BUILD = {"format": FORMAT, "precision": PRECISION, "min_rows": 2, "int8_export": onnx_target.BUILD}
FILE_TYPES = {14: "Q4_K_S", 15: "Q4_K_M"}  # general.file_type of the files this build is for
# The graph's projections and the GGUF tensors they hold, in the order the builder fuses them.
PARTS = {"q_proj": ("attn_q",), "k_proj": ("attn_k",), "v_proj": ("attn_v",), "o_proj": ("attn_output",),
         "qkv_proj": ("attn_q", "attn_k", "attn_v"), "gate_proj": ("ffn_gate",), "up_proj": ("ffn_up",),
         "gate_up_proj": ("ffn_gate", "ffn_up"), "down_proj": ("ffn_down",)}


def file_type(gguf: Path) -> str | None:
    """The file's llama.cpp file type name where it is one this build is for, else None."""
    from dflash.convert.gguf_file import scalar_keys

    return FILE_TYPES.get(scalar_keys(Path(gguf), {"general.file_type"}).get("general.file_type"))


def _key(hf_dir: Path, gguf: Path) -> dict:
    st = Path(gguf).stat()
    return {**BUILD, "source": {**onnx_target.source_files(hf_dir), Path(gguf).name: [st.st_size, st.st_mtime_ns]}}


def is_current(hf_dir: Path, out: Path, gguf: Path | None) -> bool:
    """Whether `out` holds the q4_k_m export of `hf_dir` and `gguf` as they are now."""
    return gguf is not None and Path(gguf).is_file() and onnx_target.made_as(
        out, lambda: _key(Path(hf_dir), Path(gguf))) is not None


def ensure_export(hf_dir: str | Path, out: str | Path, int8_dir: str | Path, gguf: str | Path,
                  quiet: bool = True) -> Path:
    """The q4_k_m export of `hf_dir` (the folder converted from `gguf`) in `out`, made once
    from the int8 export in `int8_dir` (made first if need be); whole or not at all."""
    hf_dir, out, gguf = Path(hf_dir), Path(out), Path(gguf)
    if is_current(hf_dir, out, gguf):
        return out / MODEL_FILE
    if not folder_is_from(hf_dir, gguf):
        raise DFlashError("bad_target", f"{hf_dir} is not the conversion of {gguf} (the {PRECISION} build takes the "
                                        "file's blocks and the folder's embedding, norms and biases)")
    return onnx_q41.from_int8_export(hf_dir, out, int8_dir, _key(hf_dir, gguf), f"the blocks of {gguf.name}",
                                     lambda src, dst: rewrite(src, gguf, dst, hf_dir), quiet)


def blocks_of(tensor, gguf: Path) -> Blocks:
    """A GGUF tensor's blocks (module doc's table), checked to rebuild the gguf package's own
    dequantized weights bit for bit."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    kind = tensor.tensor_type
    raw = np.asarray(tensor.data)
    N = raw.shape[0]
    w = quants.dequantize(raw, kind).reshape(N, -1).astype(np.float32)
    K = w.shape[1]

    def f16(at):  # the fp16 field at byte `at` of every block, as float32
        return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16).astype(np.float32)[:, 0]

    if kind in (T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_1):
        size, nbytes = 32, {T.Q4_0: 18, T.Q5_0: 22, T.Q8_0: 34, T.Q4_1: 20}[kind]
        blocks = raw.reshape(-1, nbytes)
        scale = f16(0)
        low = f16(2) if kind == T.Q4_1 else -scale * {T.Q4_0: 8, T.Q5_0: 16, T.Q8_0: 128}[kind]
        bits = 4 if kind in (T.Q4_0, T.Q4_1) else 8
    elif kind in (T.Q4_K, T.Q5_K):
        size, blocks = 32, raw.reshape(-1, 176 if kind == T.Q5_K else 144)
        sc, mc = quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
        scale = (f16(0)[:, None] * sc.astype(np.float32)).reshape(-1)
        low = -(f16(2)[:, None] * mc.astype(np.float32)).reshape(-1)
        bits = 4 if kind == T.Q4_K else 8
    elif kind == T.Q6_K:
        size, blocks = 16, raw.reshape(-1, 210)
        sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
        scale = (f16(208)[:, None] * sc).reshape(-1)
        low, bits = -scale * 32, 8
    else:
        raise DFlashError("bad_target", f"{gguf}: tensor {tensor.name} is {kind.name}, a format the {PRECISION} build "
                                        "cannot hold exactly (it takes Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K)")
    nb = K // size
    scale, low = scale.reshape(N, nb), low.reshape(N, nb)
    b = w.reshape(N, nb, size)
    safe = np.where(scale == 0, np.float32(1), scale)
    q = np.clip(np.rint((b - low[..., None]) / safe[..., None]), 0, 2 ** bits - 1)
    q = np.where(scale[..., None] == 0, 0, q).astype(np.uint8)
    # The gguf package's own arithmetic (float32): s * q - m for the K formats' minimum, d * q + m
    # for Q4_1's, d * (q - z) for the rest.
    if kind in (T.Q4_K, T.Q5_K):
        back = scale[..., None] * q.astype(np.float32) + low[..., None]
    elif kind == T.Q4_1:
        back = scale[..., None] * q.astype(np.float32) + low[..., None]
    else:
        back = scale[..., None] * (q.astype(np.float32) + (low / safe)[..., None])
    if not np.array_equal(back.astype(np.float32), b):
        raise DFlashError("bad_target", f"{gguf}: the blocks of {tensor.name} ({kind.name}) do not rebuild its "
                                        "weights exactly")
    zero = np.clip(np.rint(-low / safe), 0, 2 ** bits - 1).astype(np.uint8)
    remainder = (low + scale * zero).astype(np.float32)
    return Blocks(bits, size, q, scale.astype(np.float32), zero, remainder if remainder.any() else None)


def rewrite(src: Path, gguf: Path, dst: Path, hf_dir: Path) -> None:
    """The int8 graph `src` (exported from `hf_dir`, the conversion of `gguf`) with every
    projection's and the LM head's weights as the GGUF file's blocks (module doc)."""
    from onnx import helper

    from dflash.convert.gguf_file import open_gguf

    tensors = {t.name: t for t in open_gguf(gguf, code="bad_target").tensors}
    _check_row_order(tensors, gguf, hf_dir)

    def replace(g, n, attrs: dict, sums: dict) -> list:
        parts = [blocks_of(tensors[name], gguf) for name in _gguf_names(n.name, tensors, gguf)]
        if sum(p.q.shape[0] for p in parts) != attrs["N"] or parts[0].q.shape[1] * parts[0].size != attrs["K"]:
            raise DFlashError("bad_target", f"{gguf}: its tensors do not fit the ONNX graph's layer {n.name}")
        groups = _same_format(parts)
        if len(groups) == 1:
            return _matmul(g, n, n.name, groups[0], n.output[0], sums, attrs)
        outs = [f"{n.output[0]}/part{k}" for k in range(len(groups))]
        nodes = [x for k, (group, y) in enumerate(zip(groups, outs))
                 for x in _matmul(g, n, f"{n.name}/part{k}", group, y, sums, attrs)]
        return nodes + [helper.make_node("Concat", outs, [n.output[0]], axis=-1, name=f"{n.name}/join")]

    onnx_q41.rewrite_matmuls(src, dst, replace)


def _check_row_order(tensors: dict, gguf: Path, hf_dir: Path) -> None:
    """The file's first query and key projections are the folder's row for row: llama.cpp
    stores some architectures' (llama's) in another row order, which the conversion undoes
    and this build does not."""
    import numpy as np
    from gguf import quants

    from dflash.engine.target.hf_files import read_tensors

    names = {"blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
             "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight"}
    folder = read_tensors(hf_dir, tuple(names.values()))
    for name, hf_name in names.items():
        t = tensors.get(name)
        if t is None or hf_name not in folder:
            raise DFlashError("bad_target", f"{gguf}: no {name} beside {hf_dir}'s {hf_name} for the {PRECISION} build")
        w = quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(folder[hf_name].shape)
        if not np.array_equal(w.astype(np.float32), folder[hf_name].numpy()):
            raise DFlashError("bad_target", f"{gguf}: {name} is not {hf_dir}'s {hf_name} row for row (an architecture "
                                            f"whose rows llama.cpp reorders; the {PRECISION} build takes qwen2-like ones)")


def _gguf_names(node: str, tensors: dict, gguf: Path) -> list[str]:
    """The GGUF tensors a MatMulNBits node of the builder's graph holds, in its row order."""
    if node.startswith("/lm_head/"):
        return ["output.weight" if "output.weight" in tensors else "token_embd.weight"]
    m = onnx_q41.LAYER.match(node)
    if not m or m.group(3) not in PARTS:
        raise DFlashError("bad_target", f"{gguf}: the ONNX graph's layer {node} is not one this build maps")
    names = [f"blk.{m.group(1)}.{part}.weight" for part in PARTS[m.group(3)]]
    missing = [x for x in names if x not in tensors]
    if missing:
        raise DFlashError("bad_target", f"{gguf} has no tensor {missing[0]} for the ONNX graph's layer {node}")
    return names


def _same_format(parts: list[Blocks]) -> list[list[Blocks]]:
    """Consecutive parts grouped by (bits, block size): one MatMulNBits node each."""
    groups: list[list[Blocks]] = []
    for p in parts:
        if groups and (groups[-1][0].bits, groups[-1][0].size) == (p.bits, p.size):
            groups[-1].append(p)
        else:
            groups.append([p])
    return groups


def _matmul(g, n, name: str, group: list[Blocks], y: str, sums: dict, attrs: dict) -> list:
    """The nodes computing `y` = input @ the group's rows (their blocks joined along N)."""
    import numpy as np

    joined = Blocks(group[0].bits, group[0].size, *(np.concatenate([getattr(p, f) for p in group])
                                                    for f in ("q", "scale", "zero")),
                    None if all(p.remainder is None for p in group) else np.concatenate(
                        [p.remainder if p.remainder is not None else np.zeros_like(p.scale) for p in group]))
    return onnx_q41.blocks_node(g, n, name, joined, y, sums, attrs["accuracy_level"])
