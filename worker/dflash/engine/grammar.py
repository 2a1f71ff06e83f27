"""Typed answers: a request's constraint (`json_schema`, `regex` or `choices`), compiled by
LLGuidance into a per-request matcher whose mask restricts the target's rows.

Why LLGuidance (docs/investigations/2026-12-06-grammar-library.md): on this project's CPUs
it computes a mask in tens of microseconds, its forced tokens come as the target's own
tokens (XGrammar gives a string to tokenise again), it refuses a schema keyword it does
not implement (XGrammar compiled `if`/`not` and ignored them), and it has no dependencies.

How the engine uses it (the step knows only the `AnswerConstraint` hook of
dflash.engine.state, which `Matcher` implements; nothing in the step names a grammar):

- `parse_constraint(json_schema=, regex=, choices=)` checks a request's constraint before
  anything is generated and returns a `Constraint` (or None): DFlashError with a 22023 code
  naming the problem otherwise. `RequestChecks.validate` calls it through `constraint_of`,
  which also refuses stop strings and stop ids beside a constraint (the grammar decides
  where the answer ends; a stop would cut it short of a valid answer).
- `Vocabulary.of(tokenizer, vocab_size, eos_ids)`: the target's tokenizer as LLGuidance
  reads it (about a second to build for a 49k vocabulary, so built once per target).
  `Matcher.start(constraint, vocabulary)` at admit: a fresh matcher per request, copied
  from a compiled one cached per (constraint, vocabulary) (`compiled`, an LRU), kept in
  the request's `DecodeState.constraint`.
- Drafting: every draft is cut with `Matcher.cut(draft, sampled)` (`verify_length`) before
  the policy prices it: a chain the proposer chose (suffix, forced run, greedy drafter)
  stops before the first token the grammar forbids; a chain sampled from the drafter's law
  for the probabilistic rule keeps that one token, to be rejected at its row (cutting it
  away would bias the law; tests/test_sampling.py). The forced-token proposer
  (dflash.engine.proposers.forced) drafts `forced()` (the tokens the grammar forces from
  here, as the target's tokenizer writes them) with confidence 1: the mask there holds that
  one token, so the target takes it.
- Verify: `masks(draft)` gives one row of allowed tokens per verified row (row i: the state
  after draft[:i]); the verify rules take them: `sampling.verify_greedy(..., allowed=rows)`
  (the argmax over the allowed tokens) and `sampling.warp(logits, params, allowed=rows)`
  before the strict or probabilistic rule (the masked, renormalised target law). A
  forbidden draft has target probability 0 and is rejected at its row; the token the target
  adds is drawn from the masked law. Plain steps and a prompt's first token take `masks([])`.
- Commit: `advance(committed)`, over what the step commits only; the rejected drafts never
  entered the matcher (`masks`, `cut` and `allowed_prefix` leave it as they found it), so
  nothing needs undoing. `rollback(k)` undoes k committed tokens, for a caller that must
  take tokens back.
- End: once `is_done()`, the only token left is the end of sequence; where the target has
  one, `end_token()` names it and the step commits it without another forward (what the
  target's masked row would give, greedy or sampled). An output cut by max_new_tokens (or
  the context) before `accepts_eos()` is truncated (`truncated` in the statistics), never
  valid.

Tokenizer boundaries: where the grammar forces text, LLGuidance's mask allows only the
tokens the target's tokenizer writes for it (XGrammar's also allows other splits of the
same text), and `forced()` returns them, holding back a last token that the next bytes
could merge into. So a forced draft is the one token the mask leaves and is accepted by
construction, greedy or sampled. Exactness does not rest on it: a forced draft is
verified like any other.
"""

from __future__ import annotations

import functools
import json
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer
from llguidance.hf import from_tokenizer

from dflash.errors import DFlashError
from dflash.options import CONSTRAINTS

KINDS = CONSTRAINTS  # json_schema, regex, choices

