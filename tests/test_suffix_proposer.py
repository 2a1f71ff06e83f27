"""The suffix proposer in the engine: drafts from the prompt, the output so far and the
workload's past outputs; the policy's choice between it and the drafter; losslessness with
its drafts (greedy and sampled); the workload memory (loading, bounds, eviction, restart);
per-proposer statistics; and, through SQL, that one member's generations never feed
another member's proposals."""

import pytest
import torch

from dflash.engine.engine import GenerationRequest
from dflash.engine.workloads import WorkloadMemory
from dflash.errors import DFlashError
from tests.sqlenv import ALICE, BOB, alice, bob, connect, roles, scalar, su  # noqa: F401
from tests.test_sampling import chi_square_ok, two_token_law

LOOP = [5, 6, 7, 8, 9, 10, 11] * 4  # a prompt that repeats itself


@pytest.fixture(scope="module")
def tiny_engine():
    """The tiny target and drafter at a fixed, CPU-shaped cost curve: whether a chain pays
    must not depend on how busy the machine was when a curve was timed."""
    from dflash.engine.drafter import init_random_drafter
    from dflash.engine.engine import Engine
    from tests.conftest import cpu_like_costs, make_tiny_target, tiny_drafter_config

    return Engine(make_tiny_target(), init_random_drafter(tiny_drafter_config(), seed=1, std=0.3), "tiny-drafter",
                  cost_curve=cpu_like_costs())


def _gen(engine, ids, **kw):
    return engine.generate(GenerationRequest(input_ids=list(ids), max_new_tokens=kw.pop("max_new_tokens", 40), **kw))


def _suffix(res) -> dict:
    return res.stats.by_proposer.get("suffix", {"steps": 0, "drafted": 0, "accepted": 0})


def test_the_proposer_continues_the_longest_earlier_match(tiny_engine):
    """Its own tokens: the continuation of the longest earlier occurrence, with counts as
    confidence (one occurrence: rising with the context it agrees with); the trivial match of
    the context with itself at its end does not count."""
    from dflash.engine.proposers.suffix import NAME

    state = tiny_engine.admit(GenerationRequest(input_ids=LOOP + [5, 6], max_new_tokens=20, proposers=("suffix",)))
    draft = tiny_engine.proposer("suffix").propose([(state, 6)])[0]
    assert draft.tokens.tolist() == [7, 8, 9, 10, 11] and draft.probs is None
    assert all(0 < c < 1 for c in draft.confidence)
    assert all(a < b for a, b in zip(draft.confidence, draft.confidence[1:]))
    state.output_ids.extend([7, 8, 42, 43])  # committed since: the new tokens are indexed before the next lookup
    draft = tiny_engine.proposer("suffix").propose([(state, 4)])[0]
    assert state.proposals[NAME].indexed == state.length
    assert draft.tokens.tolist() == []  # "42, 43" never occurred before
    tiny_engine.release(state)


def test_the_policy_drafts_with_the_suffix_proposer_where_it_pays(tiny_engine):
    """A workload that asked this before: the suffix proposer drafts its answer again, for
    free, and the drafts are kept; with proposals off, or a fixed block size, it never
    drafts. The output is the target's either way."""
    prompt = [8, 9, 10, 20]  # a long answer (no end of sequence within 40 tokens)
    plain = _gen(tiny_engine, prompt, block_size=1)
    tiny_engine.workloads.load("t-policy", [plain.output_ids])
    auto = _gen(tiny_engine, prompt, workload="t-policy")
    off = _gen(tiny_engine, prompt, workload="t-policy", proposals=False)
    fixed = _gen(tiny_engine, prompt, workload="t-policy", block_size=4)
    alone = _gen(tiny_engine, prompt, workload="t-policy", proposers=("suffix",))
    assert plain.output_ids == auto.output_ids == off.output_ids == fixed.output_ids == alone.output_ids
    assert _suffix(auto)["accepted"] > 10 and _suffix(alone)["accepted"] > 10
    assert "dflash" not in alone.stats.by_proposer
    assert _suffix(off)["steps"] == 0 and _suffix(fixed)["steps"] == 0
    assert alone.stats.to_dict()["proposers"]["suffix"] == _suffix(alone)
    assert auto.stats.num_steps < plain.stats.num_steps / 2


