"""Loading models from disk into an engine: drafters in every format (a published folder, a
llama.cpp `.gguf`, an `.onnx` graph), their versions, the target, and the CLI's model options.

Above the engine and the formats (dflash.convert), below what serves, trains and benches:
they all load through here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

RANDOM_DRAFTER_WARNING = (
    "warning: no trained default drafter ships yet; using a random-weight drafter. "
    "Output is exactly the target's, but drafts are rarely accepted (tau ~ 1). For tests only."
)


def load_drafter(path: str | Path, device="cpu", dtype=None):
    """A drafter from the published folder, a `.gguf` file (llama.cpp's DFlash layout) or an
    `.onnx` file (run by ONNX Runtime); see dflash.convert."""
    import torch

    from dflash.engine.drafter import drafter_from_state, read_drafter_folder

    dtype = dtype or torch.float32
    path = Path(path)
    if path.suffix == ".onnx":
        from dflash.engine.onnx_drafter import OnnxDrafter

        return OnnxDrafter.load(path).to(device=device, dtype=dtype).eval()
    if path.suffix == ".gguf":
        from dflash.convert.gguf_file import read_gguf_drafter

        cfg, state = read_gguf_drafter(path)
    else:
        cfg, state = read_drafter_folder(path)
    return drafter_from_state(cfg, state).to(device=device, dtype=dtype).eval()


def load_versioned(path: str | Path, device="cpu", dtype=None) -> tuple[object, str | None]:
    """A drafter and its digest (dflash.engine.versions), reading the weights once. Folders
    are digested as stored; other formats (.gguf, .onnx) as loaded."""
    import torch

    from dflash.engine.drafter import drafter_from_state, read_drafter_folder
    from dflash.engine.versions import digest, model_digest
    from dflash.errors import DFlashError

    dtype = dtype or torch.float32
    path = Path(path)
    if path.is_dir():
        cfg, state = read_drafter_folder(path)
        sha = digest(cfg, state)
        return drafter_from_state(cfg, state).to(device=device, dtype=dtype).eval(), sha
    if not path.exists():
        raise DFlashError("bad_drafter", f"drafter not found: {path}")
    model = load_drafter(path, device=device, dtype=dtype)
    return model, model_digest(model)


def load_engine(target_dir, drafter_dir, device: str = "cpu", dtype: str = "float32", random_drafter=False,
                cost_dir: Path | None = None, draft_dtype: str | None = None):
    """An Engine over the target folder and the drafter (any format), on `device` in `dtype`."""
    import torch

    from dflash.engine.engine import DTYPES, Engine
    from dflash.engine.target.hf import HFTarget
    from dflash.errors import DFlashError

    if dtype not in DTYPES:
        raise DFlashError("bad_dtype", f"dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DFlashError("bad_device", "device 'cuda' was asked for but no CUDA device is available")
    if device != "cpu" and not device.startswith("cuda"):
        raise DFlashError("bad_device", f"device must be 'cpu' or 'cuda[:N]', got '{device}'")
    target = HFTarget.from_pretrained(target_dir, device=device, dtype=DTYPES[dtype])
    drafter, sha = load_versioned(drafter_dir, device=device, dtype=DTYPES[dtype])
    return Engine(target, drafter, drafter_name=Path(drafter_dir).name, random_drafter=random_drafter,
                  cost_dir=cost_dir, drafter_sha256=sha, draft_dtype=draft_dtype)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="Hugging Face model folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", help="DFlash drafter: folder in the published layout, .gguf (llama.cpp's layout) or "
                   ".onnx (run by ONNX Runtime) (default: the project's drafter)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--draft-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype the drafter computes in (drafts are proposals: output is unchanged); auto: bfloat16 "
                        "on a CPU with native bf16 when the target runs float32, else the target's dtype")


def engine_from_args(args):
    """The engine `add_model_args`'s options ask for (the embedded defaults unless named)."""
    import torch

    from dflash.model_files import cost_dir, resolve_models

    if args.threads:
        torch.set_num_threads(args.threads)
    target, drafter, is_random = resolve_models(args.target, args.drafter)
    if is_random:
        print(RANDOM_DRAFTER_WARNING, file=sys.stderr)
    return load_engine(target, drafter, device=args.device, dtype=args.dtype, random_drafter=is_random,
                       cost_dir=cost_dir(), draft_dtype=args.draft_dtype)
