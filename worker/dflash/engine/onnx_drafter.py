"""A DFlash drafter exported to ONNX (`dflash convert --to onnx`), run by ONNX Runtime.

It is called exactly like the PyTorch drafter (same config, `new_cache()`, same forward
arguments and result) and keeps the same cache discipline: the cache holds the K/V of
committed context only; each call feeds the K/V of the new context rows back and the
block's K/V never outlive the call. The graph computes in fp32; inputs are cast to fp32
and the result back to the caller's dtype and device.

Providers: CPU, or CUDA when the drafter is moved to a CUDA device and onnxruntime has
the CUDA provider. CPU threads follow torch's setting, so `--threads` means the same for
both runtimes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from dflash.engine.drafter_config import DrafterConfig
from dflash.errors import DFlashError

# Model metadata written by dflash.convert.onnx_file: the config.json, and the version
# digest (dflash.engine.versions.digest) of the drafter the graph was exported from.
CONFIG_METADATA = "dflash.config"
DIGEST_METADATA = "dflash.sha256"


def io_names(cfg: DrafterConfig) -> tuple[list[str], list[str]]:
    """The graph's input and output names (see dflash.convert.onnx_file)."""
    layers = range(cfg.num_hidden_layers)
    inputs = ["context_features", "block_embeds", "positions"]
    inputs += [f"past_{kind}_{i}" for i in layers for kind in ("key", "value")]
    outputs = ["hidden"] + [f"new_{kind}_{i}" for i in layers for kind in ("key", "value")]
    return inputs, outputs


class OnnxDraftCache:
    """The K/V of the committed context, one [1, n_kv, length, head_dim] array per graph
    input (key_0, value_0, key_1, ...), in a buffer that grows by doubling so that a step
    copies only its new rows."""

    def __init__(self, cfg: DrafterConfig, capacity: int = 256):
        self.names = io_names(cfg)[0][3:]  # past_key_0, past_value_0, ...
        self.buffer = np.zeros((len(self.names), 1, cfg.num_key_value_heads, capacity, cfg.head_dim), np.float32)
        self.length = 0

    def past(self) -> dict[str, np.ndarray]:
        return {name: self.buffer[j, :, :, : self.length] for j, name in enumerate(self.names)}

    def append(self, new: list[np.ndarray]) -> None:
        """new: the graph's new_key_0, new_value_0, ... outputs, each [1, n_kv, S, head_dim]."""
        end = self.length + new[0].shape[2]
        if end > self.buffer.shape[3]:
            cap = self.buffer.shape[3]
            while cap < end:
                cap *= 2
            grown = np.zeros(self.buffer.shape[:3] + (cap,) + self.buffer.shape[4:], np.float32)
            grown[:, :, :, : self.length] = self.buffer[:, :, :, : self.length]
            self.buffer = grown
        for j, rows in enumerate(new):
            self.buffer[j, :, :, self.length : end] = rows
        self.length = end


class OnnxDrafter:
    def __init__(self, path: Path | bytes, session, cfg: DrafterConfig):
        self.path = path  # the file, or the serialized graph (built in memory: dflash.convert.drafter_graph)
        self.session = session
        self.config = cfg
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self._threads = torch.get_num_threads()
        self.sha256: str | None = None

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu") -> "OnnxDrafter":
        path = Path(path)
        if not path.is_file():
            raise DFlashError("bad_drafter", f"ONNX drafter not found: {path}")
        session = _session(path, torch.device(device))
        meta = session.get_modelmeta().custom_metadata_map
        if CONFIG_METADATA not in meta:
            raise DFlashError("bad_drafter", f"{path} is an ONNX model but not a DFlash drafter (no {CONFIG_METADATA})")
        try:
            cfg = DrafterConfig.from_dict(json.loads(meta[CONFIG_METADATA]))
        except ValueError as exc:
            if isinstance(exc, DFlashError):
                raise
            raise DFlashError("bad_drafter", f"{path}: {CONFIG_METADATA} is not valid JSON: {exc}") from None
        expected = set(io_names(cfg)[0])
        got = {i.name for i in session.get_inputs()}
        if got != expected:
            raise DFlashError("bad_drafter", f"{path}: graph inputs {sorted(got ^ expected)[:5]} do not fit its config")
        drafter = cls(path, session, cfg)
        drafter.device = torch.device(device)
        drafter.sha256 = meta.get(DIGEST_METADATA)  # the version of the drafter it was exported from
        return drafter

    @classmethod
    def from_bytes(cls, model: bytes, cfg: DrafterConfig, sha256: str | None = None) -> "OnnxDrafter":
        drafter = cls(model, _session(model, torch.device("cpu")), cfg)
        drafter.sha256 = sha256
        return drafter

    # --- the drafter interface the engine uses ----------------------------------------

    def new_cache(self) -> OnnxDraftCache:
        return OnnxDraftCache(self.config)

    def to(self, device=None, dtype=None) -> "OnnxDrafter":
        if device is not None and torch.device(device).type != self.device.type:
            self.session = _session(self.path, torch.device(device))
            self.device = torch.device(device)
        if dtype is not None:
            self.dtype = dtype  # results are cast to it; the graph itself runs in fp32
        return self

    def eval(self) -> "OnnxDrafter":
        return self

    def __call__(self, context_features: torch.Tensor, block_embeds: torch.Tensor, positions: torch.Tensor,
                 cache: OnnxDraftCache | None = None) -> torch.Tensor:
        """Same contract as DFlashDrafter.forward: appends the S context rows to `cache`
        (cache.length += S) and returns the final-normed hidden states of the block."""
        if self.device.type == "cpu" and torch.get_num_threads() != self._threads:
            self.session = _session(self.path, self.device)  # --threads changed after loading
            self._threads = torch.get_num_threads()
        work = cache if cache is not None else self.new_cache()
        feeds = {
            "context_features": _numpy(context_features),
            "block_embeds": _numpy(block_embeds),
            "positions": positions.detach().to("cpu", torch.int64).numpy(),
            **work.past(),
        }
        hidden, *new = self.session.run(None, feeds)
        work.append(new)
        return torch.from_numpy(hidden).to(device=block_embeds.device, dtype=block_embeds.dtype)


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).contiguous().numpy()


def _session(path: Path | bytes, device: torch.device):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    providers = ["CPUExecutionProvider"]
    if device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, ("CUDAExecutionProvider", {"device_id": device.index or 0}))
    else:
        opts.intra_op_num_threads = torch.get_num_threads()
        opts.inter_op_num_threads = 1
        # Its threads spin between the operations of a call (a draft is ~100 small ones) but
        # not after it: they would take the cores from the target's forward that follows
        # every draft, and never spinning makes the draft itself markedly slower.
        opts.add_session_config_entry("session.force_spinning_stop", "1")
    try:
        return ort.InferenceSession(path if isinstance(path, bytes) else str(path), sess_options=opts,
                                    providers=providers)
    except Exception as exc:  # onnxruntime raises its own exception types for bad files
        what = "the drafter graph" if isinstance(path, bytes) else str(path)
        raise DFlashError("bad_drafter", f"{what} is not a loadable ONNX model (truncated or corrupt?): {exc}") from None
