"""A draft model: a smaller model with the target's tokenizer drafts token by token (classic
speculative decoding, as llama.cpp's `-md`, vLLM's draft model and transformers' assisted
generation do it).

The draft model is a second `Target` (any backend: its own llama.cpp or transformers
instance) with a sequence of its own per request. A draft rolls that sequence back to the
longest prefix it shares with the request's committed tokens (drafts the target kept stay
cached), takes the committed tokens past it in one forward and then drafts one token per
forward, every drafting request in the same forwards. Greedy and the strict rule: its
argmax; the probabilistic rule: a sample of its warped distribution q, which the verify
rule's p/q acceptance needs, so sampled output keeps the target's law. A position's
confidence is its distribution's peak, as the DFlash drafter's.

It owns its price (`priced`): its forward of one token at a short context and its price per
row of catch-up, measured on the first request it joins, so the policy weighs its drafts at
what they cost here and drafts with it only where that pays.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from dflash.engine.calibration import Drafter
from dflash.engine.proposers.protocol import BaseProposer, Draft, Offer
from dflash.engine.sampling import argmax_rows, peak_probs, sample, warp
from dflash.engine.target import TargetRow
from dflash.errors import DFlashError

NAME = "draft_model"
CATCH_UP_ROWS = 16  # the catch-up timed for the price per pending row


def build(engine) -> "DraftModelProposer | None":
    """The engine's draft model as a proposer; None for an engine without one."""
    model = getattr(engine, "draft_model", None)
    return None if model is None else DraftModelProposer(model, engine.target, engine.config)


def check_same_tokenizer(target, model) -> None:
    """A draft model must speak the target's tokens: the same vocabulary (every token to the
    same id) and the same end tokens; DFlashError incompatible_drafter naming both otherwise."""
    t, d = target.tokenizer, model.tokenizer
    if t is None or d is None:
        raise DFlashError("incompatible_drafter", f"the draft model {model.name} and the target {target.name} must "
                          "both have a tokenizer to be checked alike")
    if t.get_vocab() != d.get_vocab() or set(target.eos_ids) != set(model.eos_ids):
        raise DFlashError("incompatible_drafter", f"the draft model {model.name} does not have the tokenizer of the "
                          f"target {target.name} (its vocabulary or end tokens differ): a draft model drafts the "
                          "target's token ids")


@dataclass
class DraftModelState:
    seq: object  # the draft model's sequence
    ids: list[int] = field(default_factory=list)  # the tokens it caches, in order
    synced: int = 0  # of them, the leading ones known to be committed


