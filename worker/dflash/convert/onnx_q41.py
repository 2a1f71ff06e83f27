"""The ort backend's `q4_1` build: the int8 export (dflash.convert.onnx_target) rewritten to
hold a Q4_1 target's weights exactly, as 4-bit blocks.

The embedded target ships as a Q4_1 GGUF: every block of 32 weights is w = d * q + m (q in
0..15, d and m fp16), and its Hugging Face folder holds exactly those values in fp32. The
int8 export re-quantizes them onto another grid (close, not equal). ONNX Runtime's 4-bit
`MatMulNBits` holds w = d * (q - z) with an integer zero point z, and runs float zero
points (-m / d, Q4_1 exactly) about 18 times slower (a dequantizing fallback), so each
block is written with z = round(-m / d) and its remainder r = m + d * z beside it: the
layer adds r times each block's sum of its input, one Reshape, ReduceSum, MatMul and Add
per input and layer (docs/results/zen2/int4-probe). Every weight of every layer
comes back exactly; a target whose weights are not Q4_1 blocks has no such build (a clean
error naming the first matrix that is not). The tied LM head and embedding ship as Q8_0
(w = d * q): where the head's values are such blocks it becomes an exact 8-bit layer in
blocks of 32, otherwise it keeps the int8 export's.

Why a build of its own, chosen by measurement (`--target-backend auto`): on a 2-core Zen 2
(AVX2, no VNNI) its verify of 4 rows took 14 % less than the int8 build's and of 16 rows
23 % less, but ONNX Runtime's 4-bit kernel rounds a call of ONE row differently from a call
of several (the 8-bit one does not), so a lone row goes through it twice (`min_rows` 2 in
the build: the ort target sends [t, t] and keeps the first row; the copy's K/V lands past
the sequence's length, never read), which makes a plain step cost what a verify of 2
does, 11 % more than the int8 build's there. Which wins depends on the CPU and on how much
is drafted; the worker measures.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dflash.convert import onnx_target
from dflash.errors import DFlashError
from dflash.onnx_export_files import MODEL_FILE

PRECISION = "q4_1"
BLOCK = 32  # Q4_1's and Q8_0's block
FORMAT = 1  # bump when the rewrite below changes
# What the export is made as; `min_rows`: the fewest rows a call runs (module doc).
BUILD = {"format": FORMAT, "precision": PRECISION, "block_size": BLOCK, "min_rows": 2,
         "int8_export": onnx_target.BUILD}
LAYER = re.compile(r"/model/layers\.(\d+)/(attn|mlp)/(\w+_proj)/MatMul")


@dataclass
class Blocks:
    """A matrix [N, K] as a MatMulNBits node holds it: w = scale * (q - zero) + remainder per
    block of `size` (`blocks_node` writes it; dflash.convert.onnx_gguf reads GGUF files into it)."""

    bits: int
    size: int  # weights per block
    q: object  # uint8 [N, K / size, size]
    scale: object  # float32 [N, K / size]
    zero: object  # uint8 [N, K / size]
    remainder: object | None  # float32 [N, K / size]; None where every block's is 0


def is_current(hf_dir: Path, out: Path) -> bool:
    """Whether `out` holds the q4_1 export of `hf_dir` as it is now."""
    return onnx_target.made_as(out, lambda: _key(Path(hf_dir))) is not None


def _key(hf_dir: Path) -> dict:
    return {**BUILD, "source": onnx_target.source_files(hf_dir)}


def ensure_export(hf_dir: str | Path, out: str | Path, int8_dir: str | Path, quiet: bool = True) -> Path:
    """The q4_1 export of `hf_dir` in `out` (made once from the int8 export in `int8_dir`,
    which is made first if need be; whole or not at all); the model file."""
    hf_dir, out = Path(hf_dir), Path(out)
    if is_current(hf_dir, out):
        return out / MODEL_FILE
    return from_int8_export(hf_dir, out, int8_dir, _key(hf_dir), "its Q4_1 weights",
                            lambda src, dst: rewrite(src, _weights(hf_dir), dst, hf_dir), quiet)


def from_int8_export(hf_dir: Path, out: Path, int8_dir, key: dict, what: str, write, quiet: bool) -> Path:
    """A build rewritten from the int8 export (made first in `int8_dir` if need be) by
    `write(int8 model file, new model file)`, published in `out` with its batch graphs and
    the manifest `key`: whole or not at all; the model file."""
    source = onnx_target.ensure_export(hf_dir, Path(int8_dir), quiet=quiet)
    if not quiet:
        import sys

        print(f"rewriting {hf_dir.name}'s ONNX graph with {what} exactly (once) ...", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        write(source, work / MODEL_FILE)
        onnx_target.publish(work, key, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out / MODEL_FILE


def _weights(hf_dir: Path) -> dict:
    from safetensors.numpy import load_file

    weights = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    if not weights:
        raise DFlashError("bad_target", f"{hf_dir} has no .safetensors weights to take Q4_1 blocks from")
    return weights


def _blocks(w):
    """w [N, K] as fp32 blocks [N, K / 32, 32]; None where K is not whole blocks."""
    import numpy as np

    N, K = w.shape
    return None if K % BLOCK else w.reshape(N, K // BLOCK, BLOCK).astype(np.float32)


def q4_1_blocks(w):
    """(q [N, nb, 32] uint8, d [N, nb], z [N, nb] uint8, r [N, nb]) with w = d * (q - z) + r
    per block of 32, exactly; None where some block is not a Q4_1 block."""
    import numpy as np

    b = _blocks(w)
    if b is None:
        return None
    lo, hi = b.min(-1), b.max(-1)
    d = ((hi - lo) / 15).astype(np.float16).astype(np.float32)
    d = np.where(d == 0, np.float32(1), d)
    q = np.clip(np.rint((b - lo[..., None]) / d[..., None]), 0, 15).astype(np.uint8)
    if not np.array_equal((d[..., None] * q + lo[..., None]).astype(np.float32), b):
        return None
    z = np.clip(np.rint(-lo / d), 0, 15).astype(np.uint8)
    return q, d, z, (lo + d * z).astype(np.float32)


def q8_0_blocks(w):
    """(q [N, nb, 32] as uint8 q + 128, d [N, nb]) with w = d * q per block, exactly; or None."""
    import numpy as np

    b = _blocks(w)
    if b is None:
        return None
    d = (np.abs(b).max(-1) / 127).astype(np.float16).astype(np.float32)
    d = np.where(d == 0, np.float32(1), d)
    q = np.clip(np.rint(b / d[..., None]), -127, 127)
    if not np.array_equal((d[..., None] * q).astype(np.float32), b):
        return None
    return (q + 128).astype(np.uint8), d


def _source(name: str, weights: dict, hf_dir: Path):
    """The Hugging Face weight [N, K] a MatMulNBits node of the builder's graph holds."""
    import numpy as np

    if name.startswith("/lm_head/"):
        return weights.get("lm_head.weight", weights.get("model.embed_tokens.weight"))
    m = LAYER.match(name)
    if not m:
        raise DFlashError("bad_target", f"{hf_dir}: the ONNX graph's layer {name} is not one this build maps")
    layer, part, proj = m.groups()
    prefix = f"model.layers.{layer}." + ("self_attn." if part == "attn" else "mlp.")
    names = [f"{prefix}{x}_proj.weight" for x in "qkv"] if proj == "qkv_proj" else [f"{prefix}{proj}.weight"]
    if not all(n in weights for n in names):
        raise DFlashError("bad_target", f"{hf_dir}: no {names[0]} for the ONNX graph's layer {name}")
    return np.concatenate([weights[n] for n in names]) if len(names) > 1 else weights[names[0]]


