"""The next-token head (dflash.engine.proposers.head): its file, its guess, the policy's use
of it, and the engine's output with it (greedy: the target's; sampled: the target's law)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dflash.engine.engine import GenerationRequest
from dflash.engine.proposers import head as head_mod
from dflash.errors import DFlashError
from tests.test_sampling import chi_square_ok, two_token_law

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


def _random_head(folder, target, vocab=None, seed=0, backends=("hf",)):
    torch.manual_seed(seed)
    H = target.hidden_size
    head = head_mod.NextHead(H, torch.rand(H) + 0.5)
    with torch.no_grad():
        head.proj.weight.normal_(0, 0.5)
    vocab = list(range(2, target.vocab_size)) if vocab is None else vocab
    head_mod.save(folder, head, vocab, {"target": target.name, "backends": list(backends),
                                        "layer": target.num_layers - 1})
    return head, vocab


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny target and drafter with a random head made for them (backend hf)."""
    from dflash.engine.drafter import init_random_drafter
    from dflash.engine.engine import Engine
    from tests.conftest import cpu_like_costs, make_tiny_target, tiny_drafter_config

    target = make_tiny_target()
    folder = tmp_path_factory.mktemp("head")
    _random_head(folder, target)
    engine = Engine(target, init_random_drafter(tiny_drafter_config(), seed=1, std=0.3), "tiny-drafter",
                    cost_curve=cpu_like_costs(), head_dir=folder)
    return engine, folder


def test_a_head_file_reads_back_and_a_bad_one_is_a_clean_error(tmp_path, tiny):
    engine, folder = tiny
    w = head_mod.load(folder)
    H = engine.target.hidden_size
    assert w.proj.shape == (H, 2 * H) and w.vocab[0] == 2 and head_mod.fits(w, engine.target)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / head_mod.CONFIG_FILE).write_text((folder / head_mod.CONFIG_FILE).read_text())
    (bad / head_mod.WEIGHTS_FILE).write_bytes(b"not safetensors")
    with pytest.raises(DFlashError) as err:
        head_mod.load(bad)
    assert err.value.code == "bad_head" and str(bad) in err.value.message
    (bad / head_mod.WEIGHTS_FILE).write_bytes((folder / head_mod.WEIGHTS_FILE).read_bytes())
    (bad / head_mod.CONFIG_FILE).write_text(json.dumps({"format": 99}))
    with pytest.raises(DFlashError, match="not a next-token head"):
        head_mod.load(bad)


def test_a_head_loads_only_for_its_target_and_backends(tmp_path, tiny):
    engine, _ = tiny
    _random_head(tmp_path / "ort-only", engine.target, backends=("ort",))
    assert head_mod.for_target(engine.target, tmp_path / "ort-only") is None
    assert head_mod.for_target(engine.target, tmp_path / "nothing-here") is None
    assert engine.proposer("head") is not None


@pytest.mark.parametrize("bits", [None, 8])
def test_the_guess_is_the_trained_modules_argmax_with_its_softmax_peak(tmp_path, tiny, bits):
    """Inference (its ONNX Runtime graph, fp32) computes what training (the torch module) does;
    with 8-bit weights (what the engine runs) nearly so."""
    engine, _ = tiny
    target = engine.target
    head, vocab = _random_head(tmp_path / "h", target, vocab=[9, 3, 17, 4, 30, 12], seed=3)
    proposer = head_mod.for_target(target, tmp_path / "h", bits=bits)
    state = engine.admit(GenerationRequest(input_ids=PROMPT, max_new_tokens=4))
    state.output_ids.append(21)
    residual = torch.randn(target.hidden_size)
    state.proposals[head_mod.NAME] = proposer.start(state)
    proposer.observe(state, torch.stack([torch.randn(target.hidden_size), residual]))  # the last row counts
    draft = proposer.propose([(state, 2)])[0]
    with torch.no_grad():
        out = target.head_weight().float()[torch.tensor(vocab)]
        p = head(residual[None], target.embed(torch.tensor([21])).float(), out).softmax(-1)[0]
    assert draft.tokens.tolist() == [vocab[int(p.argmax())]] and draft.probs is None
    assert draft.confidence[0] == pytest.approx(float(p.max()), rel=1e-4 if bits is None else 0.05)
    dist = proposer.distributions([state])[0]
    assert dist.sum() == pytest.approx(1.0, rel=1e-5) and dist.max() == pytest.approx(draft.confidence[0])
    # A token's probability by its target id; 0 outside the head's vocabulary (5, and 47 past its largest id).
    assert proposer.probability_of(dist, np.array([3, 5, 47, 30])).tolist() == pytest.approx(
        [dist[1], 0.0, 0.0, dist[4]])
    engine.release(state)