def test_the_workload_memory_drafts_the_next_answer_and_a_restart_rebuilds_it(tiny_engine):
    """The second answer of a workload drafts from the first; an engine with no memory of the
    workload asks for its history (need_history) and, given it, drafts as well again."""
    prompt = [12, 13, 14, 8]  # a long answer (no end of sequence within 40 tokens)
    tiny_engine.workloads.load("t-memory", [])
    first = _gen(tiny_engine, prompt, workload="t-memory", proposers=("suffix",))
    second = _gen(tiny_engine, prompt, workload="t-memory", proposers=("suffix",))
    assert first.output_ids == second.output_ids
    assert _suffix(second)["accepted"] > _suffix(first)["accepted"] + 10
    assert second.stats.num_steps < first.stats.num_steps / 2
    tiny_engine.workloads.clear()  # a restarted worker: no memory, no calibration
    tiny_engine.proposer("suffix").pools.clear()
    with pytest.raises(DFlashError) as err:
        _gen(tiny_engine, prompt, workload="t-memory")
    assert err.value.code == "need_history"
    again = _gen(tiny_engine, prompt, workload="t-memory", history=[first.output_ids], proposers=("suffix",))
    assert again.output_ids == first.output_ids and again.stats.num_steps < first.stats.num_steps / 2


def test_batched_steps_with_suffix_drafts_equal_each_alone(tiny_engine):
    reqs = [GenerationRequest(input_ids=LOOP[i:] + [5], max_new_tokens=30) for i in range(4)]
    alone = [tiny_engine.generate(r).output_ids for r in reqs]
    assert [r.output_ids for r in tiny_engine.generate_many(reqs)] == alone


def test_the_head_breaks_ties_and_overrules_a_thin_majority_only():
    """head_choice: occurrences times (the head's probability + the floor); its confidence
    the winner's share of that score times n / (n + pseudo-count)."""
    import numpy as np

    from dflash.engine.knobs import SpeculativeConfig
    from dflash.engine.proposers.suffix import head_choice

    HEAD_FLOOR = SpeculativeConfig().suffix_head_floor

    tokens = np.array([3, 7, 9])
    assert head_choice(tokens, np.array([1, 1, 1]), np.array([0.1, 0.8, 0.1]), 1.0)[0] == 7  # a tie
    assert head_choice(tokens, np.array([3, 2, 0]), np.array([0.05, 0.9, 0.05]), 1.0)[0] == 7  # thin majority
    assert head_choice(tokens, np.array([9, 1, 0]), np.array([0.2, 0.8, 0.0]), 1.0)[0] == 3  # a clear one stays
    # A token the head does not know (probability 0) still wins on its counts.
    t, c = head_choice(tokens, np.array([4, 1, 0]), np.array([0.0, 0.01, 0.0]), 0.5)
    score = np.array([4 * HEAD_FLOOR, 1 * (0.01 + HEAD_FLOOR), 0.0])
    assert t == 3 and c == pytest.approx(score[0] / score.sum() * 5 / 5.5)


