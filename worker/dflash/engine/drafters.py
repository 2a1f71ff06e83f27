"""The DFlash drafter an engine runs: whether it fits the target, its draft vocabulary, its
precision and runtime, the proposer made from it, and whether a swapped-in drafter keeps
the cost curve."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dflash.engine.draft_runtime import cached_draft_choice, draft_candidates, resolve_draft_dtype
from dflash.engine.drafter_config import DrafterConfig
from dflash.engine.knobs import SpeculativeConfig
from dflash.engine.proposers.dflash import DFlashProposer
from dflash.engine.target import Target
from dflash.errors import DFlashError


@dataclass(frozen=True)
class NoDrafter:
    """What an engine without a drafter reports as its drafter."""

    name: str | None = None
    version: str | None = None


NO_DRAFTER = NoDrafter()


def check_compatible(target: Target, cfg: DrafterConfig, drafter: str | None = None) -> None:
    """A drafter must match the target it shares embeddings, head and features with.
    `drafter`: its file or folder, named in the refusal beside the target."""
    problems = (
        (cfg.hidden_size != target.hidden_size,
         f"drafter hidden size {cfg.hidden_size} does not match the target's {target.hidden_size}"),
        (cfg.vocab_size != target.vocab_size,
         f"drafter vocabulary {cfg.vocab_size} does not match the target's {target.vocab_size}"),
        (not 0 <= cfg.mask_token_id < target.vocab_size,
         f"mask token id {cfg.mask_token_id} is outside the target vocabulary"),
        (cfg.num_target_layers != target.num_layers,
         f"drafter was trained for a {cfg.num_target_layers}-layer target; this target has {target.num_layers}"),
        (any(not 0 <= i < target.num_layers for i in cfg.target_layer_ids),
         f"target_layer_ids {[i for i in cfg.target_layer_ids if not 0 <= i < target.num_layers]} are outside "
         f"the target's {target.num_layers} layers"),
    )
    for bad, why in problems:
        if bad:
            where = f" (drafter {drafter}, target {getattr(target, 'name', None) or 'given'})" if drafter else ""
            raise DFlashError("incompatible_drafter", why + where)


def check_draft_vocab(vocab, vocab_size: int) -> torch.Tensor | None:
    """A draft vocabulary as the engine takes it: distinct target ids (LongTensor) or None."""
    if vocab is None:
        return None
    vocab = torch.as_tensor(vocab, dtype=torch.long).flatten()
    if vocab.numel() == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= vocab_size or (
            vocab.unique().numel() != vocab.numel()):
        raise DFlashError("bad_drafter", f"the draft vocabulary must be distinct token ids in [0, {vocab_size})")
    return vocab


def dflash_proposer(target: Target, drafter, name: str, sha256: str | None, draft_dtype, draft_vocab,
                    draft_runtime: str | None, cost_dir: Path | None, cfg: SpeculativeConfig) -> DFlashProposer:
    """The drafter as a proposer, checked against the target, in the precision and runtime
    asked for (auto: measured fastest here, dflash.engine.draft_runtime)."""
    check_compatible(target, drafter.config, name)
    vocab = check_draft_vocab(draft_vocab, target.vocab_size)
    dtype = resolve_draft_dtype(draft_dtype, target)
    runtimes = [r for d, r in draft_candidates(target) if d == dtype] or ["torch"]
    if draft_runtime is not None:
        runtimes = [draft_runtime]
    if dtype is None or len(runtimes) > 1:  # auto: the fastest draft on this device, measured
        dtype, runtime = cached_draft_choice(cost_dir, target, drafter, vocab, dtype, sha256)
    else:
        runtime = runtimes[0]
    return DFlashProposer(target, drafter, name, sha256, dtype, vocab, runtime, cfg)


def same_geometry(a: DrafterConfig, b: DrafterConfig) -> bool:
    """Whether two drafters' forwards cost the same (their shapes agree)."""
    return _geometry(a) == _geometry(b)


def _geometry(cfg: DrafterConfig) -> tuple:
    """What a drafter forward's price depends on."""
    return (cfg.block_size, cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, len(cfg.target_layer_ids))
