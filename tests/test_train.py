"""`dflash train` pieces on a tiny random target: the objective's blocks, anchors and
labels, the block-sparse forward against the engine drafter's dense-mask forward, the loss
going down, and the checkpoint loading back through the engine's loader."""

import json

import pytest
import torch

from dflash.loading import load_drafter
from dflash.engine.engine import Engine, GenerationRequest
from dflash.train.data import collect_prompts, excluded_prompts, load_records
from dflash.train.features import FeatureCache
from dflash.suites import HERE as PROMPTS_DIR
from dflash.train.blockwise import forward_blocks
from dflash.train.objective import build_blocks, sample_anchors, slot_weights
from dflash.train.pipeline import drafter_config_for, init_from_target
from dflash.train.trainer import TrainConfig, train
from tests.conftest import make_tiny_target, tiny_drafter_config, unavailable


def test_blocks_mask_labels_and_weights():
    ids = torch.arange(100, 120)  # 20 tokens
    anchors = torch.tensor([5, 12])
    b = build_blocks(ids, anchors, 4, 3, slot_weights(4, "decay", 7.0, None))
    assert b.block_ids.tolist() == [[105, 3, 3, 3], [112, 3, 3, 3]]
    assert b.labels.tolist() == [[-100, 106, 107, 108], [-100, 113, 114, 115]]
    assert b.positions.tolist() == [[5, 6, 7, 8], [12, 13, 14, 15]]
    m = b.dense_mask()
    assert m[0, :20].tolist() == [True] * 5 + [False] * 15  # context strictly before anchor 5
    assert m[4, :20].tolist() == [True] * 12 + [False] * 8
    assert m[1, 20:].tolist() == [True] * 4 + [False] * 4  # own block only, bidirectional
    assert m[6, 20:].tolist() == [False] * 4 + [True] * 4
    assert torch.allclose(b.weights[0, 1:], torch.exp(-torch.tensor([0.0, 1.0, 2.0]) / 7.0))
    # labels past the end get no loss
    b = build_blocks(ids, torch.tensor([18]), 4, 3, slot_weights(4, "decay", 7.0, None))
    assert b.labels.tolist() == [[-100, 119, -100, -100]] and b.weights[0, 2:].sum() == 0
    # fewer loss positions: slots past them carry no label and no weight (no LM head there)
    b = build_blocks(ids, anchors, 4, 3, slot_weights(4, "uniform", None, 2))
    assert b.labels.tolist() == [[-100, 106, 107, -100], [-100, 113, 114, -100]]
    assert b.weights.tolist() == [[0, 1, 1, 0], [0, 1, 1, 0]]


def test_anchors_every_response_position_with_a_loss_label():
    # 50 tokens, response from 20: anchors 20..48 (the anchor a response token, its first label too)
    a = sample_anchors(50, 20, 512)
    assert a.tolist() == list(range(20, 49))
    gen = torch.Generator().manual_seed(0)
    capped = sample_anchors(50, 20, 10, gen)
    assert len(capped) == 10 and set(capped.tolist()) <= set(range(20, 49))
    assert torch.equal(capped, capped.sort().values)
    assert not torch.equal(capped, sample_anchors(50, 20, 10, gen))  # a fresh subset per call
    # only positions whose label is a loss token: a masked-out stretch inside the response
    loss = torch.zeros(50, dtype=torch.bool)
    loss[20:30] = True
    loss[35:] = True
    a = sample_anchors(50, 20, 512, loss_mask=loss).tolist()
    assert a == list(range(20, 29)) + list(range(35, 49))
    assert len(sample_anchors(21, 20, 512)) == 0  # one response token: nothing to predict


def test_benchmark_prompts_are_excluded():
    excluded = excluded_prompts()
    assert "Explain what a database index is and when it helps." in excluded
    assert not excluded & set(collect_prompts())