def test_several_states_are_guessed_in_one_call_as_each_alone(tiny):
    """A batched step asks the head once for every state without a chain (one by one, eight
    states spent ~10 % of the step on it); each guess is the one it gets asked alone, and a
    state with no residual yet still gets none."""
    engine, _ = tiny
    head = engine.proposer("head")
    states = [engine.admit(GenerationRequest(input_ids=PROMPT, max_new_tokens=4)) for _ in range(4)]
    for i, state in enumerate(states):
        state.output_ids.append(20 + i)
        if i != 2:
            head.observe(state, torch.randn(2, engine.target.hidden_size, generator=torch.Generator().manual_seed(i)))
    alone = [head.propose([(s, 2)])[0] for s in states]
    calls = []
    run = head.session.run
    head.session.run = lambda *a, **k: calls.append(1) or run(*a, **k)
    try:
        together = head.propose([(s, 2) for s in states])
    finally:
        head.session.run = run
    assert len(calls) == 1
    assert [d.tokens.tolist() for d in together] == [d.tokens.tolist() for d in alone]
    assert together[2].tokens.numel() == 0 and alone[0].tokens.numel() == 1
    for a, b in zip(alone, together):
        assert a.confidence == pytest.approx(b.confidence, rel=1e-5)
    for state in states:
        engine.release(state)


def test_no_residual_yet_no_guess(tiny):
    engine, _ = tiny
    state = engine.admit(GenerationRequest(input_ids=PROMPT, max_new_tokens=4))
    assert engine.proposer("head").propose([(state, 2)])[0].tokens.numel() == 0
    engine.release(state)


def test_the_policy_verifies_a_guess_only_where_it_pays():
    from dflash.engine.calibration import PointMass
    from dflash.engine.costs import CostCurve
    from dflash.engine.knobs import SpeculativeConfig
    from dflash.engine.policy import BlockPolicy
    from dflash.engine.proposers.protocol import Draft, Offer, RunningPrice

    cfg = SpeculativeConfig()

    def policy(verify_s):
        curve = CostCurve(verify_s, [0.0] * len(verify_s))
        return BlockPolicy(curve, 8, cfg, {"suffix": PointMass(cfg, 7), "head": PointMass(cfg, 7)})

    def offer(name, confidence):
        return Offer(name, None, Draft(torch.arange(len(confidence)), None, confidence), RunningPrice(0.0))

    def choice(policy, *offers):
        got, n = policy.choose(list(offers))
        return (got.name if got is not None else None), n

    cheap = policy([1.0, 1.03] + [1.5] * 6)  # a second row nearly free (ort: a plain step runs two)
    assert choice(cheap, offer("head", [0.3])) == ("head", 2)
    # a chain worth more than the guess wins
    assert choice(cheap, offer("suffix", [0.9, 0.9]), offer("head", [0.9]))[0] == "suffix"
    dear = policy([1.0, 2.0] + [2.5] * 6)
    assert choice(dear, offer("head", [0.3])) == (None, 1)
    # Its outcomes calibrate it: guesses at 0.9 that are never kept stop being verified.
    for _ in range(60):
        cheap.observe(offer("head", [0.9]), [0.9], 2, 0, 2)
    assert choice(cheap, offer("head", [0.9])) == (None, 1)


def test_greedy_with_guesses_is_the_targets_greedy_and_counts_them(tiny):
    engine, folder = tiny
    free = _free_verify(engine, folder)
    for prompt in (PROMPT, [3, 4, 3, 4, 40, 41], list(range(20, 36))):
        plain = engine.generate(GenerationRequest(input_ids=prompt, max_new_tokens=30, block_size=1))
        res = free.generate(GenerationRequest(input_ids=prompt, max_new_tokens=30, proposers=("head",)))
        assert res.output_ids == plain.output_ids
        steps = res.stats.by_proposer["head"]["steps"]
        assert steps > 0 and res.stats.by_proposer["head"]["drafted"] == steps  # one token a guess
        assert res.stats.accepted_per_position == [0] * len(res.stats.accepted_per_position)  # not the drafter's


