"""Small helpers the benchmark scripts share: medians of repeated calls, JSON reports."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path


def median_ms(fn, n: int) -> float:
    """Median wall time of `fn()` over n calls, after one warm-up call, in milliseconds."""
    return interleaved_medians_ms({"fn": fn}, n)["fn"]


def write_json_report(report: dict, out: str | Path, name: str) -> None:
    """Write `report` to OUT/NAME and echo it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


def interleaved_medians_ms(fns: dict, n: int) -> dict:
    """Median wall time (ms) of each callable, calling them in turn n times so that drift
    on a shared machine hits all of them alike."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(n):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t) * 1000)
    return {name: statistics.median(v) for name, v in times.items()}
