"""What a quantized backend takes from the target's Hugging Face folder: the config, the
tokenizer, the stop ids, and the embedding and LM head that the drafter borrows (fp32, as
stored: the same values the quantized weights were made from; read at their first use).
A folder converted from a GGUF without its weights (dflash.convert.target_gguf) lends the
embedding and head of the GGUF the backend runs, dequantized as transformers does it (the
same fp32 values the folder would hold)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from dflash.engine.target.protocol import TargetDefaults
from dflash.errors import DFlashError


EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
GGUF_NAMES = {EMBED: "token_embd.weight", HEAD: "output.weight"}  # llama.cpp's names of the same tensors


@dataclass
class HFSide:
    config: object  # the text config
    tokenizer: object | None
    eos_ids: list[int]
    folder: Path
    embed_shape: tuple[int, int]  # [V, H]
    head_shape: tuple[int, int]  # [V, H] (the embedding's when tied)
    gguf: Path | None = None  # where the embedding and head are read from, where the folder has no weights

    # The embedding and head are read at their first use, not at load: only a drafter or a
    # next-token head borrows them, and a large vocabulary's are most of a GB in fp32.
    @cached_property
    def _weights(self) -> dict[str, torch.Tensor]:
        if self.gguf is None:
            return read_tensors(self.folder, (EMBED, HEAD))
        got = read_gguf_tensors(self.gguf, (EMBED, HEAD))
        if EMBED not in got or tuple(got[EMBED].shape) != tuple(self.embed_shape):
            raise DFlashError("bad_target", f"{self.gguf}: its {GGUF_NAMES[EMBED]} is not the [{self.embed_shape[0]}, "
                                            f"{self.embed_shape[1]}] embedding {self.folder}'s config describes")
        return got

    @property
    def embed(self) -> torch.Tensor:
        return self._weights[EMBED]

    @property
    def head(self) -> torch.Tensor:
        return self._weights.get(HEAD, self.embed)


class BorrowedHead(TargetDefaults):
    """What a quantized backend lends the drafter from its HFSide (set `_side`): embedding
    and LM head."""

    _side: HFSide

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self._side.embed)

    def head_weight(self) -> torch.Tensor:
        return self._side.head


def _stored(folder: Path, names: tuple[str, ...]):
    """(name, open safetensors file) for each of `names` the folder's files hold, from the
    first file (in name order) that holds it."""
    from safetensors import safe_open

    seen = set()
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for name in names:
                if name in sf.keys() and name not in seen:
                    seen.add(name)
                    yield name, sf


def tensor_shapes(folder: Path, names: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    """The shapes of the named tensors of the folder's safetensors files (none read)."""
    return {name: tuple(sf.get_slice(name).get_shape()) for name, sf in _stored(folder, names)}


def read_tensors(folder: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    return {name: sf.get_tensor(name).float() for name, sf in _stored(folder, names)}


def read_gguf_tensors(path: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The named tensors (by their Hugging Face names) a GGUF file holds, dequantized to fp32."""
    import gguf

    try:
        stored = {t.name: t for t in gguf.GGUFReader(Path(path)).tensors}
    except Exception as exc:  # noqa: BLE001 (the reader raises its own types for a broken file)
        raise DFlashError("bad_target", f"cannot read the embedding and LM head of {path}: {exc}") from None
    return {name: torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type),
                                                        dtype=np.float32))
            for name in names if (t := stored.get(GGUF_NAMES[name])) is not None}


def read_config(folder: Path):
    """The folder's (text) config; one without a `model_type` (a GGUF architecture
    transformers has no class for, run by llama.cpp: dflash.convert.target_gguf) as the plain
    keys it holds."""
    from transformers import AutoConfig, PretrainedConfig

    if "model_type" not in json.loads((Path(folder) / "config.json").read_text()):
        return PretrainedConfig.from_pretrained(folder)
    cfg = AutoConfig.from_pretrained(folder)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def read_hf_side(hf_dir: Path, backend: str, model_file: Path, what: str, gguf: Path | None = None) -> HFSide:
    """The Hugging Face side of a backend that runs `model_file` (a `what`), both checked.
    `gguf`: the GGUF file the backend runs, which lends the embedding and head where the
    folder holds no weights (a GGUF target converted for llama.cpp alone)."""
    from transformers import AutoTokenizer

    hf_dir = Path(hf_dir)
    if not Path(model_file).is_file():
        raise DFlashError("bad_target", f"{backend} backend: no {what} at {model_file}")
    if not (hf_dir / "config.json").is_file():
        raise DFlashError("bad_target", f"{backend} backend: {hf_dir} has no config.json (the tokenizer, embedding and "
                                        "LM head come from the target's Hugging Face folder)")
    cfg = read_config(hf_dir)
    shapes = tensor_shapes(hf_dir, (EMBED, HEAD))
    lender = None
    if EMBED not in shapes and gguf is not None and not list(hf_dir.glob("*.safetensors")):
        # the tokenizer and config alone: the GGUF lends the embedding and head (their shapes
        # are the config's, checked when they are read, as a large vocabulary takes the gguf
        # reader seconds to list)
        lender = Path(gguf)
        shapes = {EMBED: (cfg.vocab_size, cfg.hidden_size)}
    if EMBED not in shapes:
        raise DFlashError("bad_target", f"{hf_dir} holds no {EMBED}")
    tokenizer = AutoTokenizer.from_pretrained(hf_dir) if (hf_dir / "tokenizer_config.json").exists() else None
    gen = hf_dir / "generation_config.json"
    eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    eos = eos if eos is not None else getattr(cfg, "eos_token_id", None)
    return HFSide(cfg, tokenizer, sorted({eos} if isinstance(eos, int) else set(eos or [])), hf_dir,
                  shapes[EMBED], shapes.get(HEAD, shapes[EMBED]), lender)