# How a JSON schema's answer is written: one line with json.dumps's separators, no other
# whitespace. Fixed separators leave the grammar more tokens to force (after `", "` comes
# a key's opening quote, after a key `": "`), and a model cannot pad an answer with
# whitespace forever. `lenient: False`: a keyword LLGuidance does not implement is an
# error, never silently ignored (the output would not validate).
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False,
               "coerce_one_of": False}

# Compiled constraints kept per (constraint, vocabulary), and validated ones per constraint.
CACHE_SIZE = 128

# LLGuidance's messages for a schema it cannot take though the schema may be valid JSON
# Schema (a keyword or format it does not implement, a reference it will not fetch).
_UNSUPPORTED = ("Unimplemented keys", "Unknown format", "is not present in a registry", "not supported",
                "only supported when")


@dataclass(frozen=True)
class Constraint:
    """A checked constraint: its kind, LLGuidance's grammar for it (also its cache key) and
    what the request gave, in a line (for messages)."""

    kind: str
    grammar: str
    what: str


class _LRU:
    """A small thread-safe least-recently-used map (the worker validates on one thread and
    steps on another)."""

    def __init__(self, size: int):
        self.size, self.items, self.lock = size, OrderedDict(), threading.Lock()
        self.hits = self.misses = 0

    def get(self, key, make):
        with self.lock:
            if key in self.items:
                self.items.move_to_end(key)
                self.hits += 1
                return self.items[key]
        value = make()  # outside the lock: a big schema's compile must not hold other callers
        with self.lock:
            self.misses += 1
            self.items[key] = value
            self.items.move_to_end(key)
            while len(self.items) > self.size:
                self.items.popitem(last=False)
        return value

    def clear(self) -> None:
        with self.lock:
            self.items.clear()
            self.hits = self.misses = 0


_validated = _LRU(CACHE_SIZE)
_compiled = _LRU(CACHE_SIZE)


