"""The engine interface served by a remote inference server (`--backend openai`).

The worker's scheduler drives any engine through `admit`, `step`, `release` and `finish`;
this one keeps that contract and moves the work to the server at `--endpoint`, which does
its own batching and speculative decoding:

- `admit` checks the request exactly as the native engine does (the shared RequestChecks,
  the tokenizer and chat template of the served model, dflash.options' meanings), refuses
  what the server cannot honour (`block_size`, `verify`: it picks its own draft lengths and
  rule), and opens ONE streamed HTTP request for it, read by a thread of its own;
- `step` takes what has arrived for each state, waiting at most WAIT_S when nothing has,
  so the scheduler's loop sees cancels and deadlines often;
- `release` hangs up, and the server aborts the request;
- `finish` builds the same GenerationResult as the native engine: the server's text and
  token ids, its timings, and its speculative counts where it reports them.

Retries happen only while nothing has been generated (openai_client.py); an endpoint that
fails a request fails it with `endpoint_unavailable` or `endpoint_error`, raised from
`finish` so that only that request's ticket fails, never the others in the same step.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash.chat import tokenizer_disagreement
from dflash.engine.engine import GenerationRequest, GenerationResult, RequestChecks, check_prior, constraint_of
from dflash.engine.sampling import SamplingParams
from dflash.engine.state import StepResult
from dflash.engine.stats import GenerationStats
from dflash.errors import DFlashError
from dflash.remote.dialects import probe, served_ids, vocab_size
from dflash.remote.openai_client import END, Endpoint, Piece, Stream

log = logging.getLogger("dflash.remote")
WAIT_S = 0.02  # the longest a step waits for news: the scheduler checks cancel and deadline between steps
UNSUPPORTED = "the inference endpoint chooses its own draft lengths and verify rule"


@dataclass
class RemoteTarget:
    """The served model, as the worker's status and the tables name it."""

    name: str
    context_length: int
    vocab_size: int
    backend: str  # "openai/llama.cpp" or "openai": status and the dflash.generations `backend` column
    device: str = "remote"
    dtype: None = None
    max_sequences: int | None = None  # the endpoint batches on its own
    selection: dict | None = None


@dataclass(frozen=True)
class RemoteDrafter:
    """What drafts for the endpoint is the endpoint's business: unnamed here."""

    name: str | None = None
    version: str | None = None


@dataclass
class RemoteStats(GenerationStats):
    """A remote generation's statistics: tokens and timings, and the endpoint's speculative
    counts when it reports them (`speculative`: steps, drafted, accepted, source
    "response" or "metrics", and pooled: true when other requests ran meanwhile, so a
    /metrics delta holds theirs too). Per-position counts are the native engine's: none."""

    speculative: dict | None = None

    @property
    def num_steps(self) -> int:
        return int((self.speculative or {}).get("steps") or 0)

    @property
    def drafted(self) -> int:
        return int((self.speculative or {}).get("drafted") or 0)

    @property
    def accepted(self) -> int:
        return int((self.speculative or {}).get("accepted") or 0)

    @property
    def drafting_steps(self) -> int:
        return self.num_steps

    def to_dict(self) -> dict:
        out = super().to_dict()
        spec = self.speculative
        out.update(block_size=None, block_policy=None, num_steps=self.num_steps or None, steps=[],
                   drafting_steps=None, accepted_per_position=None, judged_per_position=None,
                   verify_length_histogram=None, speculative=spec,
                   proposers={"endpoint": {k: spec[k] for k in ("steps", "drafted", "accepted", "pooled")}}
                   if spec else {})
        return out


@dataclass
class RemoteState:
    """One request between steps: what it asked, its stream, and what has arrived."""

    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    stop_ids: frozenset[int]
    stream: Stream | None = None
    output_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "error" once done
    server_finish: str | None = None  # what the server said, before its stream ended
    error: DFlashError | None = None
    info: dict = field(default_factory=dict)  # the server's timings and counts
    started: float = field(default_factory=time.perf_counter)
    first_at: float | None = None
    ended_at: float | None = None
    overlapped: bool = False  # another request was live at the same time (a /metrics delta is pooled)
    ids_reported: bool = False  # the server sent token ids (else they come from tokenising the text)
    proposals: dict = field(default_factory=dict)  # the native engine's proposers: none here
    prefilled: int = 0
    workload: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        return False  # prefill is the server's

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


