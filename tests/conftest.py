"""Shared fixtures: the real SmolLM2 target (converted once into the cache), the
reference fixtures from ../shared, and a tiny random Llama for fast engine tests."""

from __future__ import annotations

import os
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

# Cost curves the tests measure (often on a busy machine) go to a folder of this session's,
# never into the user's cache, where a wrong curve would steer block length auto later.
os.environ["DFLASH_COST_DIR"] = tempfile.mkdtemp(prefix="dflash-test-costs-")


def unavailable(component: str, why: str, required_in_ci: bool = True):
    """A component the test needs is missing here. Under CI (CI=true), which must test every
    component, the test fails; elsewhere it skips, and the run's summary (below) names the
    component and why, so that a skip never reads as a pass."""
    msg = f"{component} not tested: {why}"
    if required_in_ci and os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


def pytest_terminal_summary(terminalreporter, config):
    """The run's last word on what it did not test: the skipped tests grouped by reason (a
    component missing here, with how to get it) and the tests left out by -m or -k (`make
    test` leaves the slow ones to `make test-all`)."""
    reasons = Counter()
    for rep in terminalreporter.stats.get("skipped", []):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    deselected = len(terminalreporter.stats.get("deselected", []))
    if not reasons and not deselected:
        return
    terminalreporter.section("not tested here")
    for reason, n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])):
        terminalreporter.write_line(f"{n:4d} skipped: {reason}")
    if deselected:
        how = " and ".join(f"{flag} {value!r}" for flag, value in (("-m", config.option.markexpr),
                                                                   ("-k", config.option.keyword)) if value)
        slow_only = config.option.markexpr == "not slow" and not config.option.keyword  # `make test`
        terminalreporter.write_line(f"{deselected:4d} deselected by {how or 'the selection'}"
                                    + (" (the slow tests: `make test-all` runs them)" if slow_only else ""))


def shared_dir() -> Path:
    return Path(os.environ.get("DFLASH_SHARED") or REPO.parent / "shared")


@pytest.fixture(scope="session")
def shared() -> Path:
    path = shared_dir()
    if not (path / "fixtures").is_dir():
        unavailable("the reference fixtures", f"not found at {path} (set DFLASH_SHARED)")
    return path


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    from dflash.model_files import ensure_default_target

    return ensure_default_target(quiet=True)


@pytest.fixture(scope="session")
def smol_target(smol_dir):
    from dflash.engine.target.hf import HFTarget

    return HFTarget.from_pretrained(smol_dir)


@pytest.fixture(scope="session")
def zlab_engine(smol_target, shared):
    from dflash.loading import load_drafter
    from dflash.engine.engine import Engine

    return Engine(smol_target, load_drafter(shared / "fixtures/zlab-compat/drafter"), "zlab-compat",
                  cost_curve=cpu_like_costs(16))


@pytest.fixture(scope="session")
def quick_engine(smol_target, shared):
    from dflash.loading import load_drafter
    from dflash.engine.engine import Engine

    return Engine(smol_target, load_drafter(shared / "fixtures/quick-drafter"), "quick-drafter",
                  cost_curve=cpu_like_costs(16))


# --- a tiny random target + drafter: milliseconds per step ----------------------------

TINY_VOCAB = 48


def cpu_like_costs(block: int = 8):
    """A cost curve shaped like a small CPU's: each verified token and drafted position adds
    a little. Tests that need the policy to make definite choices use it instead of timing a
    tiny model on a busy machine."""
    from dflash.engine.costs import CostCurve

    return CostCurve([1.0 + 0.05 * i for i in range(block)], [0.0] + [0.05 + 0.005 * i for i in range(block - 1)])


def make_tiny_target(vocab: int = TINY_VOCAB, context: int = 96, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash.engine.target.hf import HFTarget

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        eos_token_id=1,
        bos_token_id=0,
        pad_token_id=1,
        initializer_range=0.5,  # peaked, varied distributions, unlike the usual 0.02
        attn_implementation="sdpa",
    )
    return HFTarget(LlamaForCausalLM(cfg).float().eval(), name="tiny")


def tiny_drafter_config(vocab: int = TINY_VOCAB, block_size: int = 8):
    from dflash.engine.drafter_config import DrafterConfig

    return DrafterConfig.from_dict(
        {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "vocab_size": vocab,
            "block_size": block_size,
            "num_target_layers": 4,
            "dflash_config": {"mask_token_id": 3, "target_layer_ids": [0, 2]},
        }
    )


@pytest.fixture(scope="session")
def tiny_engine():
    from dflash.engine.drafter import init_random_drafter
    from dflash.engine.engine import Engine

    return Engine(make_tiny_target(), init_random_drafter(tiny_drafter_config(), seed=1, std=0.3), "tiny-drafter")


