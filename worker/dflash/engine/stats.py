"""Per-generation statistics, in vLLM's spec-decode vocabulary, as additive counters.

A step verifies `verify_len` tokens: the anchor plus `verify_len - 1` drafts (a plain step
verifies only the anchor). τ (mean acceptance length) counts accepted drafts + 1 per step,
pooled (accepted + steps over steps), as vLLM and the DFlash paper do; acceptance rate is
accepted / drafted. Per draft position i (1-based) two counters say how often the
position was *judged* (verified, with every earlier draft accepted) and how often it was
*accepted*: their ratio is the conditional acceptance that the block-length policy and
the SQL workload priors use. Counters add, so statistics pool across generations.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from dflash.engine.calibration import judged


def pooled_tau(accepted: int, steps: int) -> float | None:
    """τ, the mean acceptance length: accepted drafts + 1 per step, pooled over steps. The
    one definition: the engine, the worker's status, the bench and training all call it."""
    return (accepted + steps) / steps if steps else None


@dataclass
class StepRecord:
    draft_ids: list[int]  # the drafts that were verified (verify length - 1 of them)
    accepted: int


def _add_at(counts: list[int], n: int) -> None:
    for i in range(n):
        counts[i] += 1


@dataclass
class GenerationStats:
    block_size: int  # the largest verify length allowed (fixed size, or the drafter's for auto)
    policy: str = "fixed"  # "fixed" | "auto"
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of them, copied from the prefix cache instead of prefilled
    new_tokens: int = 0
    steps: list[StepRecord] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    judged_per_position: list[int] = field(default_factory=list)
    verify_lengths: Counter = field(default_factory=Counter)
    # Per proposer the generation had (every one that joined it, whether it drafted or not):
    # steps it drafted, tokens it had verified, tokens kept.
    by_proposer: dict = field(default_factory=dict)
    # With a constraint (json_schema, regex, choices): whether the output ended short of a
    # whole answer (max_new_tokens or the context cut it); None without one.
    truncated: bool | None = None
    # Tokens the grammar forced that were drafted as such and kept (certain drafts: the
    # forced-token proposer's runs, or the forced run a suffix chain starts with).
    forced_tokens: int = 0
    # Of decode_s, the time the constraint's grammar took (its masks, cuts and commits).
    constraint_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0

    def __post_init__(self):
        width = max(self.block_size - 1, 0)
        self.accepted_per_position = self.accepted_per_position or [0] * width
        self.judged_per_position = self.judged_per_position or [0] * width

    def record(self, draft_ids: list[int], accepted: int, proposer: str | None = None, positional: bool = True) -> None:
        """A verified step: `proposer` drafted `draft_ids` (None: nobody) and `accepted` were
        kept. `positional`: its outcomes join the per-position counts, which are a model
        drafter's (block length auto's workload prior), not a point mass's."""
        self.steps.append(StepRecord(draft_ids, accepted))
        self.verify_lengths[len(draft_ids) + 1] += 1
        if proposer is not None and draft_ids:
            self.had((proposer,))
            c = self.by_proposer[proposer]
            c["steps"] += 1
            c["drafted"] += len(draft_ids)
            c["accepted"] += accepted
        if not positional:
            return
        _add_at(self.accepted_per_position, accepted)
        _add_at(self.judged_per_position, judged(accepted, len(draft_ids) + 1))

    def had(self, proposers) -> None:
        """These proposers joined the generation (counted from nothing where they do not draft)."""
        for name in proposers:
            self.by_proposer.setdefault(name, {"steps": 0, "drafted": 0, "accepted": 0})

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def drafted(self) -> int:
        return sum(len(s.draft_ids) for s in self.steps)

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.steps)

    @property
    def drafting_steps(self) -> int:
        return sum(1 for s in self.steps if s.draft_ids)

    @property
    def tau(self) -> float | None:
        return pooled_tau(self.accepted, self.num_steps)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def overhead_s(self) -> float:
        """Decode time spent outside the drafter and target forwards."""
        return max(self.decode_s - self.draft_s - self.verify_s, 0.0)

    @property
    def tokens_per_s(self) -> float | None:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else None

    def to_dict(self) -> dict:
        return {
            "block_size": self.block_size,
            "block_policy": self.policy,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "new_tokens": self.new_tokens,
            "num_steps": self.num_steps,
            "drafting_steps": self.drafting_steps,
            "steps": [{"draft_ids": s.draft_ids, "accepted": s.accepted} for s in self.steps],
            "drafted": self.drafted,
            "accepted": self.accepted,
            "tau": self.tau,
            "acceptance_rate": self.acceptance_rate,
            "accepted_per_position": list(self.accepted_per_position),
            "judged_per_position": list(self.judged_per_position),
            "verify_length_histogram": {str(k): v for k, v in sorted(self.verify_lengths.items())},
            "proposers": {k: dict(v) for k, v in sorted(self.by_proposer.items())},
            "truncated": self.truncated,
            "forced_tokens": self.forced_tokens,
            "constraint_s": self.constraint_s,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "overhead_s": self.overhead_s,
            "tokens_per_s": self.tokens_per_s,
        }
