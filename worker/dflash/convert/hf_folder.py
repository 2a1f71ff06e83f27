"""A drafter back in the published folder layout (config.json + model.safetensors).

Tensors go back to the config's `torch_dtype` (bf16 for published drafters) when that is
exact, which it is for anything that came from that dtype: GGUF keeps matrices in their
stored dtype and widens norms to F32. A tensor the dtype cannot hold exactly stays as it is.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash.engine.drafter_config import DrafterConfig
from dflash.engine.dtypes import DTYPES
from dflash.errors import DFlashError



def _as_stored(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is None or t.dtype == dtype:
        return t.contiguous()
    narrowed = t.to(dtype)
    return narrowed.contiguous() if torch.equal(narrowed.to(t.dtype), t) else t.contiguous()


def write_hf_drafter(cfg: DrafterConfig, state: dict[str, torch.Tensor], out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DFlashError("bad_format", f"output folder {out} exists and is not empty")
    dtype = DTYPES.get(cfg.raw.get("torch_dtype") or cfg.raw.get("dtype") or "")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        tensors = {k: _as_stored(t, dtype) for k, t in state.items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg.raw, indent=2) + "\n")
        for f in tmp.iterdir():  # mkdtemp and safetensors create private files; these are not
            f.chmod(0o644)
        tmp.chmod(0o755)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