def _short(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _problem(message: str) -> str:
    """LLGuidance's error message without the grammar listing it appends."""
    return message.split("\n<state>")[0].split("\n<grammar>")[0].strip()


def parse_constraint(json_schema=None, regex=None, choices=None) -> Constraint | None:
    """The request's constraint, checked; None when it has none. At most one of the three."""
    given = [name for name, value in zip(KINDS, (json_schema, regex, choices)) if value is not None]
    if len(given) > 1:
        raise DFlashError("conflicting_constraints",
                          f"give at most one of json_schema, regex and choices; got {' and '.join(given)}")
    if not given:
        return None
    if json_schema is not None:
        constraint = _schema_constraint(json_schema)
    elif regex is not None:
        if not isinstance(regex, str):
            raise DFlashError("bad_regex", f"regex must be a string, got {type(regex).__name__}")
        constraint = Constraint("regex", LLMatcher.grammar_from_regex(regex), f"regex {_short(regex)!r}")
    else:
        constraint = _choices_constraint(choices)
    _validated.get(constraint.grammar, lambda: _check(constraint))
    return constraint


def constraint_of(req) -> Constraint | None:
    """A GenerationRequest's constraint (its json_schema, regex and choices), checked, and
    refused beside stop strings or stop ids: the grammar decides where the answer ends, and a
    stop that cut it short would return an answer that does not parse."""
    constraint = parse_constraint(getattr(req, "json_schema", None), getattr(req, "regex", None),
                                  getattr(req, "choices", None))
    if constraint is not None and (getattr(req, "stop", None) or getattr(req, "stop_ids", None)):
        given = " and ".join(n.replace("_", " ") for n in ("stop", "stop_ids") if getattr(req, n, None))
        raise DFlashError("conflicting_constraints", f"{constraint.kind} cannot be combined with {given}: the "
                          "grammar decides where the answer ends")
    return constraint


def _schema_constraint(schema) -> Constraint:
    if not isinstance(schema, dict):
        raise DFlashError("bad_json_schema", f"json_schema must be a JSON object, got {type(schema).__name__}")
    if "x-guidance" in schema:
        raise DFlashError("unsupported_schema", "json_schema: the key x-guidance is not supported (dflash sets how "
                          "the JSON is written)")
    try:
        # Key order kept: the answer writes properties in the order the schema lists them
        # (from SQL, whose jsonb keeps none, in the required list's: options.in_required_order).
        text = json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise DFlashError("bad_json_schema", f"json_schema is not JSON: {exc}") from None
    except RecursionError:
        raise DFlashError("bad_json_schema", "json_schema nests too deeply") from None
    return Constraint("json_schema", LLMatcher.grammar_from_json_schema(text, overrides=JSON_FORMAT),
                      f"json_schema {_short(text)}")


def _choices_constraint(choices) -> Constraint:
    if not isinstance(choices, (list, tuple)):
        raise DFlashError("bad_choices", f"choices must be a list of strings, got {type(choices).__name__}")
    if not choices:
        raise DFlashError("bad_choices", "choices is empty: give at least one choice")
    bad = [c for c in choices if not isinstance(c, str) or not c]
    if bad:
        raise DFlashError("bad_choices", f"choices must be non-empty strings, got {_short(repr(bad[0]))}")
    # Lark string literals take JSON's escapes; the order (and duplicates) do not change the language.
    literals = sorted({json.dumps(c, ensure_ascii=False) for c in choices})
    return Constraint("choices", LLMatcher.grammar_from_lark("start: " + " | ".join(literals)),
                      f"choices {_short(', '.join(literals))}")


def _check(constraint: Constraint) -> bool:
    """Raise the constraint kind's bad-input code with LLGuidance's reason if it cannot compile."""
    is_error, messages = LLMatcher.validate_grammar_with_warnings(constraint.grammar)
    if is_error:
        raise _compile_error(constraint, messages[0] if messages else "rejected")
    return True


def _compile_error(constraint: Constraint, message: str) -> DFlashError:
    why = _problem(message)
    if constraint.kind == "json_schema":
        code = "unsupported_schema" if any(m in why for m in _UNSUPPORTED) else "bad_json_schema"
        return DFlashError(code, f"json_schema: {why}")
    if constraint.kind == "regex":
        return DFlashError("bad_regex", f"{constraint.what} cannot be compiled: {_regex_reason(why)}")
    return DFlashError("bad_choices", f"choices cannot be compiled: {why}")


def _regex_reason(message: str) -> str:
    """The reason in LLGuidance's regex error, without the grammar line it quotes: the
    parser's `error: ...` line, or the first line less its position."""
    for line in message.splitlines():
        if line.startswith("error: "):
            return line[len("error: "):]
    first = message.splitlines()[0] if message else "rejected"
    return first.split("): ", 1)[-1] if first.startswith("at ") else first


class Vocabulary:
    """A target's tokenizer as LLGuidance reads it: the token ids of its logits (vocab_size,
    which may exceed the tokenizer's: ids past it are never allowed) and its end-of-sequence
    ids (what the mask allows once the grammar is satisfied)."""

    _made: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> {(V, eos): Vocabulary}
    _lock = threading.Lock()

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self.vocab_size = int(vocab_size)
        self.eos_ids = tuple(sorted(set(eos_ids)))
        if not self.eos_ids:
            raise ValueError("a grammar vocabulary needs at least one end-of-sequence id")
        self.ll: LLTokenizer = from_tokenizer(tokenizer, n_vocab=self.vocab_size, eos_token=list(self.eos_ids))

    @classmethod
    def of(cls, tokenizer, vocab_size: int, eos_ids) -> "Vocabulary":
        """The vocabulary of a tokenizer object, built once (it takes about a second)."""
        key = (int(vocab_size), tuple(sorted(set(eos_ids))))
        with cls._lock:
            hit = cls._made.get(tokenizer, {}).get(key)
        if hit is None:
            hit = cls(tokenizer, vocab_size, eos_ids)
            with cls._lock:
                cls._made.setdefault(tokenizer, {})[key] = hit
        return hit

    def unpack(self, bitmask: bytes | np.ndarray, rows: int = 1) -> np.ndarray:
        """LLGuidance's bitmask (one bit per token, little-endian words) as bools [rows, V]."""
        bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8).reshape(rows, -1), axis=-1, bitorder="little")
        return bits[:, : self.vocab_size].astype(bool)


