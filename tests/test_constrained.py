"""Constrained generation end to end (json_schema, regex, choices): the step applies the
request's grammar to every verified row, whoever drafted, so speculation under a constraint
is constrained plain decoding: token for token when greedy (against a reference loop of the
target's own forward and the grammar's mask, nothing of the engine's), in law when sampling
(chi-square against the masked law, computed exactly); batched requests with different
constraints are each what they are alone; an answer cut short is reported truncated."""

import json
import math
from collections import Counter

import pytest
import torch

from dflash.engine.engine import GenerationRequest
from dflash.engine.grammar import Matcher, Vocabulary, parse_constraint
from dflash.errors import DFlashError
from tests.test_sampling import chi_square_ok

TICKET = {"type": "object", "properties": {
    "plan": {"enum": ["free", "pro", "enterprise"]}, "priority": {"type": "integer", "minimum": 1, "maximum": 5},
    "refund": {"type": "boolean"}}, "required": ["plan", "priority", "refund"], "additionalProperties": False}
DATE = "[0-9]{4}-[0-9]{2}-[0-9]{2}"
LABELS = ["billing", "technical issue", "technical debt", "account access", "other"]
CONSTRAINTS = [{"json_schema": TICKET}, {"regex": DATE}, {"choices": LABELS}]
# Eight different answers' forms, for the batch.
EIGHT = CONSTRAINTS + [
    {"json_schema": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    {"json_schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                     "additionalProperties": False}},
    {"regex": "(yes|no)"}, {"choices": ["red", "green", "blue"]},
    {"json_schema": {"type": "integer", "minimum": 0, "maximum": 99}},
]


def vocabulary(engine) -> Vocabulary:
    return Vocabulary.of(engine.tokenizer, engine.target.vocab_size, engine.target.eos_ids)


def reference(engine, prompt_ids: list[int], constraint: dict, max_new: int) -> list[int]:
    """Constrained plain decoding with none of the engine: the target model's forward over
    the whole sequence, its last row masked to what the grammar allows, the argmax."""
    m = Matcher.start(parse_constraint(**constraint), vocabulary(engine))
    ids, out = list(prompt_ids), []
    with torch.no_grad():
        while len(out) < max_new:
            logits = engine.target.model(torch.tensor([ids])).logits[0, -1].float()
            tok = int(logits.masked_fill(~m.allowed(), float("-inf")).argmax())
            m.advance([tok])
            ids.append(tok)
            out.append(tok)
            if tok in engine.target.eos_ids:
                break
    return out


def generate(engine, constraint: dict, **kw):
    return engine.generate(GenerationRequest(prompt=kw.pop("prompt", "Answer in the form asked."),
                                             max_new_tokens=kw.pop("max_new_tokens", 40), **constraint, **kw))


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=["json_schema", "regex", "choices"])
@pytest.mark.parametrize("block_size", [1, 4, None])
def test_greedy_with_speculation_is_constrained_plain_decoding(tiny_text_engine, constraint, block_size):
    res = generate(tiny_text_engine, constraint, block_size=block_size)
    assert res.output_ids == reference(tiny_text_engine, res.prompt_ids, constraint, 40)
    # Every token the grammar forbids was rejected where it was drafted: each verified draft
    # the step kept is in the output, and the output keeps to the grammar (advance refuses any other).
    m = Matcher.start(parse_constraint(**constraint), vocabulary(tiny_text_engine))
    m.advance(res.output_ids)
    assert res.stats.truncated == (not m.accepts_eos())


def test_a_whole_answer_is_valid_and_ends_there(tiny_text_engine):
    for constraint, valid in (({"choices": LABELS}, lambda s: s in LABELS),
                              ({"regex": DATE}, lambda s: len(s) == 10 and s[4] == s[7] == "-"),
                              ({"json_schema": TICKET}, lambda s: set(json.loads(s)) == set(TICKET["properties"]))):
        res = generate(tiny_text_engine, constraint, max_new_tokens=60)
        assert res.finish_reason == "stop" and res.stats.truncated is False, res.text
        assert res.output_ids[-1] in tiny_text_engine.target.eos_ids and valid(res.text), res.text
        # the grammar's time is counted, and is part of the decode's
        assert 0 < res.stats.constraint_s < res.stats.decode_s
        assert res.stats.to_dict()["constraint_s"] == res.stats.constraint_s


def test_an_answer_cut_short_is_truncated(tiny_text_engine):
    res = generate(tiny_text_engine, {"json_schema": TICKET}, max_new_tokens=3)
    assert res.finish_reason == "length" and res.stats.truncated is True
    assert res.stats.to_dict()["truncated"] is True
    with pytest.raises(ValueError):
        json.loads(res.text)
    plain = tiny_text_engine.generate(GenerationRequest(prompt="x", max_new_tokens=3))
    assert plain.stats.truncated is None and plain.stats.to_dict()["truncated"] is None


def test_a_batch_of_eight_constraints_equals_each_alone(tiny_text_engine):
    """Eight callers with eight different forms in the same steps (auto: the suffix and
    forced proposers draft, at the batch's prices; fixed sizes: the drafter): each output is
    what the request gets alone, and with a fixed size so is each step's drafts and
    acceptances."""
    reqs = [GenerationRequest(prompt=f"Request {i}: answer.", max_new_tokens=24, block_size=[None, 4][i % 2], **c)
            for i, c in enumerate(EIGHT)]
    alone = [tiny_text_engine.generate(r) for r in reqs]
    together = tiny_text_engine.generate_many(reqs)
    for r, a, b in zip(reqs, alone, together):
        assert b.output_ids == a.output_ids
        assert b.stats.truncated == a.stats.truncated
        if r.block_size is not None:
            assert [(s.draft_ids, s.accepted) for s in b.stats.steps] == [
                (s.draft_ids, s.accepted) for s in a.stats.steps]


# --- the sampling law under the mask -----------------------------------------------------


def masked_law(engine, prompt_ids: list[int], constraint: dict, temperature: float) -> dict:
    """The exact law of whole outputs (token tuples) under constrained plain sampling: every
    path the grammar allows, each row the target's warped law restricted to the allowed
    tokens and renormalised (what `sampling.warp(..., allowed=)` samples)."""
    m = Matcher.start(parse_constraint(**constraint), vocabulary(engine))
    law: dict = {}

    def walk(ids, out, p):
        with torch.no_grad():
            logits = engine.target.model(torch.tensor([ids])).logits[0, -1].double() / temperature
        allowed = m.allowed()
        probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
        for tok in allowed.nonzero().flatten().tolist():
            q = p * float(probs[tok])
            if tok in engine.target.eos_ids:
                law[tuple(out + [tok])] = law.get(tuple(out + [tok]), 0.0) + q
                continue
            m.advance([tok])
            walk(ids + [tok], out + [tok], q)
            m.rollback(1)

    walk(list(prompt_ids), [], 1.0)
    assert math.isclose(sum(law.values()), 1.0, rel_tol=1e-6)
    return law


@pytest.mark.parametrize("block_size, verify", [(None, None), pytest.param(4, "probabilistic", marks=pytest.mark.slow),
                                                pytest.param(4, "strict", marks=pytest.mark.slow)])
def test_sampling_with_speculation_follows_the_masked_law(tiny_text_engine, block_size, verify):
    """A choice, then text the grammar forces (auto: forced drafts), or the random drafter's
    sampled drafts, mostly forbidden (kept up to the first forbidden one, rejected there):
    the law of whole answers, token for token, is the masked target law."""
    constraint = {"regex": "(tech|bill)ing issue"}
    prompt = "Label this ticket."
    ids = tiny_text_engine.prompt_ids(GenerationRequest(prompt=prompt))
    law = masked_law(tiny_text_engine, ids, constraint, temperature=1.5)
    n = 300
    counts = Counter()
    for seed in range(n):
        res = generate(tiny_text_engine, constraint, prompt=prompt, temperature=1.5, seed=seed,
                       block_size=block_size, verify=verify, max_new_tokens=12)
        counts[tuple(res.output_ids)] += 1
    assert set(counts) <= set(law), f"outputs the grammar forbids: {set(counts) - set(law)}"
    # Outcomes expected fewer than 5 times share one cell (Pearson's rule of thumb).
    big = [o for o in law if law[o] * n >= 5]
    rest = [o for o in law if o not in big]
    observed = [float(counts[o]) for o in big] + [float(sum(counts[o] for o in rest))]
    expected = [law[o] for o in big] + [sum(law[o] for o in rest)]
    ok, detail = chi_square_ok(torch.tensor(observed), torch.tensor(expected))
    assert ok, detail


# --- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, code, words", [
    ({"choices": LABELS, "stop": ["x"]}, "conflicting_constraints", "stop"),
    ({"regex": DATE, "stop_ids": [5]}, "conflicting_constraints", "stop ids"),
    ({"choices": []}, "bad_choices", "empty"),
    ({"regex": "("}, "bad_regex", "unclosed"),
    ({"json_schema": {"type": "nonsense"}}, "bad_json_schema", "nonsense"),
    ({"json_schema": {"type": "array", "uniqueItems": True}}, "unsupported_schema", "uniqueItems"),
    ({"regex": "a", "json_schema": {}}, "conflicting_constraints", "json_schema and regex"),
])
def test_bad_constraints_are_refused_at_admit(tiny_text_engine, kwargs, code, words):
    with pytest.raises(DFlashError) as err:
        tiny_text_engine.admit(GenerationRequest(prompt="x", max_new_tokens=4, **kwargs))
    assert err.value.code == code and words in err.value.message, err.value.message