def test_answers_on_a_backend_without_generate_are_its_plain_greedy_output(tmp_path, smol_dir):
    """A target that has no transformers generate (llama.cpp here) answers through the
    engine's plain decoding on its own backend, batched: each answer is what that backend
    decodes for the prompt alone, cut at its end of turn (next_head --prompts on a CPU)."""
    from dflash.engine.target import llamacpp
    from dflash.loading import load_target
    from dflash.model_files import default_target_gguf
    from dflash.train.data import regenerate

    if not llamacpp.available():
        unavailable("llama-cpp-python", "not installed (make setup)")
    target = load_target(smol_dir, "llamacpp", gguf=default_target_gguf())
    prompts = ["Name a colour.", "Write a haiku about tables.", "What is 2 + 2?"]
    regenerate(target, prompts, tmp_path / "answers.jsonl", max_new_tokens=24, batch_size=2)
    records = load_records(tmp_path / "answers.jsonl")
    assert sorted(r["prompt"] for r in records) == sorted(prompts)
    plain = Engine(target, None, "none")
    for r in records:
        alone = plain.generate(GenerationRequest(input_ids=r["prompt_ids"], max_new_tokens=24, block_size=1)).output_ids
        ends = [i for i, t in enumerate(alone) if t in target.eos_ids]
        assert r["response_ids"] == (alone[: ends[0] + 1] if ends else alone)
    target.close()


def test_training_lowers_loss_and_round_trips(tmp_path, smol_dir):
    from transformers import AutoTokenizer

    from dflash.errors import DFlashError
    from dflash.train.data import regenerate, sole_writer

    target = make_tiny_target(vocab=49152, context=256)
    target.tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    target.eos_ids = [2]
    prompts = ["Say something.", "Count to five.", "Name a colour.", "Tell a joke."]
    regenerate(target, prompts, tmp_path / "data.jsonl", max_new_tokens=40, batch_size=2)
    regenerate(target, prompts, tmp_path / "data.jsonl", max_new_tokens=40, batch_size=2)  # resumes: no dupes
    with sole_writer(tmp_path / "data.jsonl"), pytest.raises(DFlashError, match="another process is writing"):
        regenerate(target, prompts + ["One more."], tmp_path / "data.jsonl", max_new_tokens=40, batch_size=2)
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
    # fp32, as tests/test_train_stages.py trains: bf16 autocast (the default) on a CPU without native
    # bf16 takes several times as long here; training under autocast runs in
    # tests/test_train_oneshot.py's dry run (the oneshot's default).
    cfg = TrainConfig(epochs=15, lr=3e-3, seqs_per_step=2, checkpoint_minutes=100, autocast=False)
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


def _random_blocks(seed: int, T: int, response_start: int, L: int = 4):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(20, 60, (T,), generator=gen)
    return build_blocks(ids, sample_anchors(T, response_start, 512), L, 3, slot_weights(L, "decay", None, None))


def test_block_sparse_forward_equals_the_engine_drafters_dense_mask_forward():
    from dflash.engine.drafter import init_random_drafter

    torch.manual_seed(0)
    dcfg = tiny_drafter_config(vocab=64, block_size=4)
    drafter = init_random_drafter(dcfg, seed=1, std=0.2).eval()
    width = dcfg.num_features * dcfg.hidden_size
    embed = torch.randn(64, dcfg.hidden_size)
    seqs = [(_random_blocks(s, T, rs), torch.randn(T, width)) for s, T, rs in ((0, 12, 3), (1, 20, 5))]
    with torch.no_grad():
        alone = []
        for b, f in seqs:
            positions = torch.cat((torch.arange(b.n_ctx), b.positions.reshape(-1)))
            ref = drafter(f[None], embed[b.block_ids.reshape(-1)][None], positions, attn_mask=b.dense_mask())[0]
            out = forward_blocks(drafter, f[None], embed[b.block_ids][None], b.anchors[None])[0]
            assert torch.allclose(out.reshape(ref.shape), ref, atol=1e-5)
            alone.append(out)
        # two sequences padded into one batch: each block's output is what it is alone
        A = max(len(b.anchors) for b, _ in seqs)
        feats = torch.zeros(2, 20, width)
        embeds = torch.zeros(2, A, 4, dcfg.hidden_size)
        anchors = torch.zeros(2, A, dtype=torch.long)
        for i, (b, f) in enumerate(seqs):
            n = len(b.anchors)
            feats[i, : len(f)], embeds[i, :n], anchors[i, :n] = f, embed[b.block_ids], b.anchors
        batched = forward_blocks(drafter, feats, embeds, anchors)
    for i, (b, _) in enumerate(seqs):
        assert torch.allclose(batched[i, : len(b.anchors)], alone[i], atol=1e-5)


