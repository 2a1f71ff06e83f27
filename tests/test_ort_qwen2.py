"""The ort backend on a target of another architecture than the default's: a tiny random
Qwen2 (transformers' Qwen2Config: biased q/k/v, untied head, 3 layers) goes through the
same export (ONNX Runtime GenAI's model builder, int8, then dflash.convert.onnx_target's
edits) and runtime (dflash.engine.target.ort) as SmolLM2. It agrees with the fp32
reference path as the backend probe requires of any quantized backend (every greedy token
among the reference's top 5, most equal), its rows are bit-identical however a step is cut
or shared, a copied prefix is what prefilling it gives, and greedy decoding with drafts is
the backend's plain greedy output. An architecture the builder cannot export is a clean
error naming the folder and the architecture.

Every test on the export runs on both builds: int8 (`ort`) and int4 (`ort-int4`).
The tiny model and its exports are made once into the model cache (CACHE/test-models),
so after the first run these tests take seconds."""

import json

import pytest
import torch

from dflash.convert import onnx_target
from dflash.engine.target import ort
from dflash.engine.target.protocol import TargetRow

pytestmark = pytest.mark.skipif(not ort.available() or onnx_target.builder_version() is None,
                                reason="onnxruntime-genai is not installed (make setup)")
VOCAB, LAYERS = 512, (0, 1)  # (not the last: hf gives it after the final norm)


def _tiny_folder(name: str, make):
    """A tiny random model saved once under CACHE/test-models/`name` (whole or not at all)."""
    import shutil
    import tempfile
    from pathlib import Path

    from dflash.model_files import cache_dir

    folder = cache_dir() / "test-models" / name
    if not (folder / "config.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{name}-"))
        torch.manual_seed(0)
        make().save_pretrained(tmp)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    return folder


@pytest.fixture(scope="module")
def qwen2_dir():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.3, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    return _tiny_folder("tiny-qwen2", lambda: Qwen2ForCausalLM(cfg).float().eval())


def _export(qwen2_dir, build):
    from dflash.model_files import onnx_export_dir

    model = onnx_target.ensure_export(qwen2_dir, onnx_export_dir(qwen2_dir, build["precision"]), build=build)
    return ort.OrtTarget(model, qwen2_dir, threads=2, context=512)


@pytest.fixture(scope="module", params=[onnx_target.BUILD, onnx_target.INT4_BUILD], ids=["int8", "int4"])
def qwen2_ort(qwen2_dir, request):
    """The export of each build (the int4 one: `ort-int4`), the tests that take it run on both."""
    return _export(qwen2_dir, request.param)


@pytest.fixture(scope="module")
def qwen2_int8(qwen2_dir):
    return _export(qwen2_dir, onnx_target.BUILD)


@pytest.fixture(scope="module")
def qwen2_hf(qwen2_dir):
    from dflash.engine.target.hf import HFTarget

    return HFTarget.from_pretrained(qwen2_dir)


def _ids(n, offset=0):
    return [(5 + 37 * i + offset) % VOCAB for i in range(n)]


def test_the_export_is_a_qwen2_graph_the_runtime_takes(qwen2_ort, qwen2_dir):
    assert json.loads((qwen2_dir / "config.json").read_text())["model_type"] == "qwen2"
    assert (qwen2_ort.num_layers, qwen2_ort.hidden_size, qwen2_ort.vocab_size) == (3, 64, VOCAB)
    int4 = qwen2_ort.build["precision"] == "int4"
    assert qwen2_ort.build == (onnx_target.INT4_BUILD if int4 else onnx_target.BUILD)
    assert qwen2_ort.backend == ("ort-int4" if int4 else "ort")
    assert qwen2_ort.max_batch == max(onnx_target.BATCH_GRAPHS)
    # A lone row goes through the weights once where this CPU's kernels round it as among
    # several (measured at load for the int4 build), twice where they do not.
    assert qwen2_ort.min_rows == (1 if not int4 or qwen2_ort.one_row_is_exact() else 2)


