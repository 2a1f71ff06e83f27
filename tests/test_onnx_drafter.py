"""The ONNX drafter (`dflash convert --to onnx`, run by ONNX Runtime): the reference forward
to 1e-4, the PyTorch drafter's outputs and cache discipline step by step, the reference's
drafts and the target's greedy output through the engine, and bad files."""

import json

import onnx
import pytest
import torch
from safetensors.torch import load_file

from dflash.cli import main
from dflash.convert import convert_drafter
from dflash.engine.drafter import read_drafter_folder
from dflash.loading import load_drafter
from dflash.engine.engine import Engine, GenerationRequest
from dflash.engine.onnx_drafter import OnnxDrafter
from dflash.engine.versions import digest
from dflash.errors import DFlashError


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def zlab_onnx(shared, tmp_path_factory):
    return convert_drafter(shared / "fixtures/zlab-compat/drafter", "onnx", tmp_path_factory.mktemp("onnx") / "zlab.onnx")


def test_forward_matches_reference(shared, smol_target, zlab_onnx):
    drafter = load_drafter(zlab_onnx)
    assert isinstance(drafter, OnnxDrafter)
    assert drafter.sha256 == digest(*read_drafter_folder(shared / "fixtures/zlab-compat/drafter"))  # its version
    f = load_file(str(shared / "fixtures/zlab-compat/forward.safetensors"))
    out = drafter(f["target_hidden"].float(), smol_target.embed(f["noise_ids"]), f["position_ids"][0])
    assert rel(out, f["expected_hidden"]) < 1e-4


def test_cached_steps_match_the_pytorch_drafter(shared, zlab_onnx):
    """Context rows fed step by step (as the loop does: prompt, then a + 1 rows per step, and
    once more rows than the cache buffer holds at first);
    every block's output within 1e-4 of PyTorch's, and both caches hold the same rows."""
    ort, pt = load_drafter(zlab_onnx), load_drafter(shared / "fixtures/zlab-compat/drafter")
    c_ort, c_pt = ort.new_cache(), pt.new_cache()
    gen = torch.Generator().manual_seed(0)
    start = 0
    for rows, block in [(9, 16), (1, 16), (3, 8), (250, 16), (2, 2)]:  # 250: past the first buffer
        feats = torch.randn(1, rows, 3 * 576, generator=gen)
        embeds = torch.randn(1, block, 576, generator=gen)
        positions = torch.arange(start, start + rows + block)
        with torch.inference_mode():
            a, b = ort(feats, embeds, positions, c_ort), pt(feats, embeds, positions, c_pt)
        start += rows
        assert rel(a, b) < 1e-4
        assert c_ort.length == c_pt.length == start


def test_engine_with_onnx_drafts_like_the_reference(shared, smol_target, zlab_onnx):
    """Through the engine, every draft block equals the reference implementation's and the
    output equals transformers' greedy generation."""
    golden = json.loads((shared / "fixtures/zlab-compat/golden.json").read_text())
    engine = Engine(smol_target, load_drafter(zlab_onnx), "zlab.onnx")
    for rec in [golden["records"][0], golden["records"][3]]:  # a chat and a raw prompt; block 16 and 8
        res = engine.generate(GenerationRequest(input_ids=rec["input_ids"], block_size=rec["block_size"],
                                                max_new_tokens=16))
        assert res.prompt_ids + res.output_ids == rec["hf_greedy_ids"][: len(rec["input_ids"]) + 16]
        drafts = [s.draft_ids for s in res.stats.steps]
        assert drafts == rec["drafts"][: len(drafts)]


def test_cli_generates_with_an_onnx_drafter(capsys, zlab_onnx):
    rc = main(["generate", "--drafter", str(zlab_onnx), "--chat", "--prompt", "Write a haiku about databases.",
               "--max-new-tokens", "6", "--block-size", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["drafter"] == "zlab.onnx" and len(out["output_ids"]) == 6 and out["num_steps"] >= 2


def test_bad_onnx_files(tmp_path, zlab_onnx):
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(zlab_onnx.read_bytes()[:5000])
    with pytest.raises(DFlashError, match="not a loadable ONNX model"):
        load_drafter(cut)
    plain = tmp_path / "plain.onnx"  # a valid ONNX model that is no drafter
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "g", [x],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    onnx.save_model(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)]), str(plain))
    with pytest.raises(DFlashError, match="not a DFlash drafter"):
        load_drafter(plain)
    with pytest.raises(DFlashError, match="not found"):
        load_drafter(tmp_path / "nowhere.onnx")
