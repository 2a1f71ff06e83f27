"""Which target backend runs fastest on this machine: measured, cached, spot-checked.

The machines differ (an AVX-512 Xeon, an AVX2-only EPYC, a GPU box), so the choice is a
measurement, never a rule: the same plain decoding step (one sequence, one new token after
a short prompt, with the drafter's feature layers asked for) timed on each candidate. The
result is cached per machine, thread count and model files like the cost curve; on a
later start the chosen backend's step is timed again and a choice whose step got more
than STALE times slower is measured afresh.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from pathlib import Path

from dflash.engine.target.protocol import TargetRow

PROMPT_TOKENS = 64
REPEATS = 9
STALE = 1.5


def step_seconds(target, layer_ids: tuple[int, ...] = (), repeats: int = REPEATS) -> float:
    """The median time of one plain decoding step (one row, one token) on `target`."""
    seq = target.new_sequence()
    try:
        prompt = [(100 + i) % target.vocab_size for i in range(PROMPT_TOKENS)]
        target.forward_batch([TargetRow(seq, prompt, 1)], layer_ids)
        times = []
        for i in range(repeats + 1):
            t = time.perf_counter()
            target.forward_batch([TargetRow(seq, [200 + i], 1)], layer_ids)
            times.append(time.perf_counter() - t)
            target.rollback(seq, PROMPT_TOKENS)
        return statistics.median(times[1:])  # the first is a warm-up
    finally:
        target.free(seq)


def cache_file(directory: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(directory) / f"target-backend-{digest}.json"


def cached_choice(directory: Path | None, key: dict) -> dict | None:
    if directory is None:
        return None
    path = cache_file(directory, key)
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return got if got.get("key") == key and got.get("choice") in got.get("step_s", {}) else None


def remember(directory: Path | None, key: dict, step_s: dict[str, float]) -> dict:
    choice = min(step_s, key=step_s.get)
    record = {"key": key, "step_s": step_s, "choice": choice}
    if directory is not None:
        path = cache_file(directory, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        tmp.replace(path)
    return record


def is_stale(record: dict, measured_s: float) -> bool:
    return measured_s > STALE * record["step_s"][record["choice"]]
