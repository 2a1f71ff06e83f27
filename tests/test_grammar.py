"""Typed answers (dflash.engine.grammar): a request's constraint checked before anything is
generated, compiled once per (constraint, tokenizer), and a per-request matcher whose masks,
forced runs, advance and rollback the decoding step uses (tests/test_constrained.py: the
engine end to end); with the target's tokenizers (SmolLM2's, and Qwen2.5's where it is in
the model cache)."""

import json
from pathlib import Path

import pytest
import torch

from dflash.engine import grammar
from dflash.engine.grammar import Matcher, Vocabulary, allowed_prefix, batch_masks, parse_constraint, verify_length
from dflash.engine.sampling import verify_greedy
from dflash.errors import DFlashError
from dflash.model_files import cache_dir

TICKET = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "plan": {"enum": ["free", "pro", "enterprise"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "refund": {"type": "boolean"},
    },
    "required": ["name", "plan", "priority", "tags", "address", "refund"],
    "additionalProperties": False,
}
ANSWER = json.dumps({"name": "Zoë \"Z\" Ærø", "plan": "enterprise", "priority": 3, "tags": ["late", "🙁 broken"],
                     "address": {"city": "Oslo", "zip": "0150"}, "refund": False}, ensure_ascii=False)
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
LABELS = ["billing", "technical issue", "account access", "feature request", "other"]


@pytest.fixture(scope="module")
def smol(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="module")
def vocab(smol):
    return Vocabulary.of(smol, 49152, [2])


QWEN = cache_dir() / "qwen2.5-coder-1.5b-instruct"


def _tokenizers():
    # Qwen2.5's 152k vocabulary takes seconds to read: with the slow tests.
    return ["smollm2", pytest.param("qwen2.5", marks=[pytest.mark.slow, pytest.mark.skipif(
        not (QWEN / "tokenizer.json").exists(), reason=f"no Qwen2.5 tokenizer at {QWEN}")])]


@pytest.fixture(scope="module", params=_tokenizers())
def any_vocab(request, smol):
    """(tokenizer, vocabulary) for each target tokenizer there is."""
    if request.param == "smollm2":
        return smol, Vocabulary.of(smol, 49152, [2])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(QWEN)
    cfg = json.loads((QWEN / "config.json").read_text())
    return tok, Vocabulary.of(tok, cfg["vocab_size"], [tok.eos_token_id])


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


# --- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, code, words", [
    ({"json_schema": {"type": "nonsense"}}, "bad_json_schema", "nonsense"),
    ({"json_schema": {"type": "object", "properties": 5}}, "bad_json_schema", "properties"),
    ({"json_schema": {"type": "integer", "minimum": 5, "maximum": 2}}, "bad_json_schema", "minimum"),
    ({"json_schema": [1, 2]}, "bad_json_schema", "JSON object"),
    ({"json_schema": {"const": float("nan")}}, "bad_json_schema", "not JSON"),
    ({"json_schema": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}}, "unsupported_schema",
     "not"),
    ({"json_schema": {"type": "array", "uniqueItems": True}}, "unsupported_schema", "uniqueItems"),
    ({"json_schema": {"type": "string", "format": "colour"}}, "unsupported_schema", "colour"),
    ({"json_schema": {"$ref": "https://example.org/s.json"}}, "unsupported_schema", "example.org"),
    ({"json_schema": {"type": "object", "maxProperties": 2, "properties": {"a": {}}}}, "unsupported_schema",
     "maxProperties"),
    ({"json_schema": {"type": "object", "x-guidance": {"lenient": True}}}, "unsupported_schema", "x-guidance"),
    ({"regex": "(ab"}, "bad_regex", "unclosed group"),
    ({"regex": "(?=x)y"}, "bad_regex", "look-around"),
    ({"regex": r"(a)\1"}, "bad_regex", "backreferences"),
    ({"regex": 5}, "bad_regex", "string"),
    ({"choices": []}, "bad_choices", "empty"),
    ({"choices": ["a", ""]}, "bad_choices", "non-empty strings"),
    ({"choices": ["a", 3]}, "bad_choices", "non-empty strings"),
    ({"choices": "a"}, "bad_choices", "list"),
    ({"regex": "a", "choices": ["a"]}, "conflicting_constraints", "regex and choices"),
    ({"json_schema": {}, "regex": "a"}, "conflicting_constraints", "json_schema and regex"),
])
def test_bad_constraints_name_the_problem(kwargs, code, words):
    with pytest.raises(DFlashError) as err:
        parse_constraint(**kwargs)
    assert err.value.code == code and words in err.value.message, err.value.message


