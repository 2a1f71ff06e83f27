"""Loading models from disk into an engine: drafters in every format (a published folder, a
llama.cpp `.gguf`, an `.onnx` graph), their versions, the target, and the CLI's model options.

Above the engine and the formats (dflash.convert), below what serves, trains and benches:
they all load through here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dflash.errors import DFlashError

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


TARGET_BACKENDS = ("auto", "hf", "llamacpp")


def load_engine(target_dir, drafter_dir, device: str = "cpu", dtype: str = "float32", random_drafter=False,
                cost_dir: Path | None = None, draft_dtype: str | None = None, target_backend: str = "auto",
                target_gguf: Path | None = None):
    """An Engine over the target folder and the drafter (any format), on `device` in `dtype`.
    The target runs in `target_backend` (dflash.engine.target: hf, the reference; llamacpp,
    the GGUF `target_gguf` in llama.cpp on a CPU); auto takes the fastest one available here."""
    import torch

    from dflash.engine.engine import DTYPES, Engine
    from dflash.errors import DFlashError

    if dtype not in DTYPES:
        raise DFlashError("bad_dtype", f"dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DFlashError("bad_device", "device 'cuda' was asked for but no CUDA device is available")
    if device != "cpu" and not device.startswith("cuda"):
        raise DFlashError("bad_device", f"device must be 'cpu' or 'cuda[:N]', got '{device}'")
    drafter, sha = load_versioned(drafter_dir, device=device, dtype=DTYPES[dtype])
    layer_ids = tuple(drafter.config.target_layer_ids)
    target = load_target(target_dir, device, dtype, target_backend, target_gguf, layer_ids, cost_dir)
    return Engine(target, drafter, drafter_name=Path(drafter_dir).name, random_drafter=random_drafter,
                  cost_dir=cost_dir, drafter_sha256=sha, draft_dtype=draft_dtype)


def load_target(target_dir, device: str = "cpu", dtype: str = "float32", backend: str = "auto",
                gguf: Path | None = None, layer_ids: tuple[int, ...] = (), cost_dir: Path | None = None):
    """The target in the backend asked for; `auto`: the fastest of those that can run it here
    (dflash.engine.target.fastest: measured once per machine, cached, spot-checked). The
    backend and why it was chosen are in the target's `selection` (the worker's status)."""
    import torch

    from dflash.engine.engine import DTYPES
    from dflash.engine.target import fastest, llamacpp
    from dflash.engine.target.hf import HFTarget

    if backend not in TARGET_BACKENDS:
        raise DFlashError("bad_params", f"--target-backend must be one of {', '.join(TARGET_BACKENDS)}, got '{backend}'")

    def hf():
        return HFTarget.from_pretrained(target_dir, device=device, dtype=DTYPES[dtype])

    def quantized():
        return llamacpp.LlamaCppTarget(gguf, target_dir, threads=torch.get_num_threads())

    if backend == "llamacpp":
        why = (f"device {device}" if device != "cpu" else None) or (
            None if llamacpp.available() else "llama-cpp-python is not installed (make setup installs it)") or (
            None if gguf is not None else "no GGUF of the target (--target-gguf FILE; the embedded default has one)")
        if why:
            raise DFlashError("bad_target", f"the llamacpp target backend cannot run here: {why}")
    if backend != "auto":
        target = hf() if backend == "hf" else quantized()
        target.selection = {"backend": target.backend, "how": "asked for (--target-backend)"}
        return target
    if device != "cpu" or dtype != "float32" or gguf is None or not llamacpp.available():
        target = hf()
        target.selection = {"backend": "hf", "how": "the only backend for this device, dtype and target"}
        return target
    import llama_cpp

    from dflash import __version__
    from dflash.engine.costs import cpu_name

    key = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "target": Path(target_dir).name,
           "gguf": [Path(gguf).name, Path(gguf).stat().st_size], "layers": list(layer_ids),
           "torch": torch.__version__, "llama_cpp": llama_cpp.__version__, "dflash": __version__}
    record = fastest.cached_choice(cost_dir, key)
    if record is not None:
        target = quantized() if record["choice"] == "llamacpp" else hf()
        now = fastest.step_seconds(target, layer_ids, repeats=5)
        if not fastest.is_stale(record, now):
            target.selection = {"backend": target.backend, "how": "measured earlier (cached), spot-checked",
                                "step_ms": {k: round(v * 1e3, 2) for k, v in record["step_s"].items()}}
            return target
        del target
    candidates = {"hf": hf(), "llamacpp": quantized()}
    step_s = {name: fastest.step_seconds(t, layer_ids) for name, t in candidates.items()}
    record = fastest.remember(cost_dir, key, step_s)
    target = candidates.pop(record["choice"])
    candidates.clear()
    target.selection = {"backend": target.backend, "how": "measured at start",
                        "step_ms": {k: round(v * 1e3, 2) for k, v in step_s.items()}}
    return target


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="Hugging Face model folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", help="DFlash drafter: folder in the published layout, .gguf (llama.cpp's layout) or "
                   ".onnx (run by ONNX Runtime) (default: the project's drafter)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, help="CPU threads (torch's and llama.cpp's; default: torch's choice)")
    p.add_argument("--target-backend", default="auto", choices=TARGET_BACKENDS,
                   help="what runs the target: hf (transformers, the reference), llamacpp (its GGUF in llama.cpp, "
                        "CPU), auto (default: the fastest available here, measured once and cached)")
    p.add_argument("--target-gguf", help="the target as GGUF for --target-backend llamacpp (default: the embedded "
                   "target's shipped Q4_1 file, when --target is not given)")
    p.add_argument("--draft-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype the drafter computes in (drafts are proposals: output is unchanged); auto: bfloat16 "
                        "on a CPU with native bf16 when the target runs float32, else the target's dtype")


BACKENDS = ("native", "openai")


def add_backend_args(p: argparse.ArgumentParser) -> None:
    """Where generation runs: here (native), or on an inference server (dflash.remote)."""
    p.add_argument("--backend", choices=BACKENDS, default="native",
                   help="native: run the target and drafter here; openai: send each request to the OpenAI-compatible "
                        "inference server at --endpoint (vLLM, SGLang, llama-server), which batches and drafts")
    p.add_argument("--endpoint", help="the inference server's URL (--backend openai), e.g. http://127.0.0.1:8080 or "
                   "http://vllm:8000/v1")
    p.add_argument("--api-key-file", help="a file holding the endpoint's API key (sent as a Bearer token)")
    p.add_argument("--model", help="the served model's name (default: the first the endpoint lists); its tokenizer "
                   "and chat template come from --target (default: the embedded SmolLM2's)")


def check_backend_args(args) -> bool:
    """Whether the options ask for the remote backend (DFlashError when they do not add up)."""
    remote = getattr(args, "backend", "native") == "openai"
    if remote and not args.endpoint:
        raise DFlashError("bad_params", "--backend openai needs --endpoint URL")
    if not remote and (getattr(args, "endpoint", None) or getattr(args, "api_key_file", None)
                       or getattr(args, "model", None)):
        raise DFlashError("bad_params", "--endpoint, --api-key-file and --model go with --backend openai")
    return remote


def _default_gguf() -> Path | None:
    """The embedded target's shipped GGUF, where its package is installed (an image may hold
    only the converted folder: then the llamacpp backend is simply not a candidate)."""
    from dflash.model_files import default_target_gguf

    try:
        path = default_target_gguf()
    except DFlashError:
        return None
    return path if path.is_file() else None


def engine_from_args(args):
    """The engine the options ask for: the native one over `add_model_args`'s models (the
    embedded defaults unless named), or with `--backend openai` the remote one, which loads
    only the target's tokenizer."""
    import torch

    from dflash.model_files import cost_dir, ensure_default_target, resolve_models

    if args.threads:
        torch.set_num_threads(args.threads)
    if check_backend_args(args):
        from dflash.remote.engine import remote_engine

        return remote_engine(args.endpoint, args.target or ensure_default_target(quiet=True), args.model,
                             args.api_key_file)
    target, drafter, is_random = resolve_models(args.target, args.drafter)
    if is_random:
        print(RANDOM_DRAFTER_WARNING, file=sys.stderr)
    gguf = getattr(args, "target_gguf", None) or (_default_gguf() if args.target is None else None)
    return load_engine(target, drafter, device=args.device, dtype=args.dtype, random_drafter=is_random,
                       cost_dir=cost_dir(), draft_dtype=args.draft_dtype,
                       target_backend=getattr(args, "target_backend", "auto"), target_gguf=gguf)
