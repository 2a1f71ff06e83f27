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
_LAYER = re.compile(r"/model/layers\.(\d+)/(attn|mlp)/(\w+_proj)/MatMul")


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
    source = onnx_target.ensure_export(hf_dir, Path(int8_dir), quiet=quiet)
    if not quiet:
        import sys

        print(f"rewriting {hf_dir.name}'s ONNX graph with its Q4_1 weights exactly (once) ...", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        rewrite(source, _weights(hf_dir), work / MODEL_FILE, hf_dir)
        onnx_target.publish(work, _key(hf_dir), out)
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
    m = _LAYER.match(name)
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
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(src))
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    nodes, sums = [], {}
    for n in g.node:
        nodes.append(n)
        if n.op_type != "MatMulNBits":
            continue
        attrs = {a.name: a for a in n.attribute}
        w = _source(n.name, weights, hf_dir)
        if w is None or tuple(w.shape) != (attrs["N"].i, attrs["K"].i):
            raise DFlashError("bad_target", f"{hf_dir}: its weights do not fit the ONNX graph's layer {n.name}")
        if n.name.startswith("/lm_head/"):
            blocks = q8_0_blocks(w)
            if blocks is not None:  # else the int8 export's head stays
                q, d = blocks
                inits[n.input[1]].CopyFrom(numpy_helper.from_array(q, n.input[1]))
                inits[n.input[2]].CopyFrom(numpy_helper.from_array(d, n.input[2]))
                attrs["block_size"].i = BLOCK
            continue
        blocks = q4_1_blocks(w)
        if blocks is None:
            raise DFlashError("bad_target", f"{hf_dir}: the weights of {n.name} are not Q4_1 blocks of {BLOCK} "
                                            f"(the {PRECISION} build is for targets that ship as Q4_1)")
        q, d, z, r = blocks
        N, nb = d.shape
        attrs["bits"].i, attrs["block_size"].i = 4, BLOCK
        inits[n.input[1]].CopyFrom(numpy_helper.from_array(q[..., 0::2] | (q[..., 1::2] << 4), n.input[1]))
        inits[n.input[2]].CopyFrom(numpy_helper.from_array(d, n.input[2]))
        zz = z if nb % 2 == 0 else np.concatenate([z, np.zeros((N, 1), np.uint8)], 1)
        zero_points = f"{n.name}/zero_points"
        g.initializer.append(numpy_helper.from_array((zz[:, 0::2] | (zz[:, 1::2] << 4)).reshape(-1), zero_points))
        while len(n.input) < 4:
            n.input.append("")
        n.input[3] = zero_points
        # The remainder: each block's input sum times r, added to the layer's output.
        x = n.input[0]
        if x not in sums:
            shape, axes = f"{x}/block_shape", f"{x}/block_axes"
            g.initializer.extend([numpy_helper.from_array(np.array([0, 0, nb, BLOCK], np.int64), shape),
                                  numpy_helper.from_array(np.array([-1], np.int64), axes)])
            nodes += [helper.make_node("Reshape", [x, shape], [f"{x}/blocks"], name=f"{x}/blocks"),
                      helper.make_node("ReduceSum", [f"{x}/blocks", axes], [f"{x}/block_sums"], keepdims=0,
                                       name=f"{x}/block_sums")]
            sums[x] = f"{x}/block_sums"
        remainder, y = f"{n.name}/remainder", n.output[0]
        g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(r.T), remainder))
        n.output[0] = f"{y}/blocks_part"
        nodes += [helper.make_node("MatMul", [sums[x], remainder], [f"{y}/remainder_part"], name=f"{n.name}/remainder"),
                  helper.make_node("Add", [f"{y}/blocks_part", f"{y}/remainder_part"], [y], name=f"{n.name}/add")]
    del g.node[:]
    g.node.extend(nodes)
    onnx.save(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
              location=dst.name + ".data", size_threshold=1024)
