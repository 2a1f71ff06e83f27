"""The device cost curve: what a step costs on the hardware at hand, by batch.

A speculative step has two parts whose price depends on the device, dtype and thread
count: the drafter over a block of D positions (its layers plus the LM head over D - 1
rows) and the target verifying L tokens. On a GPU verifying 16 tokens costs about what 1
does; on a small CPU it does not. And a step serves a batch: B requests in one forward
cost far less than B forwards (every weight is read once), so the price of one request's
extra verify rows depends on what else is in the step. The engine measures both, once per
(models, device, dtype, threads, torch): the single-request curve at every length it may
use, and the forward of B requests with L tokens each on a grid of B, keeps them on disk,
checks a cached curve against a few fresh timings before trusting it, and `status`
reports them.

`Prices` is what the block-length policy sees of one request in one step: its share of
the step's forward and the extra time each length it may choose adds, and the rate the
step decodes at plainly (the policy's exchange rate of time into tokens).
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dflash.engine.knobs import BUSY_CALLERS
from dflash.engine.sampling import peak_probs, verify_greedy

CONTEXT_TOKENS = 64  # a short prompt: the price of a step at small context
PREFILL_TOKENS = 128  # the prompt whose prefill spot_prices times (a typical request's)
TYPICAL_NEW_TOKENS = 128  # and the tokens a typical request decodes after it
# Where a typical request's decoding steps run on average: the context at which backends'
# prices are compared (dflash.engine.target.fastest). A step's price grows with the cached
# tokens at a rate that differs by backend (ONNX Runtime's attention costs more per cached
# token than llama.cpp's), so backends compared at a short context would be ranked wrong.
TYPICAL_CONTEXT = PREFILL_TOKENS + TYPICAL_NEW_TOKENS // 2
CONTEXT_ROWS = 16  # pending context rows timed for the drafter's price per row
# What a curve holds (2: the drafter's price per pending context row; 3: a draft priced with the
# verify after it; 4: lengths timed in rounds, lengths under the target's min_rows priced
# alike; 5: rounds in alternating order, each timed verify after one of its own length,
# see _curve; 6: lengths under min_rows priced alike for a lone sequence only); older ones are
# measured again.
CURVE_FORMAT = 6
REPEATS = 5
BATCH_REPEATS = 3
# The lengths timed (the drafter's block size too); prices in between are interpolated: a
# step's cost grows smoothly with its length, and the worker measures before it serves.
MEASURED = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
# Batches timed (up to the scheduler's largest, which is always timed), and their
# per-request lengths; prices in between are interpolated (a coarse grid: a worker measures
# it before it serves, and a batch's forward grows smoothly with its rows).
BATCHES = (4, 16, 64)
BATCH_LENGTHS = (1, 2, 4, 16)


@dataclass(frozen=True)
class Prices:
    """One request's prices in one step (seconds): `verify_s[L-1]` its share of the target
    forward when it verifies L tokens, `draft_s[D-1]` its share of a drafter pass over D
    positions, and `plain_rate`, the tokens per second the step's batch decodes plainly."""

    verify_s: tuple[float, ...]
    draft_s: tuple[float, ...]
    plain_rate: float
    batch: int = 1  # requests decoding in the step
    # What each row of target features the drafter has not seen yet adds to its next pass
    # (a request that decoded plainly for a while brings them all to its next draft).
    context_row_s: float = 0.0

    def step_s(self, draft_len: int, verify_len: int) -> float:
        return self.draft_s[draft_len - 1] + self.verify_s[verify_len - 1]


def _along(values: list[float], x: float) -> float:
    """values[i] is the price at i + 1; linear in between, and on past the end along the
    last segment (a prefill chunk is longer than any verify)."""
    n = len(values)
    if n == 1 or x <= 1:
        return values[0]
    if x >= n:
        return values[-1] + (x - n) * max(values[-1] - values[-2], 0.0)
    lo = int(x)
    return values[lo - 1] + (values[lo] - values[lo - 1]) * (x - lo)


