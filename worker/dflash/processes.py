"""Stopping a child process: SIGTERM, a grace period, then SIGKILL, and reaping it. One place
for what the learner (serve/learn.py), `dflash demo`'s worker, the llama.cpp bench's server
and the load bench's worker each do when they are done with a process."""

from __future__ import annotations

import subprocess


def stop(proc: subprocess.Popen, grace_s: float) -> bool:
    """Ask `proc` to end (SIGTERM) and wait up to `grace_s` seconds; then kill it. Returns
    whether it had to be killed (it ignored SIGTERM that long), so a caller can say so."""
    if proc.poll() is not None:
        return False
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
        return False
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return True