def test_the_int4_build_is_asked_for_by_name_never_chosen_by_auto(qwen2_dir):
    from dflash.loading import TARGET_BACKENDS, target_builders

    builders = target_builders(qwen2_dir)
    assert "ort-int4" in TARGET_BACKENDS and builders["ort-int4"].build == onnx_target.INT4_BUILD
    assert not builders["ort-int4"].auto and builders["ort"].auto and builders["llamacpp"].auto
    # The CLI's choices are the builders (and "auto"): a backend cannot be named and unbuilt.
    assert TARGET_BACKENDS == ("auto", *builders)


def _teacher_forced(target, prompts, tokens=None):
    """What the backend probe's child records (dflash.engine.target.probe): per prompt and
    step the greedy token, the top k, the token fed next (the reference's, when given)."""
    from dflash.engine.target import probe

    seqs = [target.new_sequence() for _ in prompts]
    out = target.forward_batch([TargetRow(s, p, 1) for s, p in zip(seqs, prompts)], LAYERS)
    rec = {"tokens": [[] for _ in prompts], "top": [[] for _ in prompts], "argmax": [[] for _ in prompts],
           "finite": True}
    for step in range(probe.NEW_TOKENS):
        nxt = []
        for i, logits in enumerate(out.logits):
            rec["finite"] &= bool(torch.isfinite(logits).all())
            rec["argmax"][i].append(int(logits[-1].argmax()))
            rec["top"][i].append([int(t) for t in logits[-1].topk(probe.TOP_K).indices])
            nxt.append(tokens[i][step] if tokens else rec["argmax"][i][-1])
            rec["tokens"][i].append(nxt[-1])
        out = target.forward_batch([TargetRow(s, [t], 1) for s, t in zip(seqs, nxt)], LAYERS)
    for s in seqs:
        target.free(s)
    return rec


def test_it_agrees_with_the_fp32_reference_as_the_probe_requires(qwen2_int8, qwen2_hf):
    """The probe's rule (dflash.engine.target.probe.judge: every greedy token, teacher-forced
    on the reference's, among its top 5, at least half equal) on four prompts; and the
    features of the layers a drafter reads close to the reference's residual stream. (The
    int8 build only: this random model's logits are near ties that a 4-bit grid reorders;
    the int4 build is held to the rule on a real model, below, and by the probe at first use.)"""
    from dflash.engine.target import probe

    qwen2_ort = qwen2_int8

    prompts = [_ids(8 + 5 * k, k) for k in range(4)]
    ref = _teacher_forced(qwen2_hf, prompts)
    verdict = probe.judge(ref, _teacher_forced(qwen2_ort, prompts, ref["tokens"]))
    assert verdict["agrees"], verdict
    ids = _ids(48)
    got = qwen2_ort.forward_batch([TargetRow(qwen2_ort.new_sequence(), ids, 1)], LAYERS).features[0]
    want = qwen2_hf.forward_batch([TargetRow(qwen2_hf.new_sequence(), ids, 1)], LAYERS).features[0]
    assert got.shape == want.shape and float((got - want).norm() / want.norm()) < 0.1


@pytest.mark.parametrize("cuts", [(1,) * 12, (3, 3, 3, 3), (5, 7), (12,)])
def test_a_row_is_the_same_however_the_step_is_cut(qwen2_ort, cuts):
    """The same 12 new tokens after a prompt, decoded in steps of the given sizes, each
    step beside another sequence's (a batch graph): logits and features bit-identical to
    the tokens in one call of their own after the prompt in one call."""
    t = qwen2_ort
    prompt, new = _ids(30), _ids(12, 3)
    whole = t.new_sequence()
    t.forward_batch([TargetRow(whole, prompt, 1)], LAYERS)
    ref = t.forward_batch([TargetRow(whole, new, len(new))], LAYERS)
    seq, other = t.new_sequence(), t.new_sequence()
    t.forward_batch([TargetRow(seq, prompt[:17], 0), TargetRow(other, _ids(9, 1), 1)], LAYERS)
    t.forward_batch([TargetRow(seq, prompt[17:], 1)], LAYERS)
    logits, feats, at = [], [], 0
    for n in cuts:
        out = t.forward_batch([TargetRow(seq, new[at:at + n], n), TargetRow(other, _ids(n % 3 + 1, at), 1)], LAYERS)
        logits.append(out.logits[0])
        feats.append(out.features[0])
        at += n
    assert torch.equal(torch.cat(logits), ref.logits[0]) and torch.equal(torch.cat(feats), ref.features[0])
    for s in (whole, seq, other):
        t.free(s)