@dataclass
class CostCurve:
    """Seconds: `verify_s[L-1]` for a target forward over L tokens with its features and the
    verify rule and cache crop; `draft_s[D-1]` for a drafter forward over a block of D with
    the LM head over D - 1 rows, and what it adds to the verify after it (`draft_s[0]` = 0:
    no drafting; see _StepBench.drafted_s). `batch_verify_s[B][L-1]`:
    one forward of B requests verifying L tokens each; `batch_draft_s[B][D-1]`: one drafter
    pass drafting D positions for each of B requests (keys are batch sizes as strings, as
    JSON keeps them). A curve without batch prices (a synthetic one) prices B requests as
    one request with all their tokens."""

    verify_s: list[float]
    draft_s: list[float]
    key: dict = field(default_factory=dict)
    measured_at: str = ""
    batch_verify_s: dict[str, list[float]] = field(default_factory=dict)
    batch_draft_s: dict[str, list[float]] = field(default_factory=dict)
    context_row_s: float = 0.0  # the drafter's price per pending context row (Prices.context_row_s)

    def __post_init__(self):
        self._prices: dict[tuple, Prices] = {}

    @property
    def max_block(self) -> int:
        return len(self.verify_s)

    def step_s(self, draft_len: int, verify_len: int) -> float:
        return self.draft_s[draft_len - 1] + self.verify_s[verify_len - 1]

    # --- prices in a batch ----------------------------------------------------------------

    def _grid(self, table: dict[str, list[float]], solo: list[float]) -> list[tuple[int, list[float]]]:
        return [(1, solo)] + sorted((int(b), v) for b, v in table.items())

    def forward_s(self, seqs: int, tokens: float) -> float:
        """One target forward over `tokens` rows of `seqs` requests."""
        if seqs <= 1 or not self.batch_verify_s:
            return _along(self.verify_s, tokens)
        return _across(self._grid(self.batch_verify_s, self.verify_s), seqs, tokens / seqs)

    def draft_batch_s(self, seqs: int, draft_len: int) -> float:
        """One drafter pass drafting `draft_len` positions for each of `seqs` requests."""
        if draft_len <= 1:
            return 0.0
        if seqs <= 1:
            return self.draft_s[draft_len - 1]
        if not self.batch_draft_s:
            return seqs * self.draft_s[draft_len - 1]
        return _across(self._grid(self.batch_draft_s, self.draft_s), seqs, draft_len)

    def solo(self) -> Prices:
        """Prices of a request stepped alone."""
        return self.prices(1)

    def prices(self, decoding: int, prefill_seqs: int = 0, prefill_tokens: int = 0, drafting: int = 1) -> Prices:
        """A request's prices in a step with `decoding` requests (itself included) verifying
        one token each, plus prefill chunks of `prefill_tokens` rows from `prefill_seqs`
        requests, and `drafting` requests expected to draft. Its verify price for L is its
        share of that base forward plus everything its L - 1 extra rows add; its draft price
        is its share of a pass that drafts for `drafting` requests."""
        key = (decoding, prefill_seqs, prefill_tokens, drafting)
        got = self._prices.get(key)
        if got is not None:
            return got
        if decoding <= 1 and prefill_seqs == 0:
            verify = tuple(self.verify_s)
        else:
            seqs, base_tokens = decoding + prefill_seqs, decoding + prefill_tokens
            base = self.forward_s(seqs, base_tokens)
            verify = tuple(base / decoding + self.forward_s(seqs, base_tokens + L - 1) - base
                           for L in range(1, self.max_block + 1))
        n = max(drafting, 1)
        draft = (0.0,) + tuple(self.draft_batch_s(n, D) / n for D in range(2, self.max_block + 1))
        plain = 1.0 / verify[0]  # each of `decoding` requests gets one token for its share
        if len(self._prices) > 4096:
            self._prices.clear()
        got = self._prices[key] = Prices(verify, draft, plain, max(decoding, 1), self.context_row_s)
        return got

    # --- reporting -------------------------------------------------------------------------

    def relative(self) -> dict:
        """Every price as a multiple of one plain step (L = 1, no drafting)."""
        ar = self.verify_s[0]
        out = {
            "verify": [round(v / ar, 3) for v in self.verify_s],
            "draft": [round(d / ar, 3) for d in self.draft_s],
            "step": [round(self.step_s(n, n) / ar, 3) for n in range(1, self.max_block + 1)],
        }
        if self.batch_verify_s:
            # Per batch: the forward of B requests verifying L each, in plain steps of one request.
            out["batch_verify"] = {b: [round(v / ar, 3) for v in vs] for b, vs in self.batch_verify_s.items()}
            out["batch_draft"] = {b: [round(v / ar, 3) for v in vs] for b, vs in self.batch_draft_s.items()}
        return out

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        return {**d, "plain_step_s": self.verify_s[0], "relative_to_plain_step": self.relative()}

    @classmethod
    def from_dict(cls, d: dict) -> "CostCurve":
        return cls(list(d["verify_s"]), list(d["draft_s"]), dict(d.get("key") or {}), d.get("measured_at", ""),
                   {str(b): list(v) for b, v in (d.get("batch_verify_s") or {}).items()},
                   {str(b): list(v) for b, v in (d.get("batch_draft_s") or {}).items()},
                   float(d.get("context_row_s") or 0.0))

    @classmethod
    def flat(cls, max_block: int, plain_s: float = 1.0) -> "CostCurve":
        """Every step costs the same (a GPU's ideal); for tests and as a last resort."""
        return cls([plain_s] * max_block, [0.0] * max_block, {"synthetic": "flat"})