def test_a_chains_first_token_is_chosen_again_with_the_heads_probabilities(tiny_engine):
    """Where the match's earlier occurrences went different ways at the first position,
    `choices` names them; `rechoose` walks the chain again from the one the head prefers,
    over the occurrences that went that way. Where they all agree, there is no choice."""
    import numpy as np

    from dflash.engine.proposers.suffix import SuffixProposer

    ambiguous = [1, 5, 6, 7, 8, 30, 31, 32, 2, 5, 6, 7, 8, 30, 31, 32, 4, 5, 6, 7, 8, 40, 41, 42, 9, 5, 6, 7, 8]
    state = tiny_engine.admit(GenerationRequest(input_ids=ambiguous, max_new_tokens=20, proposers=("suffix",)))
    draft = tiny_engine.proposer("suffix").propose([(state, 5)])[0]
    assert draft.tokens.tolist() == [30, 31, 32, 2]  # two of three occurrences (then a tie: 2 < 4)
    assert SuffixProposer.choices(state).tolist() == [30, 40]
    suffix = tiny_engine.proposer("suffix")
    again = suffix.rechoose(state, np.array([0.02, 0.95]))
    assert again.tokens.tolist() == [40, 41, 42, 9] and again.probs is None
    assert 0.5 < again.confidence[0] < 1 and again.confidence[1:] == pytest.approx(
        [1 / (1 + 1 / (len([5, 6, 7, 8]) + i)) for i in (1, 2, 3)])  # one occurrence, per-context prior
    kept = suffix.rechoose(state, np.array([0.5, 0.5]))
    assert kept.tokens.tolist() == [30, 31, 32, 2] and kept.confidence[1:] == draft.confidence[1:]
    tiny_engine.release(state)
    agree = tiny_engine.admit(GenerationRequest(input_ids=LOOP + [5, 6], max_new_tokens=20, proposers=("suffix",)))
    tiny_engine.proposer("suffix").propose([(agree, 4)])
    assert SuffixProposer.choices(agree) is None
    tiny_engine.release(agree)


@pytest.fixture(scope="module")
def free_verify_engine(tiny_engine):
    """The same models where verifying more rows costs nothing (a GPU's regime), so chains
    are verified even in a batch of 16 and the law is tested on drafted steps."""
    from dflash.engine.costs import CostCurve
    from dflash.engine.engine import Engine

    return Engine(tiny_engine.target, tiny_engine.drafter, "tiny-drafter", cost_curve=CostCurve([1.0] * 8, [0.0] * 8))


@pytest.mark.parametrize("verify", ["strict", "probabilistic"])
def test_sampling_with_suffix_drafts_follows_the_targets_law(free_verify_engine, verify):
    """Suffix drafts are point masses, verified by the strict rule: the joint law of the first
    two sampled tokens (of three, so the second can be a draft) is the target's (chi-square)."""
    prompt, kw = LOOP[:14], dict(temperature=1.5, top_k=3, verify=verify)
    target = free_verify_engine.target
    joint = two_token_law(target, prompt, GenerationRequest(input_ids=prompt, **kw).sampling())
    cells = sorted(joint)
    counts = torch.zeros(len(cells) + 1)
    drafted = 0
    # A memory of earlier answers (each after the prompt's last token, so the match is two
    # tokens long): after any first token, the suffix proposer offers its likeliest second,
    # seen often enough to be worth verifying.
    best = {x1: max((c for c in cells if c[0] == x1), key=joint.get) for x1, _ in cells}
    free_verify_engine.workloads.load(f"t-law-{verify}", [[prompt[-1], *c] for c in best.values()] * 8)
    for _ in range(100):
        for res in free_verify_engine.generate_many([GenerationRequest(input_ids=prompt, max_new_tokens=3,
                                                                workload=f"t-law-{verify}", proposers=("suffix",),
                                                                **kw) for _ in range(16)]):
            key = tuple(res.output_ids[:2])
            counts[cells.index(key) if key in joint else -1] += 1
            drafted += _suffix(res)["drafted"]
    assert drafted > 0  # the suffix proposer did draft
    ok, why = chi_square_ok(counts, torch.tensor([joint[c] for c in cells] + [0.0]))
    assert ok, why


# --- the workload memory's bounds -------------------------------------------------------------


