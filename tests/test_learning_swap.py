"""Issue 12, the hot swap: drafter versions (digests), Engine.swap_drafter between steps, and
the worker's reload_drafter while requests are in flight: none is dropped, each finishes with
the drafter it started with and says which, later ones use the new one, and a drafter that
does not load or does not fit is refused while the old one stays."""

import json
import threading
import time

import pytest
import torch

from dflash.engine.drafter import init_random_drafter, save_drafter
from dflash.engine.engine import Engine, GenerationRequest
from dflash.engine.versions import digest, label, model_digest
from dflash.loading import load_versioned
from dflash.errors import DFlashError
from dflash.serve.client import Client, WorkerError
from dflash.serve.server import Worker
from tests.conftest import cpu_like_costs, make_tiny_target, tiny_drafter_config, wait_until

VOCAB = 49152


def _copy_target():
    """A tiny target whose final norm is zero: every logit 0, so it always picks token 0."""
    target = make_tiny_target(vocab=VOCAB, context=512, seed=3)
    with torch.no_grad():
        target.model.model.norm.weight.zero_()
    target.eos_ids = [2]
    return target


def _random_drafter(seed=1):
    return init_random_drafter(tiny_drafter_config(vocab=VOCAB), seed=seed, std=0.3)


def _copy_drafter():
    """Agrees with the copy target at every position (its final norm is zero too)."""
    d = _random_drafter(seed=2)
    with torch.no_grad():
        d.norm.weight.zero_()
    return d


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    """Folders under one drafter root: a drafter the target never agrees with, one it always
    agrees with, one for another target (wrong hidden size), and one with corrupt weights."""
    root = tmp_path_factory.mktemp("drafters")
    save_drafter(_random_drafter(), root / "rand")
    save_drafter(_copy_drafter(), root / "copy")
    cfg = tiny_drafter_config(vocab=VOCAB).to_dict()
    cfg["hidden_size"], cfg["head_dim"] = 64, 16
    from dflash.engine.drafter_config import DrafterConfig

    save_drafter(init_random_drafter(DrafterConfig.from_dict(cfg)), root / "wide")
    (root / "corrupt").mkdir()
    (root / "corrupt" / "config.json").write_text((root / "rand" / "config.json").read_text())
    (root / "corrupt" / "model.safetensors").write_bytes(b"\x00" * 64)
    return root


def test_a_version_is_the_digest_of_the_weights_as_stored(drafters, tmp_path):
    model, sha = load_versioned(drafters / "rand")
    assert len(sha) == 64 and label(sha) == sha[:16]
    assert model_digest(model) == sha  # fp32 in memory, bf16 on disk: the same weights
    save_drafter(model, tmp_path / "again")
    assert load_versioned(tmp_path / "again")[1] == sha
    other = _random_drafter(seed=5)
    assert model_digest(other) != sha
    assert digest(model.config, model.state_dict()) == sha


def test_swap_between_steps_keeps_started_states_on_their_drafter():
    target = _copy_target()
    engine = Engine(target, _random_drafter(), "rand", cost_curve=cpu_like_costs())
    old_version = engine.drafter_version
    req = GenerationRequest(input_ids=[5, 6, 7], max_new_tokens=40, block_size=8)
    alone_old = engine.generate(req)
    started = engine.start(req)
    engine.step([started])
    swapped = engine.swap_drafter(_copy_drafter(), "copy")
    assert swapped["previous"] == {"drafter": "rand", "drafter_version": old_version}
    assert swapped["cost_curve_kept"] and engine.drafter_version != old_version
    later = engine.start(req)
    while not (started.done and later.done):  # interleaved, as the worker runs them
        for s in (started, later):
            if not s.done:
                engine.step([s])
    assert (started.proposals["dflash"].drafter.version == old_version
            and later.proposals["dflash"].drafter.version == engine.drafter_version)
    before, after = engine.finish(started), engine.finish(later)
    # The started state drafted with the old drafter to its end: the same steps as alone.
    assert [s.draft_ids for s in before.stats.steps] == [s.draft_ids for s in alone_old.stats.steps]
    # The later one drafts with the new drafter, which the target always agrees with.
    assert after.stats.tau > 7 and before.stats.tau < 2
    assert before.output_ids == after.output_ids == alone_old.output_ids  # lossless either way


def test_swap_refuses_a_drafter_that_does_not_fit_and_keeps_the_old_one(drafters):
    engine = Engine(_copy_target(), _random_drafter(), "rand", cost_curve=cpu_like_costs())
    version = engine.drafter_version
    wide, _ = load_versioned(drafters / "wide")
    with pytest.raises(DFlashError) as err:
        engine.swap_drafter(wide, "wide")
    assert err.value.code == "incompatible_drafter"
    assert engine.drafter_version == version and engine.drafter_name == "rand"
    assert engine.generate(GenerationRequest(input_ids=[5, 6], max_new_tokens=5, block_size=4)).output_ids


def test_a_drafter_of_another_shape_drops_the_cost_curve():
    engine = Engine(_copy_target(), _random_drafter(), "rand", cost_curve=cpu_like_costs())
    cfg = tiny_drafter_config(vocab=VOCAB).to_dict()
    cfg["num_hidden_layers"] = 2
    from dflash.engine.drafter_config import DrafterConfig

    assert engine.swap_drafter(init_random_drafter(DrafterConfig.from_dict(cfg)), "deeper")["cost_curve_kept"] is False
    assert engine._cost_curve is None  # measured again on next use


# --- the worker ----------------------------------------------------------------------------------


