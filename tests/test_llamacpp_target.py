"""The llama.cpp target backend (dflash.engine.target.llamacpp): the shipped Q4_1 GGUF behind
the Target protocol. A packed forward of several sequences equals each alone, rollback
equals never having cached the rejected rows, and greedy decoding with drafts (fixed block
sizes and auto) is exactly the same backend's plain greedy output. Bad model files are
clean errors naming the file."""

import pytest
import torch

from dflash.engine.target import llamacpp
from dflash.engine.target.protocol import TargetRow
from dflash.errors import DFlashError


@pytest.fixture(scope="module", autouse=True)
def _needs_llamacpp():
    """make setup installs llama-cpp-python: missing under CI is a failure, elsewhere a skip."""
    from tests.conftest import unavailable

    if not llamacpp.available():
        unavailable("llama-cpp-python", "not installed (make setup)")


LAYERS = (1, 9, 18, 27)  # the default drafter's


@pytest.fixture(scope="module")
def gguf():
    from dflash.model_files import default_target_gguf

    return default_target_gguf()


@pytest.fixture(scope="module")
def lc_target(gguf, smol_dir):
    return llamacpp.LlamaCppTarget(gguf, smol_dir, threads=2, context=2048)


@pytest.fixture(scope="module")
def lc_engine(lc_target, shared):
    from dflash.engine.engine import Engine
    from dflash.loading import load_drafter
    from dflash.model_files import default_drafter_dir
    from tests.conftest import cpu_like_costs

    drafter_dir, _ = default_drafter_dir()
    return Engine(lc_target, load_drafter(drafter_dir), "default-drafter", cost_curve=cpu_like_costs(16))


def _ids(n, offset=0):
    return [(1000 + 37 * i + offset) % 49000 for i in range(n)]


def test_a_packed_forward_equals_each_sequence_alone(lc_target):
    t = lc_target
    a, b = t.new_sequence(), t.new_sequence()
    pa, pb = _ids(40), _ids(23, 5)
    out = t.forward_batch([TargetRow(a, pa, 1), TargetRow(b, pb, 1)], LAYERS)
    assert [x.shape for x in out.logits] == [(1, t.vocab_size)] * 2
    assert out.features[0].shape == (40, 4 * t.hidden_size) and out.features[1].shape == (23, 4 * t.hidden_size)
    step = t.forward_batch([TargetRow(a, _ids(5, 9), 5), TargetRow(b, _ids(3, 7), 3)], LAYERS)
    assert (a.length, b.length) == (45, 26)
    for seq_ids, logits, feats in ((pa + _ids(5, 9), step.logits[0], step.features[0]),
                                   (pb + _ids(3, 7), step.logits[1], step.features[1])):
        alone = t.new_sequence()
        ref = t.forward_batch([TargetRow(alone, seq_ids, len(logits))], LAYERS)
        t.free(alone)
        assert torch.equal(ref.logits[0].argmax(-1), logits.argmax(-1))
        assert torch.equal(ref.logits[0], logits)
        assert torch.equal(ref.features[0][-len(feats):], feats)
    t.free(a)
    t.free(b)


def test_every_row_is_bit_identical_however_the_forward_is_cut(lc_target):
    """Batch invariance: one token at a time, chunks of any size, a forward longer than one
    call and two sequences sharing calls all give the very same numbers."""
    t = lc_target
    ids = _ids(100)

    def run(chunks, seqs=1):
        out, lg, k = [], [], 0
        rows = [t.new_sequence() for _ in range(seqs)]
        for c in chunks:
            o = t.forward_batch([TargetRow(s, ids[k:k + c], c) for s in rows], (9,))
            out.append(o.features[-1])
            lg.append(o.logits[-1])
            k += c
        for s in rows:
            t.free(s)
        return torch.cat(out), torch.cat(lg)

    ref = run([1] * 100)
    for chunks, seqs in (([100], 1), ([17, 33, 50], 1), ([63, 37], 1), ([5] * 20, 2), ([40, 60], 3)):
        got = run(chunks, seqs)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (chunks, seqs)


def test_rollback_equals_never_caching_the_rejected_rows(lc_target):
    t = lc_target
    s = t.new_sequence()
    prompt = _ids(30)
    t.forward_batch([TargetRow(s, prompt, 1)])
    t.forward_batch([TargetRow(s, _ids(6, 3), 6)])
    t.rollback(s, 32)  # two of the six kept
    assert s.length == 32
    again = t.forward_batch([TargetRow(s, [77, 78], 2)], LAYERS)
    fresh = t.new_sequence()
    ref = t.forward_batch([TargetRow(fresh, prompt + _ids(6, 3)[:2] + [77, 78], 2)], LAYERS)
    assert torch.equal(again.logits[0], ref.logits[0])
    assert torch.equal(again.features[0], ref.features[0][-2:])
    t.free(s)
    t.free(fresh)


def test_a_forward_longer_than_one_llama_batch_is_split(lc_target):
    t = lc_target
    s, ref = t.new_sequence(), t.new_sequence()
    long = _ids(llamacpp.BATCH_TOKENS + 100)
    out = t.forward_batch([TargetRow(s, long, 3)], LAYERS)
    assert out.logits[0].shape == (3, t.vocab_size) and out.features[0].shape[0] == len(long)
    assert s.length == len(long)
    part = t.forward_batch([TargetRow(ref, long[:200], 0)], LAYERS)
    assert part.logits[0].shape == (0, t.vocab_size)
    assert torch.equal(part.features[0], out.features[0][:200])
    t.free(s)
    t.free(ref)


@pytest.fixture(scope="module")
def plain_output(lc_engine):
    """plain_output(prompt, n): the backend's own greedy output (block size 1, alone), made
    once per module."""
    from dflash.engine.engine import GenerationRequest

    made = {}

    def output(prompt: str, n: int) -> list[int]:
        if (prompt, n) not in made:
            req = GenerationRequest(prompt=prompt, max_new_tokens=n, block_size=1, chat=True)
            made[prompt, n] = lc_engine.generate(req).output_ids
        return made[prompt, n]

    return output


@pytest.mark.parametrize("block", [16, None])
def test_greedy_with_drafts_is_the_backends_plain_greedy_output(lc_engine, plain_output, block):
    from dflash.engine.engine import GenerationRequest

    for prompt in ("Write a Python function that reverses a string.", "What is a database index?"):
        got = lc_engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=40, block_size=block, chat=True))
        assert got.output_ids == plain_output(prompt, 40), (prompt, block)
    batch = lc_engine.generate_many([GenerationRequest(prompt=p, max_new_tokens=24, block_size=block, chat=True)
                                     for p in ("Name three colours.", "Count to five.", "Say hello.")])
    for res, p in zip(batch, ("Name three colours.", "Count to five.", "Say hello.")):
        assert res.output_ids == plain_output(p, 24)


def test_bad_model_files_are_clean_errors_naming_the_file(tmp_path, smol_dir, lc_target):
    from tests.conftest import assert_bad_target

    corrupt = tmp_path / "broken.gguf"
    corrupt.write_bytes(b"GGUF" + b"\0" * 64)
    for path in (corrupt, tmp_path / "missing.gguf"):
        assert_bad_target(lambda: llamacpp.LlamaCppTarget(path, smol_dir, threads=1), path)
    seq = lc_target.new_sequence()
    with pytest.raises(DFlashError) as err:  # the last layer's output has no layer input to capture
        lc_target.forward_batch([TargetRow(seq, [1, 2], 1)], (lc_target.num_layers - 1,))
    assert err.value.code == "incompatible_drafter"
    lc_target.free(seq)
