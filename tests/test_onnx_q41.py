"""The ort backend's q4_1 build (dflash.convert.onnx_q41): Q4_1 and Q8_0 blocks are recovered
from fp32 weights exactly or not at all, the default target's export holds its shipped
weights block for block, and a target whose weights are not Q4_1 blocks is a clean error
naming the folder and the layer. (Its numbers through the engine: tests/test_ort_target.py,
which runs every test on both builds.)"""

import numpy as np
import pytest

from dflash.convert import onnx_q41, onnx_target
from dflash.engine.target import ort

pytestmark = pytest.mark.skipif(not ort.available() or onnx_target.builder_version() is None,
                                reason="onnxruntime-genai is not installed (make setup)")


def _q4_1(rng, n=6, blocks=4):
    """fp32 weights made as Q4_1 makes them: w = d * q + m per block of 32, d and m fp16."""
    d = rng.uniform(0.001, 0.05, (n, blocks, 1)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-0.5, 0.0, (n, blocks, 1)).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (n, blocks, 32))
    q[..., 0], q[..., 1] = 0, 15  # a block's range is what the quantizer spread over 0..15
    return (d * q + m).astype(np.float32).reshape(n, blocks * 32), d[..., 0], m[..., 0], q


def test_q4_1_blocks_are_recovered_exactly_or_not_at_all():
    rng = np.random.default_rng(0)
    w, d, m, q = _q4_1(rng)
    got_q, got_d, z, r = onnx_q41.q4_1_blocks(w)
    assert np.array_equal(got_q, q) and np.array_equal(got_d, d)
    assert np.array_equal(r, (m + d * z).astype(np.float32)) and z.max() <= 15
    back = got_d.astype(np.float64)[..., None] * (got_q.astype(np.float64) - z[..., None]) + r[..., None]
    assert np.abs(back - w.reshape(back.shape)).max() <= np.spacing(np.abs(r).max())  # r's own rounding at most
    assert onnx_q41.q4_1_blocks(w + rng.normal(0, 1e-4, w.shape).astype(np.float32)) is None
    assert onnx_q41.q4_1_blocks(w[:, :48]) is None  # not whole blocks


def test_q8_0_blocks_are_recovered_exactly_or_not_at_all():
    rng = np.random.default_rng(1)
    d = rng.uniform(0.001, 0.05, (5, 3, 1)).astype(np.float16).astype(np.float32)
    q = rng.integers(-127, 128, (5, 3, 32))
    q[..., 0] = 127
    w = (d * q).astype(np.float32).reshape(5, 96)
    got_q, got_d = onnx_q41.q8_0_blocks(w)
    assert np.array_equal(got_q.astype(np.int64) - 128, q) and np.array_equal(got_d, d[..., 0])
    assert onnx_q41.q8_0_blocks(w * 1.001) is None


@pytest.fixture(scope="module")
def q41_export(smol_dir):
    from dflash.model_files import onnx_export_dir

    return onnx_q41.ensure_export(smol_dir, onnx_export_dir(smol_dir, onnx_q41.PRECISION), onnx_export_dir(smol_dir))


def test_the_export_holds_the_shipped_q4_1_blocks(q41_export, smol_dir):
    """Every 4-bit layer of the graph, read back (scale d, codes q, zero point z, remainder
    r), is the target's weight: d * q + (r - d * z) is the Hugging Face folder's fp32 value
    up to r's own rounding (r is m + d * z in fp32)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(q41_export))
    inits = {i.name: i for i in model.graph.initializer}
    weights = onnx_q41._weights(smol_dir)
    checked = 0
    for n in model.graph.node:
        bits = {a.name: a.i for a in n.attribute}.get("bits")
        if n.op_type != "MatMulNBits" or bits != 4:
            continue
        packed = numpy_helper.to_array(inits[n.input[1]])
        q = np.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], packed.shape[1], 32).astype(np.float64)
        d = numpy_helper.to_array(inits[n.input[2]]).astype(np.float64)
        zp = numpy_helper.to_array(inits[n.input[3]])
        z = np.stack([zp & 15, zp >> 4], -1).reshape(d.shape[0], -1)[:, : d.shape[1]].astype(np.float64)
        r = numpy_helper.to_array(inits[f"{n.name}/remainder"]).T.astype(np.float64)
        back = d[..., None] * (q - z[..., None]) + r[..., None]
        w = onnx_q41._source(n.name, weights, smol_dir).astype(np.float64).reshape(back.shape)
        assert np.all(np.abs(back - w) <= np.spacing(np.abs(r).astype(np.float32))[..., None]), n.name
        checked += 1
    assert checked == 5 * 30  # qkv, o, gate, up, down of every layer


def test_weights_that_are_not_q4_1_blocks_are_a_clean_error(smol_dir, tmp_path):
    from dflash.model_files import onnx_export_dir
    from tests.conftest import assert_bad_target

    weights = dict(onnx_q41._weights(smol_dir))
    name = "model.layers.0.self_attn.q_proj.weight"
    weights[name] = weights[name] + np.float32(1e-4)  # off the grid
    src = onnx_target.ensure_export(smol_dir, onnx_export_dir(smol_dir))
    assert_bad_target(lambda: onnx_q41.rewrite(src, weights, tmp_path / "model.onnx", smol_dir), smol_dir)
    del weights[name]
    assert_bad_target(lambda: onnx_q41.rewrite(src, weights, tmp_path / "model.onnx", smol_dir), smol_dir)
