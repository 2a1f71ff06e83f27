"""Adapter over a Hugging Face causal LM: prefill, block verification, features, rollback.

The speculative loop needs four things from the target: logits, the hidden
features of the drafter's `target_layer_ids` (id i = output of decoder layer i =
`hidden_states[i + 1]`), its embedding table (for the drafter's block) and LM
head (for the drafter's logits), and a KV cache it can crop back to the
committed length after a partial acceptance. Written for transformers 5.x.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

from dflash.errors import DFlashError

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text", "gemma3", "smollm3")


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


class TargetModel:
    def __init__(self, model, tokenizer=None, name: str = "target"):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        cfg = _text_config(model.config)
        self.config = cfg
        self.hidden_size = cfg.hidden_size
        self.num_layers = cfg.num_hidden_layers
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.context_length = int(getattr(cfg, "max_position_embeddings", 2048))
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.embed_tokens = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        self.layer_ids: list[int] = []
        self.cache = None
        eos = getattr(model.generation_config, "eos_token_id", None) or getattr(cfg, "eos_token_id", None)
        self.eos_ids = sorted({eos} if isinstance(eos, int) else set(eos or []))

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu", dtype=torch.float32) -> "TargetModel":
        path = Path(path)
        if not (path / "config.json").is_file():
            raise DFlashError("bad_target", f"target directory {path} has no config.json")
        config = AutoConfig.from_pretrained(path)
        if config.model_type not in SUPPORTED_FAMILIES:
            raise DFlashError(
                "bad_target",
                f"target family '{config.model_type}' is not supported (supported: {', '.join(SUPPORTED_FAMILIES)})",
            )
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        except (OSError, ValueError, RuntimeError) as exc:
            raise DFlashError("bad_target", f"cannot load target from {path}: {exc}") from None
        tokenizer = AutoTokenizer.from_pretrained(path) if (path / "tokenizer_config.json").exists() else None
        return cls(model.to(device), tokenizer, name=path.name)

    # --- state --------------------------------------------------------------------

    def reset(self, layer_ids: list[int]) -> None:
        """Start a new sequence with an empty cache, collecting these layers' features."""
        self.layer_ids = list(layer_ids)
        self.cache = DynamicCache(config=self.model.config)

    @property
    def cached_length(self) -> int:
        return self.cache.get_seq_length() if self.cache is not None else 0

    def crop(self, length: int) -> None:
        """Drop K/V of positions >= length (rejected draft tokens)."""
        extra = self.cached_length - length
        if extra > 0:
            self.cache.crop(-extra)

    # --- forwards -------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run `ids` [T] after the cached prefix. Returns logits [T or 1, V] (fp32)
        and the concatenated features [T, n_feat * H] (None when no layers are asked for)."""
        want = bool(self.layer_ids)
        out = self.model(
            input_ids=ids[None],
            cache=self.cache,
            use_cache=True,
            output_hidden_states=want,
            logits_to_keep=1 if last_only else 0,
        )
        feats = None
        if want:
            hs = out.hidden_states
            feats = torch.cat([hs[i + 1][0] for i in self.layer_ids], dim=-1)
        return out.logits[0].float(), feats

    @torch.inference_mode()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