def test_the_codes_are_bad_input():
    from dflash.error_codes import BAD_INPUT

    for code in ("bad_json_schema", "unsupported_schema", "bad_regex", "bad_choices", "conflicting_constraints"):
        assert code in BAD_INPUT


def test_no_constraint_and_good_ones():
    assert parse_constraint() is None
    assert parse_constraint(json_schema=TICKET).kind == "json_schema"
    assert parse_constraint(regex=DATE).kind == "regex"
    c = parse_constraint(choices=["b", "a", "b"])
    assert c.kind == "choices" and c.grammar == parse_constraint(choices=["a", "b"]).grammar  # order, repeats: same


# --- the cache ----------------------------------------------------------------------------


def test_compiled_once_per_constraint_and_vocabulary(smol, vocab, monkeypatch):
    monkeypatch.setattr(grammar, "_compiled", grammar._LRU(2))
    c = parse_constraint(regex=DATE)
    a, b = Matcher.start(c, vocab), Matcher.start(parse_constraint(regex=DATE), vocab)
    assert grammar.cache_info()["compiled"] == {"hits": 1, "misses": 1, "size": 1}
    a.advance(enc(smol, "2026"))  # the copies are independent
    assert b.committed == 0 and not bool(b.allowed()[enc(smol, "-")[0]])
    wider = Vocabulary.of(smol, 49152 + 64, [2])  # another vocabulary: compiled again
    assert Vocabulary.of(smol, 49152 + 64, [2]) is wider
    Matcher.start(c, wider)
    assert grammar.cache_info()["compiled"]["misses"] == 2
    Matcher.start(parse_constraint(choices=LABELS), vocab)  # a third entry: the oldest goes
    assert grammar.cache_info()["compiled"]["size"] == 2
    Matcher.start(c, vocab)
    assert grammar.cache_info()["compiled"]["misses"] == 4


def test_ids_past_the_tokenizer_are_never_allowed(smol):
    wider = Vocabulary.of(smol, 49152 + 64, [2])
    m = Matcher.start(parse_constraint(json_schema={"type": "object"}), wider)
    rows = m.masks(enc(smol, '{"a": 1'))
    assert rows.shape == (len(enc(smol, '{"a": 1')) + 1, 49152 + 64)
    assert rows.any(-1).all() and not rows[:, 49152:].any()


# --- the matcher ----------------------------------------------------------------------------


def test_advance_rollback_and_the_pure_checks(smol, vocab):
    ids = enc(smol, ANSWER)
    m = Matcher.start(parse_constraint(json_schema=TICKET), vocab)
    assert allowed_prefix(m, ids) == len(ids)
    start = m.allowed()
    m.advance(ids[:7])
    after7, forced7 = m.allowed(), m.forced()
    bad = enc(smol, '"plan": "gold"')
    assert allowed_prefix(m, ids[7:]) == len(ids) - 7
    cut = allowed_prefix(m, ids[7:9] + bad)  # pure: nothing changes
    assert 2 <= cut < 2 + len(bad) and m.committed == 7 and torch.equal(m.allowed(), after7)
    with pytest.raises(ValueError):
        m.advance(ids[7:9] + bad)  # refused whole, state kept
    assert m.committed == 7 and torch.equal(m.allowed(), after7)
    m.advance(ids[7:20])
    m.rollback(13)
    assert torch.equal(m.allowed(), after7) and m.forced() == forced7
    m.rollback(7)
    assert torch.equal(m.allowed(), start)
    with pytest.raises(ValueError):
        m.rollback(1)


