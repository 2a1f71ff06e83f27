"""The shipped training corpus (checksum, no benchmark prompt) and a dry run of the
one-command GPU run (`python -m dflash.train.oneshot`) on the CPU with a tiny target."""

import json
import lzma
import shutil

import pytest
import torch

from dflash.errors import DFlashError
from dflash.train import corpus
from tests.conftest import make_tiny_target


def test_shipped_corpus_checksum_and_no_benchmark_prompt():
    from dflash.train.data import excluded_prompts

    records = corpus.load_corpus()  # verifies the sha256 in the manifest
    manifest = json.loads(corpus.MANIFEST_FILE.read_text())
    assert manifest["sha256"] == corpus.sha256_of(corpus.CORPUS_FILE)
    assert len(records) == manifest["records"] > 0
    assert sum(len(r["response_ids"]) for r in records) == manifest["response_tokens"]
    excluded = excluded_prompts()
    assert len(excluded) >= 164 + 100  # HumanEval and the chat suite at least
    assert not {r["prompt"].strip() for r in records} & excluded
    assert len({r["prompt"] for r in records}) == len(records)
    assert manifest["sha256"] in corpus.CARD_FILE.read_text()


def test_a_corpus_that_does_not_match_its_checksum_is_refused(tmp_path):
    copy = tmp_path / corpus.CORPUS_FILE.name
    with lzma.open(copy, "wt") as f:
        f.write(json.dumps({"prompt": "x", "prompt_ids": [1], "response_ids": [2]}) + "\n")
    shutil.copy(corpus.MANIFEST_FILE, tmp_path / corpus.MANIFEST_FILE.name)
    with pytest.raises(DFlashError, match="sha256"):
        corpus.load_corpus(copy)
    assert corpus.load_corpus(copy, verify=False)[0]["prompt"] == "x"


def test_packing_refuses_benchmark_prompts(tmp_path):
    answers = tmp_path / "a.jsonl"
    answers.write_text(json.dumps({"prompt": "Explain what a database index is and when it helps.",
                                   "prompt_ids": [1], "response_ids": [2]}) + "\n")
    with pytest.raises(DFlashError, match="benchmark"):
        corpus.pack(answers, tmp_path / "out")


def test_packing_keeps_each_prompts_first_answer(tmp_path):
    answers = tmp_path / "a.jsonl"
    rows = [("a", [2]), ("b", [3]), ("a", [4])]  # "a" answered twice (two writers on one file)
    answers.write_text("".join(json.dumps({"prompt": p, "prompt_ids": [1], "response_ids": r}) + "\n"
                               for p, r in rows))
    manifest = corpus.pack(answers, tmp_path / "out", name="t")
    packed = corpus.load_corpus(tmp_path / "out" / "t.jsonl.xz")
    assert [(r["prompt"], r["response_ids"]) for r in packed] == [("a", [2]), ("b", [3])]
    assert manifest["records"] == 2 and manifest["response_tokens"] == 2


def test_oneshot_dry_run_on_cpu_with_a_tiny_target(tmp_path, smol_dir):
    from transformers import AutoTokenizer

    from dflash.loading import load_drafter
    from dflash.train import oneshot
    from dflash.train.data import regenerate
    from dflash.train.sources import topic_prompts

    tiny = make_tiny_target(vocab=49152, context=256)
    tiny.tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    tiny.eos_ids = [2]
    target_dir = tmp_path / "tiny-target"
    tiny.model.save_pretrained(target_dir)
    tiny.tokenizer.save_pretrained(target_dir)
    prompts = [f"def f{i}(x):\n    \"\"\"Return x plus {i}.\"\"\"\n" for i in range(4)] + topic_prompts()[:8]
    regenerate(tiny, prompts, tmp_path / "answers.jsonl", max_new_tokens=24, batch_size=4)
    corpus.pack(tmp_path / "answers.jsonl", tmp_path / "corpus", name="tiny")

    export = tmp_path / "export"
    rc = oneshot.main(["--out", str(tmp_path / "run"), "--export", str(export), "--target", str(target_dir),
                       "--corpus", str(tmp_path / "corpus" / "tiny.jsonl.xz"), "--device", "cpu",
                       "--train-min", "0.15", "--init", "target", "--layers", "1", "--target-layer-ids", "0,2",
                       "--heldout", "2", "--eval-min", "0.05", "--seqs-per-step", "2", "--block-tokens", "256",
                       "--head-chunk-rows", "16", "--topk", "4", "--soft-mix", "0.3"])
    assert rc == 0
    summary = json.loads((export / "summary.json").read_text())
    assert summary["answers"] == 12 and summary["sequence_passes"] > 0 and summary["achieved_tflops"] > 0
    assert summary["evals"] and summary["best_heldout_tau"] >= 1.0
    for folder in ("drafter", "best"):
        drafter = load_drafter(export / folder)
        assert drafter.config.num_hidden_layers == 1
        lineage = json.loads((export / folder / "training.json").read_text())
        assert lineage[-1]["device_type"] == "cpu" and lineage[-1]["config"]["soft_mix"] == 0.3
    assert torch.isfinite(torch.tensor(summary["final_loss"]))
