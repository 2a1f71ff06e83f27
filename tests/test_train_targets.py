"""Training for a target other than the embedded default: `dflash train --target`, the one-shot
GPU run's `--target` (dry run on the CPU) and `python -m dflash.train.next_head --target`, on a
tiny random Qwen2 with a tokenizer of its own (tests/tiny_qwen.py), and (slow) on the real
Qwen2.5-Coder-1.5B-Instruct. Each drafter or head made must load for its target and only
for it."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dflash.engine.engine import Engine, GenerationRequest, check_compatible
from dflash.engine.target.hf import HFTarget
from dflash.errors import DFlashError
from dflash.loading import load_drafter
from tests.conftest import make_tiny_target
from tests.tiny_qwen import TOKENS, make_tiny_qwen2

PROMPTS = ["Say something.", "Write a function that adds two numbers.", "Name a colour.", "Explain an index."]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return make_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2") / "tiny-qwen2")


def greedy(engine: Engine, prompt: str, block_size: int | None, n: int = 12) -> list[int]:
    return engine.generate(GenerationRequest(prompt=prompt, chat=True, max_new_tokens=n,
                                             block_size=block_size)).output_ids


def assert_drafts_for(target, drafter_dir) -> None:
    """The drafter loads, fits `target` (and not another), and the engine's output with it is
    the target's own greedy output."""
    drafter = load_drafter(drafter_dir)
    check_compatible(target, drafter.config)
    engine = Engine(target, drafter, drafter_dir.name)
    for p in PROMPTS[:2]:
        assert greedy(engine, p, 4) == greedy(engine, p, 1)
    with pytest.raises(DFlashError) as err:
        check_compatible(make_tiny_target(), drafter.config)
    assert err.value.code == "incompatible_drafter"


def test_dflash_train_makes_a_drafter_for_another_target(tmp_path, qwen_dir):
    """The shipped corpus holds SmolLM2's token ids: another target's run answers its prompts
    itself, and the new drafter's mask token is the first embedding row past its tokenizer."""
    from dflash.cli import main

    run = tmp_path / "run"
    rc = main(["train", "--target", str(qwen_dir), "--out", str(run), "--prompts", "6", "--max-new-tokens", "16",
               "--gen-batch", "6", "--layers", "1", "--block-size", "4", "--epochs", "2", "--heldout", "1",
               "--seqs-per-step", "2", "--no-autocast", "--eval-minutes", "100"])
    assert rc == 0
    target = HFTarget.from_pretrained(qwen_dir)
    answers = [json.loads(line) for line in (run / "data.jsonl").read_text().splitlines()]
    assert len(answers) == 6 and all(max(a["prompt_ids"]) < TOKENS for a in answers)
    config = json.loads((run / "train" / "drafter" / "config.json").read_text())
    assert config["dflash_config"]["mask_token_id"] == TOKENS and config["num_target_layers"] == 4
    assert_drafts_for(target, run / "train" / "drafter")


def _other_targets_corpus(folder) -> str:
    """A packed corpus whose answers are another target's: its prompts, ids that are not ours."""
    from dflash.train import corpus

    answers = folder / "answers.jsonl"
    answers.write_text("".join(json.dumps({"prompt": p, "prompt_ids": [7, 8, 9], "response_ids": [10, 11]}) + "\n"
                               for p in PROMPTS * 1 + [f"Count to {i}." for i in range(6)]))
    corpus.pack(answers, folder / "corpus", name="other")
    return str(folder / "corpus" / "other.jsonl.xz")


def test_oneshot_dry_run_for_another_target(tmp_path, qwen_dir, capsys):
    """The one-shot run takes the target as an argument: a corpus of another target's answers
    is refused unless minutes are given to answer its prompts with this target; a new drafter
    (no shipped one fits) is trained, and loads for it."""
    from dflash.train import oneshot

    corpus_file = _other_targets_corpus(tmp_path)
    common = ["--target", str(qwen_dir), "--corpus", corpus_file, "--device", "cpu", "--train-min", "0.05",
              "--layers", "1", "--block-size", "4", "--heldout", "1", "--eval-min", "0.02", "--seqs-per-step", "2",
              "--block-tokens", "128", "--head-chunk-rows", "16"]
    assert oneshot.main(["--out", str(tmp_path / "refused"), "--export", str(tmp_path / "refused-export"),
                         *common]) == 2
    assert "another target's answers" in capsys.readouterr().err

    export = tmp_path / "export"
    assert oneshot.main(["--out", str(tmp_path / "run"), "--export", str(export), "--answer-min", "0.02",
                         "--answer-tokens", "16", *common]) == 0
    summary = json.loads((export / "summary.json").read_text())
    assert summary["target"] == qwen_dir.name and summary["answers"] >= 4 and summary["sequence_passes"] > 0
    lineage = json.loads((export / "best" / "training.json").read_text())
    assert lineage[0]["stage"].startswith("initialised: target layers")
    assert_drafts_for(HFTarget.from_pretrained(qwen_dir), export / "best")