def test_masks_are_the_rows_a_verify_scores(smol, vocab):
    ids = enc(smol, ANSWER)
    m = Matcher.start(parse_constraint(json_schema=TICKET), vocab)
    m.advance(ids[:5])
    draft = ids[5:12]
    rows = m.masks(draft)
    assert rows.shape == (len(draft) + 1, 49152) and m.committed == 5
    step = Matcher.start(parse_constraint(json_schema=TICKET), vocab)
    step.advance(ids[:5])
    for i in range(len(draft) + 1):
        assert torch.equal(rows[i], step.allowed()), i
        if i < len(draft):
            assert rows[i, draft[i]]
            step.advance([draft[i]])
    forbidden = m.masks(draft[:2] + [2, 5, 6])  # no end inside a string: rows past it are never read
    assert torch.equal(forbidden[:3], rows[:3]) and not forbidden[2, 2] and forbidden[3:].all()
    assert m.committed == 5 and torch.equal(m.allowed(), rows[0])
    assert verify_length(m, draft[:2] + [2, 5], sampled=False) == 2
    assert verify_length(m, draft[:2] + [2, 5], sampled=True) == 3  # the forbidden token is rejected at its row
    assert verify_length(m, draft, sampled=True) == len(draft)


def test_end_of_answer(smol, vocab):
    ids = enc(smol, ANSWER)
    m = Matcher.start(parse_constraint(json_schema=TICKET), vocab)
    m.advance(ids[:-1])
    assert not m.accepts_eos() and not m.is_done() and not m.allowed()[2]
    m.advance(ids[-1:])
    assert m.accepts_eos() and m.is_done()
    assert m.allowed().nonzero().flatten().tolist() == [2]  # only the end of sequence
    assert allowed_prefix(m, [2, 2]) == 1
    m.advance([2])
    assert m.ended and m.is_done() and allowed_prefix(m, [2]) == 0
    m.rollback(1)
    assert not m.ended and allowed_prefix(m, [2]) == 1
    email = Matcher.start(parse_constraint(regex=r"[a-z]+@[a-z]+\.[a-z]{2,}"), vocab)
    email.advance(enc(smol, "ada@example.org"))
    assert email.accepts_eos() and not email.is_done()  # ".orgx" could follow
    assert email.allowed()[2] and email.allowed().sum() > 1


def walk_forced(tok, m, ids) -> int:
    """Along a valid answer's tokens: every forced run is the answer's next tokens, and where
    the grammar forces, the mask allows that one token only. Returns the forced tokens."""
    i = forced = 0
    while i < len(ids):
        run = m.forced()
        assert run == ids[i:i + len(run)], (tok.decode(ids[:i]), [tok.decode([t]) for t in run])
        if run:
            allowed = m.allowed()
            assert allowed.sum() == 1 and allowed[run[0]]  # confidence 1: the target can only take it
        n = max(len(run), 1)
        m.advance(ids[i:i + n])
        forced += len(run)
        i += n
    return forced


@pytest.mark.parametrize("constraint, answer, at_least", [
    ({"json_schema": TICKET}, ANSWER, 0.3),
    ({"choices": LABELS}, "feature request", 0.3),
    ({"regex": DATE}, "2026-12-06", 0.0),
])
def test_forced_runs_are_the_tokenizers_tokens(any_vocab, constraint, answer, at_least):
    tok, vocab = any_vocab
    ids = enc(tok, answer)
    m = Matcher.start(parse_constraint(**constraint), vocab)
    forced = walk_forced(tok, m, ids)
    assert forced >= at_least * len(ids)
    assert m.accepts_eos()


