"""No target backend can take the worker down: each native backend is probed once in a child
process (dflash.engine.target.probe); one that dies, hangs or disagrees is recorded as
unusable, `auto` starts on the next, and one asked for by name is a clean error.

The fake backends below are built in the child from a module written into tmp_path (the
child finds it through PYTHONPATH): no model is loaded, except where the worker must serve."""

from __future__ import annotations

import os
import textwrap

import pytest

from dflash.engine.target import probe
from dflash.errors import DFlashError

FAKES = textwrap.dedent('''
    import os, signal, time
    import torch
    from dflash.engine.target.protocol import TargetOutput

    V = 50

    class Seq:
        length = 0

    class Fake:
        tokenizer = None
        vocab_size = V
        num_layers = 4
        hidden_size = 8

        def __init__(self, mode):
            self.mode = mode

        def new_sequence(self):
            return Seq()

        def free(self, seq):
            seq.length = 0

        def forward_batch(self, rows, layer_ids=()):
            if self.mode == "segv":
                os.kill(os.getpid(), signal.SIGSEGV)
            if self.mode == "no-features" and layer_ids:  # as llama.cpp's qwen2 graph aborts
                os.kill(os.getpid(), signal.SIGABRT)
            if self.mode == "hang":
                time.sleep(600)
            logits = []
            for row in rows:
                row.seq.length += len(row.ids)
                last = torch.full((1, V), -5.0)
                # the reference's law: the next token is (last id + 1) mod V; "garbage" says otherwise
                nxt = (row.ids[-1] + (7 if self.mode == "garbage" else 1)) % V
                last[0, nxt] = 5.0
                last[0, (nxt + 1) % V] = 4.0
                logits.append(last)
            feats = [torch.zeros(len(r.ids), len(layer_ids) * 8) if layer_ids else None for r in rows]
            return TargetOutput(logits, feats)

    def build(mode, **kw):
        if mode == "refuse":
            from dflash.errors import DFlashError
            raise DFlashError("bad_target", "this fake refuses to load")
        return Fake(mode)
''')


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    (tmp_path / "fake_backends.py").write_text(FAKES)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("DFLASH_PROBE_DIR", str(tmp_path / "probes"))
    return tmp_path / "probes"


def spec(mode: str) -> probe.Spec:
    return probe.Spec("fake_backends:build", {"mode": mode})


def test_a_backend_that_segfaults_is_unusable_with_the_signal_named(fakes):
    v = probe.verdict("segv", "fake-target", spec("segv"), spec("ok"), fakes)
    assert not v.usable
    assert "SIGSEGV" in v.reason and "batched decode" in v.reason
    assert v.cpu and v.key["backend"] == "segv"


def test_a_healthy_backend_agrees_with_the_reference(fakes):
    v = probe.verdict("ok", "fake-target", spec("ok"), spec("ok"), fakes)
    assert v.usable and v.features, v.reason
    assert v.agreement["equal"] == v.agreement["positions"] == len(probe.PROMPTS) * probe.NEW_TOKENS
    assert v.line() == "usable"


def test_a_backend_that_dies_giving_features_is_usable_without_a_drafter(fakes):
    v = probe.verdict("no-features", "fake-target", spec("no-features"), spec("ok"), fakes)
    assert v.usable and v.features is False
    assert "SIGABRT" in v.features_reason and "layer features" in v.features_reason
    assert v.line().startswith("usable without layer features")


def test_a_backend_that_disagrees_is_unusable(fakes):
    v = probe.verdict("garbage", "fake-target", spec("garbage"), spec("ok"), fakes)
    assert not v.usable and "disagree" in v.reason
    assert v.agreement["in_top_k"] == 0


def test_a_backend_that_hangs_is_unusable(fakes, monkeypatch):
    monkeypatch.setattr(probe, "RUN_TIMEOUT_S", 3.0)
    v = probe.verdict("hang", "fake-target", spec("hang"), spec("ok"), fakes)
    assert not v.usable and "hung" in v.reason and "batched decode" in v.reason


def test_a_backend_that_refuses_to_load_says_why_and_is_not_marked_unusable(fakes):
    """A clean error while loading (a file the backend cannot read) is the caller's: raised
    with its own code, and not kept, so the same backend given a good file is probed anew."""
    v = probe.verdict("refuse", "fake-target", spec("refuse"), spec("ok"), fakes)
    assert not v.usable and v.reason == "this fake refuses to load" and v.error_code == "bad_target"
    assert probe.cached(fakes, v.key) is None
    with pytest.raises(DFlashError) as err:
        probe.require("refuse", "fake-target", spec("refuse"), spec("ok"), fakes)
    assert err.value.code == "bad_target" and err.value.message == "this fake refuses to load"


def test_a_gguf_backends_verdict_is_kept_per_file(tmp_path, smol_dir):
    """llama.cpp's verdict holds for the GGUF it ran: another file for the same target is
    probed on its own (one it cannot read never marks the backend unusable for the rest)."""
    from dflash.loading import target_builders

    one, two = tmp_path / "one.gguf", tmp_path / "two.gguf"
    one.write_bytes(b"GGUF" + bytes(60)), two.write_bytes(b"GGUF" + bytes(61))
    keys = [probe.key_of("llamacpp", smol_dir, target_builders(smol_dir, gguf=g)["llamacpp"].build) for g in (one, two)]
    assert keys[0] != keys[1]
    assert str(one.resolve()) in keys[0]["build"]["gguf"]