@pytest.fixture
def swap_worker(tmp_path, drafters, smol_dir, monkeypatch):
    """A worker on its own engine (the copy target, SmolLM2's tokenizer, the `rand` drafter
    from its folder), each target forward slowed to >= 5 ms so generations can be in flight."""
    from transformers import AutoTokenizer

    target = _copy_target()
    target.tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    real = target.forward

    def slow(*args, **kwargs):
        time.sleep(0.005)
        return real(*args, **kwargs)

    monkeypatch.setattr(target, "forward", slow)
    model, sha = load_versioned(drafters / "rand")
    engine = Engine(target, model, "rand", cost_curve=cpu_like_costs(), drafter_sha256=sha)
    worker = Worker(engine, None, socket_path=str(tmp_path / "swap.sock"), max_queue=64, max_active=8,
                    drafter_dir=drafters / "rand", drafter_roots=[drafters])
    worker.start()
    yield worker
    worker.shutdown(timeout=10)


def _generate(path, prompt, max_new_tokens, results, errors):
    try:
        with Client(path) as c:
            results.append(c.call("generate", {"prompt": prompt, "chat": True, "max_new_tokens": max_new_tokens,
                                               "block_size": 8}))
    except Exception as exc:  # recorded: the test requires none
        errors.append(exc)


def test_reload_during_requests_drops_none_and_each_keeps_its_drafter(swap_worker, drafters):
    path = str(swap_worker.socket_path)
    old = swap_worker.status()["drafter_version"]
    new = label(load_versioned(drafters / "copy")[1])
    results, errors = [], []
    # A long generation, surely in flight at the swap, and a stream of short ones around it.
    long = threading.Thread(target=_generate, args=(path, "Tell me a long story.", 120, results, errors))
    long.start()
    assert wait_until(lambda: swap_worker.in_flight >= 1)
    stream = [threading.Thread(target=_generate, args=(path, f"Question {i}?", 12, results, errors))
              for i in range(12)]
    for i, t in enumerate(stream):
        t.start()
        if i == 5:
            with Client(path) as c:
                answer = c.call("reload_drafter", {"path": str(drafters / "copy")})
            assert answer["previous"]["drafter_version"] == old and answer["drafter_version"] == new
            assert long.is_alive()  # the long one was still running when the swap happened
        time.sleep(0.01)
    for t in [long, *stream]:
        t.join(timeout=60)
    assert not errors and len(results) == 13
    by_version = {r["drafter_version"] for r in results}
    assert by_version == {old, new}
    long_result = next(r for r in results if r["new_tokens"] == 120)
    assert long_result["drafter_version"] == old and long_result["drafter"] == "rand"
    for r in results:  # each answer's drafts are those of the drafter it names
        tau_expected_high = r["drafter_version"] == new
        assert (r["tau"] > 6) == tau_expected_high
        assert r["output_ids"] == [0] * len(r["output_ids"])  # the target's own greedy tokens either way
    with Client(path) as c:
        after = c.call("generate", {"prompt": "Hi", "chat": True, "max_new_tokens": 8, "block_size": 8})
        status = c.call("status")
    assert after["drafter_version"] == new and status["drafter_version"] == new and status["drafter"] == "copy"


@pytest.mark.parametrize("params, code", [
    ({"path": "corrupt"}, "bad_drafter"),
    ({"path": "wide"}, "incompatible_drafter"),
    ({"path": "missing"}, "bad_drafter"),
    ({"path": "copy", "sha256": "0" * 64}, "bad_drafter"),
    ({"path": "/etc"}, "forbidden_path"),
    ({"path": "../.."}, "forbidden_path"),
    ({"path": 3}, "bad_params"),
    ({"where": "x"}, "bad_params"),
])
def test_a_bad_drafter_is_refused_and_the_old_one_stays(swap_worker, drafters, params, code):
    path = str(swap_worker.socket_path)
    if isinstance(params.get("path"), str) and not params["path"].startswith("/"):
        params = {**params, "path": str(drafters / params["path"])}
    before = swap_worker.status()
    with Client(path) as c:
        with pytest.raises(WorkerError) as err:
            c.call("reload_drafter", params)
        assert err.value.code == code, err.value.message
        after = c.call("generate", {"prompt": "Hi", "chat": True, "max_new_tokens": 6, "block_size": 8})
    assert after["drafter_version"] == before["drafter_version"] == swap_worker.status()["drafter_version"]


def test_reload_without_a_path_reads_the_current_folder_again(swap_worker, drafters):
    with Client(str(swap_worker.socket_path)) as c:
        version = c.call("status")["drafter_version"]
        again = c.call("reload_drafter")
    assert again["drafter_version"] == version and again["path"] == str(drafters / "rand")


def test_a_worker_without_roots_loads_no_other_path(tmp_path, tiny_text_engine, drafters):
    worker = Worker(tiny_text_engine, None, socket_path=str(tmp_path / "noroot.sock"))
    worker.start()
    try:
        with Client(str(worker.socket_path)) as c:
            for params, code in (({"path": str(drafters / "rand")}, "forbidden_path"), ({}, "bad_params")):
                with pytest.raises(WorkerError) as err:
                    c.call("reload_drafter", params)
                assert err.value.code == code
            assert c.call("status")["drafter_version"] == tiny_text_engine.drafter_version
    finally:
        worker.shutdown(timeout=10)


def test_the_client_command_reloads(swap_worker, drafters, capsys):
    from dflash.cli import main

    assert main(["client", "--socket", str(swap_worker.socket_path), "reload-drafter",
                 "--path", str(drafters / "copy")]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["drafter"] == "copy" and swap_worker.status()["drafter"] == "copy"
    assert main(["client", "--socket", str(swap_worker.socket_path), "reload-drafter",
                 "--path", str(drafters / "wide")]) == 3
    assert "[incompatible_drafter]" in capsys.readouterr().err and swap_worker.status()["drafter"] == "copy"
