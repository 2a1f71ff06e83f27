"""dflash.processes.stop: SIGTERM, a grace period, then SIGKILL."""

import subprocess
import sys
import time

from dflash.processes import stop


def test_a_child_that_ends_on_sigterm_is_not_killed():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert stop(proc, grace_s=30) is False and proc.returncode == -15  # ended by SIGTERM itself
    assert stop(proc, grace_s=30) is False  # already gone: nothing to do


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period():
    code = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"  # SIGTERM is ignored from here on
    t = time.monotonic()
    assert stop(proc, grace_s=0.5) is True
    assert proc.returncode == -9 and 0.5 <= time.monotonic() - t < 10
    proc.stdout.close()