def test_a_target_without_a_tokenizer_cannot_take_a_constraint(tiny_engine):
    with pytest.raises(DFlashError) as err:
        tiny_engine.admit(GenerationRequest(input_ids=[1, 2, 3], max_new_tokens=4, choices=["a"]))
    assert err.value.code == "unsupported_option" and "tokenizer" in err.value.message


# --- the forced-token proposer ---------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forced_drafts_are_kept_every_time(tiny_text_engine, temperature):
    """The tokens the grammar forces, drafted with confidence 1 by the forced proposer alone:
    every one the target verifies it keeps (its masked row allows nothing else), greedy or
    sampled, and the greedy output is constrained plain decoding's."""
    res = generate(tiny_text_engine, {"json_schema": TICKET}, proposers=("forced",), temperature=temperature,
                   seed=3 if temperature else None, max_new_tokens=60)
    forced = res.stats.by_proposer["forced"]
    assert set(res.stats.by_proposer) == {"forced"}
    assert forced["steps"] > 0 and forced["accepted"] == forced["drafted"] >= len(res.output_ids) // 3
    assert res.stats.forced_tokens == forced["accepted"] == res.stats.to_dict()["forced_tokens"]
    if not temperature:
        assert res.output_ids == reference(tiny_text_engine, res.prompt_ids, {"json_schema": TICKET}, 60)


