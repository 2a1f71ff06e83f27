"""One DFlash drafter step as an ONNX graph (fp32), for ONNX Runtime.

The graph is the PyTorch drafter itself, traced by `torch.onnx.export` (dynamo), with the
draft cache turned into explicit tensors:

  inputs   context_features [1, S, F], block_embeds [1, L, H], positions [S + L] (int64),
           past_key_i / past_value_i [1, n_kv, P, head_dim] for every layer i
  outputs  hidden [1, L, H] (final-normed block states),
           new_key_i / new_value_i [1, n_kv, S, head_dim]: the K/V of the S new context
           rows, which the caller appends to its cache (block K/V are never kept)

S, L and P are dynamic (P may be 0). The drafter's config.json rides along in the
model's metadata (`dflash.config`), so the file alone is a complete drafter, and so does
the source drafter's version digest (`dflash.sha256`).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import warnings
from pathlib import Path

import torch
from torch import nn

from dflash.engine.drafter_config import DrafterConfig
from dflash.engine.drafter import drafter_from_state
from dflash.engine.onnx_drafter import CONFIG_METADATA, DIGEST_METADATA, io_names
from dflash.engine.versions import digest
from dflash.errors import DFlashError

OPSET = 18


class GraphCache:
    """The draft cache as graph tensors: past K/V in, each layer's new rows out. Quacks like
    the engine's DraftCache for the drafter's attention (`write`, `length`)."""

    def __init__(self, past: list[tuple[torch.Tensor, torch.Tensor]], new_rows: int):
        self.past = past
        self.new_rows = new_rows
        self.length = past[0][0].shape[2]
        self.new: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(past)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k/v: [B, n_kv, S + L, hd] (context rows, then the block); returns past + these."""
        self.new[layer] = (k[:, :, : self.new_rows], v[:, :, : self.new_rows])
        pk, pv = self.past[layer]
        return torch.cat((pk, k), dim=2), torch.cat((pv, v), dim=2)


class DrafterStep(nn.Module):
    def __init__(self, drafter: nn.Module):
        super().__init__()
        self.drafter = drafter

    def forward(self, context_features, block_embeds, positions, *past):
        cache = GraphCache([(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)], context_features.shape[1])
        hidden = self.drafter(context_features, block_embeds, positions, cache)
        return (hidden, *[t for kv in cache.new for t in kv])


@contextlib.contextmanager
def _quiet_exporter():
    """The exporter reports progress and optional-package notes (torchvision) on stderr;
    `dflash convert` prints only its result or its error."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            with contextlib.redirect_stdout(io.StringIO()):
                yield
    finally:
        logger.setLevel(level)


def export_onnx(cfg: DrafterConfig, state: dict[str, torch.Tensor], out: Path) -> None:
    import onnx

    drafter = drafter_from_state(cfg, state).float().eval()
    step = DrafterStep(drafter).eval()
    S, L, P = 3, 4, 5  # sample sizes; all three are dynamic in the graph
    feats = torch.randn(1, S, cfg.num_features * cfg.hidden_size)
    block = torch.randn(1, L, cfg.hidden_size)
    positions = torch.arange(P, P + S + L)
    past = [torch.randn(1, cfg.num_key_value_heads, P, cfg.head_dim) for _ in range(2 * cfg.num_hidden_layers)]
    auto = torch.export.Dim.AUTO  # the exporter works out that positions has S + L rows
    dynamic = ({1: auto}, {1: auto}, {0: auto}, tuple({2: auto} for _ in past))  # *past: one entry
    inputs, outputs = io_names(cfg)
    tmp = out.with_name(out.name + ".tmp")
    try:
        with torch.no_grad(), _quiet_exporter():
            program = torch.onnx.export(step, (feats, block, positions, *past), dynamic_shapes=dynamic,
                                        input_names=inputs, output_names=outputs, opset_version=OPSET,
                                        dynamo=True, external_data=False, optimize=True, verbose=False)
        model = program.model_proto
        onnx.helper.set_model_props(model, {CONFIG_METADATA: json.dumps(cfg.raw, sort_keys=True),
                                            DIGEST_METADATA: digest(cfg, state)})
        onnx.save_model(model, str(tmp))
        os.replace(tmp, out)
    except Exception as exc:  # the exporter raises many types; none should leave a file
        if isinstance(exc, DFlashError):
            raise
        raise DFlashError("export_failed", f"ONNX export of the drafter failed: {exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)
