"""The target as an int8 ONNX graph for ONNX Runtime's CPU kernels (the `ort` target backend).

ONNX Runtime GenAI's model builder (the well-kept exporter for these architectures) writes
the Hugging Face folder as one graph: block-quantized 8-bit weights (`MatMulNBits`, blocks of
64, int8 activations), fused rotary attention (`GroupQueryAttention`) and explicit K/V
inputs and outputs. Why int8 and not the shipped 4 bits: ONNX Runtime's int8 kernels reuse
each weight block across the rows of a call, so verifying 4 or 8 drafted tokens costs little
more than one (llama.cpp's Q4_1 kernels pay each row in full on an AVX2 CPU), and 8 bits
re-quantize the Q4_1 values almost exactly (4-bit re-quantization of 4-bit weights does not).
Why blocks of 64 (the builder's default is 32): measured on a 2-core Zen 5 EPYC, paired in
one process, a plain step took 5-7 % less and a verify of 4-16 rows 14-16 % less (fewer
per-block scale multiplications in the int8 kernel), while greedy answers stayed as close
to the fp32 reference as with 32 (first divergence at token 61/20/43 on 8 code/chat/agent
prompts, against 57/22/38); blocks of 128 were 17-20 % faster still but diverged twice as
early on code (token 31), earlier than llama.cpp's own Q4_1 path (82), so they are not used.

The builder's graph is then edited for what the engine needs:
- `seqlens_k` [B] int32 and `total_sequence_length` [] int32 replace `attention_mask`: each
  batch entry's valid length after this call minus one, and the longest; with K/V bound in
  place (ONNX Runtime's shared past/present buffers) nothing is copied per step;
- `logit_rows` [R] int64: the flattened [B * S] rows that get logits (a prefill chunk needs
  one, a verify block all), so the LM head runs over those rows only;
- `attention_rows` [P] int64 and `output_rows` [S] int64: each layer's attention reads the
  rows `attention_rows` of its input and the layer goes on with rows `output_rows` of
  attention's output. ONNX Runtime's attention rounds a call of one row differently from a
  call of several (a matrix-vector path), while the weights' kernels give a row the same
  numbers however many rows share the call (measured, every `MatMulNBits` of the graph:
  1 to 16 rows, bit-identical). So a lone row goes through the weights alone and only its
  attention sees it twice (`attention_rows` [0, 0], `output_rows` [0]; the second copy's
  K/V lands past the sequence's length and is never read): a plain step reads every weight
  for one row, not two;
- `features.{i}` [B, S, H]: the residual stream after decoder layer i (Hugging Face's
  `hidden_states[i + 1]`), every layer, for the drafter's target features.

Beside it, for several requests in one forward, a graph per size k in BATCH_GRAPHS
(`model-batch{k}.onnx`, the same weights file): ONNX Runtime's attention takes one sequence
of several rows only at batch size 1 ("batch_size must be 1 when sequence_length > 1 and
past context is given"), so these graphs keep the batch size 1 and run the rows of k
sequences as one row axis through every weight, gather each layer's attention rows
(`attention_rows`, as above) and cut them into k parts (`row_counts` [k]: how many attention
rows each sequence has; a spare place gets one row the call already has), one attention node per sequence
with K/V inputs and lengths of its own (`past_key_values.{layer}.key.{j}`, `seqlens_k.{j}`,
`total_sequence_length.{j}`, ...), and join the parts again. A sequence's rows meet the
same kernels as in the one-sequence graph, so its numbers are the same bit for bit.

The export is cached (dflash.model_files.onnx_export_dir) with a manifest of what made it;
an export whose manifest disagrees with its source folder is made again.

The int4 build (`INT4_BUILD`, the `ort-int4` backend, asked for by name only): the same
builder and edits with 4-bit weights in blocks of 32 chosen by the builder's `k_quant`
search, the LM head at 8 bits. A plain step of a model too large for the CPU's caches reads
every weight once, so fewer bytes are a faster step. But the shipped 4-bit weights are
rounded to another 4-bit grid, so answers leave the shipped file's sooner than the int8
build's do (docs/models.md measures both: speed and agreement); `auto` therefore never
picks it by itself. Its 4-bit kernels round one row as several on some CPUs and not on
others (Zen 2), so whether a lone row must go through the weights twice is measured when the
target loads (`min_rows` "measured": dflash.engine.target.ort).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from dflash.convert.target_gguf import MARKER
from dflash.errors import DFlashError
from dflash.onnx_export_files import BATCH_GRAPHS, MANIFEST, MODEL_FILE, batch_file

FORMAT = 4  # bump when the edits below change
PRECISION = "int8"
BLOCK_SIZE = 64  # weights (and int8 activations) quantized per block of this many (module doc)
BUILD = {"format": FORMAT, "precision": PRECISION, "block_size": BLOCK_SIZE}  # what an export is made as
# The int4 build (module doc): the builder's options beside the precision, the fewest rows a
# call runs measured at load.
INT4_BUILD = {"format": FORMAT, "precision": "int4", "block_size": 32, "algo_config": "k_quant",
              "matmul_mixed_precision": "last_matmul:int8", "min_rows": "measured"}
_BUILDER_OPTIONS = ("block_size", "algo_config", "matmul_mixed_precision")  # a build's keys the builder takes


def builder_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("onnxruntime-genai")
    except Exception:
        return None


def source_files(hf_dir: Path) -> dict:
    """The source folder's files an export depends on, with their sizes."""
    files = sorted(p for p in Path(hf_dir).iterdir() if p.suffix in (".json", ".safetensors"))
    return {p.name: p.stat().st_size for p in files}