def test_certain_drafts_are_left_out_of_the_rate_and_the_calibration(tiny_text_engine):
    """The forced proposer alone: every draft it makes is certain (the grammar allows nothing
    else), so for the policy's rate each step counts as the plain step that found its one other
    token, and no calibration learns from certain tokens (step.py passes the rest only)."""
    engine = tiny_text_engine
    state = engine.start(GenerationRequest(prompt="Ticket:", json_schema=TICKET, proposers=("forced",),
                                           max_new_tokens=60))
    policy, observed = state.policy, []
    observe = policy.observe
    policy.observe = lambda offer, *rest: (observed.append(offer), observe(offer, *rest))  # noqa: E731
    while not state.done:
        engine.step([state])
    res = engine.finish(state)
    drafted = [o for o in observed if o is not None]
    assert drafted and res.stats.forced_tokens >= 3 * len(drafted)
    assert policy.tokens == len(observed)  # one found token a step, however many forced ones came with it
    assert all(e.calibration.outcomes == 0 for e in policy.estimates.values() if hasattr(e, "calibration"))


def test_the_forced_proposer_joins_constrained_auto_requests_only(tiny_text_engine):
    proposer = tiny_text_engine.proposer("forced")
    assert proposer is not None and "forced" in tiny_text_engine.status()["proposers"]
    for req, joins in ((GenerationRequest(prompt="x", choices=LABELS), True),
                       (GenerationRequest(prompt="x"), False),
                       (GenerationRequest(prompt="x", choices=LABELS, block_size=4), False),
                       (GenerationRequest(prompt="x", choices=LABELS, proposers=("suffix",)), False)):
        state = tiny_text_engine.admit(req)
        assert ("forced" in state.proposals) == joins, req
        tiny_text_engine.release(state)


