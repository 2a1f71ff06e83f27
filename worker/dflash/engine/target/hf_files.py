"""What a quantized backend takes from the target's Hugging Face folder: the config, the
tokenizer, the stop ids, and the embedding and LM head that the drafter borrows (fp32, as
stored: the same values the quantized weights were made from)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash.engine.target.protocol import TargetDefaults
from dflash.errors import DFlashError


@dataclass
class HFSide:
    config: object  # the text config
    tokenizer: object | None
    eos_ids: list[int]
    embed: torch.Tensor  # [V, H]
    head: torch.Tensor  # [V, H] (the embedding when tied)


class BorrowedHead(TargetDefaults):
    """What a quantized backend lends the drafter from its HFSide: embedding and LM head
    (set `_embed` and `_head` from it)."""

    _embed: torch.Tensor
    _head: torch.Tensor

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self._embed)

    def head_weight(self) -> torch.Tensor:
        return self._head


def read_tensors(folder: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for name in names:
                if name in sf.keys() and name not in out:
                    out[name] = sf.get_tensor(name).float()
    return out


def read_hf_side(hf_dir: Path, backend: str, model_file: Path, what: str) -> HFSide:
    """The Hugging Face side of a backend that runs `model_file` (a `what`), both checked."""
    from transformers import AutoConfig, AutoTokenizer

    hf_dir = Path(hf_dir)
    if not Path(model_file).is_file():
        raise DFlashError("bad_target", f"{backend} backend: no {what} at {model_file}")
    if not (hf_dir / "config.json").is_file():
        raise DFlashError("bad_target", f"{backend} backend: {hf_dir} has no config.json (the tokenizer, embedding and "
                                        "LM head come from the target's Hugging Face folder)")
    cfg = AutoConfig.from_pretrained(hf_dir)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    weights = read_tensors(hf_dir, ("model.embed_tokens.weight", "lm_head.weight"))
    if "model.embed_tokens.weight" not in weights:
        raise DFlashError("bad_target", f"{hf_dir} holds no model.embed_tokens.weight")
    embed = weights["model.embed_tokens.weight"]
    tokenizer = AutoTokenizer.from_pretrained(hf_dir) if (hf_dir / "tokenizer_config.json").exists() else None
    gen = hf_dir / "generation_config.json"
    eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    eos = eos if eos is not None else getattr(cfg, "eos_token_id", None)
    return HFSide(cfg, tokenizer, sorted({eos} if isinstance(eos, int) else set(eos or [])), embed,
                  weights.get("lm_head.weight", embed))
