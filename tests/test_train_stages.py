"""Training in stages on a tiny target: a run resumes from its checkpoint, a later stage
continues a saved drafter and its lineage (compute, τ history), the best drafter is kept;
and the fast τ simulator agrees with the engine's own τ on the same generations."""

import json

import torch

from dflash.train.features import DeviceFeatures, FeatureCache
from dflash.train.pipeline import drafter_config_for, new_drafter, starting_drafter
from dflash.train.trainer import LINEAGE_FILE, TrainConfig, train
from tests.conftest import make_tiny_target


def _records(target, n: int, new: int = 24) -> list[dict]:
    """The tiny target's own greedy answers to a few random prompts."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        prompt = torch.randint(5, 60, (4 + i % 3,), generator=gen)
        with torch.no_grad():
            ids = target.model.generate(prompt[None], max_new_tokens=new, do_sample=False, eos_token_id=None,
                                        pad_token_id=1)[0, len(prompt):]
        out.append({"prompt": f"p{i}", "prompt_ids": prompt.tolist(), "response_ids": ids.tolist()})
    return out


def _setup(tmp_path):
    target = make_tiny_target(vocab=64, context=96)
    target.eos_ids = [1]
    records = _records(target, 10)
    cache = FeatureCache(tmp_path / "features")
    cache.build(target, records, [0, 2])
    held = [{**s, "group": "code"} for s in cache.sequences if s["prompt"] in ("p0", "p1")]
    dcfg = drafter_config_for(target, layers=1, block_size=8, layer_ids=[0, 2], mask_token_id=3)
    return target, cache, held, dcfg


def test_resume_and_continue_across_stages(tmp_path):
    target, cache, held, dcfg = _setup(tmp_path)
    cfg = TrainConfig(epochs=2, lr=3e-3, seqs_per_step=2, eval_minutes=1e-6, checkpoint_minutes=100,
                      autocast=False, stage="one")
    drafter, lineage = starting_drafter(target, dcfg, "target", None, seed=0)
    first = train(drafter, target, cache, tmp_path / "run", cfg, heldout=held, lineage=lineage)
    per_epoch = (10 - 2) // 2
    assert first["step"] == 2 * per_epoch
    assert (tmp_path / "run" / "best" / "model.safetensors").is_file()
    assert first["best_tau"] == max(e["tau"] for e in first["evals"])

    # Same run directory, more epochs: continues from its checkpoint, not from scratch.
    drafter2, _ = starting_drafter(target, dcfg, "target", None, seed=0)
    more = train(drafter2, target, cache, tmp_path / "run", TrainConfig(**{**cfg.__dict__, "epochs": 3}),
                 heldout=held, lineage=lineage)
    assert more["step"] == 3 * per_epoch and more["sequences"] == 3 * per_epoch * 2
    assert more["evals"][: len(first["evals"])] == first["evals"]

    # A new stage elsewhere, from the saved drafter: its lineage carries the first stage's compute.
    saved = tmp_path / "run" / "drafter"
    lineage = json.loads((saved / LINEAGE_FILE).read_text())
    assert [s["stage"] for s in lineage] == ["initialised: target layers, target final norm", "one"]
    assert lineage[-1]["sequences"] == more["sequences"] and lineage[-1]["seconds"] > 0
    assert lineage[-1]["answers"] == 10 - 2  # the held-out answers are never trained on
    drafter3, lineage3 = starting_drafter(target, dcfg, "target", saved, seed=0)
    for a, b in zip(drafter3.state_dict().values(), drafter2.state_dict().values()):
        assert torch.allclose(a, b.to(torch.bfloat16).float())  # stored in bf16
    stage_two = TrainConfig(**{**cfg.__dict__, "epochs": 1, "stage": "two"})
    two = train(drafter3, target, cache, tmp_path / "run2", stage_two, heldout=held, lineage=lineage3)
    final = json.loads((tmp_path / "run2" / "drafter" / LINEAGE_FILE).read_text())
    assert [s["stage"] for s in final][-2:] == ["one", "two"] and final[-1]["steps"] == two["step"]


def test_a_time_budget_covers_the_whole_run_across_resumes(tmp_path):
    """Running a budgeted run again continues it within the same budget (and the same cosine),
    rather than granting a fresh budget; a larger budget trains on."""
    target, cache, held, dcfg = _setup(tmp_path)
    cfg = TrainConfig(epochs=2, lr=3e-3, seqs_per_step=2, checkpoint_minutes=100, autocast=False,
                      time_budget_s=1e-9, schedule_by_budget=True)
    drafter, _ = starting_drafter(target, dcfg, "target", None, seed=0)
    assert train(drafter, target, cache, tmp_path / "run", cfg)["step"] == 1  # the budget ends after a step
    again = train(starting_drafter(target, dcfg, "target", None, seed=0)[0], target, cache, tmp_path / "run", cfg)
    assert again["step"] == 1 and again["sequences"] == 2
    larger = TrainConfig(**{**cfg.__dict__, "time_budget_s": 1e9})
    more = train(starting_drafter(target, dcfg, "target", None, seed=0)[0], target, cache, tmp_path / "run", larger)
    assert more["step"] == 2 * (len(cache.sequences) // 2)  # both epochs, no held-out answers here


def test_a_shared_feature_cache_trains_only_the_runs_own_answers(tmp_path):
    target, cache, held, dcfg = _setup(tmp_path)  # the cache holds p0..p9; p0 and p1 are held out
    drafter = new_drafter(target, dcfg, "target", seed=0)
    cfg = TrainConfig(epochs=1, lr=3e-3, seqs_per_step=2, autocast=False, checkpoint_minutes=100)
    state = train(drafter, target, cache, tmp_path / "run", cfg, heldout=held, prompts={f"p{i}" for i in range(6)})
    lineage = json.loads((tmp_path / "run" / "drafter" / LINEAGE_FILE).read_text())
    assert lineage[-1]["answers"] == 4 and state["step"] == 2 and state["sequences"] == 4


def test_training_at_a_shorter_block_than_the_drafter_serves(tmp_path, monkeypatch):
    """`train_block` 4 on a block-8 drafter: every training block has 4 slots, the drafter
    keeps its own block size, and a block length it cannot serve is refused before work."""
    import pytest

    from dflash.errors import DFlashError
    from dflash.train import trainer

    target, cache, held, dcfg = _setup(tmp_path)
    built = []
    real = trainer.build_blocks
    monkeypatch.setattr(trainer, "build_blocks",
                        lambda ids, anchors, L, *a: built.append(L) or real(ids, anchors, L, *a))
    drafter = new_drafter(target, dcfg, "target", seed=0)
    state = train(drafter, target, cache, tmp_path / "run", TrainConfig(epochs=1, lr=3e-3, seqs_per_step=2,
                                                                        autocast=False, train_block=4,
                                                                        checkpoint_minutes=100))
    assert state["step"] == 5 and set(built) == {4}
    assert drafter.config.block_size == 8
    for bad in (1, 9):
        with pytest.raises(DFlashError, match="train_block"):
            trainer.training_block(TrainConfig(train_block=bad), dcfg)


def test_simulated_tau_equals_the_engines(tmp_path):
    """Greedy output is fixed, so replaying the loop from teacher-forced drafts must give the
    engine's accepted counts step for step."""
    from dflash.engine.engine import Engine, GenerationRequest

    target, cache, held, dcfg = _setup(tmp_path)
    drafter = new_drafter(target, dcfg, "target", seed=0)
    train(drafter, target, cache, tmp_path / "run", TrainConfig(epochs=8, lr=3e-3, seqs_per_step=2, autocast=False,
                                                                checkpoint_minutes=100))
    from dflash.train.simulate import simulate_tau

    engine = Engine(target, drafter.eval(), "tiny")
    gen = torch.Generator().manual_seed(1)
    records, engine_steps = [], []
    for i in range(4):
        prompt = torch.randint(5, 60, (5,), generator=gen).tolist()
        res = engine.generate(GenerationRequest(input_ids=prompt, max_new_tokens=20, block_size=8))
        records.append({"prompt": f"q{i}", "prompt_ids": prompt, "response_ids": res.output_ids})
        engine_steps += [s.accepted for s in res.stats.steps]
    store = DeviceFeatures().build(target, records, dcfg.target_layer_ids, min_response=1,
                                   feature_dtype=torch.float32)
    by_prompt = {s["prompt"]: s for s in store.sequences}
    seqs = [by_prompt[r["prompt"]] for r in records]
    sim = simulate_tau(drafter, target, store, seqs, max_new_tokens=20)
    assert sum(engine_steps) > 0, "the test needs some accepted drafts"
    assert sim["steps"] == len(engine_steps)
    assert abs(sim["tau"] - (sum(engine_steps) + len(engine_steps)) / len(engine_steps)) < 1e-9