def rewrite(src: Path, weights: dict, dst: Path, hf_dir: Path) -> None:
    """The int8 graph `src` with every layer's weights as exact Q4_1 blocks (module doc)."""
    import numpy as np

    def replace(g, n, attrs: dict, sums: dict):
        w = _source(n.name, weights, hf_dir)
        if w is None or tuple(w.shape) != (attrs["N"], attrs["K"]):
            raise DFlashError("bad_target", f"{hf_dir}: its weights do not fit the ONNX graph's layer {n.name}")
        if n.name.startswith("/lm_head/"):
            head = q8_0_blocks(w)
            if head is None:  # the int8 export's head stays
                return None
            q, d = head
            blocks = Blocks(8, BLOCK, q, d, np.full(d.shape, 128, np.uint8), None)
        else:
            got = q4_1_blocks(w)
            if got is None:
                raise DFlashError("bad_target", f"{hf_dir}: the weights of {n.name} are not Q4_1 blocks of {BLOCK} "
                                                f"(the {PRECISION} build is for targets that ship as Q4_1)")
            blocks = Blocks(4, BLOCK, *got)
        return blocks_node(g, n, n.name, blocks, n.output[0], sums, attrs["accuracy_level"])

    rewrite_matmuls(src, dst, replace)


def rewrite_matmuls(src: Path, dst: Path, replace) -> None:
    """The graph `src` with each MatMulNBits node n replaced by the nodes `replace(graph, n,
    its attributes, sums)` returns (None keeps n; `sums` is blocks_node's cache), saved as
    `dst` with its weights in one data file beside it, less the weights nothing reads now."""
    import onnx

    model = onnx.load(str(src))
    g = model.graph
    nodes, sums, dead = [], {}, set()
    for n in g.node:
        new = replace(g, n, {a.name: a.i for a in n.attribute}, sums) if n.op_type == "MatMulNBits" else None
        if new is None:
            nodes.append(n)
            continue
        dead.update(n.input[1:])
        nodes += new
    live = {i for n in nodes for i in n.input}
    keep = [i for i in g.initializer if i.name not in dead or i.name in live]
    del g.initializer[:]
    g.initializer.extend(keep)
    del g.node[:]
    g.node.extend(nodes)
    onnx.save(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
              location=dst.name + ".data", size_threshold=1024)


