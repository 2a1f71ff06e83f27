"""Which target backend decodes fastest on this machine: measured, cached, spot-checked.

The machines differ (an AVX-512 Xeon, an AVX2-only EPYC, a GPU box) and so do the backends'
prices: llama.cpp's Q4_1 kernels give the cheapest plain step on an AVX2 EPYC but pay every
verified row in full, ONNX Runtime's int8 kernels read more bytes per step but verify 4
rows for about 1.35 plain steps, and prefill a prompt 1.7x as fast. Which one is faster
depends on all three and on the workload, so the choice prices a typical request (the
prefill of a 128-token prompt, then 128 new tokens at the expected rate of block length
auto: per backend the best of drafting 0, 1 or 3 tokens per step, each step priced at the
context it meets on average, 192 tokens: ONNX Runtime's attention costs more per cached
token than llama.cpp's) under each of the WORKLOADS a worker meets:

- `plain`: no draft pays (chat with nothing to copy), every step one row;
- `drafted`: drafts from the model drafter at its measured price, kept at the policy's
  default acceptance prior;
- `free`: the same acceptance, the drafts free (suffix chains, the tokens a grammar forces:
  on a CPU most kept drafts are these).

It takes the backend whose worst ratio to the best backend of a workload is least: a
backend 3 % faster at plain steps but 30 % slower once drafts are free loses, as it would
on every typed answer. A serving worker (`dflash serve`, several requests per step) weighs
beside each lone request the same request among BUSY_CALLERS callers (its prefill, then its
share of steps of that many sequences, plain: in a batch drafts rarely pay), half and half:
llama.cpp pays every batched sequence nearly in full, ONNX Runtime runs 8 for about 2.4
plain steps, so a backend that is close at one caller can be twice as fast at eight. The
result is cached per machine, thread count and runtime versions like the cost curve; on a
later start the chosen backend's plain step is timed again and a choice whose step got more
than STALE times slower is measured afresh.

A candidate whose plain step alone rules it out is not priced in full: no request can decode
faster than its plain step times the most tokens a step of the timed lengths is expected to
commit, so once a candidate has been priced, another whose plain step puts even that bound
SLACK times above that candidate's time in every workload is passed over (on a CPU the
reference transformers path: pricing it in full was a third of a cold start's choice).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from dflash.engine.costs import (TYPICAL_CONTEXT, TYPICAL_NEW_TOKENS, bench_context, keyed_file, probe_prompt, timed,
                                 write_keyed)
from dflash.engine.knobs import BUSY_CALLERS, SpeculativeConfig
from dflash.engine.policy import Prior, expected_tokens
from dflash.engine.target.protocol import TargetRow

REPEATS = 9
STALE = 1.5
SLACK = 1.25  # how far a passed-over candidate's bound must lie beyond the best (timing noise)
LENGTHS = (1, 2, 4)  # verify lengths timed; the drafter's price is timed at the same block lengths


def step_seconds(target, layer_ids: tuple[int, ...] = (), repeats: int = REPEATS) -> float:
    """The median time of one plain decoding step (one row, one token) on `target`, at the
    context the choice was priced at (costs.TYPICAL_CONTEXT)."""
    context = bench_context(target, TYPICAL_CONTEXT, 1)
    seq = target.new_sequence()
    tokens = iter(range(200, 200 + repeats + 1))
    try:
        target.forward_batch([TargetRow(seq, probe_prompt(target, context), 1)], layer_ids)

        def step():
            target.forward_batch([TargetRow(seq, [next(tokens) % target.vocab_size], 1)], layer_ids)

        def back():
            target.rollback(seq, context)

        timed(step, target.device, 1, after=back)  # a warm-up
        return timed(step, target.device, repeats, reduce=statistics.median, after=back)
    finally:
        target.free(seq)


NEW_TOKENS = TYPICAL_NEW_TOKENS  # a typical request: costs.PREFILL_TOKENS of prompt, this many new
WORKLOADS = ("plain", "drafted", "free")  # see the module's doc
WEIGHED = "the least worst ratio to the best backend over the workloads " + ", ".join(WORKLOADS)


def workload(name: str, acceptance: list[float]) -> tuple[list[float], bool]:
    """A workload's acceptance of drafts and whether its drafts are paid for."""
    if name == "plain":
        return [0.0] * len(acceptance), False
    return acceptance, name == "drafted"


