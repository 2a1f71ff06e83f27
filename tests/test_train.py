"""`dflash train` pieces on a tiny random target: the objective's masks and labels, the
loss going down, and the checkpoint loading back through the engine's loader."""

import json

import torch

from dflash.engine.drafter import load_drafter
from dflash.engine.engine import Engine, GenerationRequest
from dflash.train.data import collect_prompts, excluded_prompts, load_records
from dflash.train.features import FeatureCache
from dflash.train.objective import build_blocks, sample_anchors
from dflash.train.pipeline import drafter_config_for, init_from_target
from dflash.train.trainer import TrainConfig, train
from tests.conftest import make_tiny_target


def test_blocks_mask_labels_and_weights():
    ids = torch.arange(100, 120)  # 20 tokens
    anchors = torch.tensor([5, 12])
    b = build_blocks(ids, anchors, block_size=4, mask_id=3, gamma=7.0)
    assert b.block_ids.tolist() == [105, 3, 3, 3, 112, 3, 3, 3]
    assert b.labels.tolist() == [-100, 106, 107, 108, -100, 113, 114, 115]
    assert b.positions[20:].tolist() == [5, 6, 7, 8, 12, 13, 14, 15]
    m = b.attn_mask
    assert m[0, :20].tolist() == [True] * 5 + [False] * 15  # context strictly before anchor 5
    assert m[4, :20].tolist() == [True] * 12 + [False] * 8
    assert m[1, 20:].tolist() == [True] * 4 + [False] * 4  # own block only, bidirectional
    assert m[6, 20:].tolist() == [False] * 4 + [True] * 4
    assert torch.allclose(b.weights[1:4], torch.exp(-torch.tensor([0.0, 1.0, 2.0]) / 7.0))
    # labels past the end get no loss
    b = build_blocks(ids, torch.tensor([18]), block_size=4, mask_id=3, gamma=7.0)
    assert b.labels.tolist() == [-100, 119, -100, -100] and b.weights[2:].sum() == 0


def test_anchors_are_response_positions():
    gen = torch.Generator().manual_seed(0)
    a = sample_anchors(50, 20, 16, 10, gen)
    assert len(a) == 10 and a.min() >= 19 and a.max() <= 48 and torch.equal(a, a.sort().values)


def test_benchmark_prompts_are_excluded():
    excluded = excluded_prompts()
    assert "Explain what a database index is and when it helps." in excluded
    assert not excluded & set(collect_prompts())


def test_training_lowers_loss_and_round_trips(tmp_path, smol_dir):
    from transformers import AutoTokenizer

    from dflash.train.data import regenerate

    target = make_tiny_target(vocab=49152, context=256)
    target.tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    target.eos_ids = [2]
    prompts = ["Say something.", "Count to five.", "Name a colour.", "Tell a joke."]
    regenerate(target, prompts, tmp_path / "data.jsonl", max_new_tokens=40, batch_size=2)
    regenerate(target, prompts, tmp_path / "data.jsonl", max_new_tokens=40, batch_size=2)  # resumes: no dupes
    records = load_records(tmp_path / "data.jsonl")
    assert sorted(r["prompt"] for r in records) == sorted(prompts)
    dcfg = drafter_config_for(target, layers=1, block_size=8, layer_ids=[0, 2], mask_token_id=16)
    cache = FeatureCache(tmp_path / "features")
    cache.build(target, records, dcfg.target_layer_ids)
    seq = cache.sequences[0]
    assert cache.features(seq).shape == (len(seq["ids"]), 2 * 32)

    from dflash.engine.drafter import init_random_drafter

    drafter = init_random_drafter(dcfg, seed=0)
    init_from_target(drafter, target)
    cfg = TrainConfig(epochs=15, lr=3e-3, num_anchors=8, seqs_per_step=2, checkpoint_minutes=100)
    state = train(drafter, target, cache, tmp_path / "run", cfg)
    losses = [l for _, _, l in state["losses"]]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    assert (tmp_path / "run" / "loss.png").stat().st_size > 0
    assert json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())["block_size"] == 8

    loaded = load_drafter(tmp_path / "run" / "drafter")
    engine = Engine(target, loaded, "trained-tiny")
    res = engine.generate(GenerationRequest(prompt="Say something.", chat=True, max_new_tokens=10))
    assert len(res.output_ids) >= 1

    # resuming a finished run does no more steps
    again = train(load_drafter(tmp_path / "run" / "drafter"), target, cache, tmp_path / "run", cfg)
    assert again["step"] == state["step"]
