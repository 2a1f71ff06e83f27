"""`dflash serve --learn`: the worker fine-tunes its drafter on its own workload while idle.

**Off by default.** A drafter trained on a workload memorises some of it: its drafts may
echo phrases of the answers it was trained on. Drafts never reach anyone's output unchecked
(the target keeps only what it would have written itself), but `dflash_generate_block`
shows them, and how fast a call runs depends on them. So turn it on only where the rows
shared for training (dflash.training_rows: tables whose owner shares them, direct calls of
consenting roles) may be seen by everyone who uses the worker.

When the worker has had no request for `idle_s` seconds and at least `min_new_rows` rows
were shared since the last run (`dflash.drafter_versions.last_row_id`), one round runs
`dflash train --from-database` (dflash.train.from_database) in a child process at the
lowest CPU priority (nice 19) with few torch threads and a CPU-time budget; while any
request is in flight the child is stopped (SIGSTOP) and continued once the worker is idle
again, so serving never waits for training. A round's new drafter is adopted by the same
rule as the command's (held-out τ up by more than the margin) and loaded between requests,
as `reload_drafter` does. The learner needs a role in dflash_trainer (`--learn-database`,
by default the `--database` DSN: GRANT dflash_trainer TO dflash_worker).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflash.errors import DFlashError
from dflash.processes import stop
from dflash.train.from_database import Filters, Settings

log = logging.getLogger("dflash.learn")

NEW_ROWS = """
SELECT count(*) FROM dflash.training_rows r
WHERE r.target = %(target)s AND r.id > coalesce(
    (SELECT max(v.last_row_id) FROM dflash.drafter_versions v WHERE v.target = %(target)s), 0)"""


@dataclass
class LearnSettings:
    dsn: str
    directory: Path
    idle_s: float = 120.0  # no request for this long before a round starts
    min_new_rows: int = 200  # rows shared since the last round
    check_s: float = 30.0
    cpu_budget_min: float = 10.0  # the training's CPU time (all its threads)
    threads: int = 1
    nice: int = 19
    settings: Settings = field(default_factory=Settings)
    filters: Filters = field(default_factory=Filters)


class Learner:
    """Watches the worker and the database; runs a fine-tuning round when both allow."""

    def __init__(self, worker, settings: LearnSettings, target_dir: Path):
        if worker.drafter_dir is None:
            raise DFlashError("bad_params", "--learn needs a drafter loaded from a folder (it fine-tunes that one)")
        self.worker, self.settings, self.target_dir = worker, settings, Path(target_dir)
        self.directory = Path(settings.directory).resolve()
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.directory not in worker.drafter_roots:  # the rounds' drafters may be loaded
            worker.drafter_roots.append(self.directory)
        worker.learner = self
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.proc: subprocess.Popen | None = None
        self.state = "waiting"
        self.rounds = 0
        self.adopted = 0
        self.last: dict | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="dflash-learn", daemon=True)
        self.thread.start()
        log.info("learning from the workload: a round after %.0f s idle and %d new shared rows (runs in %s)",
                 self.settings.idle_s, self.settings.min_new_rows, self.directory)

    def shutdown(self) -> None:
        self.stop.set()
        self._end_child()
        if self.thread is not None:
            self.thread.join(timeout=30)

    def status(self) -> dict:
        return {"state": self.state, "rounds": self.rounds, "adopted": self.adopted, "last": self.last,
                "idle_s": self.settings.idle_s, "min_new_rows": self.settings.min_new_rows}

    # --- when -------------------------------------------------------------------------------

    def idle(self) -> bool:
        w = self.worker
        return w.in_flight == 0 and time.monotonic() - w.last_activity >= self.settings.idle_s

    def new_rows(self) -> int:
        import psycopg

        with psycopg.connect(self.settings.dsn, autocommit=True) as conn:
            return conn.execute(NEW_ROWS, {"target": self.worker.engine.target.name}).fetchone()[0]

    def _loop(self) -> None:
        while not self.stop.wait(self.settings.check_s):
            try:
                if self.idle() and self.new_rows() >= self.settings.min_new_rows:
                    self.run_round()
            except Exception:  # the database away, a bug: say so, keep serving, try later
                log.exception("learning round failed")
                self.state = "waiting"

    # --- one round ---------------------------------------------------------------------------

    def run_round(self) -> dict:
        """Fine-tune in a child process (paused while requests are in flight); load the new
        drafter if it was adopted. Returns the round's summary."""
        out = self.directory / time.strftime("round-%Y%m%d-%H%M%S")
        out.mkdir(parents=True)
        spec = {"dsn": self.settings.dsn, "out": str(out), "target_dir": str(self.target_dir),
                "init_from": str(self.worker.drafter_dir), "nice": self.settings.nice,
                "threads": self.settings.threads, "cpu_budget_min": self.settings.cpu_budget_min,
                "settings": asdict(self.settings.settings), "filters": asdict(self.settings.filters)}
        self.rounds += 1
        self.state = "training"
        log.info("learning round %d: fine-tuning %s in %s", self.rounds, self.worker.drafter_dir.name, out)
        with (out / "learn.log").open("w") as logfile:
            # The DSN goes through stdin, never the command line (other users can read that).
            self.proc = subprocess.Popen([sys.executable, "-m", "dflash.serve.learn"], stdin=subprocess.PIPE,
                                         stdout=logfile, stderr=subprocess.STDOUT)
            self.proc.stdin.write(json.dumps(spec).encode())
            self.proc.stdin.close()
            self._supervise()
        summary_file = out / "summary.json"
        summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {
            "adopted": False, "error": f"the round ended with status {self.proc.returncode}; see {out / 'learn.log'}"}
        self.proc = None
        if summary.get("adopted") and not self.stop.is_set():
            self.worker.reload_drafter(summary["path"], summary["sha256"])
            self.adopted += 1
        self.last = {k: summary.get(k) for k in ("adopted", "tau_before", "tau_after", "rows_used", "steps",
                                                 "version", "error")}
        self.state = "waiting"
        log.info("learning round %d done: %s", self.rounds, self.last)
        return summary

    def _supervise(self) -> None:
        """Stop the child while the worker serves; continue it when idle again."""
        paused = False
        while self.proc.poll() is None:
            if self.stop.is_set():
                self._end_child()
                break
            busy = self.worker.in_flight > 0
            if busy != paused:
                os.kill(self.proc.pid, signal.SIGSTOP if busy else signal.SIGCONT)
                paused = busy
                self.state = "paused" if busy else "training"
            time.sleep(0.05)

    def _end_child(self) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            stop(proc, grace_s=30)


