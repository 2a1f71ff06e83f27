"""The DFlash drafter as a proposer: one drafter forward drafts a whole block, for several
requests at once.

Per request it keeps the drafter it started with (a hot swap changes the drafter of
requests started afterwards only), the drafter's KV cache of committed context and the
target features not yet fed to the drafter. A draft runs the drafter over
[anchor, MASK * (D - 1)] after those pending features; the LM head (borrowed from the
target) runs over the drafted rows only, one matmul for every request in the pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash.engine.calibration import Drafter
from dflash.engine.drafter import DraftCache, DraftPart
from dflash.engine.knobs import SpeculativeConfig
from dflash.engine.proposers.protocol import BaseProposer, Draft, Offer
from dflash.engine.sampling import argmax_rows, peak_probs, sample, warp
from dflash.engine.versions import label as version_label
from dflash.engine.versions import model_digest

NAME = "dflash"


def build(engine) -> "DFlashProposer | None":
    """The engine's drafter as a proposer (its drafter management makes it: dflash.engine.drafters);
    None for an engine without a drafter."""
    return engine.dflash


class DraftHead:
    """The drafter's LM head: the target's head (which the drafter borrows) restricted to the
    draft vocabulary, when the drafter has one (`vocab`: the target ids it may draft, the
    most frequent of the training corpus; dflash.train.draft_vocab), and computed in the
    drafter's precision (int8 weights on a CPU where that measured fastest). Over the whole
    vocabulary the head is about as large as the rest of the drafter together; drafts are
    proposals the target verifies, so a token outside the draft vocabulary is merely never
    proposed: output is unchanged."""

    def __init__(self, weight: torch.Tensor, vocab: torch.Tensor | None, dtype: torch.dtype, int8: bool,
                 runtime: str = "torch"):
        w = weight if vocab is None else weight[vocab.to(weight.device)]
        self.vocab = None if vocab is None else vocab.to(weight.device)
        self.size = w.shape[0]
        self._linear, self.weight = None, None
        if int8 and runtime == "onnx":  # in the drafter's runtime (drafter_graph.OnnxHead says why)
            from dflash.engine.drafter_graph import OnnxHead

            self._linear = OnnxHead(w)
        elif int8:
            layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
            layer.weight.data = w.float().contiguous()
            self._linear = quantize_int8(torch.nn.Sequential(layer))
        else:
            self.weight = w if w.dtype == dtype else w.to(dtype)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, size] over the draft vocabulary."""
        if self._linear is not None:
            return self._linear(hidden.float())
        return torch.nn.functional.linear(hidden.to(self.weight.dtype), self.weight).float()

    def token_ids(self, rows: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft-vocabulary rows."""
        return rows if self.vocab is None else self.vocab[rows]

    def full(self, probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """A distribution over the draft vocabulary as one over the target's (zero outside)."""
        if self.vocab is None:
            return probs
        out = probs.new_zeros(probs.shape[0], vocab_size)
        return out.index_copy_(1, self.vocab, probs)


def quantize_int8(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of `module` whose Linear layers run int8 weights with per-row int8 activations
    (PyTorch's dynamic quantization; FBGEMM/oneDNN kernels on x86)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(module, {torch.nn.Linear}, dtype=torch.qint8)


@dataclass(frozen=True)
class DrafterInUse:
    """A drafter and what drafting with it needs."""

    model: object  # DFlashDrafter (maybe with int8 Linear layers) or OnnxDrafter
    mask_embeds: torch.Tensor  # the target's embedding of the mask token, one row per block slot
    name: str
    version: str | None  # dflash.engine.versions: a digest of the weights
    head: DraftHead  # the borrowed LM head, over the draft vocabulary
    layer_ids: tuple[int, ...]
    source: object  # the drafter as it was given (before an int8 copy was made of it)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the activations the drafter takes."""
        return self.mask_embeds.dtype

    def block(self, anchor_embed: torch.Tensor, draft_len: int) -> torch.Tensor:
        return torch.cat((anchor_embed.to(self.dtype), self.mask_embeds[: draft_len - 1]))


@dataclass
class DFlashState:
    drafter: DrafterInUse
    cache: DraftCache
    pending: list[torch.Tensor] = field(default_factory=list)  # features the drafter has not seen


class DFlashProposer(BaseProposer):
    name = NAME
    deferred = True

    def __init__(self, target, drafter, name: str, sha256: str | None, dtype: torch.dtype,
                 vocab: torch.Tensor | None = None, runtime: str = "torch",
                 cfg: SpeculativeConfig = SpeculativeConfig()):
        """`dtype`: the drafter's precision; torch.qint8 runs its Linear layers (and the head)
        with int8 weights and fp32 activations. `vocab`: its draft vocabulary (None: all).
        `runtime`: "torch", or "onnx" for the int8 drafter as one ONNX graph run by ONNX
        Runtime (dflash.engine.drafter_graph)."""
        self.target = target
        self.draft_dtype = dtype  # as asked: torch.qint8 for int8 weights
        self.int8 = dtype == torch.qint8
        self.dtype = torch.float32 if self.int8 else dtype  # of the activations
        self.vocab = vocab
        self.runtime = runtime
        self.cfg = cfg
        self.install(drafter, name, sha256)

    def install(self, drafter, name: str, sha256: str | None) -> None:
        """Draft with this drafter from now on (requests already started keep theirs; the
        draft vocabulary stays: a swapped-in drafter continues the one it replaces)."""
        target, vocab = self.target, self.vocab
        model = drafter.to(device=target.device, dtype=self.dtype)
        self.sha256 = sha256 if sha256 is not None else model_digest(drafter)
        if self.int8 and isinstance(model, torch.nn.Module):
            if self.runtime == "onnx":
                from dflash.engine.drafter_graph import runner

                model = runner(model, self.sha256)
            else:
                model = quantize_int8(model)
        cfg = drafter.config
        # The mask rows of every block are the same: embed them once.
        mask = target.embed(torch.full((cfg.block_size,), cfg.mask_token_id, device=target.device)).to(self.dtype)
        head = DraftHead(target.head_weight(), vocab, self.dtype, self.int8, self.runtime)
        self.current = DrafterInUse(model, mask, name, version_label(self.sha256), head, tuple(cfg.target_layer_ids),
                                    drafter)

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.current.layer_ids

    def start(self, state) -> DFlashState:
        return DFlashState(self.current, self.current.model.new_cache())

    @staticmethod
    def kept(state) -> DrafterInUse | None:
        """The drafter a state started with (None: it drafts with none)."""
        ps = state.proposals.get(NAME)
        return ps.drafter if ps is not None else None

    def join(self, state, request, allowed: set[str]) -> None:
        if state.block_size > 1 and NAME in allowed:
            state.proposals[NAME] = self.start(state)

    def calibrations(self, state, request, prior, width: int) -> dict:
        return {NAME: Drafter(self.cfg, width, prior)} if NAME in state.proposals else {}

    def offer(self, items: list[tuple[object, int]]) -> list[Offer | None]:
        """Per state it drafts for: a deferred offer, with the target rows its next pass
        must take in first."""
        return [Offer(NAME, self, pending=sum(t.shape[0] for t in state.proposals[NAME].pending))
                if NAME in state.proposals else None for state, _ in items]

    @staticmethod
    def layers_of(state) -> tuple[int, ...]:
        ps = state.proposals.get(NAME)
        return ps.drafter.layer_ids if ps is not None else ()

    @staticmethod
    def observe(state, features: torch.Tensor | None) -> None:
        if features is not None:
            state.proposals[NAME].pending.append(features)

    def propose(self, items: list[tuple[object, int]]) -> list[Draft]:
        """Drafts for (state, D) pairs, in one drafter pass per drafter in use."""
        jobs = []
        for state, D in items:
            ps = state.proposals[NAME]
            ctx = torch.cat(ps.pending) if len(ps.pending) > 1 else ps.pending[0]
            ps.pending.clear()
            jobs.append((ps, ctx, state.output_ids[-1], state.length - 1, D))
        logits = self.draft_logits(jobs)
        return [_draft(rows, state, job[0].drafter.head, self.target.vocab_size)
                for rows, (state, _), job in zip(logits, items, jobs)]

    def draft_logits(self, jobs: list[tuple[DFlashState, torch.Tensor, int, int, int]]) -> list[torch.Tensor]:
        """fp32 logits [D - 1, K] over the draft vocabulary of the drafted rows for each (proposer state, new context
        features, anchor id, anchor position, D); the context enters each state's cache."""
        out: dict[int, torch.Tensor] = {}
        groups: dict[int, list[int]] = {}
        for i, job in enumerate(jobs):
            groups.setdefault(id(job[0].drafter), []).append(i)
        with torch.inference_mode():
            for members in groups.values():
                for i, rows in zip(members, self._forward([jobs[i] for i in members])):
                    out[i] = rows
        return [out[i] for i in range(len(jobs))]

    def _forward(self, jobs) -> list[torch.Tensor]:
        target = self.target
        drafter = jobs[0][0].drafter
        ids = torch.tensor([job[2] for job in jobs], device=target.device)
        anchors = target.embed(ids)
        parts = []
        for (ps, ctx, _, start, D), anchor in zip(jobs, anchors):
            positions = torch.arange(ps.cache.length, start + D, device=target.device)
            parts.append(DraftPart(ctx.to(drafter.dtype), drafter.block(anchor[None], D), positions, ps.cache))
        if len(parts) == 1 or not hasattr(drafter.model, "forward_packed"):
            hidden = [drafter.model(p.context[None], p.block[None], p.positions, p.cache)[0, 1:] for p in parts]
        else:
            packed = drafter.model.forward_packed(parts)
            hidden = [packed[p.q_at + 1 : p.q_at + p.L] for p in parts]
        rows = drafter.head(torch.cat(hidden) if len(hidden) > 1 else hidden[0])
        return list(rows.split([p.L - 1 for p in parts]))


def _draft(logits: torch.Tensor, state, head: DraftHead, vocab_size: int) -> Draft:
    """Tokens from the drafter's logits (over its draft vocabulary) as the request's verify
    rule needs them, and each position's confidence (the draft distribution's peak; block
    length auto only)."""
    want_confidence = state.policy is not None
    if state.params.verify_mode == "probabilistic":
        probs = warp(logits, state.params)
        rows = sample(probs, state.generator)
        confidence = probs.max(-1).values.tolist() if want_confidence else None
        return Draft(head.token_ids(rows), head.full(probs, vocab_size), confidence)
    confidence = peak_probs(logits) if want_confidence else None
    return Draft(head.token_ids(argmax_rows(logits)), None, confidence)
