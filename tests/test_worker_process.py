"""`dflash serve` as operators run it: ready line, client CLI, SIGTERM drains in-flight work."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

from dflash.serve.client import Client, WorkerError


def test_serve_client_and_sigterm_drain(tmp_path, smol_dir):
    sock = tmp_path / "worker.sock"
    log = open(tmp_path / "worker.log", "w+")
    # --max-active 1: at start the worker needs the cost curve for batches up to it, on the
    # real model; for one request that is the curve tests/test_cli.py's first `dflash generate`
    # measured into this session's cost folder (DFLASH_COST_DIR, inherited; threads: torch's
    # choice, as there), read and spot-checked here, not measured again, and so is the choice
    # of target backend (measuring by batch: tests/test_batch.py; a worker measures before it
    # serves, at the default batch: tests/test_worker.py; measuring and choosing a backend:
    # tests/test_target_choice.py).
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash.cli", "serve", "--socket", str(sock), "--max-active", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        # The socket is bound a moment before the ready line is logged: wait for the line.
        end = time.monotonic() + 120
        while time.monotonic() < end and proc.poll() is None:
            log.seek(0)
            if "dflash worker ready on" in log.read():
                break
            time.sleep(0.1)
        log.seek(0)
        assert "dflash worker ready on" in log.read(), open(tmp_path / "worker.log").read()
        assert sock.exists()

        out = subprocess.run(
            [sys.executable, "-m", "dflash.cli", "client", "--socket", str(sock), "status"],
            capture_output=True, text=True, timeout=60,
        )
        status = json.loads(out.stdout)
        assert status["embedding_dim"] == 384 and status["target"] == "smollm2-135m-instruct"

        out = subprocess.run(
            [sys.executable, "-m", "dflash.cli", "client", "--socket", str(sock), "generate", "--prompt", "Hi",
             "--chat", "--max-new-tokens", "4", "--json"],
            capture_output=True, text=True, timeout=60,
        )
        gen = json.loads(out.stdout)
        for key in ("output_ids", "text", "steps", "tau", "new_tokens", "decode_s", "tokens_per_s"):
            assert key in gen

        # A generation in flight when SIGTERM arrives still gets its answer.
        result = {}

        def run():
            try:
                with Client(str(sock)) as c:
                    result["ok"] = c.call("generate", {"prompt": "Count to ten.", "max_new_tokens": 24})
            except WorkerError as exc:
                result["err"] = exc.code

        t = threading.Thread(target=run)
        t.start()
        end = time.monotonic() + 10
        while time.monotonic() < end:
            with Client(str(sock)) as c:
                if c.call("status")["in_flight"]:
                    break
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        t.join(timeout=120)
        assert proc.wait(timeout=120) == 0
        assert "ok" in result, result  # answered, not cut off by the shutdown
        assert result["ok"]["finish_reason"] in ("length", "stop") and result["ok"]["new_tokens"] >= 1
        log.seek(0)
        text = log.read()
        assert "dflash worker stopped" in text and "generate" in text
        assert not sock.exists()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