def _across(grid: list[tuple[int, list[float]]], seqs: float, per_seq: float) -> float:
    """Interpolate a price grid (batch size -> price by per-request length) at `seqs`
    requests of `per_seq` tokens each: linear in both, on past the largest batch measured."""
    sizes = [b for b, _ in grid]
    if seqs >= sizes[-1] and len(grid) > 1:
        (b0, v0), (b1, v1) = grid[-2], grid[-1]
    else:
        i = next(i for i, b in enumerate(sizes) if b >= seqs)
        (b0, v0), (b1, v1) = grid[max(i - 1, 0)], grid[i]
    p0, p1 = _along(v0, per_seq), _along(v1, per_seq)
    if b1 == b0:
        return p1
    return p0 + (p1 - p0) * (seqs - b0) / (b1 - b0)


def curve_key(engine, max_batch: int = 1) -> dict:
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
        "draft_vocab": None if engine.draft_vocab is None else int(engine.draft_vocab.numel()),
        "draft_runtime": getattr(engine, "draft_runtime", "torch"),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "dflash": __version__,
        "backend": getattr(target, "backend", "hf"),
        "target_build": target.build,
        "max_batch": max_batch,
        "format": CURVE_FORMAT,
    }


# The instruction sets that decide which kernels a runtime takes (and so every price here).
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile")


