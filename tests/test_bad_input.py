"""Bad input gets a DFlashError naming the problem (the CLI prints it without a traceback)."""

import json
import shutil

import pytest

from dflash.engine.drafter import init_random_drafter, save_drafter
from dflash.loading import load_drafter
from dflash.engine.engine import Engine, GenerationRequest, check_compatible
from dflash.errors import DFlashError
from tests.conftest import TINY_VOCAB, tiny_drafter_config


@pytest.mark.parametrize(
    "kwargs, code, words",
    [
        ({"prompt": ""}, "empty_prompt", "empty"),
        ({"input_ids": []}, "empty_prompt", "empty"),
        ({"prompt": "hi", "input_ids": [1]}, "bad_prompt", "exactly one"),
        ({"input_ids": [5, TINY_VOCAB]}, "bad_input_ids", "outside the vocabulary"),
        ({"input_ids": [5, -1]}, "bad_input_ids", "outside the vocabulary"),
        ({"input_ids": [5], "block_size": 0}, "bad_block_size", "block size"),
        ({"input_ids": [5], "block_size": 9}, "bad_block_size", "drafter's 8"),
        ({"input_ids": [5], "max_new_tokens": 0}, "bad_max_new_tokens", "max_new_tokens"),
        ({"input_ids": [5], "max_new_tokens": 500}, "context_exceeded", "context length 96"),
        ({"input_ids": [5] * 96, "max_new_tokens": 1}, "context_exceeded", "context length"),
        ({"input_ids": [5], "temperature": -1}, "bad_temperature", "temperature"),
        ({"input_ids": [5], "temperature": 1, "top_p": 0}, "bad_top_p", "top_p"),
        ({"input_ids": [5], "temperature": 1, "top_p": 1.01}, "bad_top_p", "top_p"),
        ({"input_ids": [5], "temperature": 1, "top_k": -2}, "bad_top_k", "top_k"),
        ({"input_ids": [5], "max_new_tokens": 4, "stop_ids": [10**6]}, "bad_stop", "stop ids"),
        ({"prompt": "hello"}, "bad_prompt", "no tokenizer"),
    ],
)
def test_bad_requests(tiny_engine, kwargs, code, words):
    with pytest.raises(DFlashError, match=words) as err:
        tiny_engine.generate(GenerationRequest(**kwargs))
    assert err.value.code == code


def test_incompatible_drafters_are_refused(tiny_engine):
    target = tiny_engine.target
    base = tiny_drafter_config().to_dict()
    cases = [
        ({"hidden_size": 48, "head_dim": 12}, "hidden size"),
        ({"vocab_size": TINY_VOCAB + 1}, "vocabulary"),
        ({"num_target_layers": 30}, "30-layer target; this target has 4"),
        ({"dflash_config": {"mask_token_id": 3, "target_layer_ids": [0, 4]}}, "outside the target"),
        ({"dflash_config": {"mask_token_id": TINY_VOCAB, "target_layer_ids": [0, 2]}}, "mask token"),
    ]
    from dflash.engine.drafter_config import DrafterConfig

    for change, words in cases:
        with pytest.raises(DFlashError, match=words):
            check_compatible(target, DrafterConfig.from_dict({**base, **change}))


@pytest.fixture
def saved_drafter(tmp_path):
    path = tmp_path / "drafter"
    save_drafter(init_random_drafter(tiny_drafter_config()), path)
    return path


def test_saved_drafter_round_trips(saved_drafter, tiny_engine):
    d = load_drafter(saved_drafter)
    Engine(tiny_engine.target, d)  # fits the tiny target
    cfg = json.loads((saved_drafter / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 2] and cfg["block_size"] == 8


def test_missing_weights(saved_drafter):
    (saved_drafter / "model.safetensors").unlink()
    with pytest.raises(DFlashError, match="no .safetensors"):
        load_drafter(saved_drafter)


def test_corrupt_weights(saved_drafter):
    f = saved_drafter / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(DFlashError, match="missing or corrupt"):
        load_drafter(saved_drafter)


def test_weights_that_do_not_fit_config(saved_drafter, tmp_path):
    cfg = json.loads((saved_drafter / "config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (saved_drafter / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match="missing"):
        load_drafter(saved_drafter)


def test_missing_and_broken_config(saved_drafter, tmp_path):
    with pytest.raises(DFlashError, match="not found"):
        load_drafter(tmp_path / "nowhere")
    (saved_drafter / "config.json").write_text("{not json")
    with pytest.raises(DFlashError, match="not valid JSON"):
        load_drafter(saved_drafter)
    shutil.rmtree(saved_drafter)
