"""`dflash convert` and GGUF drafters: bit-identical round trips, llama.cpp's layout (checked
against tests/golden, written by llama.cpp's own converter via `make peers`), loading a
.gguf drafter, and bad input. Most tests use a tiny drafter and a tiny target GGUF (a
full vocabulary takes the gguf reader seconds to parse)."""

import json
import shutil

import gguf
import pytest
import torch
from safetensors.torch import load_file

from dflash.cli import main
from dflash.convert import convert_drafter
from dflash.convert.gguf_file import CONFIG_KEY, Vocabulary, read_gguf_drafter, write_gguf_drafter
from dflash.engine.drafter import init_random_drafter, read_drafter_folder, save_drafter
from dflash.loading import load_drafter
from dflash.errors import DFlashError
from dflash.model_files import GGUF_FILE, SHIPPED_DRAFTER, _gguf_source, default_target_gguf
from tests.conftest import REPO, TINY_VOCAB, tiny_drafter_config

GOLDEN = REPO / "tests" / "golden" / "dflash_gguf_layout.json"


def bits(t: torch.Tensor) -> tuple:
    return t.dtype, tuple(t.shape), t.contiguous().view(torch.uint8).flatten().tolist()


def assert_same_tensors(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert bits(a[k]) == bits(b[k]), k


def config_of(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A GGUF that looks like the tiny test target to the converter: 4 layers, hidden 32,
    a 48-token vocabulary."""
    path = tmp_path_factory.mktemp("target") / "tiny-target.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(4)
    w.add_embedding_length(32)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(TINY_VOCAB)])
    w.add_token_types([int(gguf.TokenType.NORMAL)] * TINY_VOCAB)
    w.add_eos_token_id(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("drafter") / "tiny"
    save_drafter(init_random_drafter(tiny_drafter_config(), seed=4, std=0.3), path)  # bf16, as published
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tiny_folder, tiny_target):
    return convert_drafter(tiny_folder, "gguf", tiny_folder.parent / "tiny.gguf", target=tiny_target)


@pytest.mark.parametrize("outtype", ["auto", "f32"])
def test_hf_gguf_hf_round_trip_is_bit_identical(tiny_folder, tiny_gguf, tiny_target, tmp_path, outtype):
    path = tiny_gguf if outtype == "auto" else convert_drafter(tiny_folder, "gguf", tmp_path / "d.gguf",
                                                                target=tiny_target, outtype=outtype)
    back = convert_drafter(path, "hf", tmp_path / "back")
    assert_same_tensors(load_file(str(tiny_folder / "model.safetensors")), load_file(str(back / "model.safetensors")))
    assert config_of(back) == config_of(tiny_folder)
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert kinds["fc.weight"] == ("F32" if outtype == "f32" else "BF16")
    assert kinds["output_norm.weight"] == kinds["enc.output_norm.weight"] == "F32"  # 1-D: F32, as llama.cpp does


def test_layout_is_llama_cpps(tmp_path):
    """Our file for the shipped drafter against the file llama.cpp's DFlashModel converter
    wrote for it: the same keys with the same types and values (except the provenance keys
    llama.cpp derives from the folder name), the same tensors with the same types and shapes.
    The tokenizer keys are the target GGUF's, copied verbatim."""
    golden = json.loads(GOLDEN.read_text())
    target = gguf.GGUFReader(_gguf_source() / GGUF_FILE)
    ours = gguf.GGUFReader(convert_drafter(SHIPPED_DRAFTER, "gguf", tmp_path / "d.gguf", target=default_target_gguf()))
    keys = {k: f for k, f in ours.fields.items() if not k.startswith("GGUF.")}
    skip = set(golden["provenance_keys"]) | {CONFIG_KEY}
    for name, want in golden["keys"].items():
        if name in skip:
            continue
        assert name in keys, name
        assert [t.name for t in keys[name].types] == want["types"], name
        if want["value"] is not None and not name.startswith("tokenizer."):
            assert keys[name].contents() == want["value"], name
    arch_keys = {k for k in keys if not k.startswith("tokenizer.")} - skip
    assert arch_keys == {k for k in golden["keys"] if not k.startswith("tokenizer.")} - skip
    assert {t.name: {"type": t.tensor_type.name, "shape": [int(x) for x in t.shape]} for t in ours.tensors} == \
        golden["tensors"]
    for name, f in target.fields.items():
        if name.startswith("tokenizer."):
            assert keys[name].contents() == f.contents(), name
    assert keys["tokenizer.ggml.mask_token_id"].contents() == 16
    assert keys["dflash.target_layers"].contents() == [i + 1 for i in [1, 9, 18, 27]]  # llama.cpp: layer inputs


def test_published_drafter_round_trips_and_drafts_like_the_reference(capsys, shared, tmp_path):
    """The reference fixture drafter (published geometry, real vocabulary): GGUF and back is
    bit-identical, and `dflash generate --drafter X.gguf` drafts every step as the reference
    implementation did."""
    folder = shared / "fixtures/zlab-compat/drafter"
    path = convert_drafter(folder, "gguf", tmp_path / "zlab.gguf", target=default_target_gguf())
    state = read_gguf_drafter(path)[1]
    assert_same_tensors({k: t.to(torch.bfloat16) for k, t in state.items()}, load_file(str(folder / "model.safetensors")))
    rec = json.loads((shared / "fixtures/zlab-compat/golden.json").read_text())["records"][2]
    rc = main(["generate", "--drafter", str(path), "--input-ids", ",".join(map(str, rec["input_ids"])),
               "--block-size", str(rec["block_size"]), "--max-new-tokens", "16", "--json",
               "--draft-dtype", "float32", "--target-backend", "hf"])  # the reference: fp32, transformers
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["drafter"] == "zlab.gguf"
    assert rec["input_ids"] + out["output_ids"] == rec["output_ids"][: len(rec["input_ids"]) + 16]
    drafts = [s["draft_ids"] for s in out["steps"]]
    assert drafts == rec["drafts"][: len(drafts)]


def _without_our_config(src, dst):
    """The file llama.cpp's converter would write: ours minus the pg_dflash key."""
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, "dflash")
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key in (CONFIG_KEY, "general.architecture"):
            continue
        w.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_from_llama_cpps_converter_needs_the_target(tiny_folder, tiny_gguf, tiny_target, tmp_path):
    foreign = tmp_path / "foreign.gguf"
    _without_our_config(tiny_gguf, foreign)
    with pytest.raises(DFlashError, match="does not say how many layers its target has"):
        load_drafter(foreign)
    back = convert_drafter(foreign, "hf", tmp_path / "back", target=tiny_target)
    assert_same_tensors(load_file(str(tiny_folder / "model.safetensors")), load_file(str(back / "model.safetensors")))
    original, rebuilt = config_of(tiny_folder), config_of(back)
    assert {k: v for k, v in rebuilt.items() if k in original} == original


# --- bad input -------------------------------------------------------------------------


def run_cli(capsys, *args) -> tuple[int, str]:
    rc = main([str(a) for a in args])
    return rc, capsys.readouterr().err


def test_a_gguf_that_is_not_a_drafter(capsys, tmp_path, tiny_target):
    with pytest.raises(DFlashError, match="'llama' GGUF, not a DFlash drafter"):
        load_drafter(tiny_target)
    rc, err = run_cli(capsys, "convert", tiny_target, "--to", "hf", tmp_path / "out")
    assert rc == 2 and err.startswith("dflash: error:") and "not a DFlash drafter" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("keep", [10, 1000, 0.5, -100])
def test_a_truncated_gguf(capsys, tiny_gguf, tmp_path, keep):
    whole = tiny_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: int(len(whole) * keep) if isinstance(keep, float) else keep])
    with pytest.raises(DFlashError, match="truncated"):
        load_drafter(cut)
    rc, err = run_cli(capsys, "convert", cut, "--to", "hf", tmp_path / "out")
    assert rc == 2 and err.startswith("dflash: error:") and "truncated" in err
    assert not (tmp_path / "out").exists()