def test_a_history_far_beyond_the_cap_is_capped_not_loaded_whole():
    memory = WorkloadMemory(cap_mb=1.0)
    history = [list(range(i, i + 500)) for i in range(0, 10 * 1024 * 1024 // 48 // 500 * 500, 500)]  # ~10 MB
    w = memory.load("big", history)
    assert memory.size_bytes <= memory.cap_bytes
    assert 0 < w.index.num_tokens < sum(len(h) for h in history) / 5
    # the newest outputs are the ones kept
    assert w.index.tokens(w.docs[-1]) == history[0]


def test_workloads_beyond_the_cap_evict_the_least_recently_used():
    memory = WorkloadMemory(cap_mb=0.5)
    chunk = [list(range(1000))] * 5
    for key in ("a", "b", "c", "d"):
        memory.load(key, chunk)
        memory.get("a")  # a stays in use
    assert memory.size_bytes <= memory.cap_bytes
    assert "a" in memory.workloads and memory.evicted >= 1
    memory.remember("a", list(range(2000, 2400)))
    status = memory.status()
    assert status["bytes"] == memory.size_bytes and status["cap_bytes"] == memory.cap_bytes
    with pytest.raises(DFlashError):
        WorkloadMemory.check_key("x" * 1000)


# --- through SQL: one member's generations never feed another's proposals ---------------------


PROMPT = "Extract the name and city as JSON: Ada Lovelace lives in London."
STATS = ("SELECT dflash_generate_stats(%s, max_new_tokens => 40)->'proposers'->'suffix'")


def _suffix_accepted(conn, prompt=PROMPT) -> int:
    got = scalar(conn, STATS, prompt)
    return int(got["accepted"]) if got else 0


def test_a_members_memory_never_feeds_another_members_proposals(roles, sql_worker, alice, bob, su):
    """Alice asks the same thing five times: her later answers draft from her own earlier
    ones (once the memory's counts make the chain worth verifying). Bob then asks the identical question: he gains nothing from her memory
    (his first call drafts as alice's first did); the worker's memory keeps them apart, and so
    does the history a restarted worker is given (read under each caller's row security)."""
    engine = sql_worker.engine
    engine.workloads.clear()
    alice_calls = [_suffix_accepted(alice) for _ in range(5)]
    assert alice_calls[-1] > alice_calls[0] + 10
    bob_first = _suffix_accepted(bob)
    assert bob_first == alice_calls[0]  # as if no one had asked before
    assert {k for k in engine.workloads.workloads if k.startswith("role:")} >= {f"role:{ALICE}", f"role:{BOB}"}
    # A worker restart: its memory and calibration are gone; each member's history is read back
    # under their rights: alice's holds her five answers, bob's only his one.
    def rows_of(role):
        return scalar(su, "SELECT count(*) FROM dflash.workload_history(NULL, %s)", role)

    engine.workloads.clear()
    engine.proposer("suffix").pools.clear()
    before = rows_of(ALICE)
    assert _suffix_accepted(alice) > alice_calls[0] + 10
    assert len(engine.workloads.get(f"role:{ALICE}").docs) == before + 1  # her rows, then this answer
    engine.workloads.clear()
    engine.proposer("suffix").pools.clear()
    before = rows_of(BOB)
    assert before < rows_of(ALICE)
    _suffix_accepted(bob)
    assert len(engine.workloads.get(f"role:{BOB}").docs) == before + 1  # his rows only
    rows = su.execute("SELECT calling_role, proposers ? 'suffix' FROM dflash.generations"
                      " WHERE prompt = %s ORDER BY id", (PROMPT,)).fetchall()
    assert [r[0] for r in rows] == [ALICE] * 5 + [BOB, ALICE, BOB]
    assert rows[4][1] and rows[6][1]  # drafted from a memory of earlier answers


def test_proposals_off_drafts_from_no_memory(roles, sql_worker, alice):
    got = scalar(alice, "SELECT dflash_generate_stats(%s, max_new_tokens => 20, proposals => false)", PROMPT)
    assert "suffix" not in (got.get("proposers") or {})
    shares = scalar(alice, "SELECT proposers FROM dflash.block_policy WHERE calling_role = %s AND source_table IS NULL",
                    ALICE)
    assert shares["suffix"]["steps"] > 0 and 0 <= shares["suffix"]["share"] <= 1
    assert 0 <= shares["suffix"]["acceptance"] <= 1
