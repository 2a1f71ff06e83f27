"""Sampling warps and the three verify rules.

The statistical tests simulate generation of two tokens with adversarial target (p)
and draft (q) distributions on a 4-token vocabulary and compare the empirical joint
law of the two emitted tokens with the target's p1(x1) p2(x2 | x1) by a chi-square
test. `test_checker_rejects_wrong_rules` shows the same test, with the same sample
size, fails rules that are subtly wrong, so a pass means something.
"""

import functools
import math

import pytest
import torch

from dflash.engine.sampling import SamplingParams
from dflash.engine.sampling import argmax_rows, sample, verify_greedy, verify_probabilistic, verify_strict, warp

# 4,000 simulated generations per test: each wrong rule below exceeds the chi-square test's
# critical value 40-fold at this size (12,000 gave the same verdicts at three times the time).
V, K, N = 4, 2, 4000


def test_warp_temperature_topk_topp():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    p = warp(logits, SamplingParams(temperature=1.0))
    assert torch.allclose(p, logits.softmax(-1))
    p = warp(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[2:] == 0).all() and torch.allclose(p[:2], logits[:2].softmax(-1))
    full = logits.softmax(-1)  # 0.644, 0.237, 0.087, 0.032
    p = warp(logits, SamplingParams(temperature=1.0, top_p=0.7))  # needs the first two to reach 0.7
    assert (p[2:] == 0).all() and p[:2].sum() == pytest.approx(1.0)
    p = warp(logits, SamplingParams(temperature=1.0, top_p=0.5))  # the top token alone reaches 0.5
    assert p[0] == 1.0
    p = warp(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(p, (logits / 0.5).softmax(-1))
    assert full[0] < p[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # the CPU row-by-row path and torch's
def test_greedy_rule(dtype):
    logits = (torch.eye(V)[[1, 2, 3]] * 5).to(dtype)  # argmax 1, 2, 3
    assert verify_greedy(torch.tensor([1, 2]), logits) == (2, 3)  # all accepted, bonus 3
    assert verify_greedy(torch.tensor([1, 0]), logits) == (1, 2)  # second rejected, target's 2
    assert verify_greedy(torch.tensor([0, 2]), logits) == (0, 1)  # a later match does not count
    assert verify_greedy(torch.empty(0, dtype=torch.long), logits[:1]) == (0, 1)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_rows_is_torchs_argmax(dtype):
    """The numpy fast path (fp32 on a CPU) and the fallback both give torch's answer: each
    row's first maximum, ties and infinities included, for a row or a matrix."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 49152, generator=g).to(dtype)
    logits[1, [7, 300, 9000]] = 50.0  # a three-way tie: the first one wins
    logits[2, 11] = float("inf")
    logits[3] = -float("inf")  # an all -inf row: index 0
    for x in (logits, logits[0], logits[:1]):
        got = argmax_rows(x)
        assert got.dtype == torch.int64 and got.shape == x.shape[:-1]
        assert torch.equal(got, x.argmax(-1))
    assert argmax_rows(logits)[1] == 7


def test_sample_never_draws_a_token_without_mass(monkeypatch):
    """Inverse-CDF sampling: zero-probability tokens are never drawn, whatever the uniform,
    including one that rounds up to the row's total (then the last token with mass)."""
    import dflash.engine.sampling as sampling

    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0], [0.5, 0.0, 0.5, 0.0, 0.0]])
    for u in (0.0, 0.25, 0.9999, 1.0):
        monkeypatch.setattr(sampling.torch, "rand", lambda *a, u=u, **k: torch.full(a[:2], u, dtype=torch.float64))
        got = sample(probs, None).tolist()
        assert got == {0.0: [1, 0], 0.25: [3, 0], 0.9999: [3, 2], 1.0: [3, 2]}[u], (u, got)
    monkeypatch.undo()
    g = torch.Generator().manual_seed(1)
    drawn = sample(probs[0].expand(20000, 5), g)
    assert set(drawn.tolist()) == {1, 3} and abs((drawn == 3).double().mean().item() - 0.75) < 0.02


# --- the simulated world ----------------------------------------------------------