def learner_from_args(worker, args, target_dir: Path) -> Learner:
    """The learner `dflash serve --learn` starts (options: dflash.train.db_args)."""
    dsn = args.learn_database or args.database
    if not dsn:
        raise DFlashError("bad_params", "--learn needs a database: --learn-database DSN (or --database DSN) "
                          "as a role in dflash_trainer")
    from dflash.model_files import cache_dir

    settings = LearnSettings(
        dsn=dsn, directory=Path(args.learn_dir) if args.learn_dir else cache_dir() / "learn",
        idle_s=args.learn_idle_s, min_new_rows=args.learn_min_rows, cpu_budget_min=args.learn_cpu_min,
        threads=args.learn_threads, settings=Settings(margin=args.learn_margin))
    return Learner(worker, settings, target_dir)


def _child() -> int:
    """One round, in the child process: lowest priority, few threads, spec on stdin."""
    spec = json.loads(sys.stdin.read())
    os.nice(spec["nice"])
    import torch

    from dflash.train.from_database import fine_tune_config, run

    torch.set_num_threads(spec["threads"])
    out = Path(spec["out"])
    # Bounded by CPU time (the round is paused while the worker serves): a flat learning rate.
    cfg = fine_tune_config(epochs=1000, schedule="constant", cpu_budget_s=spec["cpu_budget_min"] * 60)
    try:
        run(spec["dsn"], out, target_dir=Path(spec["target_dir"]), init_from=Path(spec["init_from"]),
            default_drafter=None, filters=Filters(**spec["filters"]), settings=Settings(**spec["settings"]),
            cfg=cfg)
    except DFlashError as exc:
        (out / "summary.json").write_text(json.dumps({"adopted": False, "error": exc.message}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(_child())


def add_learn_arguments(p: argparse.ArgumentParser) -> None:
    """`dflash serve --learn` (off by default)."""
    g = p.add_argument_group("learning from the workload (off by default: a drafter trained on a workload "
                             "memorises some of it)")
    g.add_argument("--learn", action="store_true",
                   help="fine-tune the drafter on the rows shared for training while idle, adopt it if held-out "
                        "τ rises, and load it between requests")
    g.add_argument("--learn-database", metavar="DSN", help="as a role in dflash_trainer (default: --database)")
    g.add_argument("--learn-dir", help="where rounds write their data and drafters (default: CACHE/learn)")
    g.add_argument("--learn-idle-s", type=float, default=LearnSettings.idle_s,
                   help="seconds without a request before a round starts")
    g.add_argument("--learn-min-rows", type=int, default=LearnSettings.min_new_rows,
                   help="rows shared since the last round before another one runs")
    g.add_argument("--learn-cpu-min", type=float, default=LearnSettings.cpu_budget_min,
                   help="CPU minutes a round may train for")
    g.add_argument("--learn-threads", type=int, default=LearnSettings.threads, help="torch threads of a round")
    g.add_argument("--learn-margin", type=float, default=Settings.margin,
                   help="adopt a round's drafter only if held-out τ rises by more than this (relative)")