def test_a_batch_equals_each_alone(smol, vocab):
    """Requests with different constraints masked in one step: each request's rows are what
    it gets alone, whatever the others are and in whatever order."""
    cases = [({"json_schema": TICKET}, ANSWER, 6), ({"regex": DATE}, "2026-12-06", 3),
             ({"choices": LABELS}, "account access", 0), ({"json_schema": {"type": "array", "items": {
                 "type": "integer"}}}, "[1, 22, 333]", 2)]

    def fresh():
        out = []
        for constraint, answer, done in cases:
            ids = enc(smol, answer)
            m = Matcher.start(parse_constraint(**constraint), vocab)
            m.advance(ids[:done])
            out.append((m, ids[done:done + 4]))
        return out

    alone = [m.masks(d) for m, d in fresh()]
    batch = fresh()
    together = batch_masks([m for m, _ in batch] + [None], [d for _, d in batch] + [[1, 2]])
    assert together[-1] is None
    for a, b in zip(alone, together):
        assert torch.equal(a, b)
    backwards = batch_masks([m for m, _ in batch][::-1], [d for _, d in batch][::-1])[::-1]
    for a, b in zip(alone, backwards):
        assert torch.equal(a, b)


# --- exactness: speculation under the mask is constrained plain decoding ----------------


def fake_logits(prefix: tuple, vocab_size: int) -> torch.Tensor:
    """A deterministic stand-in for the target: logits that depend on the whole prefix."""
    g = torch.Generator().manual_seed(hash(prefix) % (2**31))
    return torch.randn(vocab_size, generator=g)


def plain_constrained(m: Matcher, n: int, vocab_size: int) -> list[int]:
    out = []
    while len(out) < n and not m.ended:
        logits = fake_logits(tuple(out), vocab_size)
        _, nxt = verify_greedy(torch.empty(0, dtype=torch.long), logits[None], m.masks([]))
        m.advance([nxt])
        out.append(nxt)
    return out


def speculative_constrained(m: Matcher, n: int, vocab_size: int, gen: torch.Generator) -> list[int]:
    out = []
    while len(out) < n and not m.ended:
        # A draft: the forced run, then random tokens (mostly ones the grammar rejects), cut.
        draft = m.forced() + torch.randint(0, vocab_size, (3,), generator=gen).tolist()
        draft = draft[:allowed_prefix(m, draft)]
        rows = torch.stack([fake_logits(tuple(out + draft[:i]), vocab_size) for i in range(len(draft) + 1)])
        a, nxt = verify_greedy(torch.tensor(draft, dtype=torch.long), rows, m.masks(draft))
        m.advance(draft[:a] + [nxt])
        out += draft[:a] + [nxt]
    return out[:n]


@pytest.mark.parametrize("constraint", [{"json_schema": TICKET}, {"regex": DATE}, {"choices": LABELS}])
def test_greedy_speculation_under_the_mask_is_plain_constrained_decoding(vocab, constraint):
    c = parse_constraint(**constraint)
    plain = plain_constrained(Matcher.start(c, vocab), 60, vocab.vocab_size)
    spec = speculative_constrained(Matcher.start(c, vocab), 60, vocab.vocab_size, torch.Generator().manual_seed(3))
    assert spec == plain


def test_a_finished_answer_is_valid(smol, vocab):
    for constraint, check in (({"regex": DATE}, lambda s: len(s) == 10 and s[4] == "-" and s[7] == "-"),
                              ({"choices": LABELS}, lambda s: s in LABELS)):
        m = Matcher.start(parse_constraint(**constraint), vocab)
        out = plain_constrained(m, 40, vocab.vocab_size)
        assert m.ended and m.is_done() and out[-1] == 2
        assert check(smol.decode(out[:-1])), smol.decode(out)


# --- the request through the worker ---------------------------------------------------------