def request_seconds(prices: dict, acceptance: list[float], paid: bool = True) -> float:
    """A typical request's time on a backend: its prompt's prefill, then NEW_TOKENS at the
    expected rate (prefill prices differ more between backends than decode prices do: llama.cpp
    prefills in calls of at most 63 rows, ONNX Runtime's int8 kernels take a whole chunk)."""
    return prefill_seconds(prices) + NEW_TOKENS / expected_rate(prices, acceptance, paid)


def prefill_seconds(prices: dict) -> float:
    return sum(prices.get("prefill", {}).values())


def busy_seconds(prices: dict) -> float | None:
    """The typical request among BUSY_CALLERS callers: its prefill, then its share of plain
    steps of that many sequences (None: prices without that step's)."""
    step = prices["verify"].get(str(BUSY_CALLERS))
    if step is None:
        return None
    return prefill_seconds(prices) + NEW_TOKENS * step / BUSY_CALLERS


def choice_seconds(prices: dict, acceptance: list[float], serving: bool, paid: bool = True) -> float:
    """A workload's time: the lone request's, or for a serving worker the mean of it and the
    busy one's."""
    lone = request_seconds(prices, acceptance, paid)
    busy = busy_seconds(prices) if serving else None
    return lone if busy is None else (lone + busy) / 2


def workload_seconds(prices: dict, acceptance: list[float], serving: bool) -> dict[str, float]:
    """choice_seconds in each of the WORKLOADS, `acceptance` the drafts' prior."""
    out = {}
    for name in WORKLOADS:
        rates, paid = workload(name, acceptance)
        out[name] = choice_seconds(prices, rates, serving, paid)
    return out


def worst_ratios(measured: dict[str, dict], acceptance: list[float], serving: bool) -> dict[str, float]:
    """Per backend the most its time exceeds the best backend's in any workload (1.0: best in all)."""
    times = {name: workload_seconds(prices, acceptance, serving) for name, prices in measured.items()}
    best = {w: min(t[w] for t in times.values()) for w in WORKLOADS}
    return {name: max(t[w] / best[w] for w in WORKLOADS) for name, t in times.items()}


def choose(measured: dict[str, dict], acceptance: list[float], serving: bool) -> str:
    """The backend of the least worst ratio (the first of equals)."""
    ratios = worst_ratios(measured, acceptance, serving)
    return min(ratios, key=ratios.get)


def expected_rate(prices: dict, acceptance: list[float], paid: bool = True) -> float:
    """Tokens per second of a lone request at the best of the timed lengths: `prices` holds
    seconds by length, {"verify": {"1": s, "2": s, "4": s}, "draft": {"2": s, "4": s}};
    `paid`: whether the drafts cost their price (False: free drafts)."""
    best = 0.0
    for L in LENGTHS:
        cost = prices["verify"][str(L)] + (prices["draft"][str(L)] if L > 1 and paid else 0.0)
        best = max(best, expected_tokens(acceptance, L) / cost)
    return best


def fastest_possible_s(plain_s: float, acceptance: list[float]) -> float:
    """The least time a typical request could take on a backend whose plain step takes
    `plain_s`: no prefill, and each step priced as a plain one (a verify of L rows costs at
    least one row, a draft at least nothing) while committing the most tokens of any timed L."""
    return NEW_TOKENS * plain_s / max(expected_tokens(acceptance, L) for L in LENGTHS)


