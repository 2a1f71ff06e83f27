"""Precision names and their torch dtypes: the target's and the drafter's (the names alone,
torch-free, are in dflash.engine.knobs for the CLI)."""

from __future__ import annotations

import torch

from dflash.engine.knobs import DRAFT_DTYPE_NAMES, DTYPE_NAMES

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
DRAFT_DTYPES = {**DTYPES, "int8": torch.qint8}  # int8: int8 weights, fp32 activations (CPU)
assert tuple(DRAFT_DTYPES) == DRAFT_DTYPE_NAMES