def compiled(constraint: Constraint, vocabulary: Vocabulary) -> LLMatcher:
    """A matcher at the start of `constraint` for `vocabulary`, compiled once and kept
    (CACHE_SIZE of them, least recently used out); copy it, never advance it."""

    def make():
        m = LLMatcher(vocabulary.ll, constraint.grammar, log_level=0)
        if m.is_error():
            raise _compile_error(constraint, m.get_error())
        m.compute_bitmask()  # the first mask builds the lexer's tables, which copies share
        return m

    return _compiled.get((constraint.grammar, vocabulary), make)


def _timed(method):
    """Adds the method's time to the matcher's `seconds`: what the grammar costs a request."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t

    return wrapper


class Matcher:
    """One request's place in its grammar: the tokens it has committed, and what may come next."""

    def __init__(self, matcher: LLMatcher, vocabulary: Vocabulary, constraint: Constraint):
        self._m, self.vocabulary, self.constraint = matcher, vocabulary, constraint
        self.committed = 0
        self._ended = False  # the end of sequence is committed (it comes last)
        self._forced: list[int] | None = None  # `forced()` here (None: not asked since the last move)
        self.seconds = 0.0  # spent in the step's calls below (masks, cuts, commits, forced runs)

    @classmethod
    def start(cls, constraint: Constraint, vocabulary: Vocabulary) -> "Matcher":
        return cls(compiled(constraint, vocabulary).deep_copy(), vocabulary, constraint)

    def allowed(self) -> torch.Tensor:
        """The tokens allowed next: bool [V]."""
        return torch.from_numpy(self.vocabulary.unpack(self._m.compute_bitmask())[0])

    @_timed
    def masks(self, draft) -> torch.Tensor:
        """bool [len(draft) + 1, V]: row i allows what may follow the committed tokens and
        draft[:i] (the rows a verify of `draft` scores). After the first token the grammar
        forbids, rows allow everything: no verify rule reads them (the forbidden token is
        rejected at its own row), and a row must hold some token. After an end of sequence:
        the end only. The matcher is left as it was."""
        draft = [int(t) for t in draft]
        n = allowed_prefix(self, draft)
        rows, done = [], 0
        try:
            for i in range(len(draft) + 1):
                if i > n:
                    rows.append(b"\xff" * len(rows[0]))
                elif self.ended or (i and draft[i - 1] in self.vocabulary.eos_ids):
                    rows.append(self._eos_only())
                else:
                    rows.append(self._m.compute_bitmask())
                    if i < n and draft[i] not in self.vocabulary.eos_ids:
                        if not self._m.consume_token(draft[i]):
                            raise RuntimeError(f"grammar matcher refused an allowed draft: {self._m.get_error()}")
                        done += 1
        finally:
            if done:
                self._m.rollback(done)
        return torch.from_numpy(self.vocabulary.unpack(b"".join(rows), len(rows)))

    def _eos_only(self) -> bytes:
        bits = np.zeros(len(self._m.compute_bitmask()) * 8, dtype=np.uint8)
        bits[list(self.vocabulary.eos_ids)] = 1
        return np.packbits(bits, bitorder="little").tobytes()

    @_timed
    def advance(self, tokens) -> None:
        """Commit tokens the step accepted (every one allowed: the verify masked the rest)."""
        tokens = [int(t) for t in tokens]
        if allowed_prefix(self, tokens) < len(tokens):
            # A bug upstream (a token committed without the mask); refuse before the matcher's
            # state breaks (an LLGuidance matcher that consumed a bad token stays in error).
            raise ValueError(f"tokens {tokens} leave the grammar of {self.constraint.what}")
        for t in tokens:
            if t in self.vocabulary.eos_ids:
                # Kept here, not given to LLGuidance: its matcher, rolled back over an end of
                # sequence, no longer says it is finished nor allows the end again.
                self._ended = True
            elif not self._m.consume_token(t):
                raise RuntimeError(f"grammar matcher refused an allowed token: {self._m.get_error()}")
            self.committed += 1
        self._forced = None

    def rollback(self, k: int) -> None:
        """Undo the last k committed tokens."""
        if not 0 <= k <= self.committed:
            raise ValueError(f"cannot roll back {k} of {self.committed} committed tokens")
        in_matcher = k - int(self.ended and k > 0)
        if in_matcher and not self._m.rollback(in_matcher):
            raise RuntimeError(f"grammar matcher could not roll back {k} tokens: {self._m.get_error()}")
        if k:
            self._ended = False
        self.committed -= k
        self._forced = None

    @property
    def ended(self) -> bool:
        """Whether the end of sequence was committed: nothing may follow."""
        return self._ended

    @_timed
    def cut(self, draft, sampled: bool) -> int:
        """How much of a draft to verify (`verify_length`)."""
        return verify_length(self, draft, sampled)

    @_timed
    def end_token(self) -> int | None:
        """The end of sequence, where the answer is whole, nothing else may follow and the
        target has one end token (with several, its row chooses among them); else None."""
        if not self.ended and len(self.vocabulary.eos_ids) == 1 and self._m.is_stopped():
            return self.vocabulary.eos_ids[0]
        return None

    @_timed
    def forced(self) -> list[int]:
        """The tokens the grammar forces from here, as the target's tokenizer writes them
        (empty where the next token is a choice). Asked once per step by each proposer that
        reads it, computed once."""
        if self._forced is None:
            self._forced = [] if self.ended else list(self._m.compute_ff_tokens())
        return self._forced

    def accepts_eos(self) -> bool:
        """Whether the output so far is a whole answer (the grammar may end here)."""
        return self.ended or self._m.is_accepting()

    def is_done(self) -> bool:
        """Whether nothing but the end of sequence may come (or it came)."""
        return self.ended or self._m.is_stopped()