def blocks_node(g, n, name: str, blocks, y: str, sums: dict, accuracy_level: int) -> list:
    """The nodes that compute `y` = (the input of MatMulNBits node `n`) @ `blocks`' matrix
    (dflash.convert.onnx_gguf.Blocks: w = scale * (q - zero) + remainder per block): a
    MatMulNBits node `name` with integer zero points and, where some block has a remainder,
    each block's input sum times it added (module doc). The weights become initializers of
    `g` named after `name`; `sums` caches the block sums of an input across nodes."""
    import numpy as np
    from onnx import helper, numpy_helper

    N, nb, size = blocks.q.shape
    x = n.input[0]
    if blocks.bits == 4:
        packed = blocks.q[..., 0::2] | (blocks.q[..., 1::2] << 4)
        z = blocks.zero if nb % 2 == 0 else np.concatenate([blocks.zero, np.zeros((N, 1), np.uint8)], 1)
        zero = (z[:, 0::2] | (z[:, 1::2] << 4)).reshape(-1)
    else:
        packed, zero = blocks.q, blocks.zero.reshape(-1)
    g.initializer.extend([numpy_helper.from_array(np.ascontiguousarray(packed), f"{name}/weights"),
                          numpy_helper.from_array(np.ascontiguousarray(blocks.scale, np.float32), f"{name}/scales"),
                          numpy_helper.from_array(np.ascontiguousarray(zero), f"{name}/zero_points")])
    out = y if blocks.remainder is None else f"{y}/blocks_part"
    nodes = [helper.make_node("MatMulNBits", [x, f"{name}/weights", f"{name}/scales", f"{name}/zero_points"], [out],
                              name=name, domain="com.microsoft", K=nb * size, N=N, bits=blocks.bits,
                              block_size=size, accuracy_level=accuracy_level)]
    if blocks.remainder is None:
        return nodes
    if (x, size) not in sums:
        shape, axes = f"{x}/block_shape_{size}", f"{x}/block_axes"
        g.initializer.append(numpy_helper.from_array(np.array([0, 0, nb, size], np.int64), shape))
        if not any(i.name == axes for i in g.initializer):
            g.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), axes))
        nodes += [helper.make_node("Reshape", [x, shape], [f"{x}/blocks_{size}"], name=f"{x}/blocks_{size}"),
                  helper.make_node("ReduceSum", [f"{x}/blocks_{size}", axes], [f"{x}/block_sums_{size}"], keepdims=0,
                                   name=f"{x}/block_sums_{size}")]
        sums[(x, size)] = f"{x}/block_sums_{size}"
    g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(blocks.remainder.T), f"{name}/remainder"))
    return nodes + [helper.make_node("MatMul", [sums[(x, size)], f"{name}/remainder"], [f"{y}/remainder_part"],
                                     name=f"{name}/remainder"),
                    helper.make_node("Add", [out, f"{y}/remainder_part"], [y], name=f"{name}/add")]
