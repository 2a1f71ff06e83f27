"""Per-generation statistics, in vLLM's spec-decode vocabulary.

tau (mean acceptance length) counts accepted drafts + 1 per step, as vLLM and
the DFlash paper do; acceptance rate is accepted / drafted.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepRecord:
    draft_ids: list[int]
    accepted: int


@dataclass
class GenerationStats:
    block_size: int
    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: list[StepRecord] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0

    def record(self, draft_ids: list[int], accepted: int) -> None:
        self.steps.append(StepRecord(draft_ids, accepted))

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
    def tau(self) -> float | None:
        return (self.accepted + self.num_steps) / self.num_steps if self.steps else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def accepted_per_position(self) -> list[int]:
        """counts[i] = steps whose draft at position i+1 was accepted."""
        counts = [0] * max(self.block_size - 1, 0)
        for s in self.steps:
            for i in range(s.accepted):
                counts[i] += 1
        return counts

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
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "num_steps": self.num_steps,
            "steps": [{"draft_ids": s.draft_ids, "accepted": s.accepted} for s in self.steps],
            "drafted": self.drafted,
            "accepted": self.accepted,
            "tau": self.tau,
            "acceptance_rate": self.acceptance_rate,
            "accepted_per_position": self.accepted_per_position,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "overhead_s": self.overhead_s,
            "tokens_per_s": self.tokens_per_s,
        }
