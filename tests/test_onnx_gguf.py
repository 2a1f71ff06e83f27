"""The ort backend's q4_k_m build (dflash.convert.onnx_gguf): every GGUF block format it takes
is read into MatMulNBits blocks that rebuild the gguf package's own dequantized weights, a
format it cannot hold is a clean error naming the file, the tensor and the format; only a
Q4_K_M/Q4_K_S file makes it a candidate. On the installed Qwen2.5-Coder-0.5B (slow): the
export holds the file's blocks, its rows are bit-identical however a step is cut, and it
agrees with the fp32 reference as the backend probe requires."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from dflash.convert import onnx_gguf, onnx_target
from dflash.engine.target import ort
from dflash.errors import DFlashError

pytestmark = pytest.mark.skipif(not ort.available() or onnx_target.builder_version() is None,
                                reason="onnxruntime-genai is not installed (make setup)")
FILE = Path("model.gguf")
# format: (bits, weights per block, byte offsets of its fp16 fields)
FORMATS = {"Q4_0": (4, 32, (0,)), "Q4_1": (4, 32, (0, 2)), "Q5_0": (8, 32, (0,)), "Q8_0": (8, 32, (0,)),
           "Q4_K": (4, 32, (0, 2)), "Q5_K": (8, 32, (0, 2)), "Q6_K": (8, 16, (208,))}


def _tensor(kind: str, rows: int = 3, cols: int = 512, seed: int = 0):
    """A GGUF tensor of random blocks of `kind`, its fp16 scales small and finite."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    t = GGMLQuantizationType[kind]
    block, nbytes = GGML_QUANT_SIZES[t]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * cols // block, nbytes), dtype=np.uint8)
    for at in FORMATS.get(kind, (None, None, ()))[2]:
        raw[:, at:at + 2] = rng.uniform(0.001, 0.05, (len(raw), 1)).astype(np.float16).view(np.uint8)
    return SimpleNamespace(name="blk.0.ffn_down.weight", tensor_type=t, data=raw.reshape(rows, -1))


@pytest.mark.parametrize("kind", list(FORMATS))
def test_each_format_becomes_blocks_that_rebuild_its_weights(kind):
    from gguf import quants

    t = _tensor(kind)
    b = onnx_gguf.blocks_of(t, FILE)
    bits, size, _ = FORMATS[kind]
    assert (b.bits, b.size) == (bits, size) and b.q.max() < 2 ** bits and b.zero.max() < 2 ** bits
    w = quants.dequantize(t.data, t.tensor_type).reshape(3, -1).astype(np.float64)
    r = b.remainder[..., None] if b.remainder is not None else 0.0
    back = b.scale[..., None].astype(np.float64) * (b.q.astype(np.float64) - b.zero[..., None]) + r
    # exact up to the remainder's own float32 rounding (it is s * z - m, stored once per block)
    tol = np.spacing(np.abs(b.remainder).astype(np.float32))[..., None] if b.remainder is not None else 0
    assert np.all(np.abs(back - w.reshape(back.shape)) <= tol)
    # integer zero points where the format has one: no remainder to add
    assert (b.remainder is None) == (kind not in ("Q4_1", "Q4_K", "Q5_K"))


def test_a_format_it_cannot_hold_is_a_clean_error():
    with pytest.raises(DFlashError) as err:
        onnx_gguf.blocks_of(_tensor("Q2_K"), FILE)
    assert err.value.code == "bad_target"
    assert all(s in err.value.message for s in (str(FILE), "blk.0.ffn_down.weight", "Q2_K")), err.value.message


def test_only_a_q4_k_m_file_makes_it_a_candidate(smol_dir):
    from dflash.loading import target_builders
    from dflash.model_files import default_target_gguf

    builders = target_builders(smol_dir, gguf=default_target_gguf())  # SmolLM2 ships as Q4_1
    assert "not a Q4_K_M" in builders["ort-q4_k_m"].why_not
    assert "no GGUF" in target_builders(smol_dir)["ort-q4_k_m"].why_not


