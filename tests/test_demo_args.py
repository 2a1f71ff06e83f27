"""`dflash demo --target NAME` (make demo MODEL=NAME) starts the worker on that target; without
it, on the embedded default. The end-to-end demo itself needs a PostgreSQL cluster."""

from types import SimpleNamespace

import pytest

from dflash import demo
from dflash.cli import build_parser


class _Exited:
    """A worker process that has already exited: the demo reports it and stops."""

    def __init__(self, cmd, started):
        started.append(cmd)

    def poll(self):
        return 1


@pytest.mark.parametrize("target", [None, "qwen2.5-coder-1.5b-instruct"])
def test_the_demo_starts_the_worker_on_the_target_asked_for(monkeypatch, tmp_path, target):
    started, stopped = [], []
    server = SimpleNamespace(socket_dir=tmp_path, os_user="postgres", stop=lambda: stopped.append(True))
    monkeypatch.setattr(demo, "start_local_cluster", lambda: server)
    monkeypatch.setattr(demo.subprocess, "Popen", lambda cmd: _Exited(cmd, started))
    monkeypatch.setattr(demo, "stop", lambda proc, grace_s: None)
    args = build_parser().parse_args(["demo", *(["--target", target] if target else [])])
    assert args.target == target
    assert args.func(args) == 1 and stopped  # the worker "did not start": the cluster is stopped
    (cmd,) = started
    assert cmd[2:5] == ["dflash.cli", "serve", "--socket"]
    assert ("--target" in cmd) == (target is not None)
    if target:
        assert cmd[cmd.index("--target") + 1] == target