# The simulated world's laws are memoised (the same tensor for the same prefix, read, never
# written, by every rule): the N simulated generations per test then spend their time in
# the rules under test, not in building the same small tensors again.
@functools.lru_cache(maxsize=None)
def target_row(prefix: tuple) -> torch.Tensor:
    """p(. | prefix): a fixed, prefix-dependent law with zeros in it."""
    table = {
        (): [0.5, 0.3, 0.2, 0.0],
    }
    if prefix in table:
        return torch.tensor(table[prefix])
    h = (sum((i + 1) * (t + 1) for i, t in enumerate(prefix)) * 7) % 5
    rows = [[0.1, 0.2, 0.3, 0.4], [0.7, 0.0, 0.0, 0.3], [0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 1.0, 0.0], [0.05, 0.6, 0.05, 0.3]]
    return torch.tensor(rows[h])


@functools.lru_cache(maxsize=None)
def draft_rows(case: str) -> torch.Tensor:
    """q_1..q_K (factorised, as a block drafter proposes)."""
    if case == "equal":  # q equals p at position 1
        return torch.stack([target_row(()), torch.tensor([0.1, 0.2, 0.3, 0.4])])
    if case == "disjoint":  # q's support misses p's entirely at position 1
        return torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    if case == "onehot":  # deterministic drafter
        return torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    if case == "zeros":  # zeros in q where p has mass
        return torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.6, 0.0, 0.4, 0.0]])
    raise ValueError(case)


def simulate_two_tokens(rule, case: str, gen: torch.Generator, k: int = K) -> tuple[int, int]:
    out: list[int] = []
    q = draft_rows(case)[:k]
    while len(out) < 2:
        drafts = sample(q, gen)
        p = target_rows(tuple(out), tuple(drafts.tolist()))
        a, nxt = rule(drafts, q, p, gen)
        out += drafts.tolist()[:a] + [nxt]
    return out[0], out[1]


@functools.lru_cache(maxsize=None)
def target_rows(prefix: tuple, drafts: tuple) -> torch.Tensor:
    """p_1..p_{K+1}: the target's law after the prefix and after each draft in turn."""
    rows = [target_row(prefix)]
    for d in drafts:
        prefix = prefix + (d,)
        rows.append(target_row(prefix))
    return torch.stack(rows)


def expected_joint() -> torch.Tensor:
    p1 = target_row(())
    return torch.stack([p1[x] * target_row((x,)) for x in range(V)])


def two_token_law(target, prompt: list[int], params) -> dict[tuple[int, int], float]:
    """The target's joint law of the first two sampled tokens after `prompt` (warped by
    `params`), computed exactly from its distributions: {(x1, x2): probability}."""
    from dflash.engine.sampling import warp

    with torch.inference_mode():
        p1 = warp(target.forward(torch.tensor(prompt), target.new_cache())[0][-1], params)
        joint = {}
        for x1 in torch.nonzero(p1).flatten().tolist():
            p2 = warp(target.forward(torch.tensor(prompt + [x1]), target.new_cache())[0][-1], params)
            for x2 in torch.nonzero(p2).flatten().tolist():
                joint[(x1, x2)] = float(p1[x1] * p2[x2])
    return joint


def chi_square_ok(counts: torch.Tensor, probs: torch.Tensor, z: float = 3.72) -> tuple[bool, str]:
    """Pearson chi-square against a 1e-4 critical value (Wilson-Hilferty); cells the
    target gives probability 0 must never be seen."""
    n = counts.sum()
    zero = probs == 0
    if counts[zero].sum() > 0:
        return False, f"impossible outcomes seen: {counts[zero].sum().item()}"
    expected = probs[~zero] * n
    stat = float(((counts[~zero] - expected) ** 2 / expected).sum())
    df = int((~zero).sum()) - 1
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < crit, f"chi2 {stat:.1f} vs critical {crit:.1f} (df {df})"