class _NoCostCurve:
    """No device prices here: the endpoint decides when drafting pays."""

    @staticmethod
    def to_dict():
        return None


class RemoteEngine(RequestChecks):
    random_drafter = False
    drafter_sha256 = None
    draft_dtype = None
    block_size = None  # no drafter block of its own (generate_block is refused)
    cost_curve = _NoCostCurve()

    def __init__(self, endpoint: Endpoint, dialect, tokenizer, target: RemoteTarget, tokenizer_checked: bool = True):
        self.client = endpoint
        # whether the endpoint's /tokenize confirmed that the ids sent are its model's (an
        # endpoint without one is served unchecked: status says so, not only the start-up log)
        self.tokenizer_checked = tokenizer_checked
        self.dialect = dialect
        self.tokenizer = tokenizer
        self.target = target
        self.max_batch = 1  # set by the scheduler; the endpoint batches on its own
        self.arrived = threading.Condition()
        self.live: dict[int, RemoteState] = {}  # the states whose streams are open, by id
        # Text, not token ids, where the endpoint refused ids once, or where its tokenizer could
        # not be checked: ids of another vocabulary would be read as other words (garbage with
        # no error), while text is read by the served model's own tokenizer.
        self.prompt_as_text = not tokenizer_checked

    # --- what the worker reads ---------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return self.client.url

    @property
    def drafter_name(self) -> str | None:
        return None

    @property
    def drafter_version(self) -> str | None:
        return None

    def in_use(self, state=None) -> RemoteDrafter:
        return RemoteDrafter()

    def status(self) -> dict:
        """What the worker's status shows of it (EngineCore): the served model and endpoint;
        no device, drafter, prices or memories of its own."""
        return {"device": self.target.device, "dtype": None, "draft_dtype": None, "draft_runtime": None, "head": None,
                "proposers": {}, "draft_vocab": None, "target_backend": self.target.backend,
                "target_backend_choice": None, "backends": None, "endpoint": self.endpoint, "model": self.target.name,
                "block_size": None, "cost_curve": None, "drafter_sha256": None, "workload_memory": None,
                "prefix_cache": None, "tokenizer_checked": self.tokenizer_checked}

    def knows_workload(self, key: str) -> bool:
        return True  # it drafts nothing from workloads: never ask a caller for their history

    def explain_policy(self, prior: dict | None = None) -> dict:
        check_prior(prior)
        return {"acceptance": [], "lengths": [], "start_block_size": None}

    def swap_drafter(self, *args, **kwargs) -> dict:
        raise DFlashError("unsupported_option", f"{UNSUPPORTED}: it serves its own drafter")

    # --- requests ------------------------------------------------------------------------------

    def admit(self, req: GenerationRequest) -> RemoteState:
        if req.block_size is not None:
            raise DFlashError("unsupported_option", f"{UNSUPPORTED}: block_size must be NULL with --backend openai")
        if req.verify not in (None, "greedy"):
            raise DFlashError("unsupported_option", f"{UNSUPPORTED}: verify must be NULL with --backend openai")
        params = req.sampling()
        prompt_ids = self.prompt_ids(req)
        self.validate(req, len(prompt_ids))
        constraint = constraint_of(req)  # checked by validate: bad input keeps its own code
        if constraint is not None:
            raise DFlashError("unsupported_option", f"{constraint.kind} is applied by dflash's own decoding step, "
                              "which does not run with --backend openai")
        opts = {"max_new_tokens": req.max_new_tokens, "temperature": params.temperature, "top_k": params.top_k,
                "top_p": params.top_p, "seed": params.seed, "stop": list(req.stop), "stop_ids": list(req.stop_ids)}
        body = self.dialect.body(prompt_ids, opts)
        text_body = None
        if self.dialect.text_fallback or self.prompt_as_text:  # the same prompt as text, special tokens and all
            text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
            if self.text_keeps_turns(prompt_ids, text):
                text_body = self.dialect.body(prompt_ids, opts, text)
                body, text_body = (text_body, None) if self.prompt_as_text else (body, text_body)
            elif self.prompt_as_text:
                raise DFlashError("bad_prompt", "the prompt's text spells the target's special tokens (its chat "
                                  "template's markup), and this endpoint takes no token ids: sent as text they "
                                  "would become that markup, so it is not sent (leave the markup out of the prompt)")
        state = RemoteState(prompt_ids, params, req.max_new_tokens, frozenset(req.stop_ids))
        with self.arrived:
            for other in self.live.values():  # their /metrics deltas will hold each other's counts
                other.overlapped = state.overlapped = True
            self.live[id(state)] = state
        state.stream = Stream(self.client, self.dialect.path, body, self.dialect.parse, self.arrived,
                              fallback=text_body, counters=self.dialect.metrics)
        return state

    def text_keeps_turns(self, ids: list[int], text: str) -> bool:
        """Whether `text` (the prompt's ids decoded) reads back as the same added tokens: a
        server that takes the prompt as text parses the tokens its tokenizer adds (the chat
        template's markup) out of it, so text in a prompt that spells them (kept as plain text
        in `ids`: dflash.chat) would become turns of its own. The server's tokenizer is this
        one (checked at start-up)."""
        added = self._added_ids
        again = self.tokenizer(text, add_special_tokens=False).input_ids
        return [t for t in again if t in added] == [t for t in ids if t in added]

    @functools.cached_property
    def _added_ids(self) -> frozenset:
        return frozenset(getattr(self.tokenizer, "added_tokens_decoder", {}) or ()) | frozenset(
            self.tokenizer.all_special_ids)

    def step(self, states: list[RemoteState], budget: int | None = None) -> list[StepResult]:
        """What has arrived for each state, as one step's results (waiting up to WAIT_S
        when nothing has)."""
        with self.arrived:
            if not any(s.stream.events for s in states if not s.done):
                self.arrived.wait(WAIT_S)
        return [self._collect(s) for s in states]

    def _collect(self, s: RemoteState) -> StepResult:
        anchor = s.output_ids[-1] if s.output_ids else s.prompt_ids[-1]
        committed: list[int] = []
        while s.stream.events and not s.done:
            item = s.stream.events.popleft()
            if item is END:
                s.finish_reason = s.server_finish or "length"
                self._ended(s)
            elif isinstance(item, DFlashError):
                s.error, s.finish_reason = item, "error"
                self._ended(s)
            else:
                self._take(s, item, committed)
        return StepResult(anchor=anchor, draft_ids=[], accepted=0, next_token=committed[-1] if committed else None,
                          committed=committed, draft_len=1, verify_len=1,
                          finish_reason=None if s.finish_reason == "error" else s.finish_reason)

    def _take(self, s: RemoteState, piece: Piece, committed: list[int]) -> None:
        if s.first_at is None and (piece.ids or piece.text):
            s.first_at = time.perf_counter()
        s.info.update(piece.info)
        s.texts.append(piece.text)
        ids = piece.ids
        s.ids_reported = s.ids_reported or bool(ids)
        if piece.finish_reason is not None:
            s.server_finish = piece.finish_reason
        # Stop ids and the token limit are checked here too: not every server takes stop ids,
        # and one that overshoots must not make an answer longer than asked. (At the limit
        # itself the server ends the answer, with its timings and counts: wait for them.)
        reason, room = None, s.max_new_tokens - len(s.output_ids)
        stop = next((i for i, t in enumerate(ids) if t in s.stop_ids), None)
        if stop is not None and stop < room:
            ids, reason = ids[: stop + 1], "stop"
        elif len(ids) > room:
            ids, reason = ids[:room], "length"
        s.output_ids += ids
        committed += ids
        if reason is not None:
            s.finish_reason = reason
            self._ended(s)

    def _ended(self, s: RemoteState) -> None:
        s.ended_at = s.ended_at or time.perf_counter()
        if s.stream is not None:
            s.stream.close()
        with self.arrived:
            self.live.pop(id(s), None)

    def release(self, state: RemoteState) -> None:
        """Hang up: the server aborts the request (a cancel, a deadline, a failed ticket)."""
        self._ended(state)

    def finish(self, state: RemoteState) -> GenerationResult:
        self.release(state)
        if state.stream is not None and state.stream.used_fallback:
            self.prompt_as_text = True
        if state.error is not None:
            raise state.error
        text = "".join(state.texts)
        ids = state.output_ids if state.ids_reported else self.tokenizer(text, add_special_tokens=False).input_ids
        stats = RemoteStats(block_size=1, prompt_tokens=len(state.prompt_ids), new_tokens=len(ids),
                            speculative=self._speculative(state, len(ids)))
        timings = state.info.get("timings") or {}
        first = state.first_at or state.ended_at
        if "prompt_ms" in timings and "predicted_ms" in timings:  # the server's own clock
            stats.prefill_s, stats.decode_s = timings["prompt_ms"] / 1000.0, timings["predicted_ms"] / 1000.0
        else:  # ours: to the first piece, then to the end
            stats.prefill_s, stats.decode_s = first - state.started, state.ended_at - first
        return GenerationResult(state.prompt_ids, list(ids), text, state.finish_reason or "length", stats)

    @staticmethod
    def _speculative(state: RemoteState, new_tokens: int) -> dict | None:
        """The endpoint's drafted and accepted counts: llama-server's per request (its
        verify steps derived as in the native engine's count: every step but the prefill's
        commits its accepted drafts plus one token), else a /metrics delta."""
        spec = state.info.get("speculative")
        if spec is not None:
            return {**spec, "steps": max(new_tokens - 1 - spec["accepted"], 0) or None}
        delta = state.info.get("counters_delta")
        if delta is not None:
            return {**delta, "source": "metrics", "pooled": state.overlapped}
        return None

    def generate(self, req: GenerationRequest) -> GenerationResult:
        state = self.admit(req)
        try:
            while not state.done:
                self.step([state])
        finally:
            self.release(state)
        return self.finish(state)