def test_the_worker_answers_in_form_and_refuses_bad_input_before_generating(worker):
    from tests.test_worker import call
    from dflash.serve.client import WorkerError

    answer = call(worker, "generate", {"prompt": "x", "choices": ["yes", "no"], "max_new_tokens": 8})
    assert answer["text"] in ("yes", "no") and answer["truncated"] is False
    cut = call(worker, "generate", {"prompt": "x", "json_schema": TICKET, "max_new_tokens": 2})
    assert cut["truncated"] is True and cut["finish_reason"] == "length"
    for params, code in (({"prompt": "x", "choices": []}, "bad_choices"),
                         ({"prompt": "x", "json_schema": "{}"}, "bad_params"),
                         ({"prompt": "x", "choices": ["a"], "stop": ["b"]}, "conflicting_constraints"),
                         ({"prompt": "x", "regex": "(", "choices": ["a"]}, "conflicting_constraints")):
        with pytest.raises(WorkerError) as err:
            call(worker, "generate", params)
        assert err.value.code == code, params
    assert call(worker, "status")["ready"]


def test_the_cli_reads_a_schema_file_or_text(tmp_path):
    from dflash.cli import build_parser

    path = tmp_path / "s.json"
    path.write_text(json.dumps(TICKET))
    p = build_parser()
    assert p.parse_args(["generate", "--prompt", "x", "--json-schema", str(path)]).json_schema == TICKET
    assert p.parse_args(["generate", "--prompt", "x", "--json-schema", '{"type": "string"}']).json_schema == {
        "type": "string"}
    args = p.parse_args(["generate", "--prompt", "x", "--choice", "a", "--choice", "b c", "--regex", "[0-9]+"])
    assert args.choices == ["a", "b c"] and args.regex == "[0-9]+"
    assert p.parse_args(["generate", "--prompt", "x"]).choices is None
    for bad in (str(tmp_path / "missing.json"), "{not json", "[1]"):
        with pytest.raises(SystemExit):
            p.parse_args(["generate", "--prompt", "x", "--json-schema", bad])


def test_the_cli_exits_4_on_a_cut_answer(smol_dir, capsys):
    """A constrained answer max_new_tokens cut short is printed, but the command does not
    succeed: a script must not take it for a valid answer."""
    import dflash.cli as cli

    schema = json.dumps(TICKET)
    assert cli.main(["generate", "--prompt", "x", "--json-schema", schema, "--max-new-tokens", "2", "--json"]) == 4
    assert json.loads(capsys.readouterr().out)["truncated"] is True
    assert cli.main(["generate", "--prompt", "x", "--json-schema", schema, "--max-new-tokens", "2"]) == 4
    assert "[truncated:" in capsys.readouterr().err
    assert cli.main(["generate", "--prompt", "x", "--choice", "yes", "--choice", "no", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")


def test_the_cli_refuses_before_loading(capsys, monkeypatch):
    import dflash.cli as cli

    monkeypatch.setattr(cli, "engine_from_args", lambda args: pytest.fail("loaded the models"))
    assert cli.main(["generate", "--prompt", "x", "--choice", "a", "--regex", "b"]) == 2
    assert "at most one of json_schema, regex and choices" in capsys.readouterr().err
    assert cli.main(["generate", "--prompt", "x", "--choice", "a", "--stop", "b"]) == 2
    assert "cannot be combined with stop" in capsys.readouterr().err


def test_the_extraction_suite_compiles(vocab):
    from dflash.suites import HERE, load_suite

    lines = [json.loads(x) for x in (HERE / "extraction.jsonl").read_text().splitlines() if x.strip()]
    assert len(lines) >= 30 and len(load_suite("extraction")) == len(lines)
    kinds = set()
    for line in lines:
        constraint = {k: v for k, v in line.items() if k != "prompt"}
        assert len(constraint) == 1, line
        kinds |= set(constraint)
        Matcher.start(parse_constraint(**constraint), vocab)  # compiles with the target's tokenizer
    assert kinds == {"json_schema", "choices", "regex"}
