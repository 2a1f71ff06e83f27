"""Draft vocabularies (dflash.engine.draft_vocab, dflash.train.draft_vocab): K chosen by
held-out coverage, read back with clean errors, and drafting over one keeps the output (the
target verifies): greedy equals plain greedy, drafts come from the vocabulary only."""

import json

import pytest
import torch

from dflash.engine import draft_vocab
from dflash.errors import DFlashError


def _records(n=200):
    # token t appears with a frequency falling in t; token 47 only in the held-out tenth
    out = []
    for i in range(n):
        ids = [t for t in range(40) for _ in range(max(40 - t, 1) // 8 + 1)]
        if i % 10 == 0:
            ids.append(47)
        out.append({"response_ids": ids})
    return out


def test_k_is_the_smallest_step_that_covers_the_held_out_answers(monkeypatch):
    from dflash.train import draft_vocab as make

    monkeypatch.setattr(make, "STEP", 8)
    got = make.choose(_records(), 0.9, always=[2, 45])
    curve = {int(k): v for k, v in got["coverage_curve"].items()}
    k = min(n for n, c in curve.items() if c >= 0.9)
    assert got["held_out_coverage"] >= 0.9 and got["token_ids"][:k] == list(range(k))
    assert 45 in got["token_ids"] and 2 in got["token_ids"]  # stop tokens always in
    assert len(set(got["token_ids"])) == len(got["token_ids"]) == got["k"]
    assert make.choose(_records(), 0.9, always=[], k=5)["token_ids"] == list(range(5))


def test_reading_a_draft_vocabulary(tmp_path):
    path = draft_vocab.write(tmp_path, [5, 3, 9], {"source": "test"})
    assert draft_vocab.read(path) == [5, 3, 9] == draft_vocab.read(tmp_path) == draft_vocab.for_drafter(tmp_path)
    assert draft_vocab.for_drafter(tmp_path, "full") is None and draft_vocab.for_drafter(tmp_path / "none") is None
    for bad in ("{not json", json.dumps({"format": "other", "token_ids": [1]}),
                json.dumps({"format": draft_vocab.FORMAT, "token_ids": [1, -2]}),
                json.dumps({"format": draft_vocab.FORMAT, "token_ids": []})):
        path.write_text(bad)
        with pytest.raises(DFlashError) as err:
            draft_vocab.read(path)
        assert err.value.code == "bad_drafter" and str(path) in err.value.message
    with pytest.raises(DFlashError):
        draft_vocab.for_drafter(tmp_path, str(tmp_path / "missing.json"))


def test_the_engine_refuses_a_vocabulary_that_does_not_fit(tiny_engine):
    from dflash.engine.engine import Engine

    for bad in ([1, 1, 2], [0, 48], []):
        with pytest.raises(DFlashError) as err:
            Engine(tiny_engine.target, tiny_engine.drafter, "tiny", draft_vocab=bad)
        assert err.value.code == "bad_drafter"


def test_the_shipped_drafter_has_a_measured_vocabulary():
    from dflash.model_files import SHIPPED_DRAFTER

    data = json.loads((SHIPPED_DRAFTER / draft_vocab.FILE).read_text())
    assert data["held_out_coverage"] >= data["target_coverage"] >= 0.99
    assert data["k"] == len(data["token_ids"]) < 49152 and 2 in data["token_ids"]  # <|im_end|>


@pytest.mark.parametrize("dtype", [None, "int8"])
def test_drafting_over_a_vocabulary_keeps_the_output(tiny_engine, dtype):
    from dflash.engine.engine import Engine, GenerationRequest

    vocab = list(range(0, 48, 2))  # half the tiny vocabulary
    engine = Engine(tiny_engine.target, tiny_engine.drafter, "tiny-vocab", draft_vocab=vocab, draft_dtype=dtype,
                    cost_curve=tiny_engine.cost_curve)
    for prompt in ([5, 6, 7], [9, 3, 4, 11]):
        plain = tiny_engine.generate(GenerationRequest(input_ids=prompt, max_new_tokens=20, block_size=1))
        state = engine.start(GenerationRequest(input_ids=prompt, max_new_tokens=20, block_size=4))
        while not state.done:
            for res in engine.step([state]):
                assert set(res.draft_ids) <= set(vocab)
        assert engine.finish(state).output_ids == plain.output_ids


def test_a_draft_over_a_vocabulary_is_a_distribution_over_the_targets():
    """What the probabilistic verify rule gets: the draft vocabulary's distribution placed on
    the target's ids (zero elsewhere), and sampled tokens that are target ids."""
    from types import SimpleNamespace

    from dflash.engine.proposers.dflash import DraftHead, _draft
    from dflash.engine.sampling import SamplingParams

    vocab = torch.tensor([7, 3, 11])
    head = DraftHead(torch.randn(16, 4), vocab, torch.float32, int8=False)
    logits = head(torch.randn(5, 4))
    assert logits.shape == (5, 3)
    state = SimpleNamespace(policy=object(), params=SamplingParams(temperature=1.0, verify="probabilistic"),
                            generator=torch.Generator().manual_seed(0))
    d = _draft(logits, state, head, 16)
    assert d.probs.shape == (5, 16) and torch.allclose(d.probs.sum(-1), torch.ones(5))
    assert torch.all(d.probs[:, [i for i in range(16) if i not in (7, 3, 11)]] == 0)
    assert set(d.tokens.tolist()) <= {7, 3, 11} and torch.all(d.probs[torch.arange(5), d.tokens] > 0)
    assert torch.allclose(d.probs[:, vocab], logits.softmax(-1))
    state.params = SamplingParams()
    greedy = _draft(logits, state, head, 16)
    assert greedy.tokens.tolist() == vocab[logits.argmax(-1)].tolist() and greedy.probs is None
