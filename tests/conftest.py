"""Shared fixtures: the real SmolLM2 target (converted once into the cache), the
reference fixtures from ../shared, and a tiny random Llama for fast engine tests."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    return Path(os.environ.get("DFLASH_SHARED") or REPO.parent / "shared")


@pytest.fixture(scope="session")
def shared() -> Path:
    path = shared_dir()
    if not (path / "fixtures").is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"reference fixtures not found at {path} (set DFLASH_SHARED)")
        pytest.skip(f"reference fixtures not found at {path} (set DFLASH_SHARED)")
    return path


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    from dflash.models import ensure_default_target

    return ensure_default_target(quiet=True)


@pytest.fixture(scope="session")
def smol_target(smol_dir):
    from dflash.engine.target import TargetModel

    return TargetModel.from_pretrained(smol_dir)


@pytest.fixture(scope="session")
def zlab_engine(smol_target, shared):
    from dflash.engine.drafter import load_drafter
    from dflash.engine.engine import Engine

    return Engine(smol_target, load_drafter(shared / "fixtures/zlab-compat/drafter"), "zlab-compat")


@pytest.fixture(scope="session")
def quick_engine(smol_target, shared):
    from dflash.engine.drafter import load_drafter
    from dflash.engine.engine import Engine

    return Engine(smol_target, load_drafter(shared / "fixtures/quick-drafter"), "quick-drafter")


# --- a tiny random target + drafter: milliseconds per step ----------------------------

TINY_VOCAB = 48


def make_tiny_target(vocab: int = TINY_VOCAB, context: int = 96, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash.engine.target import TargetModel

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
    return TargetModel(LlamaForCausalLM(cfg).float().eval(), name="tiny")


def tiny_drafter_config(vocab: int = TINY_VOCAB, block_size: int = 8):
    from dflash.engine.config import DrafterConfig

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
    return Engine(target, init_random_drafter(tiny_drafter_config(vocab=vocab), seed=1, std=0.3), "tiny-drafter")


@pytest.fixture(scope="session")
def embedder():
    from dflash.embed import Embedder

    return Embedder()


# --- PostgreSQL ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pg_server():
    import subprocess

    from dflash.localpg import docker_engine_available, start_server

    if not docker_engine_available():
        share = Path(subprocess.check_output(["pg_config", "--sharedir"], text=True).strip()) / "extension"
        missing = [f for f in ("dflash.control", "vector.control", "plpython3u.control") if not (share / f).exists()]
        if missing:
            msg = f"PostgreSQL pieces not installed ({', '.join(missing)}): run `make install-extension`"
            if os.environ.get("CI"):
                pytest.fail(msg)
            pytest.skip(msg)
    server = start_server(REPO)
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
    group = "postgres" if os.geteuid() == 0 else None
    worker = Worker(tiny_text_engine, embedder, socket_path=str(path), socket_group=group, max_queue=16)
    worker.start()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("SELECT dflash.set_config('socket_path', %s)", (pg_server.server_path(path),))
    yield worker
    worker.shutdown(timeout=10)


@pytest.fixture
def slow_engine(tiny_text_engine, monkeypatch):
    """Every target forward takes >= 5 ms, so generations last long enough to interrupt."""
    target = tiny_text_engine.target
    real = target.forward

    def slow(*args, **kwargs):
        time.sleep(0.005)
        return real(*args, **kwargs)

    monkeypatch.setattr(target, "forward", slow)
    return tiny_text_engine


def wait_until(cond, timeout: float = 5.0) -> bool:
    """Poll `cond` until it holds or `timeout` seconds pass; returns its last value."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()
