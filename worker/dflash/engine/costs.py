"""The device cost curve: what a step of each length costs on the hardware at hand.

A speculative step has two parts whose price depends on the device, dtype and thread
count: the drafter over a block of D positions (its layers plus the LM head over D - 1
rows) and the target verifying L tokens. On a GPU verifying 16 tokens costs about what 1
does; on a small CPU it does not. The block-length policy needs these prices, so the
engine measures them once per (models, device, dtype, threads, torch) and keeps them on
disk; `status` reports them.
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


@torch.inference_mode()
def measure(engine) -> CostCurve:
    """Time each verify length and each draft length once the caches hold a short prompt."""
    target, drafter = engine.target, engine.drafter
    device, B = target.device, engine.block_size
    layer_ids = engine.layer_ids
    prompt = torch.arange(100, 100 + CONTEXT_TOKENS, device=device) % target.vocab_size
    cache = target.new_cache()
    _, feats = target.forward(prompt, cache, layer_ids)
    drafting = engine.in_use()
    draft_cache = drafter.new_cache()
    anchor = engine.target.embed(prompt[-1:])
    drafting.logits(feats[:-1], anchor, 1, torch.arange(0, CONTEXT_TOKENS, device=device), draft_cache)

    def verify(L):
        ids = prompt[:L]
        logits, _ = target.forward(ids, cache, layer_ids)
        verify_greedy(ids[1:], logits)
        target.crop(cache, CONTEXT_TOKENS)

    def draft(D):
        committed = draft_cache.length
        logits = drafting.logits(feats[-1:], anchor, D, torch.arange(committed, committed + 1 + D, device=device),
                                 draft_cache)
        logits.softmax(-1).max(-1)
        draft_cache.length = committed  # the context row is written again next time

    verify(B), draft(B)  # warm-up at the largest shapes
    lengths = [n for n in MEASURED if n < B] + [B]
    verify_at, draft_at = {}, {1: 0.0}
    for L in lengths:  # interleaved, so a slow moment of the machine spreads out
        verify_at[L] = _best_s(lambda: verify(L), device)
        if L > 1:
            draft_at[L] = _best_s(lambda: draft(L), device)
    verify_s = _non_decreasing(_interpolate(verify_at, B))
    draft_s = [0.0] + _non_decreasing(_interpolate(draft_at, B)[1:])
    return CostCurve(verify_s, draft_s, curve_key(engine), time.strftime("%Y-%m-%dT%H:%M:%S%z"))


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
    """The cached curve for this engine's key, or a fresh measurement (then cached)."""
    key = curve_key(engine)
    path = cache_path(key, directory) if directory is not None else None
    if path is not None and path.is_file():
        try:
            curve = CostCurve.from_dict(json.loads(path.read_text()))
            if curve.key == key and curve.max_block == engine.block_size:
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