def test_a_verdict_is_remembered_and_can_be_probed_again(fakes, monkeypatch):
    first = probe.verdict("segv", "fake-target", spec("segv"), spec("ok"), fakes)

    def no_child(*a, **k):
        raise AssertionError("probed a second time")

    with monkeypatch.context() as m:
        m.setattr(probe, "_run_child", no_child)
        again = probe.verdict("segv", "fake-target", spec("segv"), spec("ok"), fakes)
    assert again == first
    assert probe.forget(fakes, first.cpu) >= 1
    assert probe.cached(fakes, first.key) is None
    runs = []
    real = probe._run_child
    monkeypatch.setattr(probe, "_run_child", lambda *a: runs.append(1) or real(*a))
    probe.verdict("segv", "fake-target", spec("segv"), spec("ok"), fakes)
    assert len(runs) == 2  # the reference's tokens were forgotten too, then the backend


def test_a_backend_asked_for_by_name_that_failed_is_a_clean_error(fakes):
    with pytest.raises(DFlashError) as err:
        probe.require("segv", "fake-target", spec("segv"), spec("ok"), fakes)
    assert err.value.code == "backend_unusable"
    for part in ("segv", "SIGSEGV", "CPU", "dflash doctor --reprobe"):
        assert part in err.value.message


def test_auto_starts_and_serves_on_the_next_backend(fakes, monkeypatch, tmp_path, smol_dir, shared):
    """The worker's start (load_engine with auto) with a crashing native backend beside the
    reference: the crash is recorded, the worker comes up on hf, serves, and its status lists
    each backend's verdict."""
    from dflash import loading
    from dflash.serve.client import Client
    from dflash.serve.server import Worker

    real = loading.target_builders

    def with_a_crashing_backend(target_dir, device="cpu", dtype="float32", gguf=None):
        builders = real(target_dir, device, dtype, gguf)
        crashing = loading._Builder(lambda: pytest.fail("an unusable backend was built in the worker"), None,
                                    name="crashing", target_dir=target_dir, probe=spec("segv"),
                                    reference=spec("ok"))
        return {"hf": builders["hf"], "crashing": crashing}

    monkeypatch.setattr(loading, "target_builders", with_a_crashing_backend)
    engine = loading.load_engine(smol_dir, shared / "fixtures/quick-drafter", head="none")
    assert engine.target.backend == "hf"
    assert "SIGSEGV" in engine.target.selection["not_candidates"]["crashing"]
    worker = Worker(engine, None, socket_path=str(tmp_path / "w.sock"))
    worker.start()
    try:
        with Client(str(worker.socket_path)) as c:
            out = c.call("generate", {"input_ids": [1, 2, 3, 4], "max_new_tokens": 4})
            status = c.call("status", {})
    finally:
        worker.shutdown(timeout=10)
    assert len(out["output_ids"]) == 4
    assert status["target_backend"] == "hf"
    assert "SIGSEGV" in status["backends"]["crashing"] and status["backends"]["hf"].startswith("usable")
    # a second start reads the verdict: no child runs
    monkeypatch.setattr(probe, "_run_child", lambda *a: pytest.fail("probed again"))
    loading.load_engine(smol_dir, shared / "fixtures/quick-drafter", head="none")


def test_a_cache_that_cannot_be_written_keeps_the_verdict_for_this_process(fakes, tmp_path, capsys):
    """A read-only model folder (an image's) must not stop the worker: the verdict holds for
    this start, and the next start probes again."""
    ro = tmp_path / "read-only"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):  # root ignores the mode: make writing fail another way
            ro.chmod(0o700)
            ro.rmdir()
            ro.write_text("a file where the folder should be")
        v = probe.verdict("segv", "fake-target", spec("segv"), spec("ok"), ro)
    finally:
        if ro.is_dir():
            ro.chmod(0o700)
    assert not v.usable and "SIGSEGV" in v.reason
    assert "cannot keep a backend probe's verdict" in capsys.readouterr().err


def test_a_backend_without_features_is_refused_for_a_drafter_and_passed_over_by_auto(fakes, monkeypatch, smol_dir,
                                                                                      shared):
    """With a DFlash drafter, a backend whose feature capture died is a clean
    incompatible_drafter when named, and not a candidate under auto."""
    from dflash import loading

    real = loading.target_builders

    def with_a_featureless_backend(target_dir, device="cpu", dtype="float32", gguf=None):
        featureless = loading._Builder(lambda: pytest.fail("built"), None, name="featureless", target_dir=target_dir,
                                       probe=spec("no-features"), reference=spec("ok"))
        return {"hf": real(target_dir, device, dtype, gguf)["hf"], "featureless": featureless}

    monkeypatch.setattr(loading, "target_builders", with_a_featureless_backend)
    monkeypatch.setattr(loading, "TARGET_BACKENDS", (*loading.TARGET_BACKENDS, "featureless"))
    with pytest.raises(DFlashError) as err:
        loading.load_engine(smol_dir, shared / "fixtures/quick-drafter", head="none", target_backend="featureless")
    assert err.value.code == "incompatible_drafter" and "no layer features" in err.value.message
    engine = loading.load_engine(smol_dir, shared / "fixtures/quick-drafter", head="none")
    assert engine.target.backend == "hf"
    assert engine.target.selection["backends"]["featureless"].startswith("usable without layer features")
