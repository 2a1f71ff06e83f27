"""The engine: a target and a drafter loaded once, serving validated generation requests.

This is the one entry point the CLI, the worker and the benchmarks share: it
turns a request (text or ids, sampling parameters, stops) into prompt ids, runs
the speculative loop and returns ids, text and statistics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash.engine.config import DrafterConfig, SamplingParams
from dflash.engine.drafter import DFlashDrafter, load_drafter
from dflash.engine.loop import speculative_generate
from dflash.engine.stats import GenerationStats
from dflash.engine.target import TargetModel
from dflash.errors import DFlashError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class GenerationRequest:
    prompt: str | None = None
    input_ids: list[int] | None = None
    chat: bool = False
    max_new_tokens: int = 128
    block_size: int | None = None  # None: the drafter's trained block size
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    verify: str | None = None
    stop: list[str] = field(default_factory=list)
    stop_ids: list[int] = field(default_factory=list)

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


def check_compatible(target: TargetModel, cfg: DrafterConfig) -> None:
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


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class Engine:
    def __init__(self, target: TargetModel, drafter: DFlashDrafter, drafter_name: str = "drafter", random_drafter=False):
        check_compatible(target, drafter.config)
        self.target = target
        self.drafter = drafter.to(device=target.device, dtype=target.dtype)
        self.drafter_name = drafter_name
        self.random_drafter = random_drafter
        self.tokenizer = target.tokenizer
        cfg = drafter.config
        # The mask rows of every block are the same: embed them once.
        self.mask_embeds = target.embed(torch.full((cfg.block_size,), cfg.mask_token_id, device=target.device))

    @classmethod
    def load(cls, target_dir, drafter_dir, device: str = "cpu", dtype: str = "float32", random_drafter=False):
        if dtype not in DTYPES:
            raise DFlashError("bad_dtype", f"dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise DFlashError("bad_device", "device 'cuda' was asked for but no CUDA device is available")
        if device != "cpu" and not device.startswith("cuda"):
            raise DFlashError("bad_device", f"device must be 'cpu' or 'cuda[:N]', got '{device}'")
        target = TargetModel.from_pretrained(target_dir, device=device, dtype=DTYPES[dtype])
        drafter = load_drafter(drafter_dir, device=device, dtype=DTYPES[dtype])
        return cls(target, drafter, drafter_name=Path(drafter_dir).name, random_drafter=random_drafter)

    @property
    def block_size(self) -> int:
        return self.drafter.config.block_size

    # --- requests ---------------------------------------------------------------------

    def prompt_ids(self, req: GenerationRequest) -> list[int]:
        if (req.prompt is None) == (req.input_ids is None):
            raise DFlashError("bad_prompt", "give exactly one of a prompt text or input ids")
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
        if req.chat:
            if not self.tokenizer.chat_template:
                raise DFlashError("bad_prompt", "this target's tokenizer has no chat template")
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": req.prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        else:
            ids = self.tokenizer(req.prompt).input_ids
        return list(ids)

    def validate(self, req: GenerationRequest, n_prompt: int) -> int:
        """Check the request's numbers; returns the block size to use."""
        block = self.block_size if req.block_size is None else req.block_size
        if not _is_int(block) or not 1 <= block <= self.block_size:
            raise DFlashError(
                "bad_block_size", f"block size must be an integer from 1 to the drafter's {self.block_size}, got {block}"
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
        return block

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def generate(
        self, req: GenerationRequest, on_step: Callable[[list[int]], str | None] | None = None
    ) -> GenerationResult:
        """`on_step(output_ids)` runs after prefill and after every step; it may return a finish
        reason to end the generation there, or raise to abandon it (cancel, deadline)."""
        params = req.sampling()
        prompt_ids = self.prompt_ids(req)
        block = self.validate(req, len(prompt_ids))

        def step_hook(out: list[int]) -> str | None:
            reason = on_step(out) if on_step is not None else None
            if reason:
                return reason
            if req.stop:
                text = self.decode(out)
                if any(s in text for s in req.stop):
                    return "stop"
            return None

        result = speculative_generate(
            self.target,
            self.drafter,
            prompt_ids,
            block_size=block,
            params=params,
            max_new_tokens=req.max_new_tokens,
            stop_ids=frozenset(self.target.eos_ids) | frozenset(req.stop_ids),
            mask_embeds=self.mask_embeds,
            on_step=step_hook,
        )
        ids, text = result.output_ids, self.decode(result.output_ids)
        if req.stop:
            ids, text = self._cut_at_stop_string(ids, text, req.stop)
        result.stats.new_tokens = len(ids)
        return GenerationResult(prompt_ids, ids, text, result.finish_reason, result.stats)

    def _cut_at_stop_string(self, ids: list[int], text: str, stops: list[str]) -> tuple[list[int], str]:
        """Text ends before the first stop string; ids end with the token that completed it."""
        hits = [text.find(s) for s in stops if s in text]
        if not hits:
            return ids, text
        cut = min(hits)
        first_stop = min((s for s in stops if s in text), key=text.find)
        for n in range(1, len(ids) + 1):
            if first_stop in self.decode(ids[:n]):
                return ids[:n], text[:cut]
        return ids, text[:cut]