def test_the_head_guesses_only_where_the_suffix_proposer_has_nothing(tiny):
    engine, folder = tiny
    free = _free_verify(engine, folder)
    loop = [5, 6, 7, 8, 9, 10, 11] * 4
    res = free.generate(GenerationRequest(input_ids=loop, max_new_tokens=20, proposers=("suffix", "head")))
    plain = engine.generate(GenerationRequest(input_ids=loop, max_new_tokens=20, block_size=1))
    assert res.output_ids == plain.output_ids
    assert res.stats.by_proposer.get("suffix", {}).get("steps", 0) > 0


AMBIGUOUS = [1, 5, 6, 7, 8, 30, 31, 32, 2, 5, 6, 7, 8, 30, 31, 32, 4, 5, 6, 7, 8, 40, 41, 42, 9, 5, 6, 7, 8]


def test_one_head_call_guesses_and_chooses_a_chains_first_token(tiny):
    """In a step the head is asked once: for a guess where a state has no chain, and for the
    first token of a chain whose earlier occurrences went different ways (that chain is
    replaced by the suffix proposer's `rechoose` with the head's probabilities, as alone):
    the composed proposer's offers."""
    from dflash.engine import step as step_mod
    from dflash.engine.proposers.suffix import SuffixProposer

    engine, _ = tiny
    head, H = engine.proposer("head"), engine.target.hidden_size
    novel = engine.admit(GenerationRequest(input_ids=[43, 44, 45, 46], max_new_tokens=8))
    torn = engine.admit(GenerationRequest(input_ids=AMBIGUOUS[:-1], max_new_tokens=8))
    novel.output_ids.append(47)  # never seen before: no chain after it
    torn.output_ids.append(AMBIGUOUS[-1])  # "5 6 7 8" again: two earlier went on with 30, one with 40
    for i, state in enumerate((novel, torn)):
        head.observe(state, torch.randn(1, H, generator=torch.Generator().manual_seed(i)))
    items = [(s, step_mod._most(s, engine)) for s in (novel, torn)]
    chains = engine.proposer("suffix").propose(items)
    assert chains[0].tokens.numel() == 0 and SuffixProposer.choices(torn) is not None
    alone_probs = head.distributions([torn])[0]
    alone = engine.proposer("suffix").rechoose(torn, head.probability_of(alone_probs, SuffixProposer.choices(torn)))
    calls = []
    run = head.session.run
    head.session.run = lambda *a, **k: calls.append(1) or run(*a, **k)
    try:
        offers = engine.proposer("suffix_head").offer(items)
    finally:
        head.session.run = run
    assert len(calls) == 1
    assert [o.name for o in offers] == ["head", "suffix"] and offers[0].draft.tokens.numel() == 1
    assert offers[1].draft.tokens.tolist() == alone.tokens.tolist()
    assert offers[1].draft.confidence == pytest.approx(alone.confidence, rel=1e-5)
    for state in (novel, torn):
        engine.release(state)


def test_greedy_with_head_chosen_chains_is_the_targets_greedy(tiny, monkeypatch):
    from dflash.engine.proposers.suffix import SuffixProposer

    engine, folder = tiny
    free = _free_verify(engine, folder)
    asked = []
    rechoose = SuffixProposer.rechoose
    monkeypatch.setattr(SuffixProposer, "rechoose", lambda self, s, p: asked.append(1) or rechoose(self, s, p))
    for prompt in (AMBIGUOUS, AMBIGUOUS[::-1] + AMBIGUOUS):
        plain = engine.generate(GenerationRequest(input_ids=prompt, max_new_tokens=24, block_size=1))
        res = free.generate(GenerationRequest(input_ids=prompt, max_new_tokens=24, proposers=("suffix", "head")))
        assert res.output_ids == plain.output_ids
    assert asked


_FREE = {}


def _free_verify(engine, folder):
    """The same models and head where verifying more rows costs nothing, so guesses are verified."""
    from dflash.engine.costs import CostCurve
    from dflash.engine.engine import Engine

    if folder not in _FREE:
        _FREE[folder] = Engine(engine.target, engine.drafter, "tiny-drafter",
                               cost_curve=CostCurve([1.0] * 8, [0.0] * 8), head_dir=folder)
    return _FREE[folder]


