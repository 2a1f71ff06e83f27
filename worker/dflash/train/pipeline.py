"""`dflash train`: prompts -> target-regenerated responses -> feature cache -> drafter.

Each stage caches its output under the run directory and resumes from it, so a run can
be stopped and continued in stages (for example across sessions on a CPU machine).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash.engine.config import DrafterConfig, build_target_layer_ids
from dflash.engine.drafter import DFlashDrafter, init_random_drafter
from dflash.engine.target import TargetModel
from dflash.train.data import collect_prompts, load_records, read_prompt_file, regenerate
from dflash.train.features import FeatureCache
from dflash.train.trainer import TrainConfig, train


def drafter_config_for(target: TargetModel, layers: int, block_size: int, layer_ids: list[int] | None,
                       mask_token_id: int) -> DrafterConfig:
    cfg = target.config
    n_heads = cfg.num_attention_heads
    return DrafterConfig.from_dict({
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", n_heads),
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": target.context_length,
        "vocab_size": target.vocab_size,
        "block_size": block_size,
        "num_target_layers": target.num_layers,
        "dflash_config": {
            "mask_token_id": mask_token_id,
            "target_layer_ids": layer_ids or build_target_layer_ids(target.num_layers, max(layers, 3)),
        },
    })


def init_from_target(drafter: DFlashDrafter, target: TargetModel) -> None:
    """Copy evenly spaced target decoder layers into the draft layers where shapes match."""
    layers = target.model.model.layers
    n = len(drafter.layers)
    picks = [round(i * (len(layers) - 1) / max(1, n - 1)) for i in range(n)]
    with torch.no_grad():
        for d, t in zip(drafter.layers, (layers[i] for i in picks)):
            src = dict(t.named_parameters())
            for name, p in d.named_parameters():
                if name in src and src[name].shape == p.shape:
                    p.copy_(src[name])


def build_data(target: TargetModel, prompts: list[str], data: Path, *, max_new_tokens: int, gen_batch: int,
               deadline: float | None = None) -> list[dict]:
    """Stage 1: the target's own greedy answers (resumes; stops at `deadline`)."""
    regenerate(target, prompts, data, max_new_tokens=max_new_tokens, batch_size=gen_batch, deadline=deadline)
    return load_records(data)


def build_features(target: TargetModel, records: list[dict], layer_ids: list[int], where: Path, *,
                   batch_tokens: int = 4096, deadline: float | None = None) -> FeatureCache:
    """Stage 2: the target-layer features the drafter is conditioned on (resumes)."""
    cache = FeatureCache(where)
    cache.build(target, records, layer_ids, batch_tokens=batch_tokens, deadline=deadline)
    return cache


def new_drafter(target: TargetModel, dcfg: DrafterConfig, init: str, seed: int) -> DFlashDrafter:
    """Stage 3: the untrained drafter, random or with target layers copied in."""
    drafter = init_random_drafter(dcfg, seed=seed)
    if init == "target":
        init_from_target(drafter, target)
    return drafter


def run(target_dir: Path, out: Path, *, prompts: int | None, max_new_tokens: int, gen_batch: int, layers: int,
        block_size: int, layer_ids: list[int] | None, mask_token_id: int, init: str, cfg: TrainConfig,
        device: str = "cpu", prompt_file: Path | None = None) -> Path:
    out = Path(out)
    target = TargetModel.from_pretrained(target_dir, device=device)
    todo = read_prompt_file(prompt_file)[:prompts] if prompt_file else collect_prompts(prompts)
    records = build_data(target, todo, out / "data.jsonl", max_new_tokens=max_new_tokens, gen_batch=gen_batch)
    dcfg = drafter_config_for(target, layers, block_size, layer_ids, mask_token_id)
    cache = build_features(target, records, dcfg.target_layer_ids, out / "features")
    train(new_drafter(target, dcfg, init, cfg.seed), target, cache, out / "train", cfg)
    return out / "train" / "drafter"