@pytest.fixture(scope="session")
def copy_engine():
    """A tiny target and drafter that always agree: both final norms are zero, so every
    logit is 0 and both always pick token 0 (the first of equal maxima). Every draft is
    kept: the case where `auto` should draft the whole block."""
    from dflash.engine.drafter import init_random_drafter
    from dflash.engine.engine import Engine

    target = make_tiny_target(seed=3)
    drafter = init_random_drafter(tiny_drafter_config(), seed=2, std=0.3)
    with torch.no_grad():
        target.model.model.norm.weight.zero_()
        drafter.norm.weight.zero_()
    return Engine(target, drafter, "copy-drafter", cost_curve=cpu_like_costs())


@pytest.fixture(scope="session")
def tiny_text_engine(smol_dir):
    """A tiny random target with SmolLM2's real tokenizer, so text prompts work and steps
    take milliseconds (worker tests)."""
    from transformers import AutoTokenizer

    from dflash.engine.drafter import init_random_drafter
    from dflash.engine.engine import Engine

    vocab = 49152
    target = make_tiny_target(vocab=vocab, context=512)
    target.tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    target.eos_ids = [2]
    # A fixed curve: whether the policy drafts (the suffix proposer's chains in the SQL tests)
    # must not hang on how busy the machine was when a tiny model's steps were timed.
    return Engine(target, init_random_drafter(tiny_drafter_config(vocab=vocab), seed=1, std=0.3), "tiny-drafter",
                  cost_curve=cpu_like_costs())


def assert_bad_target(make, path) -> None:
    """`make()` fails with a clean bad_target error that names `path`."""
    from dflash.errors import DFlashError

    with pytest.raises(DFlashError) as err:
        make()
    assert err.value.code == "bad_target" and str(path) in err.value.message, err.value.message


@pytest.fixture(scope="session")
def embedder():
    from dflash.embed import Embedder

    return Embedder()


# --- PostgreSQL ----------------------------------------------------------------------------


def pytest_configure(config):
    config.addinivalue_line("markers", "pg: needs PostgreSQL (set automatically; CI runs `-m pg` on both back ends)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "pg_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.pg)


def pytest_report_header(config):
    from dflash.localpg import BackendUnavailable, choose_backend

    try:
        backend, why = choose_backend(REPO)
    except BackendUnavailable as exc:
        backend, why = "unavailable", str(exc)
    return f"PostgreSQL for SQL tests: {backend} ({why})"


@pytest.fixture(scope="session")
def pg_backend() -> str:
    """"containers" or "local": DFLASH_TEST_BACKEND=containers|local|auto (dflash.localpg)."""
    from dflash.localpg import BackendUnavailable, choose_backend

    try:
        return choose_backend(REPO)[0]
    except BackendUnavailable as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def pg_server(pg_backend):
    import subprocess

    from dflash.localpg import start_server

    if pg_backend == "local":
        share = Path(subprocess.check_output(["pg_config", "--sharedir"], text=True).strip()) / "extension"
        missing = [f for f in ("dflash.control", "vector.control", "plpython3u.control") if not (share / f).exists()]
        if missing:
            unavailable("PostgreSQL", f"pieces not installed ({', '.join(missing)}): run `make install-extension`")
    server = start_server(REPO, pg_backend)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def pg_dsn(pg_server):
    import psycopg

    with psycopg.connect(pg_server.dsn(), autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS dflash_test")
        conn.execute("CREATE DATABASE dflash_test")
    dsn = pg_server.dsn("dflash_test")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION dflash CASCADE")
    return dsn


@pytest.fixture(scope="session")
def sql_worker(pg_server, pg_dsn, tiny_text_engine, embedder):
    """A worker on the tiny engine whose socket the server's backends can reach."""
    import psycopg

    from dflash.serve.server import Worker

    path = pg_server.socket_dir / "worker.sock"
    worker = Worker(tiny_text_engine, embedder, socket_path=str(path), socket_group=pg_server.socket_group,
                    max_queue=16)
    worker.start()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("SELECT dflash.set_config('socket_path', %s)", (pg_server.server_path(path),))
    yield worker
    worker.shutdown(timeout=10)


@pytest.fixture
def make_worker(tmp_path, tiny_text_engine, embedder):
    """Workers on the tiny engine, each on its own socket, shut down after the test."""
    from dflash.serve.server import Worker

    workers = []

    def make(**kwargs):
        kwargs.setdefault("socket_path", str(tmp_path / f"w{len(workers)}.sock"))
        w = Worker(tiny_text_engine, embedder, **kwargs)
        w.start()
        workers.append(w)
        return w

    yield make
    for w in workers:
        w.shutdown(timeout=10)


@pytest.fixture
def worker(make_worker):
    return make_worker(max_queue=16)


@pytest.fixture
def slow_engine(tiny_text_engine, monkeypatch):
    """Every target forward takes >= 5 ms, so generations last long enough to interrupt."""
    target = tiny_text_engine.target
    real = target.forward_batch

    def slow(*args, **kwargs):
        time.sleep(0.005)
        return real(*args, **kwargs)

    monkeypatch.setattr(target, "forward_batch", slow)
    return tiny_text_engine


def wait_until(cond, timeout: float = 5.0) -> bool:
    """Poll `cond` until it holds or `timeout` seconds pass; returns its last value."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()