def test_a_forced_offer_is_the_forced_run_within_the_step(tiny_text_engine):
    state = tiny_text_engine.admit(GenerationRequest(prompt="x", json_schema=TICKET))
    proposer = tiny_text_engine.proposer("forced")
    run = state.constraint.forced()
    assert len(run) > 2  # '{"plan": "' as the tokenizer writes it
    long, short, none = proposer.offer([(state, 16), (state, 3), (state, 1)])
    assert long.draft.tokens.tolist() == run and long.draft.confidence == [1.0] * len(run)
    assert short.draft.tokens.tolist() == run[:2] and none is None
    # after a whole enum value the grammar has one way on (`", "priority": `): the offer follows the matcher
    state.constraint.advance(run + tiny_text_engine.tokenizer.encode("pro", add_special_tokens=False))
    after = state.constraint.forced()
    assert after and proposer.offer([(state, 16)])[0].draft.tokens.tolist() == after
    tiny_text_engine.release(state)


def test_a_suffix_chain_starts_with_the_forced_run_and_goes_on_past_it(tiny_text_engine):
    """Where the grammar forces a run, the suffix proposer's chain is that run, certain, then
    what followed it in the workload's past answers (the value after that key)."""
    engine = tiny_text_engine
    state = engine.admit(GenerationRequest(prompt="x", json_schema=TICKET))
    run = state.constraint.forced()
    pro = engine.tokenizer.encode("pro", add_special_tokens=False)
    engine.release(state)
    engine.workloads.load("tickets", [run + pro + [engine.target.eos_ids[0]]])
    try:
        state = engine.admit(GenerationRequest(prompt="x", json_schema=TICKET, workload="tickets"))
        suffix = engine.proposer("suffix")
        (draft,) = suffix.propose([(state, 16)])
        assert draft.tokens.tolist()[: len(run) + len(pro)] == run + pro and draft.certain == len(run)
        assert draft.confidence[: len(run)] == [1.0] * len(run) and suffix.choices(state) is None
        (cut,) = suffix.propose([(state, len(run) + 1)])  # no room past the run: the forced proposer's offer alone
        assert len(cut.tokens) == 0
        engine.release(state)
    finally:
        engine.workloads.workloads.pop("tickets", None)


def test_forced_runs_in_suffix_chains_are_kept_and_counted(tiny_text_engine):
    """The suffix proposer alone, a workload answering alike twice: the second answer's chains
    carry its forced runs, every one kept and counted as forced, and the output is constrained
    plain decoding's."""
    engine = tiny_text_engine
    engine.workloads.load("tickets", [])
    try:
        first, second = (generate(engine, {"json_schema": TICKET}, workload="tickets", proposers=("suffix",),
                                  max_new_tokens=60) for _ in range(2))
    finally:
        engine.workloads.workloads.pop("tickets", None)
    assert second.output_ids == first.output_ids == reference(engine, first.prompt_ids, {"json_schema": TICKET}, 60)
    assert set(second.stats.by_proposer) == {"suffix"} and second.stats.forced_tokens > 0
    assert second.stats.forced_tokens <= second.stats.by_proposer["suffix"]["accepted"]
    assert len(second.stats.steps) < len(first.stats.steps)
