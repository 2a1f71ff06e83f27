"""Tunable defaults of the engine: every knob of speculation (SpeculativeConfig) and the
scheduler's. Torch-free, so the CLI can show them without loading a model."""

from __future__ import annotations

from dataclasses import dataclass

# The scheduler's defaults (dflash.engine.scheduler): requests served by one engine step,
# and the tokens one step may take while others decode (a prefill chunk gets what is left).
DEFAULT_MAX_BATCH = 16
DEFAULT_STEP_TOKENS = 128
DEFAULT_MAX_QUEUE = 64  # requests waiting for the engine thread before the worker answers "busy"
# The callers a serving worker's choice of target backend weighs beside a lone request
# (dflash.engine.target.fastest): a step of that many sequences is priced as a verify of that
# many rows in one (costs.spot_prices): one shape every backend can time at start, and on
# both CPU backends about what that many sequences cost (docs/models.md, the backends table).
BUSY_CALLERS = 8
# Finished generations remembered: the engine's recent counts (the prior of requests that
# bring none), and those the worker's recent τ pools.
RECENT_PRIOR = 200
RECENT_TAU = 100
# Memory the engine keeps between requests, capped: the prefix cache's K/V rows
# (dflash.engine.prefix_cache), and the workloads' past outputs the suffix proposer reads
# (dflash.engine.workloads); with the fewest leading prompt tokens worth copying from the
# prefix cache instead of prefilling. On a 1.5B model the prefix cache's cap holds about 34
# short requests (a Qwen2.5-Coder-1.5B row is 56 KiB, and a sequence's K/V is reserved in
# runs of 256 rows); 128 MB held 8, too few for a workload whose kinds of prompt take turns
# (llama-server's own prompt cache defaults to 8 GiB).
PREFIX_CACHE_MB = 512.0
WORKLOAD_MEMORY_MB = 64.0
PREFIX_MIN_TOKENS = 16


# Precisions by name (dflash.engine.dtypes maps them to torch's): the target's and the
# drafter's, which may also be int8 (int8 weights, fp32 activations; CPU).
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DRAFT_DTYPE_NAMES = (*DTYPE_NAMES, "int8")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Every knob of speculation: block length `auto` (policy.py), the calibration of every
    proposer's confidence (calibration.py); one place for their defaults."""

    # The longest verify (anchor included) of an engine without a drafter (with one: its block size).
    max_block: int = 16
    default_acceptance: float = 0.5  # a priori chance the first draft is kept (no workload prior)
    default_decay: float = 0.85  # ... and its decay per later position
    prior_strength: float = 2.0  # steps of evidence the default prior is worth
    max_prior_strength: float = 32.0  # a workload prior never outweighs this many steps
    confidence_weight: float = 0.75  # a priori, the drafter's confidence against position history
    calibration_bins: int = 10  # confidence bins for the online calibration
    calibration_strength: float = 2.0  # pseudo-outcomes per bin before any is seen
    history: int = 32  # recent drafted steps replayed to price drafting
    probe_after: int = 8  # plain steps before drafting is tried again
    probe_max_gap: int = 64  # probes that do not pay back off up to this gap
    # ... and never more often than keeps failed probes under this share of a request's time:
    # where verifying costs several plain steps (llama.cpp's Q4_1 on an AVX2 CPU: a probe of 3
    # costs 2.7 plain steps and the drafter's pass) probes are spaced out accordingly, and
    # where even drafts that are always kept could not pay, there are none.
    probe_overhead: float = 0.01
    # A request whose prior rests on this many judged first drafts (the workload's or the
    # engine's recent generations) and says drafting does not pay starts at this gap: the
    # evidence that probes would gather at 8, 16, 32 is already in the prior.
    informed_prior_steps: float = 16.0
    informed_gap: int = 32
    # A probe drafts this many positions (anchor included) and verifies them all. 3, not
    # more: on a CPU a verify of 3 costs about what 2 does while 4 costs markedly more
    # (small-M matmul kernels), and the first draft positions decide whether drafting pays.
    probe_len: int = 3
    # Finished auto generations before their median length, not max_new_tokens, bounds the steps
    # a request plans its drafter's probes over (Engine.steps_expected).
    typical_after: int = 8
    warmup_outcomes: int = 4  # drafted steps verify everything until this many outcomes are calibrated
    # Point masses (drafts made before the choice: the suffix proposer's chains, the head's
    # guesses): before any outcome, a position is trusted at this share of its confidence (a
    # count of one earlier occurrence says little), with point_mass_strength pseudo-outcomes;
    # a proposer's pooled outcomes of recent requests (at most max_prior_strength of them per
    # bin) start each new request's calibration.
    point_mass_trust: float = 0.5
    point_mass_strength: float = 4.0
    # The suffix proposer (proposers/suffix.py): the longest suffix it looks up; the shortest
    # match that proposes (1: even a one-token match proposes what most often followed that
    # token, a bigram guess the policy trusts only as far as its calibrated outcomes say, at a
    # verify price of nearly nothing for a row or two); a chain at most this many times as long
    # as the match it continues; workloads whose pooled calibration is kept (least recently used
    # dropped); and, where the next-token head chooses a chain's first token among the ways its
    # earlier occurrences went, each candidate scores occurrences × (the head's probability +
    # this floor): the head breaks ties and overrules a thin majority, and the floor keeps a
    # token outside the head's vocabulary in the running. Chosen by replaying bench runs
    # (docs/investigations/2026-12-05-chain-confidence-and-replay.md, 2026-12-05-head-choice.md).
    suffix_max_context: int = 32
    suffix_min_match: int = 1
    suffix_spec_factor: int = 2
    suffix_max_pools: int = 256
    suffix_head_floor: float = 0.01