def takes_whole(matcher: Matcher, ids) -> bool:
    """Whether token ids spell an answer the grammar takes whole from the matcher's state
    (it reads bytes, so any tokenization of the same text does): how the bench checks an
    answer against a regex in the grammar library's own syntax. Advances the matcher."""
    ids = [int(t) for t in ids]
    if allowed_prefix(matcher, ids) < len(ids):
        return False
    matcher.advance(ids)
    return matcher.accepts_eos()


def allowed_prefix(matcher: Matcher, draft) -> int:
    """How many of `draft`'s tokens the grammar allows in a row from the matcher's state:
    a chain is cut at the first token it rejects. Leaves the matcher as it was."""
    draft = [int(t) for t in draft]
    if not draft or matcher.ended:
        return 0
    if matcher.is_done():
        # LLGuidance counts no token from a finished grammar, though its mask allows the end
        # of sequence there; nothing may follow it.
        return int(draft[0] in matcher.vocabulary.eos_ids)
    n = matcher._m.validate_tokens(draft)
    return min(n, next((i + 1 for i, t in enumerate(draft[:n]) if t in matcher.vocabulary.eos_ids), n))


def verify_length(matcher: Matcher, draft, sampled: bool) -> int:
    """How much of a draft to verify under the grammar (pure). A draft the proposer chose
    (a suffix chain, a forced run, a greedy drafter's tokens) stops before the first token
    the grammar forbids. A draft sampled from the drafter's law q for the probabilistic rule
    keeps that token, to be rejected at its row so the residual max(0, p - q) is drawn there:
    cut before it, the target's row would be drawn instead and the output would not follow
    the masked target law (tests/test_sampling.py shows the difference)."""
    n = allowed_prefix(matcher, draft)
    return n + 1 if sampled and n < len(draft) else n


def batch_masks(matchers: list[Matcher | None], drafts: list) -> list[torch.Tensor | None]:
    """Each request's verify masks (`Matcher.masks`), None for a request without a constraint.
    Each matcher reads only its own state, so a request's masks are the same in any batch."""
    return [None if m is None else m.masks(d) for m, d in zip(matchers, drafts)]


def cache_info() -> dict:
    """Hits, misses and sizes of the two caches (for tests and the worker's status)."""
    return {name: {"hits": c.hits, "misses": c.misses, "size": len(c.items)}
            for name, c in (("validated", _validated), ("compiled", _compiled))}