def cpu_name() -> str:
    """The CPU's model name, family/model and the ISA_FLAGS it has, e.g. "AMD EPYC (family 26
    model 2: avx2 avx512f avx512_vnni avx_vnni avx512_bf16)". Part of every cached
    measurement's key and of every benchmark's record: VMs here report the same model name
    ("AMD EPYC") for a Zen 3 with AVX2 only and a Zen 5 with AVX-512, whose prices differ."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model", "flags") and key not in fields:
                fields[key] = value.strip()
            if len(fields) == 4:
                break
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown"
    if "cpu family" not in fields:
        return name
    have = set(fields.get("flags", "").split())
    isa = " ".join(f for f in ISA_FLAGS if f in have) or "no AVX2"
    return f"{name} (family {fields['cpu family']} model {fields.get('model', '?')}: {isa})"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probe_prompt(target, n: int) -> list[int]:
    """The tokens every timing here caches before it times a step: n ids counting up from
    100 (past the special tokens), wrapped at the vocabulary."""
    return [(100 + i) % target.vocab_size for i in range(n)]


def timed(fn, device=None, repeats: int = REPEATS, reduce=min, after=None) -> float:
    """The serving core's one timing harness: `fn`'s time over `repeats` runs, the device
    synchronised around each, reduced by `reduce`: the fastest by default (interference from
    other work only ever adds time), the median where a typical step is wanted. `after` runs
    untimed after each run (a rollback)."""
    times = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
        if after is not None:
            after()
    return reduce(times)


def _non_decreasing(xs: list[float]) -> list[float]:
    """More tokens never cost less: a dip is measurement noise, so carry the maximum."""
    out, top = [], 0.0
    for x in xs:
        top = max(top, x)
        out.append(top)
    return out


def bench_context(target, wanted: int, rows: int) -> int:
    """`wanted` cached tokens, or fewer where the target's context would not leave room for
    `rows` more (a small test model)."""
    return max(rows + 1, min(wanted, target.context_length - rows - 1))


class _StepBench:
    """`seqs` requests whose target and drafter caches hold a short prompt, and the two timed
    parts of a step for all of them at once (an engine without a drafter: the verify alone,
    every draft priced at nothing)."""

    drafts = True  # whether there is a drafter to time

    def __init__(self, engine, seqs: int = 1, context: int = CONTEXT_TOKENS):
        from dflash.engine.target import TargetRow

        target = engine.target
        self.device, self.block_size = target.device, engine.block_size
        self.target, self.layer_ids = target, engine.layer_ids
        # (room for a block, and for spot_prices' verify of BUSY_CALLERS rows)
        self.context = context = bench_context(target, context, max(self.block_size, BUSY_CALLERS))
        self.prompt = probe_prompt(target, context)
        self.seqs = [target.new_sequence() for _ in range(seqs)]
        out = target.forward_batch([TargetRow(q, self.prompt, 1) for q in self.seqs], self.layer_ids)
        self.feats = out.features[0]
        self.proposer = engine.dflash
        self.row = TargetRow
        self.drafts = self.proposer is not None
        if not self.drafts:
            return
        self.states = [self.proposer.start(None) for _ in range(seqs)]
        # The drafter's cache holds the context (all rows but the anchor's).
        self.proposer.draft_logits([(ps, self.feats[:-2], self.prompt[-2], context - 2, 1)
                                    for ps in self.states])

    def verify(self, L: int) -> None:
        ids = self.prompt[:L]
        out = self.target.forward_batch([self.row(q, ids, L) for q in self.seqs], self.layer_ids)
        for q, logits in zip(self.seqs, out.logits):
            verify_greedy(torch.tensor(ids[1:], device=self.device), logits)
            self.target.rollback(q, self.context)

    def draft(self, D: int, context_rows: int = 1) -> None:
        """A draft of D after `context_rows` rows of new context features (the drafter's cache
        holds the rest of the prompt; the rows are written again each time)."""
        if not self.drafts:
            return
        committed = [ps.cache.length for ps in self.states]
        for ps in self.states:
            ps.cache.length = self.context - 1 - context_rows
        jobs = [(ps, self.feats[-1 - context_rows : -1], self.prompt[-1], self.context - 1, D) for ps in self.states]
        for logits in self.proposer.draft_logits(jobs):
            peak_probs(logits)  # the confidences a step computes
        for ps, n in zip(self.states, committed):
            ps.cache.length = n

    def warm_up(self) -> None:
        self.verify(self.block_size), self.draft(self.block_size)  # the largest shapes first

    def verify_s(self, L: int, repeats: int = REPEATS) -> float:
        return timed(lambda: self.verify(L), self.device, repeats)

    def draft_s(self, D: int, repeats: int = REPEATS, context_rows: int = 1) -> float:
        return timed(lambda: self.draft(D, context_rows), self.device, repeats)

    def drafted_s(self, D: int, repeats: int = REPEATS, verify_s: float | None = None) -> float:
        """What drafting D adds to a step: a draft of D with the verify of D after it, less
        that verify alone (`verify_s`, if measured already), and never less than the draft's
        own time (a smaller difference is noise). Not the draft alone: a runtime whose
        threads spin on after the draft, or whose pool must wake the target's, slows the
        verify that follows, and the step pays that too."""
        if verify_s is None:
            verify_s = self.verify_s(D, repeats)
        both = timed(lambda: (self.draft(D), self.verify(D)), self.device, repeats)
        return _drafted(both, verify_s, self.draft_s(D, repeats))

    def context_row_s(self, repeats: int = REPEATS, rows: int = CONTEXT_ROWS) -> float:
        """What one more pending context row adds to a draft (of 2)."""
        return max(self.draft_s(2, repeats, rows + 1) - self.draft_s(2, repeats), 0.0) / rows

    def close(self) -> None:
        for q in self.seqs:
            self.target.free(q)


def _drafted(both_s: float, verify_s: float, draft_s: float) -> float:
    """What drafting adds to its step (_StepBench.drafted_s): a draft with its verify less
    the verify alone, never less than the draft alone."""
    return max(both_s - verify_s, draft_s)


def _curve(bench: _StepBench, lengths, repeats: int) -> tuple[list[float], list[float]]:
    """Verify and draft prices at every length 1..B from timings at `lengths`, the fastest of
    `repeats` rounds in which every length is timed once in turn: a slow moment of the
    machine (on a shared VM one lasts seconds) then costs each length one sample, not one
    length all of its samples and a kink in the curve. Every other round runs the lengths
    longest first: a call right after a much larger one runs slower (measured with ONNX
    Runtime on a 2-core Zen 4: a plain step 6.4 ms alone, 7.7 ms right after a verify of 16),
    so the shortest length, which a round in the other order times right after the longest,
    would always be timed too high and the curve too flat (verifying 3 priced at 1.03 plain
    steps where live steps took 1.26). A verify shorter than the target's
    `min_rows` is the same call as one of `min_rows` (padded), so all are priced as their
    fastest."""
    B = bench.block_size
    lengths = [n for n in lengths if n < B] + [B]
    verify_at = {L: float("inf") for L in lengths}
    draft_at = {L: float("inf") for L in lengths if L > 1 and bench.drafts}
    both_at = dict(draft_at)  # a draft and the verify after it
    for r in range(repeats):
        for L in lengths if r % 2 == 0 else lengths[::-1]:
            bench.verify(L)  # settle: the call timed follows one of its own length
            verify_at[L] = min(verify_at[L], timed(lambda: bench.verify(L), bench.device, 1))
            if L in draft_at:
                draft_at[L] = min(draft_at[L], timed(lambda: bench.draft(L), bench.device, 1))
                both_at[L] = min(both_at[L], timed(lambda: (bench.draft(L), bench.verify(L)), bench.device, 1))
    # Only a lone sequence's call is padded to min_rows through the weights: a batch of
    # several runs each sequence's own rows (ort._together), so there a verify of 2 rows is
    # dearer than one of 1, and pricing it alike would have `auto` verify two rows per
    # caller where that does not pay.
    padded = [L for L in lengths if L <= bench.target.min_rows] if len(bench.seqs) == 1 else []
    if padded:
        fastest = min(verify_at[L] for L in padded)
        verify_at.update({L: fastest for L in padded})
    drafted = {L: 0.0 for L in lengths}  # no drafter: nothing to pay
    drafted.update({L: _drafted(both_at[L], verify_at[L], draft_at[L]) for L in draft_at})
    return _non_decreasing(_interpolate(verify_at, B)), [0.0] + _non_decreasing(_interpolate(drafted, B)[1:])


@torch.inference_mode()
def measure(engine, max_batch: int = 1) -> CostCurve:
    """Time each verify length and each draft length once the caches hold a short prompt,
    for one request and for batches of up to `max_batch`."""
    bench = _StepBench(engine)
    bench.warm_up()
    verify_s, draft_s = _curve(bench, MEASURED, REPEATS)
    context_row_s = bench.context_row_s() if engine.block_size > 1 and engine.dflash is not None else 0.0
    bench.close()
    batch_verify, batch_draft = {}, {}
    for seqs in [b for b in BATCHES if b < max_batch] + ([max_batch] if max_batch > 1 else []):
        bench = _StepBench(engine, seqs)
        bench.warm_up()
        v, d = _curve(bench, BATCH_LENGTHS, BATCH_REPEATS)
        bench.close()
        # A bigger batch never costs less than a smaller one at the same lengths.
        below = batch_verify.get(str(max((int(b) for b in batch_verify), default=0)), verify_s)
        batch_verify[str(seqs)] = [max(a, b) for a, b in zip(v, below)]
        below = batch_draft.get(str(max((int(b) for b in batch_draft), default=0)), draft_s)
        batch_draft[str(seqs)] = [max(a, b) for a, b in zip(d, below)]
    return CostCurve(verify_s, draft_s, curve_key(engine, max_batch), time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                     batch_verify, batch_draft, context_row_s)


# A cached curve is checked against a few fresh timings before it is trusted: one measured
# while the machine was busy prices every step too high and too flat (every length looks
# the same when the time is spent waiting), which steers the policy wrong for as long as the
# cache lives. Interference only ever adds time, so a spot price clearly *below* the cached
# one means the cache was measured badly; a spot price above it means the machine is busy
# now, and a re-measurement would be the worse of the two.
# The policy trades in the curve's ratios (what verifying L costs in plain steps), and a
# cached curve can be misshapen without being too high: timed in a moment when only its
# short lengths were slow, it prices drafting too cheaply for as long as it lives. So the
# spot check's longest length over its shortest is compared too.
SPOT_LENGTHS = (1, 4)
SPOT_TOLERANCE = 0.75  # re-measure when a spot price is under this fraction of the cached one
SPOT_SHAPE_TOLERANCE = 0.12  # or when the spot prices' ratio is off the cached one's by more


@torch.inference_mode()
def spot_check(engine, curve: CostCurve) -> dict:
    """Fresh prices for a plain step, a short verify and a full draft, beside the cached
    ones; and a plain step of the largest batch measured."""
    bench = _StepBench(engine)
    B = bench.block_size
    bench.warm_up()
    checks = {}
    for L in sorted({min(n, B) for n in SPOT_LENGTHS}):
        checks[f"verify_{L}"] = (bench.verify_s(L), curve.verify_s[L - 1])
    if B > 1 and bench.drafts:
        checks[f"draft_{B}"] = (bench.drafted_s(B), curve.draft_s[B - 1])
    bench.close()
    if curve.batch_verify_s:
        seqs = max(int(b) for b in curve.batch_verify_s)
        bench = _StepBench(engine, seqs)
        bench.verify(1)
        checks[f"batch_{seqs}_verify_1"] = (bench.verify_s(1, BATCH_REPEATS), curve.batch_verify_s[str(seqs)][0])
        bench.close()
    return checks


@torch.inference_mode()
def spot_prices(engine, lengths=(1, 2, 4), repeats: int = REPEATS) -> dict:
    """A few prices of a lone request (seconds by length, keys as strings): verifying L
    tokens with the drafter's features, and the drafter's pass over a block of L, both at a
    typical request's context (TYPICAL_CONTEXT); and a verify of BUSY_CALLERS rows, the price
    of a step of that many callers. What the choice of a target backend weighs
    (dflash.engine.target.fastest)."""
    from dflash.engine.target import TargetRow

    bench = _StepBench(engine, context=TYPICAL_CONTEXT)
    bench.verify(max(*lengths, BUSY_CALLERS)), bench.draft(max(lengths))  # warm up the largest shapes
    verify = longer_never_cheaper({str(L): bench.verify_s(L, repeats) for L in sorted({*lengths, BUSY_CALLERS})})
    draft = longer_never_cheaper({str(L): bench.drafted_s(L, repeats, verify[str(L)]) if bench.drafts else 0.0
                                  for L in lengths if 1 < L <= engine.block_size})
    bench.close()
    target, ids = engine.target, probe_prompt(engine.target, PREFILL_TOKENS)

    def prefill():
        seq = target.new_sequence()
        target.forward_batch([TargetRow(seq, ids, 1)], engine.layer_ids)
        target.free(seq)

    return {"verify": verify, "draft": draft,
            "prefill": {str(PREFILL_TOKENS): timed(prefill, target.device, max(2, repeats // 2))}}


def longer_never_cheaper(prices: dict[str, float]) -> dict[str, float]:
    """Prices by length (keys as strings) with no length dearer than a longer one: more rows
    or a longer block never cost less, so a shorter length timed above a longer one met a slow
    round (a draft of 2 was once timed at twice a draft of 4), and the longer one's price
    bounds it."""
    out, bound = {}, float("inf")
    for L in sorted(prices, key=int, reverse=True):
        bound = min(bound, prices[L])
        out[L] = bound
    return {L: out[L] for L in sorted(prices, key=int)}


def is_stale(checks: dict) -> bool:
    if any(now < SPOT_TOLERANCE * cached for now, cached in checks.values()):
        return True
    verifies = sorted((int(k.split("_")[1]), v) for k, v in checks.items() if k.startswith("verify_"))
    if len(verifies) < 2:
        return False
    (_, (now_1, cached_1)), (_, (now_n, cached_n)) = verifies[0], verifies[-1]
    if min(now_1, cached_1, now_n, cached_n) <= 0:
        return False
    return abs((now_n / now_1) / (cached_n / cached_1) - 1) > SPOT_SHAPE_TOLERANCE


def _interpolate(points: dict[int, float], B: int) -> list[float]:
    """Prices at every length 1..B, linear between the measured ones."""
    xs = sorted(points)
    out = []
    for n in range(1, B + 1):
        hi = next(x for x in xs if x >= n)
        lo = max(x for x in xs if x <= n)
        out.append(points[lo] if hi == lo else points[lo] + (points[hi] - points[lo]) * (n - lo) / (hi - lo))
    return out


def keyed_file(directory: Path, kind: str, key: dict) -> Path:
    """Where a measurement of `kind` for `key` is kept in the cost directory (the key's digest
    names it; the file holds the key too, to be checked on reading)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(directory) / f"{kind}-{digest}.json"


def write_keyed(path: Path, record: dict) -> None:
    """Write a measurement whole or not at all (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)


def cache_path(key: dict, directory: Path) -> Path:
    return keyed_file(directory, "cost-curve", key)


def load_or_measure(engine, directory: Path | None, max_batch: int = 1) -> CostCurve:
    """The cached curve for this engine's key if a spot check agrees with it, else a fresh
    measurement (then cached)."""
    key = curve_key(engine, max_batch)
    path = cache_path(key, directory) if directory is not None else None
    if path is not None and path.is_file():
        try:
            curve = CostCurve.from_dict(json.loads(path.read_text()))
            if curve.key == key and curve.max_block == engine.block_size and not is_stale(spot_check(engine, curve)):
                return curve
        except (OSError, ValueError, KeyError):
            pass  # unreadable: measure again
    curve = measure(engine, max_batch)
    if path is not None:
        write_keyed(path, curve.to_dict())
    return curve
