import pytest

from dflash.engine.drafter_config import DrafterConfig, build_target_layer_ids
from dflash.engine.sampling import SamplingParams
from dflash.errors import DFlashError


@pytest.mark.parametrize(
    "n_target, n_draft, expected",
    [
        (36, 5, [1, 9, 17, 25, 33]),  # Qwen3-4B/8B published value
        (32, 5, [1, 8, 15, 22, 29]),  # Qwen3.5-4B, Llama-3.1-8B
        (64, 5, [1, 16, 31, 46, 61]),  # Qwen3.6-27B
        (30, 1, [15]),
        (30, 2, [1, 27]),
    ],
)
def test_target_layer_fallback_matches_published_configs(n_target, n_draft, expected):
    assert build_target_layer_ids(n_target, n_draft) == expected


def _cfg(**over):
    cfg = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 100,
        "block_size": 16,
        "num_target_layers": 36,
        "dflash_config": {"mask_token_id": 5},
    }
    cfg.update(over)
    return cfg


def test_config_fallback_and_roundtrip():
    cfg = DrafterConfig.from_dict(_cfg())
    assert cfg.target_layer_ids == [1, 33]
    again = DrafterConfig.from_dict(cfg.to_dict())
    assert again.target_layer_ids == [1, 33] and again.mask_token_id == 5 and again.block_size == 16


def test_config_reads_transformers5_rope_parameters():
    cfg = DrafterConfig.from_dict(_cfg(rope_parameters={"rope_theta": 1e7, "rope_type": "default"}))
    assert cfg.rope_theta == 1e7


@pytest.mark.parametrize(
    "change, message",
    [
        ({"block_size": None}, "block_size"),
        ({"dflash_config": {}}, "mask_token_id"),
        ({"num_attention_heads": 3}, "multiple"),
        ({"layer_types": ["full_attention"]}, "layer_types"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_window"),
    ],
)
def test_bad_drafter_configs_are_named(change, message):
    cfg = _cfg(**change)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(DFlashError, match=message):
        DrafterConfig.from_dict(cfg)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"verify": "maybe"}, "verify"),
        ({"verify": "greedy", "temperature": 0.5}, "greedy"),
        ({"seed": -3}, "seed"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(DFlashError, match=message):
        SamplingParams(**kwargs)


def test_verify_mode_defaults():
    assert SamplingParams().verify_mode == "greedy"
    assert SamplingParams(temperature=0.7).verify_mode == "probabilistic"
    assert SamplingParams(temperature=0.7, verify="strict").verify_mode == "strict"
    assert SamplingParams(temperature=0, verify="strict").verify_mode == "greedy"
