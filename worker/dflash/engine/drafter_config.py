"""The drafter's config.json as a dataclass.

`DrafterConfig` reads the published DFlash layout (Qwen3-style keys plus the
top-level `block_size` / `num_target_layers` and `dflash_config`) without
requiring anything the z-lab checkpoints do not carry.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflash.errors import DFlashError


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference fallback when `dflash_config.target_layer_ids` is absent.

    One draft layer takes the middle target layer; otherwise ids are spread
    evenly over [1, num_target_layers - 3] with Python's (banker's) round.
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    num_target_layers: int
    mask_token_id: int
    target_layer_ids: list[int]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    hidden_act: str = "silu"
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_dict(cls, cfg: dict) -> "DrafterConfig":
        def need(key, container=cfg, where="config.json"):
            if key not in container:
                raise DFlashError("bad_drafter", f"drafter {where} has no '{key}'")
            return container[key]

        dflash_cfg = cfg.get("dflash_config") or {}
        num_layers = int(need("num_hidden_layers"))
        num_target_layers = int(need("num_target_layers"))
        block_size = cfg.get("block_size", dflash_cfg.get("block_size"))
        if block_size is None:
            raise DFlashError("bad_drafter", "drafter config.json has no 'block_size'")
        mask_token_id = dflash_cfg.get("mask_token_id", cfg.get("mask_token_id"))
        if mask_token_id is None:
            raise DFlashError("bad_drafter", "drafter config.json has no 'dflash_config.mask_token_id'")
        layer_ids = dflash_cfg.get("target_layer_ids") or build_target_layer_ids(num_target_layers, num_layers)
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:  # transformers 5.x writes rope settings under rope_parameters
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0)
        if cfg.get("rope_scaling") or (cfg.get("rope_parameters") or {}).get("rope_type", "default") != "default":
            raise DFlashError("bad_drafter", "drafters with scaled RoPE (YaRN etc.) are not supported yet")
        n_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        layer_types = list(cfg.get("layer_types") or [])
        if layer_types and len(layer_types) != num_layers:
            raise DFlashError("bad_drafter", f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        out = cls(
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=num_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads", n_heads)),
            head_dim=int(cfg.get("head_dim") or hidden // n_heads),
            vocab_size=int(need("vocab_size")),
            block_size=int(block_size),
            num_target_layers=num_target_layers,
            mask_token_id=int(mask_token_id),
            target_layer_ids=[int(i) for i in layer_ids],
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 40960)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            layer_types=layer_types,
            sliding_window=cfg.get("sliding_window"),
            raw=dict(cfg),
        )
        out.validate()
        return out

    @classmethod
    def from_file(cls, path: str | Path) -> "DrafterConfig":
        path = Path(path)
        if not path.is_file():
            raise DFlashError("bad_drafter", f"drafter config not found: {path}")
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise DFlashError("bad_drafter", f"drafter config {path} is not valid JSON: {exc}") from None
        if not isinstance(cfg, dict):
            raise DFlashError("bad_drafter", f"drafter config {path} is not a JSON object")
        return cls.from_dict(cfg)

    def validate(self) -> None:
        if self.hidden_act != "silu":
            raise DFlashError("bad_drafter", f"drafter hidden_act '{self.hidden_act}' is not supported (silu only)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DFlashError("bad_drafter", "num_attention_heads must be a multiple of num_key_value_heads")
        if self.block_size < 1:
            raise DFlashError("bad_drafter", f"drafter block_size must be >= 1, got {self.block_size}")
        if not self.target_layer_ids:
            raise DFlashError("bad_drafter", "drafter target_layer_ids is empty")
        for lt in self.layer_types:
            if lt not in ("full_attention", "sliding_attention"):
                raise DFlashError("bad_drafter", f"unknown layer type '{lt}'")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise DFlashError("bad_drafter", "sliding_attention layers need 'sliding_window'")

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def to_dict(self) -> dict:
        """The published config.json layout (Qwen3 keys + DFlash keys)."""
        out = dict(self.raw)
        d = asdict(self)
        for key in ("raw", "mask_token_id", "target_layer_ids"):
            d.pop(key)
        if not d["layer_types"]:
            d.pop("layer_types")
        if d["sliding_window"] is None:
            d.pop("sliding_window")
        out.update(d)
        out.setdefault("architectures", ["DFlashDraftModel"])
        out.setdefault("model_type", "qwen3")
        out.setdefault("torch_dtype", "bfloat16")
        out.setdefault("tie_word_embeddings", False)
        out["dflash_config"] = {
            **(self.raw.get("dflash_config") or {}),
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
        }
        return out
