"""Adapter over a Hugging Face causal LM: prefill, block verification, features, rollback.

The speculative loop needs four things from the target: logits, the hidden
features of the drafter's `target_layer_ids` (id i = output of decoder layer i =
`hidden_states[i + 1]`), its embedding table (for the drafter's block) and LM
head (for the drafter's logits), and a KV cache it can crop back to the
committed length after a partial acceptance. The adapter is stateless: each request's
decode state owns its cache (`new_cache()`), so requests can take turns on one model.
Written for transformers 5.x.
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

    # --- the cache: owned by the caller's decode state, never by the model ---------------

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    @staticmethod
    def cache_length(cache) -> int:
        return cache.get_seq_length()

    @staticmethod
    def crop(cache, length: int) -> None:
        """Drop K/V of positions >= length (rejected draft tokens)."""
        extra = cache.get_seq_length() - length
        if extra > 0:
            cache.crop(-extra)

    # --- forwards -------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self, ids: torch.Tensor, cache, layer_ids: tuple[int, ...] | list[int] = (), last_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run `ids` [T] after the prefix held in `cache` (which grows by T). Returns logits
        [T or 1, V] (fp32) and the concatenated features of `layer_ids` [T, n_feat * H]
        (None when no layers are asked for). Only the asked-for hidden states are kept:
        transformers takes a list of indices for `output_hidden_states` and stores None
        for the rest."""
        out = self.model(
            input_ids=ids[None],
            cache=cache,
            use_cache=True,
            output_hidden_states=[i + 1 for i in layer_ids] if layer_ids else False,
            logits_to_keep=1 if last_only else 0,
        )
        feats = None
        if layer_ids:
            hs = out.hidden_states
            feats = torch.cat([hs[i + 1][0] for i in layer_ids], dim=-1)
        return out.logits[0].float(), feats

    @torch.inference_mode()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
