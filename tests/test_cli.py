"""The `dflash` CLI contract other parts rely on: run as a subprocess, like a user (the JSON
contract, exit statuses, stderr); options that only change what a run does are run through
the command's own `main` in this process (no second start-up of Python, torch and models)."""

import json
import os
import subprocess
import sys

import pytest


def dflash(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "dflash.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


def generate_here(capsys, *args) -> dict:
    """`dflash generate ARGS --json` through the command's own main, in this process."""
    from dflash import cli

    capsys.readouterr()
    rc = cli.main(["generate", *args, "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)


@pytest.fixture(scope="module")
def generated(smol_dir):
    proc = dflash("generate", "--prompt", "Name a color.", "--chat", "--max-new-tokens", "6", "--json")
    assert proc.returncode == 0, proc.stderr
    return proc


def test_generate_json_contract(generated):
    out = json.loads(generated.stdout)
    for key in ("output_ids", "text", "steps", "tau", "new_tokens", "decode_s", "tokens_per_s", "acceptance_rate",
                "accepted_per_position", "prefill_s", "num_steps"):
        assert key in out, key
    assert len(out["output_ids"]) == out["new_tokens"] <= 6
    # No --block-size: auto, each step's verify length chosen between 1 and the drafter's 16.
    assert out["block_policy"] == "auto" and out["block_size"] == 16
    assert all(set(s) == {"draft_ids", "accepted"} and len(s["draft_ids"]) <= 15 for s in out["steps"])
    hist = out["verify_length_histogram"]
    assert sum(hist.values()) == out["num_steps"]
    assert hist == {str(n): sum(len(s["draft_ids"]) + 1 == n for s in out["steps"])
                    for n in {len(s["draft_ids"]) + 1 for s in out["steps"]}}
    assert out["tau"] == pytest.approx(sum(s["accepted"] + 1 for s in out["steps"]) / len(out["steps"]))


def test_a_fixed_block_size_verifies_that_many_every_step(smol_dir, capsys):
    out = generate_here(capsys, "--prompt", "Name a color.", "--chat", "--max-new-tokens", "6", "--block-size", "16")
    assert out["block_policy"] == "fixed" and out["verify_length_histogram"] == {"16": out["num_steps"]}
    assert all(len(s["draft_ids"]) == 15 for s in out["steps"])


def test_the_shipped_default_drafter_is_used(generated):
    out = json.loads(generated.stdout)
    assert out["random_drafter"] is False and out["drafter"] == "smollm2-135m-instruct-dflash-b16"
    assert "random-weight drafter" not in generated.stderr


def test_input_ids_and_block_size_one(smol_dir, capsys):
    out = generate_here(capsys, "--input-ids", "504,2365,6354", "--max-new-tokens", "4", "--block-size", "1")
    assert out["block_size"] == 1 and all(s["draft_ids"] == [] for s in out["steps"])
    assert out["prompt_ids"] == [504, 2365, 6354] and len(out["output_ids"]) == 4


BAD_INPUT = [
    (["--prompt", "  "], "prompt is empty"),
    (["--input-ids", "1,99999999"], "outside the vocabulary"),
    (["--prompt", "x", "--block-size", "17"], "block size"),
    (["--prompt", "x", "--temperature", "-1"], "temperature"),
    (["--prompt", "x", "--max-new-tokens", "100000"], "context length"),
    (["--prompt", "x", "--drafter", "/nonexistent"], "not found"),
]


def test_a_drafter_for_another_target_is_refused_before_any_model_loads(smol_dir, monkeypatch, capsys, tmp_path):
    """incompatible_drafter from the two config files, naming the drafter and the target."""
    from dflash import cli
    from dflash.engine.drafter import init_random_drafter, save_drafter
    from tests.conftest import tiny_drafter_config

    other = tmp_path / "other-drafter"
    save_drafter(init_random_drafter(tiny_drafter_config()), other)
    monkeypatch.setattr(cli, "engine_from_args", lambda _args: pytest.fail("a bad request loaded the models"))
    assert cli.main(["generate", "--prompt", "x", "--drafter", str(other)]) == 2
    err = capsys.readouterr().err
    assert "does not match the target's 576" in err and str(other) in err and smol_dir.name in err, err


@pytest.mark.parametrize("args, words", BAD_INPUT)
def test_bad_input_is_one_clean_line_before_any_model_loads(smol_dir, monkeypatch, capsys, args, words):
    """In this process (the command's own `main`), with loading the models made to fail: each
    bad input is refused from the options and the model folders' config files alone. The
    command run as a process, exit status and stderr, is the test below."""
    from dflash import cli

    def no_loading(_args):
        raise AssertionError("a bad request loaded the models")

    monkeypatch.setattr(cli, "engine_from_args", no_loading)
    assert cli.main(["generate", *args]) == 2
    err = capsys.readouterr().err
    assert words in err and "dflash: error:" in err


def test_bad_input_from_the_command_line_exits_2_with_one_clean_line(smol_dir):
    args, words = BAD_INPUT[3]
    proc = dflash("generate", *args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert words in proc.stderr and "dflash: error:" in proc.stderr