def test_batched_features_equal_one_sequence_at_a_time(tmp_path):
    target = make_tiny_target(vocab=64, context=96)
    gen = torch.Generator().manual_seed(0)
    records = [{"prompt": f"p{i}", "prompt_ids": torch.randint(2, 64, (3 + i,), generator=gen).tolist(),
                "response_ids": torch.randint(2, 64, (5 + 3 * i,), generator=gen).tolist()} for i in range(6)]
    cache = FeatureCache(tmp_path / "f")
    cache.build(target, records[:2], [0, 2], batch_tokens=64)
    cache = FeatureCache(tmp_path / "f")  # reopened: resumes after the first two
    cache.build(target, records, [0, 2], batch_tokens=64)
    assert sorted(s["prompt"] for s in cache.sequences) == sorted(r["prompt"] for r in records)
    for seq in cache.sequences:
        _, ref = target.forward(torch.tensor(seq["ids"]), target.new_cache(), [0, 2])
        assert torch.allclose(cache.features(seq), ref.to(torch.bfloat16).float(), atol=2e-2, rtol=2e-2)


def test_sources_are_varied_and_humaneval_shaped():
    from dflash.train import sources

    shaped = [p for p in sources.stdlib_prompts() if p.startswith("def ")]
    assert len(shaped) > 200
    compile(shaped[0] + "    pass\n", "<prompt>", "exec")  # a signature and docstring, like HumanEval
    topics = sources.topic_prompts()
    assert len(topics) >= 10 * len(sources._lines(sources.TOPIC_FILE))
    chat = {line.strip().lower() for line in (PROMPTS_DIR / "chat.txt").read_text().splitlines()}
    assert not any(t.lower() in p for t in sources._lines(sources.TOPIC_FILE) for p in chat if len(t) > 8)


def test_prompt_file_round_trip_drops_benchmark_prompts(tmp_path):
    from dflash.train.data import read_prompt_file, write_prompt_file

    bench = "Explain what a database index is and when it helps."
    write_prompt_file(["a\nmulti-line prompt", bench, "Tell me about owls."], tmp_path / "p.jsonl")
    assert read_prompt_file(tmp_path / "p.jsonl") == ["a\nmulti-line prompt", "Tell me about owls."]


def test_ar_assistant_trains_and_materialises(tmp_path):
    from transformers import AutoModelForCausalLM

    from dflash.train.assistant import build_assistant, materialize_assistant, train_assistant

    target = make_tiny_target(vocab=64, context=96)
    gen = torch.Generator().manual_seed(0)
    records = [{"prompt": f"p{i}", "prompt_ids": [5, 6, 7],
                "response_ids": (torch.arange(10, 30) + i % 3).tolist()} for i in range(12)]
    model = build_assistant(target.model, layers=2)
    frozen = model.get_input_embeddings().weight.clone()
    state = train_assistant(model, records, tmp_path / "run", lr=3e-3, seqs_per_step=4, epochs=10)
    losses = [l for _, _, l in state["losses"]]
    assert losses[-1] < 0.5 * losses[0]
    assert torch.equal(model.get_input_embeddings().weight, frozen)  # the target's embedding stays as it was
    out = materialize_assistant(tmp_path / "run" / "assistant", target.model, tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.tensor([[5, 6, 7, 10, 11]])
    with torch.no_grad():
        for name, p in model.named_parameters():  # stored layers are bf16: compare like with like
            if name.startswith(("model.layers.", "model.norm.")):
                p.copy_(p.to(torch.bfloat16).float())
        assert torch.allclose(loaded(x).logits, model.eval()(x).logits, atol=1e-4)
    assert loaded.config.num_hidden_layers == 2