def test_replay_by_hand():
    from dflash.train.simulate import replay

    ids = [7, 7, 10, 11, 12, 13, 14, 15, 2, 9]  # prompt [7, 7], answer from position 2, eos (2) at 8
    accepted = {2: 2, 5: 0, 6: 3}
    # start at 2 (first token from prefill): accept 2 -> 5, accept 0 -> 6, accept 3 commits 7, 8=eos, stop
    assert replay(ids, 2, accepted, 128, {2}) == [2, 0, 3]
    assert replay(ids, 2, accepted, 4, {2}) == [2]  # 1 + 3 tokens reach max_new_tokens 4


def test_model_card_tau_against_compute_from_the_lineage(tmp_path):
    from dflash.engine.drafter import init_random_drafter
    from dflash.train.card import card, compute_rows, main
    from dflash.train.trainer import save_with_lineage
    from tests.conftest import tiny_drafter_config

    lineage = [
        {"stage": "init"},
        {"stage": "gpu", "device": "H200", "device_type": "cuda", "seconds": 600, "sequences": 10, "blocks": 1000,
         "evals": [{"seconds": 300, "blocks": 500, "by_group": {"code": 1.5, "chat": 1.3}}],
         "yardstick": {"code": 1.6, "chat": 1.4, "prompts": {"code": 40, "chat": 40}}},
        {"stage": "cpu", "device": "cpu", "device_type": "cpu", "seconds": 7200, "cpu_seconds": 3600, "sequences": 5,
         "answers": 1234,
         "blocks": 200, "config": {"lr": 3e-4, "schedule": "constant", "weighting": "dpace", "max_anchors": 512,
                                   "loss_positions": 8, "autocast": True},
         "evals": [{"seconds": 0, "cpu_seconds": 0, "blocks": 0, "by_group": {"code": 1.55}},
                   {"seconds": 7200, "cpu_seconds": 3600, "blocks": 200, "by_group": {"code": 1.7, "chat": 1.45}}]},
    ]
    rows = compute_rows(lineage)
    assert [(round(r["gpu_min"], 1), round(r["cpu_core_h"], 2), r["blocks"]) for r in rows] == [
        (5.0, 0.0, 500), (10.0, 0.0, 1000), (10.0, 0.0, 1000), (10.0, 1.0, 1200)]
    assert rows[1]["bench"]["code"] == 1.6 and rows[3]["sim"]["chat"] == 1.45 and not rows[3]["bench"]

    folder = tmp_path / "drafter"
    save_with_lineage(init_random_drafter(tiny_drafter_config(vocab=64)), folder, lineage)
    bench = tmp_path / "bench" / "results.json"
    bench.parent.mkdir()
    bench.write_text(json.dumps({"command": "dflash bench ...", "results": [
        {"suite": "code", "method": "dflash-16", "tau": 1.812, "prompts": 40},
        {"suite": "chat", "method": "dflash-16", "tau": 1.5, "prompts": 40},
        {"suite": "code", "method": "ar", "tau": None, "prompts": 40}]}))
    dest = tmp_path / "asset"
    assert main(["--drafter", str(folder), "--bench", str(bench.parent), "--ship", "--dest", str(dest)]) == 0
    text = (dest / "README.md").read_text()
    assert "τ **1.81** on the first 40 HumanEval prompts, **1.50** on the first 40 chat" in text
    assert "| cpu | 10.0 | 1.00 | 1,200 | 1.70 | 1.45 | 1.81 | 1.50 |" in text
    assert "| 5 | 200 | 1,234 training answers, lr 0.0003 (constant), dpace weighting" in text
    assert json.loads((dest / LINEAGE_FILE).read_text())[-1]["yardstick"]["code"] == 1.812
    assert (dest / "model.safetensors").is_file() and text == card(dest)


def test_the_card_rounds_the_yardstick_once(tmp_path):
    """τ 1.2447 is 1.24 on the card: the lineage keeps 4 places, so the card's 2-place
    rounding is the only one (3 places stored 1.245, which printed as 1.25)."""
    from dflash.train.card import ASSET_DIR, card, read_bench

    bench = {"results": [{"suite": "chat", "method": "dflash-16", "tau": 1.2446527981248168, "prompts": 40},
                         {"suite": "chat", "method": "ar", "tau": None, "prompts": 40}]}
    (tmp_path / "results.json").write_text(json.dumps(bench))
    yard = read_bench(tmp_path)
    assert yard["chat"] == 1.2447 and yard["prompts"] == {"chat": 40}
    (tmp_path / "config.json").write_text((ASSET_DIR / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"x")
    (tmp_path / LINEAGE_FILE).write_text(json.dumps([{"stage": "s", "yardstick": yard}]))
    text = card(tmp_path)
    assert "**1.24** on the first 40 chat prompts" in text and "1.25" not in text
