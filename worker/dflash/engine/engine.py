"""The engine: a target and its proposers loaded once, serving validated generation requests.

This is the one entry point the CLI, the worker's scheduler and the benchmarks share.
`admit(request)` validates and tokenises a request into a new DecodeState (nothing cached
yet); `step(states)` runs one batched step for any set of states (prefill chunks and
draft / verify / commit, one target forward; see step.py); `finish(state)` turns a state
into ids, text and statistics and frees its memory. `start(request)` is admit plus the
whole prefill, `generate()` is start, steps, finish, and `generate_many()` runs several
requests as one batch.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash.engine import step as step_mod
from dflash.engine.drafter_config import DrafterConfig
from dflash.engine.dtypes import DRAFT_DTYPES
from dflash.engine.knobs import PolicyConfig
from dflash.engine.sampling import SamplingParams, argmax_rows
from dflash.engine.costs import CostCurve, Prices, load_or_measure
from dflash.engine.drafter import DFlashDrafter
from dflash.engine.prefix_cache import PrefixCache
from dflash.engine.policy import BlockPolicy, Prior, explain
from dflash.engine.proposers.dflash import NAME as DFLASH
from dflash.engine.proposers.dflash import DFlashProposer, DrafterInUse
from dflash.engine.proposers import head as head_mod
from dflash.engine.proposers.head import NAME as HEAD
from dflash.engine.proposers.suffix import NAME as SUFFIX
from dflash.engine.proposers.suffix import SuffixProposer
from dflash.engine.state import DecodeState, StepResult
from dflash.engine.versions import model_digest
from dflash.engine.stats import GenerationStats
from dflash.engine.stops import StopStrings
from dflash.engine.target import Target
from dflash.engine.target.hf import HFTarget
from dflash.engine.workloads import WorkloadMemory
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


def check_compatible(target: Target, cfg: DrafterConfig) -> None:
    """A drafter must match the target it shares embeddings, head and features with."""
    if cfg.hidden_size != target.hidden_size:
        raise DFlashError(
            "incompatible_drafter",
            f"drafter hidden size {cfg.hidden_size} does not match the target's {target.hidden_size}",
        )
    if cfg.vocab_size != target.vocab_size:
        raise DFlashError(
            "incompatible_drafter",
            f"drafter vocabulary {cfg.vocab_size} does not match the target's {target.vocab_size}",
        )
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise DFlashError("incompatible_drafter", f"mask token id {cfg.mask_token_id} is outside the target vocabulary")
    if cfg.num_target_layers != target.num_layers:
        raise DFlashError(
            "incompatible_drafter",
            f"drafter was trained for a {cfg.num_target_layers}-layer target; this target has {target.num_layers}",
        )
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise DFlashError(
            "incompatible_drafter", f"target_layer_ids {bad} are outside the target's {target.num_layers} layers"
        )


def resolve_draft_dtype(choice, target: Target) -> torch.dtype | None:
    """The precision the drafter computes in. None: the target's (drafts bit-identical to the
    reference implementation's at fp32). "auto": None here, and the engine measures (see
    fastest_draft). Or a name of DRAFT_DTYPES."""
    if choice is None:
        return target.dtype
    if isinstance(choice, torch.dtype):
        return choice
    if choice == "auto":
        return None
    if choice not in DRAFT_DTYPES:
        raise DFlashError("bad_dtype", f"draft dtype must be auto or one of {', '.join(DRAFT_DTYPES)}, got '{choice}'")
    if choice == "int8" and target.device.type != "cpu":
        raise DFlashError("bad_dtype", "draft dtype int8 runs on a CPU only")
    return DRAFT_DTYPES[choice]


def dtype_name(dtype: torch.dtype) -> str:
    """The name the options use (int8 for the int8-weight drafter)."""
    return next((k for k, v in DRAFT_DTYPES.items() if v == dtype), str(dtype).replace("torch.", ""))


def draft_candidates(target: Target) -> list[tuple[torch.dtype, str]]:
    """What `auto` tries, as (precision, runtime): on a GPU the target's dtype; on a CPU fp32,
    bf16 where the CPU has native bf16 matrix instructions (elsewhere it is ~100x slower),
    int8 weights in PyTorch, and the int8 drafter as one ONNX Runtime graph."""
    if target.device.type != "cpu":
        return [(target.dtype, "torch")]
    out = [(torch.float32, "torch")]
    if torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        out.append((torch.bfloat16, "torch"))
    out.append((torch.qint8, "torch"))
    try:
        import onnxruntime  # noqa: F401

        out.append((torch.qint8, "onnx"))
    except ImportError:
        pass
    return out


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
        if req.chat:
            from dflash.chat import chat_prompt_ids

            ids = chat_prompt_ids(self.tokenizer, req.prompt)
        else:
            ids = self.tokenizer(req.prompt).input_ids
        return list(ids)

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
        if any(getattr(req, name) is not None for name in CONSTRAINTS):
            from dflash.engine.grammar import refuse_constrained  # LLGuidance loads only for a constrained request

            refuse_constrained(req)  # until the step applies the mask (the plan: dflash.engine.grammar)
        return block

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""


class Engine(RequestChecks):
    endpoint = None  # the inference server an engine sends requests to (dflash.remote); None: it runs the models

    def __init__(
        self,
        target: Target,
        drafter: DFlashDrafter,
        drafter_name: str = "drafter",
        random_drafter=False,
        *,
        cost_curve: CostCurve | None = None,
        cost_dir: Path | None = None,
        policy_config: PolicyConfig = PolicyConfig(),
        drafter_sha256: str | None = None,
        draft_dtype: str | torch.dtype | None = None,
        draft_vocab: torch.Tensor | None = None,
        draft_runtime: str | None = None,
        head_dir: str | Path | None = None,
    ):
        check_compatible(target, drafter.config)
        self.target = target
        self.draft_vocab = check_draft_vocab(draft_vocab, target.vocab_size)
        self.draft_dtype = resolve_draft_dtype(draft_dtype, target)
        runtimes = [r for d, r in draft_candidates(target) if d == self.draft_dtype] or ["torch"]
        if draft_runtime is not None:
            runtimes = [draft_runtime]
        if self.draft_dtype is None or len(runtimes) > 1:  # auto: the fastest draft on this device, measured
            self.draft_dtype, self.draft_runtime = cached_draft_choice(
                cost_dir, target, drafter, self.draft_vocab, self.draft_dtype, drafter_sha256)
        else:
            self.draft_runtime = runtimes[0]
        self.random_drafter = random_drafter
        self.tokenizer = target.tokenizer
        self.dflash = DFlashProposer(target, drafter, drafter_name, drafter_sha256, self.draft_dtype, self.draft_vocab,
                                     self.draft_runtime)
        self.workloads = WorkloadMemory()
        # Finished requests' prompts kept in the target's K/V memory for their workload's next
        # ones, where the backend's cached rows are exact to reuse (dflash.engine.prefix_cache).
        self.prefixes = PrefixCache(target) if PrefixCache.supported(target) else None
        self.suffix = SuffixProposer(self.workloads, policy_config.calibration_bins)
        # The next-token head (block length auto), where `head_dir` holds one made for this
        # target and backend; None otherwise.
        self.head = head_mod.for_target(target, head_dir)
        self.policy_config = policy_config
        self.cost_dir = cost_dir
        self._cost_curve = cost_curve
        # The most requests one step serves (the scheduler's batch): the cost curve is
        # measured up to it. 1 for an engine that steps one request at a time.
        self.max_batch = 1
        self._drafting = 1  # how many requests drafted in the last step that drafted
        # Counts of recent `auto` generations: the starting prior of requests that bring none.
        self.recent_counts: deque[dict] = deque(maxlen=200)
        self._max_token_chars = None

    # --- the drafter, and replacing it between steps --------------------------------------

    @property
    def drafter(self):
        return self.dflash.current.model

    @property
    def drafter_name(self) -> str:
        return self.dflash.current.name

    @property
    def drafter_sha256(self) -> str | None:
        return self.dflash.sha256

    @property
    def drafter_version(self) -> str | None:
        return self.dflash.current.version

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.dflash.layer_ids

    def in_use(self) -> DrafterInUse:
        """The current drafter, as a state started now keeps it."""
        return self.dflash.current

    def swap_drafter(self, drafter, name: str, sha256: str | None = None, random_drafter: bool = False) -> dict:
        """Replace the drafter for states started from now on (call it between steps, on the
        thread that steps). States already started keep the drafter they started with. A
        drafter that does not fit the target is refused (DFlashError) and nothing changes.
        The cost curve is kept when the new drafter has the old one's shapes (its forwards
        cost the same) and measured again on next use otherwise; what recent generations
        taught block length auto is forgotten (it was the old drafter's acceptance)."""
        check_compatible(self.target, drafter.config)
        before = {"drafter": self.drafter_name, "drafter_version": self.drafter_version}
        same_shape = _geometry(drafter.config) == _geometry(self.drafter.config)
        self.dflash.install(drafter, name, sha256)
        self.random_drafter = random_drafter
        if not same_shape:
            self._cost_curve = None
        self.recent_counts.clear()
        return {"previous": before, "drafter": self.drafter_name, "drafter_version": self.drafter_version,
                "cost_curve_kept": same_shape}

    @property
    def block_size(self) -> int:
        return self.drafter.config.block_size

    @property
    def cost_curve(self) -> CostCurve:
        """The device's step prices, measured on first use (and cached on disk in cost_dir)."""
        if self._cost_curve is None:
            self._cost_curve = load_or_measure(self, self.cost_dir, self.max_batch)
        return self._cost_curve

    def prices(self, decoding: int, prefill_seqs: int = 0, prefill_tokens: int = 0) -> Prices:
        """One decoding request's prices in a step of `decoding` of them plus prefill chunks."""
        return self.cost_curve.prices(decoding, prefill_seqs, prefill_tokens, self._drafting)

    def note_drafting(self, n: int) -> None:
        if n:
            self._drafting = n

    # --- block-length policy --------------------------------------------------------------

    def prior_for(self, req: GenerationRequest) -> Prior:
        """The request's own workload prior, else what recent auto generations saw. A seeded
        sampling request uses neither, so the same seed gives the same output."""
        width = self.block_size - 1
        cfg = self.policy_config
        if req.prior is not None:
            return Prior.from_counts(req.prior.get("accepted"), req.prior.get("judged"), width, cfg)
        if req.seed is not None or not self.recent_counts:
            return Prior.default(width, cfg)
        pooled = pool_counts(self.recent_counts, width)
        return Prior.from_counts(pooled["accepted"], pooled["judged"], width, cfg)

    def explain_policy(self, prior: dict | None = None) -> dict:
        """What `auto` expects and where it starts, for a workload's pooled counts."""
        width = self.block_size - 1
        p = (Prior.from_counts(prior.get("accepted"), prior.get("judged"), width, self.policy_config)
             if prior else Prior.default(width, self.policy_config))
        return explain(self.cost_curve, self.block_size, p, self.policy_config)

    # --- decoding -------------------------------------------------------------------------

    def admit(self, req: GenerationRequest) -> DecodeState:
        """Validate and tokenise the request; its state caches nothing yet (the first steps
        prefill it)."""
        params = req.sampling()
        prompt_ids = self.prompt_ids(req)
        fixed = self.validate(req, len(prompt_ids))
        block = fixed if fixed is not None else self.block_size
        policy = None
        if fixed is None and block > 1:
            # A seeded sample starts from defaults only, so the same seed gives the same output.
            suffix_prior = (None if req.seed is not None
                            else self.suffix.prior(req.workload, self.policy_config.max_prior_strength))
            policy = BlockPolicy(self.cost_curve, block, self.prior_for(req), self.policy_config, suffix_prior)
        gen = None
        if not params.greedy:
            gen = torch.Generator(device=self.target.device)
            gen.manual_seed(params.seed if params.seed is not None else torch.seed())
        workload = self._workload(req)
        state = DecodeState(
            prompt_ids=prompt_ids,
            params=params,
            max_new_tokens=req.max_new_tokens,
            stop_ids=frozenset(self.target.eos_ids) | frozenset(req.stop_ids),
            block_size=block,
            policy=policy,
            seq=self.target.new_sequence(),
            generator=gen,
            stats=GenerationStats(block_size=block, policy="auto" if policy else "fixed",
                                  prompt_tokens=len(prompt_ids)),
            stops=StopStrings(self.decode, req.stop) if req.stop else None,
            workload=workload,
        )
        allowed = set(req.proposers) if req.proposers is not None else {DFLASH, SUFFIX, HEAD}
        if policy is not None and policy.drafter_sits_out(len(prompt_ids), self.steps_expected(req)):
            allowed.discard(DFLASH)  # auto would not run it here: no features, no lookups for it
        if block > 1 and (DFLASH in allowed or fixed is not None):  # a fixed block size: the drafter's
            state.proposals[DFLASH] = self.dflash.start(state)
        if policy is not None and req.proposals and SUFFIX in allowed:
            state.proposals[SUFFIX] = self.suffix.start(state)
        if policy is not None and self.head is not None and HEAD in allowed:
            state.proposals[HEAD] = self.head.start(state)
        return state

    def steps_expected(self, req: GenerationRequest) -> int:
        """The steps a request's drafter schedule is planned over: its max_new_tokens, or, for
        an unseeded request once `typical_after` auto generations have finished, the median steps
        they took if fewer (most requests stop at an end token long before max_new_tokens, and
        a drafter kept ready for a probe that the typical request never reaches costs the
        target's features on every step). A seeded one plans over max_new_tokens alone, so the
        same seed gives the same output."""
        steps = sorted(c["steps"] for c in self.recent_counts if "steps" in c)
        if req.seed is not None or len(steps) < self.policy_config.typical_after:
            return req.max_new_tokens
        return min(req.max_new_tokens, steps[len(steps) // 2])

    def knows_workload(self, key: str) -> bool:
        """Whether this engine holds a memory of the workload (else a request must bring its history)."""
        return key in self.workloads.workloads

    def _workload(self, req: GenerationRequest) -> str | None:
        """The request's workload key, its memory loaded (from the history it brings) if this
        engine has none yet; DFlashError need_history when it has none and brings none."""
        if req.workload is None:
            return None
        key = WorkloadMemory.check_key(req.workload)
        if self.workloads.get(key) is None:
            if req.history is None:
                raise DFlashError("need_history", f"this worker has no memory of workload {key!r} yet: "
                                  "send its past outputs as 'history'")
            self.workloads.load(key, check_history(req.history, self.target.vocab_size))
        return key

    def start(self, req: GenerationRequest) -> DecodeState:
        """Admit and prefill the request in one go; the state holds the first token."""
        state = self.admit(req)
        self.step([state])
        return state

    def step(self, states: list[DecodeState], budget: int | None = None) -> list[StepResult]:
        """One step for every state (none done): one target forward for all of them.
        `budget`: the most tokens that forward may take (prefill chunks fill what decoding
        leaves; None: whole prompts at once)."""
        if self.prefixes is not None:
            self._share_prompts(states, budget)
        results = step_mod.step(self, states, budget)
        for state in states:
            if state.done:  # its KV memory is not needed again: free it now, not when its call ends
                self._retire(state)
        return results

    def _share_prompts(self, states: list[DecodeState], budget: int | None) -> None:
        """The requests whose prefill may start this step (the step's prompt chunks go first
        come first served, within `budget`) copy the longest run of leading prompt tokens
        that a kept sequence or a request of the same workload in this step has cached: the
        rows of a table inserted at once prefill one after another, and each finds the
        template's rows in the one before it (dflash.engine.prefix_cache). Not a request the
        drafter runs in: it reads the features of every prompt row, and a copied row has none."""
        ahead = 0  # prompt tokens still to prefill of the requests before it
        for state in [s for s in states if s.prefilling]:
            if budget is not None and ahead >= budget:
                break
            if not state.prefilled and not state.seq.length and state.workload is not None \
                    and DFLASH not in state.proposals:
                live = [((o.prompt_ids + o.output_ids)[:o.seq.length], o.seq) for o in states
                        if o is not state and o.workload == state.workload and o.seq.length]
                state.prefilled = state.stats.cached_prompt_tokens = self.prefixes.reuse(
                    state.workload, state.prompt_ids, state.seq, live)
            ahead += len(state.prompt_ids) - state.prefilled

    def _retire(self, state: DecodeState) -> None:
        """A finished request's K/V memory: kept by the prefix cache for its workload's next
        prompts where it can be (the state gets an empty sequence), else freed."""
        if self.prefixes is not None and state.workload is not None:
            cached = state.length - 1  # every committed token but the last has its row cached
            if state.seq.length >= cached and self.prefixes.keep(
                    state.workload, (state.prompt_ids + state.output_ids)[:cached], state.seq):
                state.seq = self.target.new_sequence()
                return
        self.target.free(state.seq)

    def release(self, state: DecodeState) -> None:
        """Free a state's memory (a request that ends early: cancelled, past its deadline)."""
        self.target.free(state.seq)
        state.proposals.clear()

    def finish(self, state: DecodeState) -> GenerationResult:
        ids = state.output_ids
        text = self.decode(ids)
        if state.stops is not None and state.stops.hit_at is not None:
            text = state.stops.cut(text)
        state.stats.new_tokens = len(ids)
        if state.policy is not None:
            self.recent_counts.append({**state.policy.counts(), "steps": len(state.stats.steps)})
        if state.workload is not None and ids:
            self.workloads.remember(state.workload, list(ids))
        self.release(state)
        return GenerationResult(state.prompt_ids, list(ids), text, state.finish_reason or "length", state.stats)

    def generate(self, req: GenerationRequest) -> GenerationResult:
        state = self.start(req)
        while not state.done:
            self.step([state])
        return self.finish(state)

    def generate_many(self, reqs: list[GenerationRequest], budget: int | None = None) -> list[GenerationResult]:
        """Several requests as one batch: every step serves all that are not done (at most
        the target's `max_sequences` at once, earliest first, where it has such a bound)."""
        states = [self.admit(r) for r in reqs]
        cap = getattr(self.target, "max_sequences", None) or len(states)
        while True:
            live = [s for s in states if not s.done][:cap]
            if not live:
                break
            self.step(live, budget)
        return [self.finish(s) for s in states]


def check_draft_vocab(vocab, vocab_size: int) -> torch.Tensor | None:
    """A draft vocabulary as the engine takes it: distinct target ids (LongTensor) or None."""
    if vocab is None:
        return None
    vocab = torch.as_tensor(vocab, dtype=torch.long).flatten()
    if vocab.numel() == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= vocab_size or (
            vocab.unique().numel() != vocab.numel()):
        raise DFlashError("bad_drafter", f"the draft vocabulary must be distinct token ids in [0, {vocab_size})")
    return vocab


def cached_draft_choice(directory: Path | None, target: Target, drafter, vocab, only, sha256) -> tuple[torch.dtype, str]:
    """fastest_draft's answer, measured once per machine, threads, drafter and runtimes and
    kept beside the cost curves (a wrong choice costs speed, never output, so it is not
    spot-checked; a new drafter, vocabulary or runtime version measures again)."""
    import json

    from dflash.engine.costs import cpu_name, keyed_file, write_keyed
    from dflash.engine.target.fastest import runtime_versions

    names = {dtype_name(d): d for d, _ in draft_candidates(target)}
    key = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "device": str(target.device),
           "drafter": sha256 or "unversioned", "vocab": None if vocab is None else int(vocab.numel()),
           "only": None if only is None else dtype_name(only), "versions": runtime_versions(),
           "target": getattr(target, "backend", "hf"), "target_build": target.build,
           "timed": "draft and the verify after it"}  # what fastest_draft times (older choices timed the draft alone)
    path = None
    if directory is not None and sha256 is not None:
        path = keyed_file(directory, "draft-choice", key)
        try:
            got = json.loads(path.read_text())
            if got.get("key") == key and got.get("dtype") in names:
                return names[got["dtype"]], got["runtime"]
        except (OSError, ValueError):
            pass
    dtype, runtime = fastest_draft(target, drafter, vocab, only, sha256=sha256)
    if path is not None:
        write_keyed(path, {"key": key, "dtype": dtype_name(dtype), "runtime": runtime})
    return dtype, runtime


@torch.inference_mode()
def fastest_draft(target: Target, drafter, vocab: torch.Tensor | None, only: torch.dtype | None = None,
                  repeats: int = 5, sha256: str | None = None) -> tuple[torch.dtype, str]:
    """The drafter precision and runtime (of draft_candidates; of precision `only` if given)
    whose draft of a short block after a short context, with the target's forward that
    follows every draft, runs fastest here: a runtime whose threads spin on after the draft
    slows that forward (PyTorch's OpenMP kernels did: a drafted step of 4 on the ort target
    2.23 plain steps instead of 1.53), which the draft's own time does not show. Drafts are
    proposals: the choice changes how often they are kept, never the output. Measured at
    start, in a second or two."""
    import copy
    import time

    from dflash.engine.target import TargetRow

    candidates = [c for c in draft_candidates(target) if only is None or c[0] == only]
    if len(candidates) == 1 or not isinstance(drafter, torch.nn.Module):
        return candidates[0] if candidates else (only, "torch")
    cfg = drafter.config
    context = torch.randn(16, cfg.num_features * cfg.hidden_size, device=target.device)
    # The drafter's own digest names its built graph (a shared placeholder would hand one
    # drafter another's graph).
    sha256 = sha256 or model_digest(drafter)
    seq, prompt = target.new_sequence(), [(100 + i) % target.vocab_size for i in range(context.shape[0])]
    target.forward_batch([TargetRow(seq, prompt, 1)])
    # Rounds in which every candidate is timed once in turn, the fastest round of each kept
    # (as the cost curve is measured): a slow moment of a shared machine (a database starting
    # beside the worker) then costs every candidate one sample, not one candidate all of them.
    # A worker container once took PyTorch's int8 drafter this way, at 12 ms a drafted step on
    # the ort target against 3.5 ms for the ONNX Runtime one (Zen 2).
    # A proposer in fp32 or int8 drafts from the drafter as it is (int8: from a quantized
    # copy); one in another precision converts the module in place, so it gets a copy.
    proposers = [DFlashProposer(target, drafter if dtype in (torch.float32, torch.qint8) else copy.deepcopy(drafter),
                                "probe", sha256, dtype, vocab, runtime) for dtype, runtime in candidates]
    best_s = [float("inf")] * len(candidates)
    try:
        for round_ in range(repeats):  # the first round warms every candidate up
            for i, proposer in enumerate(proposers):
                state = proposer.start(None)
                t = time.perf_counter()
                logits = proposer.draft_logits([(state, context, 0, context.shape[0], 4)])[0]
                target.forward_batch([TargetRow(seq, [0] + argmax_rows(logits).tolist(), 4)])
                if round_:
                    best_s[i] = min(best_s[i], time.perf_counter() - t)
                target.rollback(seq, len(prompt))
    finally:
        target.free(seq)
    drafter.to(dtype=torch.float32)
    return candidates[min(range(len(candidates)), key=best_s.__getitem__)]


def _geometry(cfg: DrafterConfig) -> tuple:
    """What a drafter forward's price depends on."""
    return (cfg.block_size, cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, len(cfg.target_layer_ids))


def pool_counts(counts, width: int) -> dict:
    """Add per-position counts of several generations (missing positions count 0)."""
    acc, jud = [0] * width, [0] * width
    for c in counts:
        for i, (a, j) in enumerate(zip(c.get("accepted") or [], c.get("judged") or [])):
            if i < width:
                acc[i] += a
                jud[i] += j
    return {"accepted": acc, "judged": jud}


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