def test_next_head_for_another_target(tmp_path, qwen_dir, capsys):
    """A head made for a target (here on hf, named) is loaded by the engine for that target
    and not for another; with no answers of its own it is a clean error. Unnamed, another
    target's backends are the one a CPU worker serves it on."""
    from dflash.engine.proposers import head as head_mod
    from dflash.engine.target import ort
    from dflash.train import next_head

    assert next_head.other_target_backends() == ("ort" if ort.available() and not torch.cuda.is_available() else "hf")

    out = tmp_path / "head"
    # (the tiny Qwen's heads of 8 are too narrow for ONNX Runtime's attention: hf, named)
    assert next_head.main(["--target", str(qwen_dir), "--out", str(out), "--threads", "1", "--backends", "hf"]) == 2
    assert "another target's answers" in capsys.readouterr().err
    assert next_head.main(["--target", str(qwen_dir), "--out", str(out), "--prompts", "8", "--max-new-tokens", "16",
                           "--heldout", "2", "--epochs", "2", "--vocab", "64", "--threads", "1", "--backends",
                           "hf"]) == 0
    config = json.loads((out / head_mod.CONFIG_FILE).read_text())
    assert config["target"] == qwen_dir.name and config["backends"] == ["hf"] and config["vocab_k"] <= 64
    assert config["train_positions"] > 0 and config["heldout"]["positions"] > 0
    target = HFTarget.from_pretrained(qwen_dir)
    assert head_mod.for_target(target, out) is not None
    assert head_mod.for_target(make_tiny_target(), out) is None


# --- the real Qwen2.5-Coder-1.5B-Instruct ---------------------------------------------------


def _need(name: str):
    from dflash.model_files import installed

    if not installed(name):
        why = f"{name} is not installed (dflash models {name})"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)


@pytest.mark.slow
def test_a_short_cpu_training_run_for_qwen_coder_loads_as_its_drafter(tmp_path):
    """`dflash train --target FILE.gguf` for Qwen2.5-Coder-1.5B: a few answers, one draft layer,
    a few steps; the drafter loads for the target (hf: llama.cpp's qwen2 graph gives no layer
    features) and the output with it is the target's plain greedy output."""
    from dflash.cli import main
    from dflash.model_files import QWEN_CODER_15B, model_gguf, resolve_target

    _need(QWEN_CODER_15B)
    torch.set_num_threads(2)
    gguf = model_gguf(QWEN_CODER_15B)
    run = tmp_path / "run"
    assert main(["train", "--target", str(gguf), "--out", str(run), "--prompts", "3", "--max-new-tokens", "16",
                 "--gen-batch", "3", "--layers", "1", "--block-size", "4", "--epochs", "1", "--heldout", "1",
                 "--seqs-per-step", "2", "--max-anchors", "8", "--no-autocast", "--eval-minutes", "100"]) == 0
    drafter_dir = run / "train" / "drafter"
    config = json.loads((drafter_dir / "config.json").read_text())
    assert config["hidden_size"] == 1536 and config["num_target_layers"] == 28 and config["vocab_size"] == 151936
    assert config["dflash_config"]["mask_token_id"] == 151665  # the first row past Qwen2.5's tokenizer
    target = HFTarget.from_pretrained(resolve_target(str(gguf), quiet=True).folder)
    drafter = load_drafter(drafter_dir)
    check_compatible(target, drafter.config)
    engine = Engine(target, drafter, drafter_dir.name)
    prompt = "Write a Python function that returns the square of a number."
    assert greedy(engine, prompt, 4, 16) == greedy(engine, prompt, 1, 16)


@pytest.mark.slow
def test_a_next_token_head_for_qwen_coder(tmp_path):
    """`python -m dflash.train.next_head --target NAME` for Qwen2.5-Coder-1.5B at tiny size: the
    head is for that target on hf, and the engine loads it there."""
    from dflash.engine.proposers import head as head_mod
    from dflash.model_files import QWEN_CODER_15B, resolve_target
    from dflash.train import next_head

    _need(QWEN_CODER_15B)
    out = tmp_path / "head"
    assert next_head.main(["--target", QWEN_CODER_15B, "--out", str(out), "--prompts", "3", "--max-new-tokens", "16",
                           "--heldout", "1", "--epochs", "1", "--vocab", "256", "--backends", "hf"]) == 0
    config = json.loads((out / head_mod.CONFIG_FILE).read_text())
    assert config["target"] == QWEN_CODER_15B and config["backends"] == ["hf"] and config["layer"] == 27
    target = HFTarget.from_pretrained(resolve_target(QWEN_CODER_15B, quiet=True).folder)
    assert head_mod.for_target(target, out) is not None