def ruled_out_above(measured: dict[str, dict], acceptance: list[float], serving: bool = False) -> float:
    """The plain step (seconds) beyond which a candidate cannot win against `measured`: its
    least time in every workload (fastest_possible_s; for a serving worker a busy step costs at
    least one plain step) lies SLACK beyond one measured backend's time there, so that backend
    beats it everywhere and its worst ratio cannot be the least."""
    def least_per_plain_s(name):
        lone = fastest_possible_s(1.0, workload(name, acceptance)[0])
        return (lone + NEW_TOKENS / BUSY_CALLERS) / 2 if serving else lone

    return min(max(SLACK * t / least_per_plain_s(w) for w, t in workload_seconds(prices, acceptance, serving).items())
               for prices in measured.values())


def default_acceptance(cfg: SpeculativeConfig = SpeculativeConfig()) -> list[float]:
    return Prior.default(max(LENGTHS), cfg).rates()


def runtime_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "llama-cpp-python", "onnxruntime", "onnxruntime-genai"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def cache_file(directory: Path, key: dict) -> Path:
    return keyed_file(directory, "target-backend", key)


def cached_choice(directory: Path | None, key: dict) -> dict | None:
    if directory is None:
        return None
    try:
        got = json.loads(cache_file(directory, key).read_text())
    except (OSError, ValueError):
        return None
    return got if got.get("key") == key and got.get("choice") in got.get("measured", {}) else None


def remember(directory: Path | None, key: dict, measured: dict[str, dict],
             passed_over: dict[str, float] | None = None, serving: bool = False) -> dict:
    """Choose from each backend's measured prices (spot_prices) and cache the choice.
    `passed_over`: the plain step (seconds) of each candidate that ruled_out_above ruled out;
    `serving`: for a serving worker (choice_seconds)."""
    acceptance = default_acceptance()
    rates = {name: expected_rate(prices, acceptance) for name, prices in measured.items()}
    request = {name: request_seconds(prices, acceptance) for name, prices in measured.items()}
    record = {"key": key, "measured": measured, "acceptance": acceptance, "expected_tokens_per_s": rates,
              "request_s": request,
              "workload_s": {name: workload_seconds(prices, acceptance, serving) for name, prices in measured.items()},
              "worst_ratio": worst_ratios(measured, acceptance, serving),
              "choice": choose(measured, acceptance, serving)}
    if serving:
        record["busy_request_s"] = {name: busy_seconds(prices) for name, prices in measured.items()}
    if passed_over:
        record["passed_over"] = {name: {"plain_s": s, "fastest_possible_request_s": fastest_possible_s(s, acceptance)}
                                 for name, s in passed_over.items()}
    if directory is not None:
        write_keyed(cache_file(directory, key), record)
    return record


def summary(record: dict) -> dict:
    """What `status` shows of a choice: each backend's prices (ms), expected tokens/s, its
    time in each workload and its worst ratio to the best."""
    ms = {name: {kind: {L: round(s * 1e3, 2) for L, s in by_len.items()} for kind, by_len in prices.items()}
          for name, prices in record["measured"].items()}
    return {"prices_ms": ms, "expected_tokens_per_s": {k: round(v, 1) for k, v in
                                                       record["expected_tokens_per_s"].items()},
            "request_s": {k: round(v, 3) for k, v in record.get("request_s", {}).items()},
            **({"workload_s": {k: {w: round(t, 3) for w, t in v.items()} for k, v in record["workload_s"].items()},
                "worst_ratio": {k: round(v, 3) for k, v in record["worst_ratio"].items()}, "chosen_by": WEIGHED}
               if "worst_ratio" in record else {}),
            **({"busy_request_s": {k: None if v is None else round(v, 3)
                                   for k, v in record["busy_request_s"].items()},
                "weighed": f"a lone request and one among {BUSY_CALLERS} callers, half and half"}
               if "busy_request_s" in record else {}),
            **({"failed": record["failed"]} if record.get("failed") else {}),
            **({"passed_over": {name: f"plain step {v['plain_s'] * 1e3:.1f} ms: a request takes at least "
                                f"{v['fastest_possible_request_s']:.2f} s" for name, v in record["passed_over"].items()}}
               if record.get("passed_over") else {})}


def is_stale(record: dict, measured_s: float) -> bool:
    return measured_s > STALE * record["measured"][record["choice"]]["verify"]["1"]