def test_the_file_type_is_read_from_the_header_alone(tmp_path):
    """`file_type` runs at every start with a GGUF target: its keys are read from the header
    (a scan that stops at the last key wanted) as gguf's whole reader reads them, arrays of
    strings and numbers skipped; a file the scan cannot read gets the reader's clean error."""
    import gguf

    from dflash.convert.gguf_file import field_value, open_gguf, scalar_keys
    from dflash.errors import DFlashError

    path = tmp_path / "keys.gguf"
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_name("keys")
    w.add_token_list(["<a>", "bé", "c" * 300])
    w.add_array("test.floats", [0.5, 1.5])
    w.add_uint32("qwen2.block_count", 3)
    w.add_float32("test.eps", 1e-6)
    w.add_file_type(15)
    w.add_uint64("test.big", 2**40)
    w.add_bool("test.flag", True)
    w.add_tensor("t", np.zeros((2, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    keys = {"qwen2.block_count", "test.eps", "general.file_type", "test.big", "test.flag", "absent.key"}
    reader = open_gguf(path)
    assert scalar_keys(path, keys) == {k: field_value(reader, k) for k in keys if k != "absent.key"}
    assert onnx_gguf.file_type(path) == "Q4_K_M"
    path.write_bytes(path.read_bytes()[:40])  # cut inside the keys
    with pytest.raises(DFlashError) as err:
        onnx_gguf.file_type(path)
    assert err.value.code == "bad_target" and str(path) in err.value.message
    with pytest.raises(DFlashError) as err:
        onnx_gguf.file_type(tmp_path / "none.gguf")
    assert err.value.code == "bad_target" and "not found" in err.value.message


# --- the installed Qwen2.5-Coder-0.5B (dflash models qwen2.5-coder-0.5b-instruct) ----------


@pytest.fixture(scope="module")
def qwen05():
    from tests.test_model_files import _need

    from dflash import model_files

    folder = _need(model_files.QWEN_CODER_05B)
    return folder, model_files.model_gguf(model_files.QWEN_CODER_05B)


@pytest.fixture(scope="module")
def qwen05_ort(qwen05):
    from dflash.model_files import onnx_export_dir

    folder, gguf = qwen05
    model = onnx_gguf.ensure_export(folder, onnx_export_dir(folder, onnx_gguf.PRECISION), onnx_export_dir(folder), gguf)
    return ort.OrtTarget(model, folder, threads=2, context=512)


@pytest.mark.slow
def test_the_export_holds_the_files_blocks(qwen05, qwen05_ort):
    """Every MatMulNBits node read back (codes, scales, zero points, remainders; a node per
    format where a projection's parts differ) is the GGUF tensor's dequantized weight."""
    import onnx
    from gguf import quants
    from onnx import numpy_helper

    from dflash.convert.gguf_file import open_gguf

    folder, gguf = qwen05
    tensors = {t.name: t for t in open_gguf(gguf).tensors}
    model = onnx.load(str(qwen05_ort.model_file))
    inits = {i.name: i for i in model.graph.initializer}
    rows = {}
    for n in model.graph.node:
        if n.op_type != "MatMulNBits":
            continue
        a = {x.name: x.i for x in n.attribute}
        q = numpy_helper.to_array(inits[n.input[1]])
        if a["bits"] == 4:
            q = np.stack([q & 15, q >> 4], -1).reshape(a["N"], -1)
        s = numpy_helper.to_array(inits[n.input[2]]).reshape(a["N"], -1).astype(np.float64)
        z = numpy_helper.to_array(inits[n.input[3]]).reshape(a["N"], -1)
        if a["bits"] == 4:
            z = np.stack([z & 15, z >> 4], -1).reshape(a["N"], -1)[:, : s.shape[1]]
        w = s[..., None] * (q.reshape(a["N"], s.shape[1], -1).astype(np.float64) - z[..., None])
        if f"{n.name}/remainder" in inits:
            w += numpy_helper.to_array(inits[f"{n.name}/remainder"]).T[..., None]
        key = n.name.split("/part")[0]
        rows.setdefault(key, []).append(w.reshape(a["N"], -1))
    assert len(rows) == 24 * 5 + 1  # qkv, o, gate, up, down of every layer, and the head
    for key, parts in rows.items():
        names = onnx_gguf._gguf_names(key, tensors, gguf)
        want = np.concatenate([quants.dequantize(np.asarray(tensors[x].data), tensors[x].tensor_type)
                               .reshape(tensors[x].data.shape[0], -1) for x in names])
        assert np.allclose(np.concatenate(parts), want, rtol=0, atol=1e-6), key


@pytest.mark.slow
def test_rows_are_the_same_however_a_step_is_cut_and_it_agrees_with_the_reference(qwen05, qwen05_ort):
    import torch

    from dflash.engine.target import probe
    from dflash.engine.target.hf import HFTarget
    from dflash.engine.target.protocol import TargetRow
    from tests.test_ort_qwen2 import _teacher_forced

    t = qwen05_ort
    assert (t.backend, t.min_rows) == ("ort-q4_k_m", 2)
    ids = [(1000 + 37 * i) % 50000 for i in range(52)]
    whole = t.new_sequence()
    t.forward_batch([TargetRow(whole, ids[:40], 1)], (1, 5))
    ref = t.forward_batch([TargetRow(whole, ids[40:], 12)], (1, 5))
    for cuts in ((1,) * 12, (3, 4, 5)):
        seq, other, at, logits = t.new_sequence(), t.new_sequence(), 40, []
        t.forward_batch([TargetRow(seq, ids[:25], 0), TargetRow(other, ids[:7], 1)], (1, 5))
        t.forward_batch([TargetRow(seq, ids[25:40], 1)], (1, 5))
        for n in cuts:
            logits.append(t.forward_batch([TargetRow(seq, ids[at:at + n], n), TargetRow(other, [9], 1)],
                                          (1, 5)).logits[0])
            at += n
        assert torch.equal(torch.cat(logits), ref.logits[0]), cuts
    prompts = [t.tokenizer(p)["input_ids"] for p in probe.PROMPTS]
    hf = HFTarget.from_pretrained(qwen05[0])
    reference = _teacher_forced(hf, prompts)
    assert probe.judge(reference, _teacher_forced(t, prompts, reference["tokens"]))["agrees"]