class DraftModelProposer(BaseProposer):
    name = NAME
    deferred = True

    def __init__(self, model, target, cfg):
        check_same_tokenizer(target, model)
        self.model, self.target, self.cfg = model, target, cfg
        self.vocab_size = target.vocab_size
        self._step_s: float | None = None  # one forward of one token (measured at first use)
        self._row_s = 0.0  # what each more row of catch-up adds
        self._priced: dict[int, tuple[object, object]] = {}

    # --- joining a request ---------------------------------------------------------------

    def join(self, state, request, allowed: set[str]) -> None:
        if state.block_size > 1 and NAME in allowed:
            state.proposals[NAME] = DraftModelState(self.model.new_sequence())

    def leave(self, state) -> None:
        ps = state.proposals.get(NAME)
        if ps is not None:
            self.model.free(ps.seq)

    def calibrations(self, state, request, prior, width: int) -> dict:
        return {NAME: Drafter(self.cfg, width, prior)} if NAME in state.proposals else {}

    # --- its price -------------------------------------------------------------------------

    def priced(self, prices):
        """`prices` with this model's drafts at what they cost here: D positions are D - 1
        forwards of one token, and each committed token past its cache one more row."""
        if self._step_s is None:
            self._measure()
        got = self._priced.get(id(prices))
        if got is None or got[0] is not prices:
            if len(self._priced) > 4096:
                self._priced.clear()
            draft = (0.0,) + tuple((D - 1) * self._step_s for D in range(2, len(prices.draft_s) + 1))
            got = self._priced[id(prices)] = (prices, replace(prices, draft_s=draft, context_row_s=self._row_s))
        return got[1]

    @torch.inference_mode()
    def _measure(self) -> None:
        from dflash.engine.costs import CONTEXT_TOKENS, bench_context, probe_prompt, timed

        model = self.model
        context = bench_context(model, CONTEXT_TOKENS, CATCH_UP_ROWS)
        prompt = probe_prompt(model, context + CATCH_UP_ROWS)
        seq = model.new_sequence()
        try:
            model.forward_batch([TargetRow(seq, prompt[:context], 1)])

            def run(n: int) -> None:
                model.forward_batch([TargetRow(seq, prompt[context:context + n], 1)])

            def back() -> None:
                model.rollback(seq, context)

            run(CATCH_UP_ROWS)  # warm up the larger shape
            back()
            one = timed(lambda: run(1), model.device, after=back)
            many = timed(lambda: run(CATCH_UP_ROWS), model.device, after=back)
        finally:
            model.free(seq)
        self._step_s, self._row_s = one, max(many - one, 0.0) / (CATCH_UP_ROWS - 1)

    def status(self) -> dict:
        return {"model": self.model.name, "backend": self.model.backend,
                "step_s": self._step_s, "catch_up_row_s": self._row_s}

    # --- drafting --------------------------------------------------------------------------

    @staticmethod
    def _shared(ps: DraftModelState, state) -> int:
        """How many leading tokens its cache shares with the request's committed ones (at most
        all but the last: a draft's first forward takes the last committed token)."""
        P = len(state.prompt_ids)
        committed = P + len(state.output_ids)
        n = min(ps.synced, committed - 1)
        while n < min(len(ps.ids), committed - 1):
            tok = state.prompt_ids[n] if n < P else state.output_ids[n - P]
            if ps.ids[n] != tok:
                break
            n += 1
        return n

    def offer(self, items: list[tuple[object, int]]) -> list[Offer | None]:
        """A deferred offer per state it drafts for, with the committed tokens its cache lacks
        besides the last (which every draft's first forward takes)."""
        out = []
        for state, _ in items:
            ps = state.proposals.get(NAME)
            out.append(None if ps is None else Offer(
                NAME, self, pending=len(state.prompt_ids) + len(state.output_ids) - 1 - self._shared(ps, state)))
        return out

    @torch.inference_mode()
    def propose(self, items: list[tuple[object, int]]) -> list[Draft]:
        """D - 1 tokens per (state, D), one forward per position for all states."""
        model = self.model
        rows, want = [], []
        for state, D in items:
            ps = state.proposals[NAME]
            n = self._shared(ps, state)
            model.rollback(ps.seq, n)
            committed = list(state.prompt_ids) + list(state.output_ids)
            ps.ids, ps.synced = committed[:n], n
            rows.append(TargetRow(ps.seq, committed[n:], 1))
            ps.ids.extend(committed[n:])
            ps.synced = len(committed)
            want.append(D - 1)
        tokens: list[list[int]] = [[] for _ in items]
        probs: list[list[torch.Tensor]] = [[] for _ in items]
        confidence: list[list[float]] = [[] for _ in items]
        live = list(range(len(items)))
        while live:
            logits = model.forward_batch(rows).logits
            nxt_rows, nxt_live = [], []
            for i, rows_i in zip(live, logits):
                state = items[i][0]
                tok, q, c = self._pick(self._fit(rows_i[-1:]), state)
                tokens[i].append(tok)
                confidence[i].append(c)
                if q is not None:
                    probs[i].append(q)
                if len(tokens[i]) < want[i]:
                    ps = state.proposals[NAME]
                    nxt_rows.append(TargetRow(ps.seq, [tok], 1))
                    ps.ids.append(tok)
                    nxt_live.append(i)
            rows, live = nxt_rows, nxt_live
        return [Draft(torch.tensor(toks, dtype=torch.long), torch.cat(ps) if ps else None,
                      conf if state.policy is not None else None)
                for toks, ps, conf, (state, _) in zip(tokens, probs, confidence, items)]

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        """Its logits over the target's vocabulary (a model's embedding may have more or fewer
        padding rows past the tokenizer's tokens; none of those is ever a draft)."""
        V = self.vocab_size
        if logits.shape[-1] == V:
            return logits.float()
        if logits.shape[-1] > V:
            return logits[..., :V].float()
        pad = logits.new_full((*logits.shape[:-1], V - logits.shape[-1]), float("-inf"))
        return torch.cat((logits, pad), -1).float()

    @staticmethod
    def _pick(logits: torch.Tensor, state) -> tuple[int, torch.Tensor | None, float]:
        """(token, the distribution it was sampled from or None for a point mass, confidence)
        from one row of logits [1, V], as the request's verify rule needs it."""
        if state.params.verify_mode == "probabilistic":
            q = warp(logits, state.params)
            tok = int(sample(q, state.generator)[0])
            return tok, q, float(q[0].max())
        return int(argmax_rows(logits)[0]), None, peak_probs(logits)[0]
