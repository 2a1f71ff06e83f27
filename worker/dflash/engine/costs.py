"""The device cost curve: what a step of each length costs on the hardware at hand.

A speculative step has two parts whose price depends on the device, dtype and thread
count: the drafter over a block of D positions (its layers plus the LM head over D - 1
rows) and the target verifying L tokens. On a GPU verifying 16 tokens costs about what 1
does; on a small CPU it does not. The block-length policy needs these prices, so the
engine measures them once per (models, device, dtype, threads, torch) and keeps them on
disk, checks a cached curve against a few fresh timings before trusting it, and `status`
reports them.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dflash.engine.sampling import verify_greedy

CONTEXT_TOKENS = 64  # a short prompt: the price of a step at small context
REPEATS = 5
# The lengths timed (the drafter's block size too); prices in between are interpolated: a
# step's cost grows smoothly with its length, and the worker measures before it serves.
MEASURED = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


@dataclass
class CostCurve:
    """Seconds: `verify_s[L-1]` for a target forward over L tokens with its features and the
    verify rule and cache crop; `draft_s[D-1]` for a drafter forward over a block of D with
    the LM head over D - 1 rows (`draft_s[0]` = 0: no drafting)."""

    verify_s: list[float]
    draft_s: list[float]
    key: dict = field(default_factory=dict)
    measured_at: str = ""

    @property
    def max_block(self) -> int:
        return len(self.verify_s)

    def step_s(self, draft_len: int, verify_len: int) -> float:
        return self.draft_s[draft_len - 1] + self.verify_s[verify_len - 1]

    def relative(self) -> dict:
        """Every price as a multiple of one plain step (L = 1, no drafting)."""
        ar = self.verify_s[0]
        return {
            "verify": [round(v / ar, 3) for v in self.verify_s],
            "draft": [round(d / ar, 3) for d in self.draft_s],
            "step": [round(self.step_s(n, n) / ar, 3) for n in range(1, self.max_block + 1)],
        }

    def to_dict(self) -> dict:
        return {**asdict(self), "plain_step_s": self.verify_s[0], "relative_to_plain_step": self.relative()}

    @classmethod
    def from_dict(cls, d: dict) -> "CostCurve":
        return cls(list(d["verify_s"]), list(d["draft_s"]), dict(d.get("key") or {}), d.get("measured_at", ""))

    @classmethod
    def flat(cls, max_block: int, plain_s: float = 1.0) -> "CostCurve":
        """Every step costs the same (a GPU's ideal); for tests and as a last resort."""
        return cls([plain_s] * max_block, [0.0] * max_block, {"synthetic": "flat"})


def curve_key(engine) -> dict:
    from dflash import __version__

    target = engine.target
    return {
        "target": target.name,
        "drafter": engine.drafter_name,
        "block_size": engine.block_size,
        "device": str(target.device),
        "device_name": torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else cpu_name(),
        "dtype": str(target.dtype).replace("torch.", ""),
        "draft_dtype": str(engine.draft_dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "dflash": __version__,
    }


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_s(fn, device) -> float:
    """The fastest of a few runs: interference from other work only ever adds time."""
    times = []
    for _ in range(REPEATS):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return min(times)


def _non_decreasing(xs: list[float]) -> list[float]:
    """More tokens never cost less: a dip is measurement noise, so carry the maximum."""
    out, top = [], 0.0
    for x in xs:
        top = max(top, x)
        out.append(top)
    return out


class _StepBench:
    """A target and drafter cache holding a short prompt, and the two timed parts of a step."""

    def __init__(self, engine):
        target = engine.target
        self.device, self.block_size = target.device, engine.block_size
        self.target, self.layer_ids = target, engine.layer_ids
        self.prompt = torch.arange(100, 100 + CONTEXT_TOKENS, device=self.device) % target.vocab_size
        self.cache = target.new_cache()
        _, self.feats = target.forward(self.prompt, self.cache, self.layer_ids)
        self.drafting = engine.in_use()
        self.draft_cache = engine.drafter.new_cache()
        self.anchor = target.embed(self.prompt[-1:])
        self.drafting.logits(self.feats[:-1], self.anchor, 1, torch.arange(0, CONTEXT_TOKENS, device=self.device),
                             self.draft_cache)

    def verify(self, L: int) -> None:
        ids = self.prompt[:L]
        logits, _ = self.target.forward(ids, self.cache, self.layer_ids)
        verify_greedy(ids[1:], logits)
        self.target.crop(self.cache, CONTEXT_TOKENS)

    def draft(self, D: int) -> None:
        committed = self.draft_cache.length
        positions = torch.arange(committed, committed + 1 + D, device=self.device)
        logits = self.drafting.logits(self.feats[-1:], self.anchor, D, positions, self.draft_cache)
        logits.softmax(-1).max(-1)
        self.draft_cache.length = committed  # the context row is written again next time

    def warm_up(self) -> None:
        self.verify(self.block_size), self.draft(self.block_size)  # the largest shapes first

    def verify_s(self, L: int) -> float:
        return _best_s(lambda: self.verify(L), self.device)

    def draft_s(self, D: int) -> float:
        return _best_s(lambda: self.draft(D), self.device)


@torch.inference_mode()
def measure(engine) -> CostCurve:
    """Time each verify length and each draft length once the caches hold a short prompt."""
    bench = _StepBench(engine)
    B = bench.block_size
    bench.warm_up()
    lengths = [n for n in MEASURED if n < B] + [B]
    verify_at, draft_at = {}, {1: 0.0}
    for L in lengths:  # interleaved, so a slow moment of the machine spreads out
        verify_at[L] = bench.verify_s(L)
        if L > 1:
            draft_at[L] = bench.draft_s(L)
    verify_s = _non_decreasing(_interpolate(verify_at, B))
    draft_s = [0.0] + _non_decreasing(_interpolate(draft_at, B)[1:])
    return CostCurve(verify_s, draft_s, curve_key(engine), time.strftime("%Y-%m-%dT%H:%M:%S%z"))


# A cached curve is checked against a few fresh timings before it is trusted: one measured
# while the machine was busy prices every step too high and too flat (every length looks
# the same when the time is spent waiting), which steers the policy wrong for as long as the
# cache lives. Interference only ever adds time, so a spot price clearly *below* the cached
# one means the cache was measured badly; a spot price above it means the machine is busy
# now, and a re-measurement would be the worse of the two.
SPOT_LENGTHS = (1, 4)
SPOT_TOLERANCE = 0.75  # re-measure when a spot price is under this fraction of the cached one


@torch.inference_mode()
def spot_check(engine, curve: CostCurve) -> dict:
    """Fresh prices for a plain step, a short verify and a full draft, beside the cached ones."""
    bench = _StepBench(engine)
    B = bench.block_size
    bench.warm_up()
    checks = {}
    for L in sorted({min(n, B) for n in SPOT_LENGTHS}):
        checks[f"verify_{L}"] = (bench.verify_s(L), curve.verify_s[L - 1])
    if B > 1:
        checks[f"draft_{B}"] = (bench.draft_s(B), curve.draft_s[B - 1])
    return checks


def is_stale(checks: dict) -> bool:
    return any(now < SPOT_TOLERANCE * cached for now, cached in checks.values())


def _interpolate(points: dict[int, float], B: int) -> list[float]:
    """Prices at every length 1..B, linear between the measured ones."""
    xs = sorted(points)
    out = []
    for n in range(1, B + 1):
        hi = next(x for x in xs if x >= n)
        lo = max(x for x in xs if x <= n)
        out.append(points[lo] if hi == lo else points[lo] + (points[hi] - points[lo]) * (n - lo) / (hi - lo))
    return out


def cache_path(key: dict, directory: Path) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(directory) / f"cost-curve-{digest}.json"


def load_or_measure(engine, directory: Path | None) -> CostCurve:
    """The cached curve for this engine's key if a spot check agrees with it, else a fresh
    measurement (then cached)."""
    key = curve_key(engine)
    path = cache_path(key, directory) if directory is not None else None
    if path is not None and path.is_file():
        try:
            curve = CostCurve.from_dict(json.loads(path.read_text()))
            if curve.key == key and curve.max_block == engine.block_size and not is_stale(spot_check(engine, curve)):
                return curve
        except (OSError, ValueError, KeyError):
            pass  # unreadable: measure again
    curve = measure(engine)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(curve.to_dict(), indent=1))
        tmp.replace(path)
    return curve