def test_a_drafter_that_does_not_fit_the_target(capsys, shared, tiny_folder, tiny_target, tmp_path):
    rc, err = run_cli(capsys, "convert", shared / "fixtures/zlab-compat/drafter", "--to", "gguf",
                      tmp_path / "x.gguf", "--target", tiny_target)
    assert rc == 2 and err.startswith("dflash: error:") and "hidden size 576 does not match the target's 32" in err
    assert not list(tmp_path.glob("x.gguf*"))
    # Written without a target to check against, it is refused where it is used.
    cfg, state = read_drafter_folder(tiny_folder)
    write_gguf_drafter(cfg, state, tmp_path / "tiny.gguf", Vocabulary())
    rc, err = run_cli(capsys, "generate", "--drafter", tmp_path / "tiny.gguf", "--input-ids", "1,2", "--max-new-tokens", 2)
    assert rc == 2 and "hidden size 32 does not match" in err


def test_gguf_keys_must_agree_with_our_config(tiny_gguf, tmp_path):
    path = tmp_path / "d.gguf"
    shutil.copyfile(tiny_gguf, path)
    reader = gguf.GGUFReader(path, "r+")  # edit one key in place: block_size 8 -> 4
    field = reader.fields["dflash.block_size"]
    field.parts[field.data[0]][0] = 4
    del reader
    with pytest.raises(DFlashError, match="disagree"):
        read_gguf_drafter(path)


def test_bad_conversions(capsys, tiny_folder, tiny_gguf, tmp_path):
    rc, err = run_cli(capsys, "convert", tiny_folder, "--to", "hf", tmp_path / "x")
    assert rc == 2 and "converts a .gguf file back" in err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "file").write_text("x")
    rc, err = run_cli(capsys, "convert", tiny_gguf, "--to", "hf", tmp_path / "full")
    assert rc == 2 and "not empty" in err