def test_a_copied_prefix_and_a_rollback_are_exact(qwen2_ort):
    t = qwen2_ort
    src, fresh, copied = t.new_sequence(), t.new_sequence(), t.new_sequence()
    t.forward_batch([TargetRow(src, _ids(40) + _ids(6, 9), 6)], LAYERS)
    t.rollback(src, 40)  # the rejected rows' K/V must not matter
    t.forward_batch([TargetRow(src, _ids(3, 2), 3)], LAYERS)
    ref = t.forward_batch([TargetRow(fresh, _ids(40) + _ids(5, 4), 5)], LAYERS)
    t.copy_prefix(src, copied, 40)
    got = t.forward_batch([TargetRow(copied, _ids(5, 4), 5)], LAYERS)
    assert torch.equal(got.logits[0], ref.logits[0]) and torch.equal(got.features[0], ref.features[0][40:])
    for s in (src, fresh, copied):
        t.free(s)


def test_greedy_with_drafts_is_the_backends_plain_greedy(qwen2_ort):
    """Through the engine, with a random drafter made for this target (drafts rarely kept,
    so both kept and rejected rows are exercised), several requests at once and alone."""
    from dflash.engine.drafter import init_random_drafter
    from dflash.engine.drafter_config import DrafterConfig
    from dflash.engine.engine import Engine, GenerationRequest
    from tests.conftest import cpu_like_costs

    cfg = DrafterConfig.from_dict({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                   "vocab_size": VOCAB, "block_size": 8, "num_target_layers": 3,
                                   "dflash_config": {"mask_token_id": 3, "target_layer_ids": list(LAYERS)}})
    engine = Engine(qwen2_ort, init_random_drafter(cfg, seed=1, std=0.3), "tiny-qwen2-drafter",
                    cost_curve=cpu_like_costs(8))
    prompts = [_ids(20, k) for k in range(3)]
    plain = [engine.generate(GenerationRequest(input_ids=p, max_new_tokens=16, block_size=1)).output_ids
             for p in prompts]
    for block in (4, None):
        reqs = [GenerationRequest(input_ids=p, max_new_tokens=16, block_size=block) for p in prompts]
        assert [r.output_ids for r in engine.generate_many(reqs)] == plain
        assert engine.generate(reqs[0]).output_ids == plain[0]


@pytest.mark.slow
def test_an_architecture_the_builder_cannot_export_is_a_clean_error(tmp_path):
    """GPT-2 (which ONNX Runtime GenAI's builder does not export): bad_target naming the
    folder and the architecture, and nothing left in the export folder."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from dflash.errors import DFlashError

    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64)).save_pretrained(folder)
    with pytest.raises(DFlashError) as err:
        onnx_target.ensure_export(folder, tmp_path / "out")
    assert err.value.code == "bad_target"
    assert str(folder) in err.value.message and "GPT2LMHeadModel" in err.value.message, err.value.message
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["gpt2"]


@pytest.mark.slow
def test_the_int4_build_of_the_installed_1_5b_passes_the_backend_probe(tmp_path):
    """The probe's rule (above) for `ort-int4` on Qwen2.5-Coder-1.5B-Instruct, run as a first
    `--target-backend ort-int4` runs it (in a child, its verdict kept in tmp_path, not the
    cache's; the export made once, minutes)."""
    from dflash.loading import target_builders
    from dflash.model_files import QWEN_CODER_15B, model_gguf, resolve_target

    from tests.conftest import unavailable

    if not model_gguf(QWEN_CODER_15B).is_file():  # a named model: make setup does not install it
        unavailable("Qwen2.5-Coder-1.5B-Instruct", "not installed (dflash models qwen2.5-coder-1.5b-instruct)",
                    required_in_ci=False)
    files = resolve_target(QWEN_CODER_15B, quiet=True)
    builder = target_builders(files.folder, gguf=files.gguf)["ort-int4"]
    verdict = builder.verdict(tmp_path)
    assert verdict.usable and verdict.agreement["agrees"], verdict