def remote_engine(url: str, tokenizer_dir: str | Path, model: str | None = None,
                  api_key_file: str | None = None) -> RemoteEngine:
    """An engine for the server at `url`, with the served model's tokenizer from
    `tokenizer_dir` (no weights are loaded). Raises endpoint_unavailable when the server
    does not answer, bad_target when the tokenizer cannot be the model's."""
    from transformers import AutoTokenizer

    endpoint = Endpoint(url, Endpoint.read_key(api_key_file))
    dialect, models = probe(endpoint, model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except Exception as exc:
        raise DFlashError("bad_target", f"cannot read a tokenizer from {tokenizer_dir}: {exc}") from None
    served_vocab = vocab_size(models, dialect.model)
    if served_vocab is not None and len(tokenizer) > served_vocab:
        raise DFlashError("bad_target", f"the tokenizer in {tokenizer_dir} has {len(tokenizer)} tokens, more than the "
                          f"served model's {served_vocab}: pass --target with the served model's tokenizer")
    checked = check_tokenizer(endpoint, dialect, tokenizer, tokenizer_dir)
    context = dialect.context_length or _context_of(tokenizer, tokenizer_dir)
    backend = "openai" if dialect.kind == "openai" else f"openai/{dialect.kind}"
    target = RemoteTarget(dialect.model, int(context), served_vocab or len(tokenizer), backend)
    return RemoteEngine(endpoint, dialect, tokenizer, target, checked)


def check_tokenizer(endpoint: Endpoint, dialect, tokenizer, source) -> bool:
    """The ids sent are the served model's only if its tokenizer is ours: the server's
    /tokenize must give our ids for a probe text and for that text in our chat template
    (its markup: the special tokens' ids). A difference is bad_target; a server without
    /tokenize cannot be checked (logged; False: the engine then sends text)."""
    try:
        differs = tokenizer_disagreement(tokenizer, lambda text: served_ids(endpoint, dialect, text))
    except LookupError:
        log.warning("the inference endpoint %s has no /tokenize: cannot check that the tokenizer of %s is the "
                    "served model's, so prompts go to it as text (its own tokenizer reads them)", endpoint.url,
                    source)
        return False
    if differs is not None:
        raise DFlashError("bad_target", f"the served model {dialect.model} does not tokenise as the tokenizer of "
                          f"{source} does ({differs}): pass --target with the served model's GGUF file, folder or "
                          "name")
    return True


def _context_of(tokenizer, folder) -> int:
    """The model's context where the server does not say it: its config, else the tokenizer's."""
    import json

    cfg = Path(folder) / "config.json"
    if cfg.is_file():
        n = json.loads(cfg.read_text()).get("max_position_embeddings")
        if isinstance(n, int) and n > 0:
            return n
    n = getattr(tokenizer, "model_max_length", None)
    return n if isinstance(n, int) and 0 < n < 10**7 else 2048
