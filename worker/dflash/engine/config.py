"""Configuration as dataclasses: the drafter's config.json and per-request sampling.

`DrafterConfig` reads the published DFlash layout (Qwen3-style keys plus the
top-level `block_size` / `num_target_layers` and `dflash_config`) without
requiring anything the z-lab checkpoints do not carry.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflash.errors import DFlashError

VERIFY_MODES = ("greedy", "strict", "probabilistic")

# The scheduler's defaults (dflash.engine.scheduler): requests served by one engine step,
# and the tokens one step may take while others decode (a prefill chunk gets what is left).
DEFAULT_MAX_BATCH = 16
DEFAULT_STEP_TOKENS = 128


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


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen and verified for one request.

    temperature 0 means greedy decoding; then the verify mode is always
    `greedy` (the three rules coincide). With temperature > 0 the default rule
    is `probabilistic` (drafts sampled from the drafter, p/q acceptance).
    Every finite temperature >= 0 and every top_p in (0, 1] is valid, down to the
    limits (1e-300, subnormals, 1e300): `sampling.warp` takes them to a proper
    distribution.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    verify: str | None = None

    def __post_init__(self):
        t = self.temperature
        if not isinstance(t, (int, float)) or not self._finite(t) or t < 0:
            raise DFlashError("bad_temperature", f"temperature must be a finite number >= 0, got {t}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise DFlashError("bad_top_k", f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        p = self.top_p
        if not isinstance(p, (int, float)) or not self._finite(p) or not (0 < p <= 1):
            raise DFlashError("bad_top_p", f"top_p must be in (0, 1], got {p}")
        if self.verify is not None and self.verify not in VERIFY_MODES:
            raise DFlashError("bad_verify", f"verify must be one of {', '.join(VERIFY_MODES)}, got '{self.verify}'")
        if self.verify == "greedy" and t > 0:
            raise DFlashError("bad_verify", "verify 'greedy' needs temperature 0; use 'strict' or 'probabilistic'")
        if self.seed is not None and (not isinstance(self.seed, int) or not (0 <= self.seed < 2**63)):
            raise DFlashError("bad_seed", f"seed must be an integer in [0, 2^63), got {self.seed}")

    @staticmethod
    def _finite(x: int | float) -> bool:
        """A finite float, or an int that converts to one (math.isfinite raises
        OverflowError for an int past float range, such as a 400-digit JSON number)."""
        try:
            return math.isfinite(x)
        except OverflowError:
            return False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def verify_mode(self) -> str:
        if self.greedy:
            return "greedy"
        return self.verify or "probabilistic"


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of block length `auto` (see policy.py); one place for their defaults."""

    default_acceptance: float = 0.5  # a priori chance the first draft is kept (no workload prior)
    default_decay: float = 0.85  # ... and its decay per later position
    prior_strength: float = 2.0  # steps of evidence the default prior is worth
    max_prior_strength: float = 32.0  # a workload prior never outweighs this many steps
    confidence_weight: float = 0.75  # a priori, the drafter's confidence against position history
    calibration_bins: int = 10  # confidence bins for the online calibration
    calibration_strength: float = 2.0  # pseudo-outcomes per bin before any is seen
    history: int = 32  # recent drafted steps replayed to price drafting
    probe_after: int = 8  # plain steps before drafting is tried again
    probe_max_gap: int = 64  # probes that do not pay back off up to this gap
    # A request whose prior rests on this many judged first drafts (the workload's or the
    # engine's recent generations) and says drafting does not pay starts at this gap: the
    # evidence that probes would gather at 8, 16, 32 is already in the prior.
    informed_prior_steps: float = 16.0
    informed_gap: int = 32
    # A probe drafts this many positions (anchor included) and verifies them all. 3, not
    # more: on a CPU a verify of 3 costs about what 2 does while 4 costs markedly more
    # (small-M matmul kernels), and the first draft positions decide whether drafting pays.
    probe_len: int = 3
    warmup_outcomes: int = 4  # drafted steps verify everything until this many outcomes are calibrated
    # The suffix proposer's chains: before any outcome, a chain position is trusted at this
    # share of its match-count confidence (a count of one earlier occurrence says little),
    # with suffix_strength pseudo-outcomes; the engine's pooled outcomes of recent requests
    # (at most max_prior_strength of them per bin) start each new request's calibration.
    suffix_trust: float = 0.5
    suffix_strength: float = 4.0
