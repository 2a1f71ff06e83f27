"""The drafter as one ONNX Runtime graph (dflash.engine.drafter_graph): in fp32 it computes
what the PyTorch drafter computes; int8 weights stay close; drafting with it keeps the
target's output, and the engine measures it beside the other precisions."""

import time

import pytest
import torch

from dflash.engine.drafter import init_random_drafter

pytest.importorskip("onnxruntime")


def _run(drafter, ctx, block, split=5):
    cache = drafter.new_cache()
    with torch.inference_mode():
        drafter(ctx[:, :split], block[:, :1], torch.arange(0, split + 1), cache)
        cache.length = split
        n = ctx.shape[1] - split
        return drafter(ctx[:, split:], block, torch.arange(split, split + n + block.shape[1]), cache)


@pytest.mark.parametrize("bits", [None, 8])
def test_the_graph_computes_the_drafters_step(bits):
    from dflash.engine.drafter_graph import build
    from dflash.engine.onnx_drafter import OnnxDrafter
    from tests.conftest import tiny_drafter_config

    cfg = tiny_drafter_config()
    drafter = init_random_drafter(cfg, seed=3, std=0.2).eval()
    state = {k: v for k, v in drafter.state_dict().items() if not k.startswith("rotary.")}
    graph = OnnxDrafter.from_bytes(build(cfg, state, bits=bits).SerializeToString(), cfg)
    ctx, block = torch.randn(1, 9, cfg.num_features * cfg.hidden_size), torch.randn(1, 4, cfg.hidden_size)
    got, want = _run(graph, ctx, block), _run(drafter, ctx, block)
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    if bits is None:
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    else:
        assert cos > 0.98
    cache_ref, cache_graph = drafter.new_cache(), graph.new_cache()  # the caches hold the same context rows
    with torch.inference_mode():
        drafter(ctx, block, torch.arange(0, 13), cache_ref)
    graph(ctx, block, torch.arange(0, 13), cache_graph)
    assert cache_graph.length == cache_ref.length == 9


def test_drafting_with_the_graph_keeps_the_output(tiny_engine):
    from dflash.engine.engine import Engine, GenerationRequest

    engine = Engine(tiny_engine.target, tiny_engine.drafter, "tiny-graph", draft_dtype="int8", draft_runtime="onnx",
                    cost_curve=tiny_engine.cost_curve)
    assert engine.draft_runtime == "onnx" and type(engine.dflash.current.model).__name__ == "OnnxDrafter"
    assert type(engine.dflash.current.head._linear).__name__ == "OnnxHead"  # the head in the same runtime
    for prompt in ([5, 6, 7], [9, 3, 4, 11]):
        plain = tiny_engine.generate(GenerationRequest(input_ids=prompt, max_new_tokens=16, block_size=1))
        for block in (4, None):
            got = engine.generate(GenerationRequest(input_ids=prompt, max_new_tokens=16, block_size=block))
            assert got.output_ids == plain.output_ids


def kind(dtype, runtime):
    """A draft_candidates entry as the DFlashProposer drafting it says: (int8, dtype, runtime)."""
    return dtype == torch.qint8, torch.float32 if dtype == torch.qint8 else dtype, runtime


def slow_drafts_but(monkeypatch, fast) -> list:
    """Every drafter precision and runtime drafts 60 ms slower than it does, except `fast` (an
    entry of draft_candidates): the one a measurement must choose, whatever this machine's
    own speeds. Returns the list of what drafted, in order (as `kind`)."""
    from dflash.engine.proposers.dflash import DFlashProposer

    drafted, draft_logits = [], DFlashProposer.draft_logits

    def slowed(self, jobs):
        drafted.append((self.int8, self.dtype, self.runtime))
        if drafted[-1] != kind(*fast):
            time.sleep(0.06)
        return draft_logits(self, jobs)

    monkeypatch.setattr(DFlashProposer, "draft_logits", slowed)
    return drafted


def test_auto_measures_every_drafter_runtime_and_takes_the_fastest(tiny_engine, monkeypatch):
    from dflash.engine.engine import Engine, draft_candidates

    candidates = draft_candidates(tiny_engine.target)
    assert (torch.qint8, "onnx") in candidates and len(candidates) >= 3
    fast = candidates[1]  # neither the first nor (below) the last: no default passes both
    drafted = slow_drafts_but(monkeypatch, fast)
    engine = Engine(tiny_engine.target, tiny_engine.drafter, "tiny-auto", draft_dtype="auto",
                    cost_curve=tiny_engine.cost_curve)
    assert (engine.draft_dtype, engine.draft_runtime) == fast
    assert set(drafted) == {kind(*c) for c in candidates}  # every one measured


def test_the_onnx_head_computes_the_draft_heads_logits():
    """The head of the ONNX Runtime drafter (8-bit weights, int8 activations) stays close to
    the fp32 head over a draft vocabulary, and picks the same token where one clearly leads."""
    from dflash.engine.proposers.dflash import DraftHead

    torch.manual_seed(0)
    weight, vocab = torch.randn(300, 64), torch.tensor([3, 7, 11, 250, 299, 0])
    fp32 = DraftHead(weight, vocab, torch.float32, int8=False)
    onnx = DraftHead(weight, vocab, torch.float32, int8=True, runtime="onnx")
    hidden = torch.randn(5, 64)
    hidden[0] = weight[250] * 3  # token 250 (draft row 3) clearly leads
    got, want = onnx(hidden), fp32(hidden)
    assert got.shape == want.shape == (5, 6) and got.dtype == torch.float32
    assert (got - want).norm() / want.norm() < 0.03
    assert int(got[0].argmax()) == int(want[0].argmax()) == 3 and onnx.token_ids(got[0].argmax()) == 250


def test_the_drafter_runtime_is_timed_with_the_verify_that_follows(tiny_engine, monkeypatch):
    """A runtime whose threads spin on after a draft slows the target's next forward, which the
    draft's own time does not show: each timed draft is followed by a verify of its block."""
    from dflash.engine.engine import draft_candidates, fastest_draft

    target = tiny_engine.target
    calls = []
    forward = target.forward_batch

    def spy(rows, layers=()):
        calls.append(sum(len(r.ids) for r in rows))
        return forward(rows, layers)

    candidates = draft_candidates(target)
    monkeypatch.setattr(target, "forward_batch", spy)
    drafted = slow_drafts_but(monkeypatch, candidates[-1])
    assert fastest_draft(target, tiny_engine.drafter, None, repeats=3) == candidates[-1]
    assert calls.count(4) == 3 * len(candidates)  # a verify of 4 after every timed draft
    # Round by round, every candidate once in turn: a slow moment of the machine costs each
    # candidate one sample, never one candidate all of its samples.
    assert drafted == [kind(*c) for c in candidates] * 3
