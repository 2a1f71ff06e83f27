"""Drafter versions: one digest names a drafter's weights wherever they are.

The digest is SHA-256 over the drafter's config (canonical JSON) and its tensors as the
published layout stores them (bf16, unprefixed names, sorted), so the same weights have
the same version whether read from a folder, held in memory by the engine (fp32 weights
read from bf16 round-trip exactly) or just written by training. The worker reports it
(`status`, every generate answer), `dflash.generations.drafter_version` records it, and
`dflash.drafter_versions.sha256` holds it for every fine-tuned drafter; the version label
is its first 16 hex digits.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from dflash.engine.drafter_config import DrafterConfig
from dflash.engine.drafter import DFlashDrafter, _state_key
from dflash.errors import DFlashError

VERSION_CHARS = 16


def digest(cfg: DrafterConfig, state: dict[str, torch.Tensor]) -> str:
    """SHA-256 (hex) of a drafter's config and tensors, as stored."""
    h = hashlib.sha256()
    h.update(json.dumps(cfg.to_dict(), sort_keys=True).encode())
    for name in sorted(k for k in state if _state_key(k)):
        t = state[name].detach().to("cpu", torch.bfloat16).contiguous()
        h.update(name.encode() + b"\0" + str(tuple(t.shape)).encode() + b"\0")
        h.update(t.view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def model_digest(model) -> str | None:
    """The digest of a drafter held in memory; None for one without tensors of its own
    (an ONNX Runtime session)."""
    if not isinstance(model, DFlashDrafter):
        return None
    return digest(model.config, model.state_dict())


def label(sha256: str | None) -> str | None:
    """The short version name of a digest."""
    return sha256[:VERSION_CHARS] if sha256 else None
