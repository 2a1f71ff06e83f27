"""The engine: a target and its proposers loaded once, serving validated generation requests.

This is the one entry point the CLI, the worker's scheduler and the benchmarks share (the
engine core, dflash.engine.core). Its other jobs live beside it: request validation
(requests.py), the drafter it runs and its hot swap (drafters.py), the drafter's measured
precision and runtime (draft_runtime.py).
`admit(request)` validates and tokenises a request into a new DecodeState (nothing cached
yet); `step(states)` runs one batched step for any set of states (prefill chunks and
draft / verify / commit, one target forward; see step.py); `finish(state)` turns a state
into ids, text and statistics and frees its memory. `start(request)` is admit plus the
whole prefill, `generate()` is start, steps, finish, and `generate_many()` runs several
requests as one batch.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import torch

from dflash.engine import step as step_mod
from dflash.engine.costs import CostCurve, Prices, load_or_measure
from dflash.engine.draft_runtime import (  # noqa: F401 (re-exported: the engine's drafter precision, by name)
    draft_candidates, dtype_name, fastest_draft)
from dflash.engine.drafter import DFlashDrafter
from dflash.engine.drafters import (  # noqa: F401 (check_compatible re-exported)
    NO_DRAFTER, NoDrafter, check_compatible, dflash_proposer, same_geometry)
from dflash.engine.knobs import RECENT_PRIOR, SpeculativeConfig
from dflash.engine.policy import BlockPolicy, Prior, explain
from dflash.engine.prefix_cache import PrefixCache
from dflash.engine.proposers import registry
from dflash.engine.proposers.dflash import DrafterInUse
from dflash.engine.requests import (  # noqa: F401 (re-exported: what callers build requests with)
    GenerationRequest, GenerationResult, RequestChecks, check_history, check_prior, constraint_of)
from dflash.engine.state import DecodeState, StepResult
from dflash.engine.stats import GenerationStats
from dflash.engine.stops import StopStrings
from dflash.engine.target import Target
from dflash.engine.workloads import WorkloadMemory
from dflash.errors import DFlashError


class Engine(RequestChecks):
    endpoint = None  # the inference server an engine sends requests to (dflash.remote); None: it runs the models

    def __init__(
        self,
        target: Target,
        drafter: DFlashDrafter | None,
        drafter_name: str = "drafter",
        random_drafter=False,
        *,
        cost_curve: CostCurve | None = None,
        cost_dir: Path | None = None,
        config: SpeculativeConfig = SpeculativeConfig(),
        drafter_sha256: str | None = None,
        draft_dtype: str | torch.dtype | None = None,
        draft_vocab: torch.Tensor | None = None,
        draft_runtime: str | None = None,
        head_dir: str | Path | list[Path] | None = None,
        draft_model: Target | None = None,
    ):
        self.target = target
        self.config = config
        # The DFlash drafter as a proposer (None: the engine runs the free proposers only).
        self.dflash = None if drafter is None else dflash_proposer(
            target, drafter, drafter_name, drafter_sha256, draft_dtype, draft_vocab, draft_runtime, cost_dir, config)
        self.random_drafter = random_drafter
        self.tokenizer = target.tokenizer
        self.workloads = WorkloadMemory()
        # Finished requests' prompts kept in the target's K/V memory for their workload's next
        # ones, where the backend's cached rows are exact to reuse (dflash.engine.prefix_cache).
        self.prefixes = PrefixCache(target) if PrefixCache.supported(target) else None
        # The next-token head (block length auto): the first in `head_dir` (a folder, or a list
        # of them in order of preference) made for this target and backend.
        self.head_dir = head_dir
        # A smaller model with the target's tokenizer, drafting token by token (proposers/draft_model.py).
        self.draft_model = draft_model
        self.proposers = registry.build(self)  # every proposer, in the registry's order
        self.cost_dir = cost_dir
        self._cost_curve = cost_curve
        # The most requests one step serves (the scheduler's batch): the cost curve is
        # measured up to it. 1 for an engine that steps one request at a time.
        self.max_batch = 1
        self._drafting = 1  # how many requests drafted in the last step that drafted
        # Counts of recent `auto` generations: the starting prior of requests that bring none.
        self.recent_counts: deque[dict] = deque(maxlen=RECENT_PRIOR)
        self._max_token_chars = None

    # --- the drafter, and replacing it between steps --------------------------------------

    @property
    def draft_dtype(self) -> torch.dtype | None:
        """The drafter's precision (torch.qint8: int8 weights); None without a drafter."""
        return self.dflash.draft_dtype if self.dflash is not None else None

    @property
    def draft_vocab(self) -> torch.Tensor | None:
        """The tokens the drafter may propose (None: all, or no drafter)."""
        return self.dflash.vocab if self.dflash is not None else None

    @property
    def draft_runtime(self) -> str | None:
        """torch, or onnx (one ONNX Runtime graph); None without a drafter."""
        return self.dflash.runtime if self.dflash is not None else None

    @property
    def drafter(self):
        return self.dflash.current.model if self.dflash is not None else None

    @property
    def drafter_name(self) -> str | None:
        return self.in_use().name

    @property
    def drafter_sha256(self) -> str | None:
        return self.dflash.sha256 if self.dflash is not None else None

    @property
    def drafter_version(self) -> str | None:
        return self.in_use().version

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.dflash.layer_ids if self.dflash is not None else ()

    def in_use(self, state: DecodeState | None = None) -> DrafterInUse | NoDrafter:
        """The drafter a state keeps (the one it started with), or that one started now keeps."""
        kept = self.dflash.kept(state) if self.dflash is not None and state is not None else None
        return kept or (self.dflash.current if self.dflash is not None else NO_DRAFTER)

    def swap_drafter(self, drafter, name: str, sha256: str | None = None, random_drafter: bool = False) -> dict:
        """Replace the drafter for states started from now on (call it between steps, on the
        thread that steps). States already started keep the drafter they started with. A
        drafter that does not fit the target is refused (DFlashError) and nothing changes.
        The cost curve is kept when the new drafter has the old one's shapes (its forwards
        cost the same) and measured again on next use otherwise; what recent generations
        taught block length auto is forgotten (it was the old drafter's acceptance)."""
        if self.dflash is None:
            raise DFlashError("bad_drafter", "this engine runs without a drafter: there is none to replace")
        check_compatible(self.target, drafter.config, name)
        before = {"drafter": self.drafter_name, "drafter_version": self.drafter_version}
        same_shape = same_geometry(drafter.config, self.drafter.config)
        self.dflash.install(drafter, name, sha256)
        self.random_drafter = random_drafter
        if not same_shape:
            self._cost_curve = None
        self.recent_counts.clear()
        return {"previous": before, "drafter": self.drafter_name, "drafter_version": self.drafter_version,
                "cost_curve_kept": same_shape}

    @property
    def block_size(self) -> int:
        """The longest verify: the drafter's block, or without one the config's `max_block`."""
        return self.drafter.config.block_size if self.dflash is not None else self.config.max_block

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
        cfg = self.config
        if req.prior is not None:
            return Prior.from_counts(req.prior.get("accepted"), req.prior.get("judged"), width, cfg)
        if req.seed is not None or not self.recent_counts:
            return Prior.default(width, cfg)
        pooled = pool_counts(self.recent_counts, width)
        return Prior.from_counts(pooled["accepted"], pooled["judged"], width, cfg)

    def explain_policy(self, prior: dict | None = None) -> dict:
        """What `auto` expects and where it starts, for a workload's pooled counts."""
        width = self.block_size - 1
        p = (Prior.from_counts(prior.get("accepted"), prior.get("judged"), width, self.config)
             if prior else Prior.default(width, self.config))
        return explain(self.cost_curve, self.block_size, p, self.config)

    # --- decoding -------------------------------------------------------------------------

    def admit(self, req: GenerationRequest) -> DecodeState:
        """Validate and tokenise the request; its state caches nothing yet (the first steps
        prefill it)."""
        params = req.sampling()
        prompt_ids = self.prompt_ids(req)
        fixed = self.validate(req, len(prompt_ids))
        if fixed is not None and fixed > 1 and not any(p.deferred for p in self.proposers):
            raise DFlashError("bad_block_size", "this engine runs without a model drafter: block size 1 or null (auto)")
        block = fixed if fixed is not None else self.block_size
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
            policy=None,
            seq=self.target.new_sequence(),
            generator=gen,
            stats=GenerationStats(block_size=block, policy="auto" if fixed is None and block > 1 else "fixed",
                                  prompt_tokens=len(prompt_ids)),
            stops=StopStrings(self.decode, req.stop) if req.stop else None,
            workload=workload,
            constraint=self._matcher(req),
        )
        auto = fixed is None and block > 1
        if auto:  # the proposers the request lets draft (None: all there are)
            allowed = set(req.proposers) if req.proposers is not None else {n for p in self.proposers for n in p.parts}
        else:  # a fixed block size (or none): the model drafter's
            allowed = {p.name for p in self.proposers if p.deferred}
        for proposer in self.proposers:
            proposer.join(state, req, allowed)
            if proposer.deferred and proposer.name in state.proposals:  # one model drafter per request
                allowed = allowed - {p.name for p in self.proposers if p.deferred}
        if auto:
            state.policy = self._policy(state, req)
        # the proposers the generation has (its statistics say so even of those that never draft)
        state.stats.had(state.proposals)
        return state

    def _matcher(self, req: GenerationRequest):
        """The request's place in its grammar (dflash.engine.grammar.Matcher), or None
        without a constraint."""
        constraint = constraint_of(req)
        return None if constraint is None else self.matcher(constraint)

    def matcher(self, constraint):
        """A checked constraint's grammar at its start, on this target's vocabulary."""
        if self.tokenizer is None:
            raise DFlashError("unsupported_option", f"{constraint.kind} needs the target's tokenizer, and this "
                              "target has none")
        from dflash.engine.grammar import Matcher, Vocabulary

        return Matcher.start(constraint, Vocabulary.of(self.tokenizer, self.target.vocab_size, self.target.eos_ids))

    def _policy(self, state: DecodeState, req: GenerationRequest) -> BlockPolicy:
        """Block length auto for a new request: its calibration of every proposer that joined
        it. A model drafter that auto would never run in the request leaves it (no features,
        no lookups for it)."""
        width = min(state.block_size, self.cost_curve.max_block) - 1
        prior = self.prior_for(req)
        estimates = {}
        for proposer in self.proposers:
            estimates.update(proposer.calibrations(state, req, prior, width))
        drafter = next((p for p in self.proposers if p.deferred and p.name in state.proposals), None)
        policy = BlockPolicy(self.cost_curve, state.block_size, self.config, estimates,
                             drafter.priced if drafter is not None else None)
        if drafter is not None and policy.drafter_sits_out(len(state.prompt_ids), self.steps_expected(req)):
            drafter.leave(state)
            del state.proposals[drafter.name]
            policy.drop(drafter.name)
        return policy

    def status(self) -> dict:
        """What the worker's status shows of this engine (EngineCore)."""
        parts = {name: p.part(name).status() for p in self.proposers for name in p.parts}
        return {
            "device": str(self.target.device),
            "dtype": dtype_name(self.target.dtype),
            "draft_dtype": None if self.draft_dtype is None else dtype_name(self.draft_dtype),
            "draft_runtime": self.draft_runtime,  # torch, or onnx (one ONNX Runtime graph)
            # the next-token head's training record (None: no head for this target and backend)
            "head": parts.get("head"),
            # every proposer that runs, with what it shows of itself
            "proposers": parts,
            # tokens the drafter may propose (None: the whole vocabulary; dflash.engine.draft_vocab)
            "draft_vocab": None if self.draft_vocab is None else int(self.draft_vocab.numel()),
            "target_backend": self.target.backend,
            # how it was chosen (--target-backend auto: each candidate's measured prices and the
            # tokens per second it promised)
            "target_backend_choice": self.target.selection,
            # each target backend's verdict on this machine (probed in a child: dflash doctor)
            "backends": (self.target.selection or {}).get("backends"),
            # the remote backend's: whether the endpoint confirmed the tokenizer (null here: the
            # engine tokenises for its own target)
            "tokenizer_checked": None,
            "endpoint": self.endpoint,
            "model": self.target.name,
            "block_size": self.block_size,
            "cost_curve": self.cost_curve.to_dict(),
            "drafter_sha256": self.drafter_sha256,
            # the suffix proposer's memory of each workload's past outputs (dflash.engine.workloads)
            "workload_memory": self.workloads.status(),
            # prompts kept in the target's K/V memory for their workload's next ones
            # (dflash.engine.prefix_cache; None: the backend cannot reuse cached rows exactly)
            "prefix_cache": self.prefixes.status() if self.prefixes is not None else None,
        }

    def proposer(self, name: str):
        """The proposer (or the part of a composed one) of that name; None where there is none."""
        return next((p.part(name) for p in self.proposers if p.part(name) is not None), None)

    def steps_expected(self, req: GenerationRequest) -> int:
        """The steps a request's drafter schedule is planned over: its max_new_tokens, or, for
        an unseeded request once `typical_after` auto generations have finished, the median steps
        they took if fewer (most requests stop at an end token long before max_new_tokens, and
        a drafter kept ready for a probe that the typical request never reaches costs the
        target's features on every step). A seeded one plans over max_new_tokens alone, so the
        same seed gives the same output."""
        steps = sorted(c["steps"] for c in self.recent_counts if "steps" in c)
        if req.seed is not None or len(steps) < self.config.typical_after:
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
                    and not any(p.deferred and p.name in state.proposals for p in self.proposers):
                live = [((o.prompt_ids + o.output_ids)[:o.seq.length], o.seq) for o in states
                        if o is not state and o.workload == state.workload and o.seq.length]
                state.prefilled = state.stats.cached_prompt_tokens = self.prefixes.reuse(
                    state.workload, state.prompt_ids, state.seq, live)
            ahead += len(state.prompt_ids) - state.prefilled

    def _retire(self, state: DecodeState) -> None:
        """A finished request's K/V memory: kept by the prefix cache for its workload's next
        prompts where it can be (the state gets an empty sequence), else freed."""
        if self.prefixes is not None and state.workload is not None:
            # Every committed token but the last has its row cached, or fewer: tokens the
            # grammar forced at the end (a JSON answer's closing brace, its end of text) are
            # committed without a forward. Rows past them (drafts rejected) are never read.
            cached = min(state.length - 1, state.seq.length)
            if self.prefixes.keep(state.workload, (state.prompt_ids + state.output_ids)[:cached], state.seq):
                state.seq = self.target.new_sequence()
                return
        self.target.free(state.seq)

    def release(self, state: DecodeState) -> None:
        """Free a state's memory (a request that ends early: cancelled, past its deadline)."""
        self.target.free(state.seq)
        for proposer in self.proposers:
            proposer.leave(state)
        state.proposals.clear()

    def finish(self, state: DecodeState) -> GenerationResult:
        ids = state.output_ids
        text = self.decode(ids)
        if state.stops is not None and state.stops.hit_at is not None:
            text = state.stops.cut(text)
        state.stats.new_tokens = len(ids)
        if state.constraint is not None:  # cut by max_new_tokens or the context short of a whole answer
            state.stats.truncated = not state.constraint.accepts_eos()
            state.stats.constraint_s = state.constraint.seconds
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
        cap = self.target.max_sequences or len(states)
        while True:
            live = [s for s in states if not s.done][:cap]
            if not live:
                break
            self.step(live, budget)
        return [self.finish(s) for s in states]


def pool_counts(counts, width: int) -> dict:
    """Add per-position counts of several generations (missing positions count 0)."""
    acc, jud = [0] * width, [0] * width
    for c in counts:
        for i, (a, j) in enumerate(zip(c.get("accepted") or [], c.get("judged") or [])):
            if i < width:
                acc[i] += a
                jud[i] += j
    return {"accepted": acc, "judged": jud}