def run_rule(rule, case, k=K, seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    for _ in range(N):
        x1, x2 = simulate_two_tokens(rule, case, gen, k)
        counts[x1, x2] += 1
    return chi_square_ok(counts.flatten(), expected_joint().flatten())


def strict(drafts, q, p, gen):
    return verify_strict(drafts, p, gen)


def probabilistic(drafts, q, p, gen):
    return verify_probabilistic(drafts, q, p, gen)


@pytest.mark.parametrize(
    "case, k", [("equal", 2), ("disjoint", 2), ("onehot", 2), ("zeros", 2), ("equal", 1), ("zeros", 1)]
)
@pytest.mark.parametrize("rule", [strict, probabilistic], ids=["strict", "probabilistic"])
def test_rule_output_follows_target_distribution(rule, case, k):
    # k = 1: a fully accepted step emits the draft and the bonus, so the bonus rule is tested too.
    ok, detail = run_rule(rule, case, k)
    assert ok, detail


# --- deliberately wrong rules: the checker must catch them ----------------------------


def wrong_resample_from_p(drafts, q, p, gen):
    """Accept with min(1, p/q) but resample from p instead of the residual."""
    k = len(drafts)
    for i in range(k):
        d = int(drafts[i])
        if q[i, d] > 0 and torch.rand(1, generator=gen).item() * q[i, d] <= p[i, d]:
            continue
        return i, int(sample(p[i], gen))
    return k, int(sample(p[k], gen))


def wrong_accept_with_p(drafts, q, p, gen):
    """Accept with probability p(d) (ignoring q), residual as if q were used."""
    k = len(drafts)
    for i in range(k):
        d = int(drafts[i])
        if torch.rand(1, generator=gen).item() <= p[i, d]:
            continue
        res = (p[i] - q[i]).clamp_min(0)
        return i, int(sample(res / res.sum() if res.sum() > 0 else p[i], gen))
    return k, int(sample(p[k], gen))


def wrong_bonus_row(drafts, q, p, gen):
    """Correct acceptance, but the bonus token drawn from the wrong row (p_K, not p_{K+1})."""
    a, nxt = verify_probabilistic(drafts, q, p, gen)
    if a == len(drafts):
        return a, int(sample(p[a - 1], gen))
    return a, nxt


@pytest.mark.parametrize(
    "rule, case, k",
    [(wrong_resample_from_p, "zeros", 2), (wrong_accept_with_p, "zeros", 2), (wrong_bonus_row, "equal", 1)],
)
def test_checker_rejects_wrong_rules(rule, case, k):
    ok, detail = run_rule(rule, case, k)
    assert not ok, f"a wrong rule passed: {detail}"


# --- the engine end to end --------------------------------------------------------


@pytest.mark.parametrize("verify", ["strict", "probabilistic"])
def test_same_seed_same_output(tiny_engine, verify):
    from dflash.engine.engine import GenerationRequest

    def run(seed):
        req = GenerationRequest(
            input_ids=[5, 6, 7], max_new_tokens=20, temperature=0.9, top_p=0.95, top_k=20, seed=seed, verify=verify
        )
        return tiny_engine.generate(req).output_ids

    assert run(11) == run(11)
    assert any(run(11) != run(s) for s in (12, 13, 14))


# --- with a grammar's mask: the masked, renormalised target law ---------------------------


@functools.lru_cache(maxsize=None)
def allowed_row(prefix: tuple) -> torch.Tensor:
    """A grammar's mask after `prefix` in the simulated world: it forbids one token the target
    likes (token (last + 1) % V), unless that would leave the target no mass."""
    p = target_row(prefix)
    allowed = torch.ones(V, dtype=torch.bool)
    allowed[((prefix[-1] if prefix else 0) + 1) % V] = False
    return allowed if p[allowed].sum() > 0 else torch.ones(V, dtype=torch.bool)


def masked_joint() -> torch.Tensor:
    def law(prefix):
        p = target_row(prefix) * allowed_row(prefix)
        return p / p.sum()

    return torch.stack([law(())[x] * law((x,)) for x in range(V)])


@functools.lru_cache(maxsize=None)
def masked_target_rows(prefix: tuple, drafts: tuple) -> torch.Tensor:
    """The target's rows warped under the mask (what constrained plain decoding samples from);
    a row after a token the grammar forbids allows everything (grammar.Matcher.masks: no
    rule reads it, the forbidden token is rejected at its own row)."""
    rows, masks = target_rows(prefix, drafts), []
    for i in range(len(drafts) + 1):
        before = prefix + drafts[:i]
        ok = all(allowed_row(before[:j])[before[j]] for j in range(len(prefix), len(before)))
        masks.append(allowed_row(before) if ok else torch.ones(V, dtype=torch.bool))
    return warp(rows.log(), SamplingParams(temperature=1.0), allowed=torch.stack(masks))


def first_forbidden(prefix: tuple, drafts: tuple) -> int:
    n = 0
    while n < len(drafts) and allowed_row(prefix + drafts[:n])[drafts[n]]:
        n += 1
    return n


def run_masked_rule(rule, case, k=K, seed=0, cut=None):
    """Two tokens decoded under the mask; the rule verifies the drafts as they are (cut None:
    a forbidden draft is rejected at its row), cut before their first forbidden token
    ("before"), or after it ("after": it stays, to be rejected at its row)."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    for _ in range(N):
        out: list[int] = []
        while len(out) < 2:
            q = draft_rows(case)[:k]
            drafts = sample(q, gen)
            if cut is not None:
                n = first_forbidden(tuple(out), tuple(drafts.tolist()))
                n = n + 1 if cut == "after" and n < len(drafts) else n
                drafts, q = drafts[:n], q[:n]
            a, nxt = rule(drafts, q, masked_target_rows(tuple(out), tuple(drafts.tolist())), gen)
            out += drafts.tolist()[:a] + [nxt]
        counts[out[0], out[1]] += 1
    return chi_square_ok(counts.flatten(), masked_joint().flatten())


@pytest.mark.parametrize("rule, case, k, cut", [
    (strict, "disjoint", 2, None), (strict, "zeros", 2, "before"),
    (probabilistic, "equal", 2, None), (probabilistic, "zeros", 2, "after"), (probabilistic, "zeros", 1, "after"),
    (probabilistic, "onehot", 2, "before"),  # a draft that is not sampled may be cut before
], ids=lambda x: getattr(x, "__name__", str(x)))
def test_rules_under_a_mask_follow_the_masked_target_law(rule, case, k, cut):
    ok, detail = run_masked_rule(rule, case, k, cut=cut)
    assert ok, detail


def test_a_sampled_draft_cut_before_its_forbidden_token_breaks_the_law():
    """The probabilistic rule must see a sampled draft's forbidden token and reject it (the
    residual is drawn there); cut away, the target's row is drawn instead and the law is off.
    The same check also catches the mask forgotten altogether."""
    ok, detail = run_masked_rule(probabilistic, "zeros", 1, cut="before")
    assert not ok, f"a biased rule passed: {detail}"
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(V, V)
    for _ in range(N):  # plain sampling from the unmasked law, judged against the masked one
        x1 = int(sample(target_row(()), gen))
        x2 = int(sample(target_row((x1,)), gen))
        counts[x1, x2] += 1
    assert not chi_square_ok(counts.flatten(), masked_joint().flatten())[0]


def test_the_mask_argument_changes_nothing_when_absent():
    """Without a mask the verify rules and warp are what they were, bit for bit; with an
    all-allowing mask too."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 1000, generator=g)
    everything = torch.ones_like(logits, dtype=torch.bool)
    for params in (SamplingParams(temperature=0.7, top_k=50, top_p=0.9), SamplingParams(temperature=1.0)):
        assert torch.equal(warp(logits, params), warp(logits, params, None))
        assert torch.equal(warp(logits, params), warp(logits, params, allowed=everything))
    draft = logits[:3].argmax(-1)
    draft[2] = (draft[2] + 1) % 1000
    for x in (logits, logits.double()):  # the numpy path and torch's
        expected = (2, int(logits[2].argmax()))
        assert verify_greedy(draft, x) == verify_greedy(draft, x, None) == verify_greedy(draft, x, everything) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # the CPU row-by-row path and torch's
def test_greedy_under_a_mask_takes_the_best_allowed_token(dtype):
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0], [0.0, 1.0, 3.0, 2.0], [9.0, 0.0, 0.0, 1.0]], dtype=dtype)
    allowed = torch.tensor([[True, True, True, True], [True, True, False, True], [False, True, True, True]])
    assert verify_greedy(torch.tensor([0, 3]), logits, allowed) == (2, 3)  # 3 beats the forbidden 0
    assert verify_greedy(torch.tensor([0, 2]), logits, allowed) == (1, 3)  # a forbidden draft is rejected
    assert verify_greedy(torch.tensor([0, 2]), logits) == (2, 0)  # unmasked: what it was
    p = warp(logits.float(), SamplingParams(temperature=1.0), allowed=allowed)
    assert (p[~allowed] == 0).all() and torch.allclose(p.sum(-1), torch.ones(3))
    e = torch.tensor([0.0, 1.0, 0.0, 2.0]).exp() * torch.tensor([1.0, 1.0, 0.0, 1.0])
    assert torch.allclose(p[1], e / e.sum())