def _source_key(hf_dir: Path, build: dict = BUILD) -> dict:
    """What the export depends on: this module's edits, the build and the source files."""
    return {**build, "source": source_files(hf_dir)}


def is_current(hf_dir: Path, out: Path, build: dict = BUILD) -> bool:
    """Whether `out` holds an export of `hf_dir` as it is now (made by the builder installed
    here, when one is: a machine that runs the export without the builder, such as the
    worker image, takes it as made)."""
    manifest = made_as(out, lambda: _source_key(Path(hf_dir), build))
    builder = builder_version()
    return manifest is not None and (builder is None or manifest.get("builder") == builder)


def made_as(out: Path, key) -> dict | None:
    """The manifest of the export in `out` when it was made as `key()` (see `publish`; the
    source folder is read only where there is a manifest) and has all its files; else None."""
    try:
        manifest = json.loads((Path(out) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    files = [MODEL_FILE, *(batch_file(k) for k in BATCH_GRAPHS)]
    return manifest if manifest.get("key") == key() and all((Path(out) / f).is_file() for f in files) else None


def ensure_export(hf_dir: str | Path, out: str | Path, quiet: bool = True, build: dict = BUILD) -> Path:
    """The ONNX export of the Hugging Face folder `hf_dir` as `build` (BUILD, int8, or
    INT4_BUILD) in folder `out` (made once, whole or not at all: 20-60 s on 2 cores for
    SmolLM2, minutes for a 1.5B), edited as the module says; the model file."""
    hf_dir, out = Path(hf_dir), Path(out)
    precision = build["precision"]
    if is_current(hf_dir, out, build):
        return out / MODEL_FILE
    if builder_version() is None:
        raise DFlashError("bad_target", "the ort target backend needs onnxruntime-genai (its model builder) to export "
                                        f"{hf_dir}; make setup installs it")
    if not (hf_dir / "config.json").is_file():
        raise DFlashError("bad_target", f"target directory {hf_dir} has no config.json")
    what = describe(hf_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        built = work / "built"
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", hf_dir.name, "-i", str(hf_dir),
               "-o", str(built), "-p", precision, "-e", "cpu", "-c", str(work / "cache"),
               "--extra_options", *(f"{k}={build[k]}" for k in _BUILDER_OPTIONS if k in build)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        if not quiet:
            print(f"exporting {hf_dir.name} to an {precision} ONNX graph (once) ...", file=sys.stderr)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0 or not (built / MODEL_FILE).is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise DFlashError("bad_target", f"ONNX Runtime's model builder cannot export {what}: {' | '.join(tail)}")
        final = work / "final"
        final.mkdir()
        try:
            edit(built / MODEL_FILE, final / MODEL_FILE)
        except DFlashError as exc:  # a graph of another shape: say which model and architecture made it
            raise DFlashError("bad_target", f"the ort backend cannot run {what}: {exc.message}") from None
        publish(final, _source_key(hf_dir, build), out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out / MODEL_FILE


def describe(hf_dir: Path) -> str:
    """The target folder as an error names it: the folder, its architecture (config.json's)
    and, for a folder converted from a GGUF file, that file (the conversion's marker)."""
    try:
        cfg = json.loads((Path(hf_dir) / "config.json").read_text())
        arch = (cfg.get("architectures") or [None])[0] or cfg.get("model_type") or "unknown"
    except (OSError, ValueError, AttributeError):
        arch = "unknown"
    try:
        gguf = json.loads((Path(hf_dir) / MARKER).read_text()).get("gguf")
    except (OSError, ValueError, AttributeError):
        gguf = None
    return f"{hf_dir} (architecture {arch}" + (f", converted from {gguf})" if gguf else ")")


def publish(folder: Path, key: dict, out: Path) -> None:
    """The batch graphs and the manifest (`key`, the builder's version) beside `folder`'s
    edited graph, then `folder` becomes `out`: an export is there whole or not at all."""
    for k in BATCH_GRAPHS:
        write_batch_graph(folder / MODEL_FILE, folder / batch_file(k), k)
    (folder / MANIFEST).write_text(json.dumps({"key": key, "builder": builder_version()}, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    folder.rename(out)


def edit(src: Path, dst: Path) -> None:
    """The builder's graph with the inputs and outputs the engine needs (module doc)."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(src))
    g = model.graph
    nodes = list(g.node)
    gqa = [n for n in nodes if n.op_type == "GroupQueryAttention"]
    head = [n for n in nodes if n.output and n.output[0] == "logits"]
    if not gqa or len(head) != 1:
        raise DFlashError("bad_target", f"{src}: not the graph shape this backend edits (GroupQueryAttention layers and "
                                        "one logits node)")
    # 1. lengths in, attention_mask out
    for n in gqa:
        n.input[5], n.input[6] = "seqlens_k", "total_sequence_length"
    keep_inputs = [i for i in g.input if i.name != "attention_mask"]
    del g.input[:]
    g.input.extend(keep_inputs)
    g.input.extend([helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch_size"]),
                    helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
                    helper.make_tensor_value_info("logit_rows", TensorProto.INT64, ["logit_rows"]),
                    helper.make_tensor_value_info("attention_rows", TensorProto.INT64, ["attention_rows"]),
                    helper.make_tensor_value_info("output_rows", TensorProto.INT64, ["sequence_length"])])
    # 1b. attention's own rows: a lone row is doubled for attention only (module doc)
    padded = {}
    for n in gqa:
        qkv, out = n.input[0], n.output[0]
        padded[id(n)] = (helper.make_node("Gather", [qkv, "attention_rows"], [f"{qkv}/attention_rows"], axis=1,
                                          name=f"{n.name}/pad"),
                         helper.make_node("Gather", [f"{out}/attention_rows", "output_rows"], [out], axis=1,
                                          name=f"{n.name}/unpad"))
        n.input[0], n.output[0] = f"{qkv}/attention_rows", f"{out}/attention_rows"
    nodes = [x for n in nodes for x in ((padded[id(n)][0], n, padded[id(n)][1]) if id(n) in padded else (n,))]
    # 2. logits of the asked rows only: [B, S, H] -> [B * S, H] -> rows -> LM head
    lm = head[0]
    normed = lm.input[0]
    hidden = _hidden_size(model, lm)
    shape = helper.make_tensor("dflash/rows_shape", TensorProto.INT64, [2], [-1, hidden])
    g.initializer.append(shape)
    flat = helper.make_node("Reshape", [normed, "dflash/rows_shape"], ["dflash/rows"], name="dflash/rows")
    pick = helper.make_node("Gather", ["dflash/rows", "logit_rows"], ["dflash/picked"], axis=0, name="dflash/pick")
    lm.input[0] = "dflash/picked"
    # 3. the residual stream after every decoder layer, as the graph output itself (not an
    # Identity of it: 30 copies cost 3 % of a plain step whether or not a call asks for them)
    layers = len(gqa)
    renamed = {}
    for i in range(layers):
        node = _residual_node(nodes, i + 1, layers)
        while len(node.output) < 4:
            node.output.append("")
        if node.output[3]:
            renamed[node.output[3]] = f"features.{i}"
        node.output[3] = f"features.{i}"
    for n in nodes:
        for k, name in enumerate(n.input):
            if name in renamed:
                n.input[k] = renamed[name]
    # Insert the new nodes where their inputs exist (the graph stays topologically sorted).
    at = nodes.index(lm)
    nodes[at:at] = [flat, pick]
    del g.node[:]
    g.node.extend(_drop_dead(nodes, {o.name for o in g.output} | {f"features.{i}" for i in range(layers)}))
    outputs = [o for o in g.output if o.name != "logits"]
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["logit_rows", "vocab_size"]))
    g.output.extend(outputs)
    g.output.extend(helper.make_tensor_value_info(f"features.{i}", TensorProto.FLOAT,
                                                  ["batch_size", "sequence_length", hidden]) for i in range(layers))
    onnx.save(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
              location=dst.name + ".data", size_threshold=1024)


def write_batch_graph(src: Path, dst: Path, k: int) -> None:
    """The edited graph `src` for k sequences per call (module doc), written beside it as
    `dst`: the graph only, its weights stay in `src`'s data file."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(src), load_external_data=False)
    g = model.graph
    nodes, layers = [], 0
    for n in g.node:
        if n.op_type != "GroupQueryAttention":
            nodes.append(n)
            continue
        layer, qkv, out = int(n.output[1].split(".")[1]), n.input[0], n.output[0]  # present.{layer}.key
        layers += 1
        parts = [f"{qkv}/seq{j}" for j in range(k)]
        nodes.append(helper.make_node("Split", [qkv, "row_counts"], parts, axis=1, name=f"{n.name}/split"))
        for j in range(k):
            ins = list(n.input)
            ins[0], ins[3], ins[4] = parts[j], f"past_key_values.{layer}.key.{j}", f"past_key_values.{layer}.value.{j}"
            ins[5], ins[6] = f"seqlens_k.{j}", f"total_sequence_length.{j}"
            node = helper.make_node(n.op_type, ins, [f"{out}/seq{j}", f"present.{layer}.key.{j}",
                                                     f"present.{layer}.value.{j}"], name=f"{n.name}/seq{j}",
                                    domain=n.domain)
            node.attribute.extend(n.attribute)
            nodes.append(node)
        nodes.append(helper.make_node("Concat", [f"{out}/seq{j}" for j in range(k)], [out], axis=1,
                                      name=f"{n.name}/join"))
    del g.node[:]
    g.node.extend(nodes)
    old = {i.name: i for i in g.input}
    kv_dims = [d.dim_value or d.dim_param for d in old["past_key_values.0.key"].type.tensor_type.shape.dim]
    inputs = [old[name] for name in ("input_ids", "logit_rows", "attention_rows", "output_rows")]
    inputs.append(helper.make_tensor_value_info("row_counts", TensorProto.INT64, [k]))
    outputs = [o for o in g.output if not o.name.startswith("present.")]
    for j in range(k):
        inputs += [helper.make_tensor_value_info(f"seqlens_k.{j}", TensorProto.INT32, [1]),
                   helper.make_tensor_value_info(f"total_sequence_length.{j}", TensorProto.INT32, [])]
        for layer in range(layers):
            for kind in ("key", "value"):
                dims = [1, kv_dims[1], f"capacity_{j}", kv_dims[3]]
                inputs.append(helper.make_tensor_value_info(f"past_key_values.{layer}.{kind}.{j}", TensorProto.FLOAT, dims))
                outputs.append(helper.make_tensor_value_info(f"present.{layer}.{kind}.{j}", TensorProto.FLOAT, dims))
    del g.input[:]
    g.input.extend(inputs)
    del g.output[:]
    g.output.extend(outputs)
    onnx.save(model, str(dst))


def _hidden_size(model, lm) -> int:
    for init in model.graph.initializer:
        if init.name == lm.input[1]:
            for a in lm.attribute:
                if a.name == "K":
                    return a.i
    raise DFlashError("bad_target", "cannot read the hidden size from the LM head")


def _residual_node(nodes, layer: int, layers: int):
    """The SkipSimplifiedLayerNormalization that opens layer `layer` (or the final norm):
    its fourth output is the residual sum, i.e. the output of layer `layer` - 1."""
    name = f"/model/layers.{layer}/input_layernorm/" if layer < layers else f"/model/layers.{layers}/final_norm"
    got = [n for n in nodes if n.name.startswith(name) and n.op_type == "SkipSimplifiedLayerNormalization"]
    if len(got) != 1:
        raise DFlashError("bad_target", f"cannot find the residual stream after layer {layer - 1} in the graph")
    return got[0]


def _drop_dead(nodes, wanted: set[str]):
    """Nodes whose outputs something still reads (the attention-mask subgraph goes)."""
    live, keep = set(wanted), []
    for n in reversed(nodes):
        if any(o and o in live for o in n.output):
            keep.append(n)
            live.update(i for i in n.input if i)
    return list(reversed(keep))
