"""Generation requests as the engines take them, and the checks every engine shares.

`GenerationRequest` (a prompt and dflash.options' generation options) and
`GenerationResult`; `RequestChecks` validates a request against a target (its prompt, its
numbers) for the native engine and the remote one alike; `encode_prompt` tokenises a
prompt text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dflash.engine.sampling import SamplingParams
from dflash.engine.stats import GenerationStats
from dflash.errors import DFlashError
from dflash.options import CONSTRAINTS, defaults

_D = defaults()


@dataclass
class GenerationRequest:
    """A prompt (text or ids) and the generation options (dflash.options: their defaults,
    bounds and meaning live there)."""

    prompt: str | None = None
    input_ids: list[int] | None = None
    chat: bool = _D["chat"]
    max_new_tokens: int = _D["max_new_tokens"]
    block_size: int | None = _D["block_size"]  # None: `auto`, chosen per step; 1..B: that length every step
    temperature: float = _D["temperature"]
    top_k: int = _D["top_k"]
    top_p: float = _D["top_p"]
    seed: int | None = _D["seed"]
    verify: str | None = _D["verify"]
    proposals: bool = _D["proposals"]
    stop: list[str] = field(default_factory=list)
    stop_ids: list[int] = field(default_factory=list)
    # The answer's form, at most one (dflash.engine.grammar).
    json_schema: dict | None = _D["json_schema"]
    regex: str | None = _D["regex"]
    choices: list[str] | None = _D["choices"]
    # The workload whose memory the suffix proposer reads and the output joins (a key the
    # caller's side makes: one role's calls, or one role's rows of one table), and that
    # workload's past outputs (newest first) for when this engine has no memory of it yet.
    workload: str | None = None
    history: list[list[int]] | None = None
    # Which proposers may draft (None: all there are); the bench's `suffix` method says ("suffix",).
    proposers: tuple[str, ...] | None = None
    # Pooled per-position counts of earlier generations of the same workload (auto only):
    # {"accepted": [...], "judged": [...]}, as GenerationStats counts them.
    prior: dict | None = None

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.seed, self.verify)


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str
    stats: GenerationStats

    def to_dict(self) -> dict:
        stats = self.stats.to_dict()
        return {
            "output_ids": self.output_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "prompt_ids": self.prompt_ids,
            **stats,
        }


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class RequestChecks:
    """A request's prompt and numbers checked against a target: what every engine that takes
    GenerationRequests shares (this one, and dflash.remote's, which sends them on to an
    inference server). Needs `self.target` (its `context_length` and `vocab_size`),
    `self.tokenizer` and `self.block_size`."""

    _max_token_chars: int | None = None

    @property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (byte-level vocabularies: a vocabulary
        entry's length bounds the bytes it covers), so a prompt's length in characters
        bounds its token count from below without tokenising it."""
        if self._max_token_chars is None:
            vocab = self.tokenizer.get_vocab() if self.tokenizer is not None else {}
            self._max_token_chars = max((len(t) for t in vocab), default=1) or 1
        return self._max_token_chars

    def prompt_ids(self, req: GenerationRequest) -> list[int]:
        if (req.prompt is None) == (req.input_ids is None):
            raise DFlashError("bad_prompt", "give exactly one of a prompt text or input ids")
        ctx = self.target.context_length
        if req.input_ids is not None:
            ids = req.input_ids
            if not isinstance(ids, (list, tuple)) or not ids:
                raise DFlashError("empty_prompt", "input ids are empty")
            bad = [i for i in ids if not _is_int(i) or not 0 <= i < self.target.vocab_size]
            if bad:
                raise DFlashError(
                    "bad_input_ids", f"input ids {bad[:5]} are outside the vocabulary [0, {self.target.vocab_size})"
                )
            return list(ids)
        if not isinstance(req.prompt, str) or not req.prompt.strip():
            raise DFlashError("empty_prompt", "the prompt is empty")
        if self.tokenizer is None:
            raise DFlashError("bad_prompt", "this target has no tokenizer; pass input ids instead")
        # Refuse a prompt that cannot fit before tokenising it: tokenising megabytes would hold
        # the engine for seconds, and every other caller with it.
        at_least = math.ceil(len(req.prompt) / self.max_token_chars)
        if at_least >= ctx:
            raise DFlashError(
                "context_exceeded",
                f"prompt of {len(req.prompt)} characters is at least {at_least} tokens, past the context length {ctx}",
            )
        return encode_prompt(self.tokenizer, req.prompt, req.chat)

    def validate(self, req: GenerationRequest, n_prompt: int) -> int | None:
        """Check the request's numbers; returns the fixed block size, or None for auto."""
        block = req.block_size
        if block is not None and (not _is_int(block) or not 1 <= block <= self.block_size):
            raise DFlashError(
                "bad_block_size",
                f"block size must be an integer from 1 to the drafter's {self.block_size} (or null: auto), got {block}",
            )
        if not _is_int(req.max_new_tokens) or req.max_new_tokens < 1:
            raise DFlashError("bad_max_new_tokens", f"max_new_tokens must be an integer >= 1, got {req.max_new_tokens}")
        ctx = self.target.context_length
        if n_prompt + req.max_new_tokens > ctx:
            raise DFlashError(
                "context_exceeded",
                f"prompt ({n_prompt} tokens) + max_new_tokens ({req.max_new_tokens}) exceeds the context length {ctx}",
            )
        bad = [i for i in req.stop_ids if not _is_int(i) or not 0 <= i < self.target.vocab_size]
        if bad:
            raise DFlashError("bad_stop", f"stop ids {bad[:5]} are outside the vocabulary")
        if any(not isinstance(s, str) or not s for s in req.stop):
            raise DFlashError("bad_stop", "stop strings must be non-empty strings")
        if req.stop and self.tokenizer is None:
            raise DFlashError("bad_stop", "stop strings need a tokenizer")
        check_prior(req.prior)
        constraint_of(req)
        return block

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""


def constraint_of(req: GenerationRequest):
    """The request's constraint (dflash.engine.grammar.Constraint), checked; None without one."""
    if all(getattr(req, name) is None for name in CONSTRAINTS):
        return None
    from dflash.engine.grammar import constraint_of as checked  # LLGuidance loads only for a constrained request

    return checked(req)


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    """A prompt's token ids: as the user's turn of the tokenizer's chat template, or as it is."""
    if chat:
        from dflash.chat import chat_prompt_ids  # only the template's own markup becomes special tokens

        return chat_prompt_ids(tokenizer, prompt)
    return list(tokenizer(prompt).input_ids)


def check_history(history, vocab_size: int) -> list[list[int]]:
    """A workload's past outputs as requests bring them: lists of token ids, newest first."""
    ok = isinstance(history, list) and all(isinstance(h, list) for h in history)
    ok = ok and all(_is_int(t) and 0 <= t < vocab_size for h in history for t in h)
    if not ok:
        raise DFlashError("bad_params", "history must be a list of token-id lists (a workload's past outputs)")
    return history


def check_prior(prior):
    """A workload prior as requests carry it: None, or per-position counts. Returns it."""
    if prior is None:
        return None
    ok = isinstance(prior, dict) and set(prior) <= {"accepted", "judged"}
    for key in ("accepted", "judged"):
        values = prior.get(key) if isinstance(prior, dict) else None
        ok = ok and isinstance(values, list) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in values)
    if not ok:
        raise DFlashError("bad_prior", 'prior must be {"accepted": [counts], "judged": [counts]} of numbers >= 0')
    return prior