@pytest.mark.parametrize("verify", ["strict", "probabilistic"])
def test_sampling_with_guesses_follows_the_targets_law(tiny, verify):
    """Guesses are point masses, verified by the strict rule: the joint law of the first two
    sampled tokens (of three, so the second can be a guess) is the target's (chi-square)."""
    engine, folder = tiny
    free = _free_verify(engine, folder)
    prompt, kw = PROMPT, dict(temperature=1.5, top_k=3, verify=verify)
    target = free.target
    joint = two_token_law(target, prompt, GenerationRequest(input_ids=prompt, **kw).sampling())
    cells = sorted(joint)
    counts = torch.zeros(len(cells) + 1)
    guessed = 0
    for _ in range(100):
        for res in free.generate_many([GenerationRequest(input_ids=prompt, max_new_tokens=3, proposers=("head",), **kw)
                                       for _ in range(16)]):
            key = tuple(res.output_ids[:2])
            counts[cells.index(key) if key in joint else -1] += 1
            guessed += res.stats.by_proposer.get("head", {}).get("drafted", 0)
    assert guessed > 0
    ok, why = chi_square_ok(counts, torch.tensor([joint[c] for c in cells] + [0.0]))
    assert ok, why


def test_rms_norm_matches_the_modules():
    x, w = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32), np.arange(1, 9, dtype=np.float32)
    t = torch.from_numpy(x)
    want = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + head_mod.EPS) * torch.from_numpy(w)
    np.testing.assert_allclose(head_mod.rms_norm(x, w), want.numpy(), rtol=1e-5)


def test_head_auto_chooses_among_the_heads_made_for_the_target(tmp_path, monkeypatch, tiny):
    """--head auto: the heads made here for the target (CACHE/heads/<target>/, next_head's
    default output) and the shipped ones made for it; the engine loads the first that fits
    its backend, and a head made for another target never loads."""
    import os

    from dflash.loading import head_folder
    from dflash.model_files import SHIPPED_HEADS, heads_dir

    engine, _ = tiny
    target = engine.target
    monkeypatch.setenv("PG_DFLASH_CACHE", str(tmp_path))
    assert head_folder("auto", target.name) == []  # the shipped head is SmolLM2's
    assert head_folder("auto", "smollm2-135m-instruct") == [SHIPPED_HEADS / "smollm2-135m-instruct-next"]
    assert head_folder("auto", "qwen2.5-coder-1.5b-instruct") == [SHIPPED_HEADS / "qwen2.5-coder-1.5b-instruct-next"]
    mine = heads_dir(target.name)
    _random_head(mine / "hf", target)
    _random_head(mine / "ort", target, backends=("ort",))
    os.utime(mine / "ort" / head_mod.CONFIG_FILE, (2e9, 2e9))  # the newest: first, but not for hf
    _random_head(mine / "stray", target)
    config = json.loads((mine / "stray" / head_mod.CONFIG_FILE).read_text())
    (mine / "stray" / head_mod.CONFIG_FILE).write_text(json.dumps({**config, "target": "another-model"}))
    found = head_folder("auto", target.name)
    assert found == [mine / "ort", mine / "hf"]
    assert head_mod.for_target(target, found).w.config["backends"] == ["hf"]
    assert head_mod.for_target(target, mine / "stray") is None
    assert head_folder("none", target.name) is None


def test_the_shipped_qwen_head_fits_its_target_on_its_backend_only():
    """The 1.5B's shipped head loads, and fits the 1.5B (28 layers of 1536, 151,936 tokens) on
    `ort-q4_k_m` only: another backend's last feature is another state."""
    from types import SimpleNamespace

    from dflash.model_files import SHIPPED_HEADS

    w = head_mod.load(SHIPPED_HEADS / "qwen2.5-coder-1.5b-instruct-next")
    qwen = SimpleNamespace(name="qwen2.5-coder-1.5b-instruct", backend="ort-q4_k_m", hidden_size=1536,
                           num_layers=28, vocab_size=151936)
    assert head_mod.fits(w, qwen) and len(w.vocab) == w.config["vocab_k"] == 2048
    assert not head_mod.fits(w, SimpleNamespace(**{**vars(qwen), "backend": "ort"}))
    assert not head_mod.fits(w, SimpleNamespace(**{**vars(qwen), "name": "qwen2.5-coder-0.5b-instruct"}))
