"""Block length `auto`: per step, which offer to verify and how far, at this step's prices.

Every proposer of a request may offer a draft each step (dflash.engine.proposers.protocol):
a ready one (its tokens and confidences known: a suffix chain, a guess, a forced token) or a
deferred one (a model drafter, which drafts only when chosen). The policy is a chooser over
those offers at the batch's prices, plus the probe schedule of the request's model drafter.
It never names a proposer: each offer's name keys the request's calibration of it
(dflash.engine.calibration). Each decision maximises expected committed tokens minus their
price at the going rate (Dinkelbach's form of maximising tokens per second):

0. A ready offer is worth its best verify length L: its confidences calibrated on the
   request's outcomes of that proposer, its price (a lookup) already paid.
1. A deferred offer, before drafting, is worth its best draft length D (1 = no drafter
   forward: a plain step). The value
   of drafting D is estimated by replaying the request's recent drafted steps: for each
   remembered vector of draft confidences, what the best verify length would have earned
   under today's calibration, minus the drafter's price for D. With no history yet, the
   per-position acceptance prior stands in.
2. After drafting, the verify length L <= D from the drafter's own confidence at each
   position (its distribution's peak probability), calibrated online per request: field
   reports find the drafter's confidence predicts acceptance far better than history.
   The drafter's price is sunk by then; only the verify lengths' prices differ.

Expected committed tokens for verify length L with conditional acceptances a_1, a_2, ...:
1 + a_1 + a_1 a_2 + ... (L - 1 terms). Prices come from the device's cost curve.

When drafting has not paid for a while the policy probes again, briefly (a short draft)
and ever more rarely, so a request whose drafts stop being kept pays almost nothing, and
one whose drafts start being kept notices. How rarely also follows the prices: a probe that
fails costs its drafter pass and its extra verified rows, and probes are spaced so that
failed ones take at most `probe_overhead` of the time; where even drafts that are always
kept could not pay (verifying L costs more than L plain steps), there are none.

Lossless by construction: every decision depends on past outcomes, the cost curve and the
draft *distributions*' peaks, never on the current step's sampled drafts or target draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dflash.engine.calibration import Drafter, best, shrink
from dflash.engine.costs import CostCurve, Prices
from dflash.engine.knobs import SpeculativeConfig


@dataclass
class Prior:
    """Per-position pseudo-counts: accepted[i] of judged[i] at draft position i + 1."""

    accepted: list[float]
    judged: list[float]

    @classmethod
    def from_counts(cls, accepted, judged, width: int, cfg: SpeculativeConfig) -> "Prior":
        """Pooled counts of earlier generations, shrunk so they never outweigh more than
        `cfg.max_prior_strength` steps of this request; positions nobody judged fall back to
        the default prior."""
        default = cls.default(width, cfg)
        acc, jud = list(default.accepted), list(default.judged)
        for i in range(min(width, len(accepted or []), len(judged or []))):
            n, k = float(judged[i] or 0), float(accepted[i] or 0)
            if n <= 0:
                continue
            (k,), (n,) = shrink([min(max(k, 0.0), n)], [n], cfg.max_prior_strength)
            acc[i], jud[i] = k + acc[i] * 0.25, n + jud[i] * 0.25
        return cls(acc, jud)

    @classmethod
    def default(cls, width: int, cfg: SpeculativeConfig) -> "Prior":
        rates = [cfg.default_acceptance * cfg.default_decay**i for i in range(width)]
        return cls([r * cfg.prior_strength for r in rates], [cfg.prior_strength] * width)

    def rates(self) -> list[float]:
        return [a / j if j > 0 else 0.0 for a, j in zip(self.accepted, self.judged)]


def expected_tokens(acceptance: list[float], verify_len: int) -> float:
    """Expected tokens one step commits when it verifies `verify_len` tokens (anchor +
    verify_len - 1 drafts) and draft i is kept with conditional probability acceptance[i]."""
    total, run = 1.0, 1.0
    for a in acceptance[: verify_len - 1]:
        run *= a
        total += run
    return total


class BlockPolicy:
    """The per-request state of `auto`: its calibration of each proposer's offers
    (`estimates`, by offer name: calibration.PointMass or calibration.Drafter, at most one
    of the latter: the request's model drafter), what it has committed and spent, and the
    drafter's probe schedule.

    Prices come with every step (`price(prices)` before `choose`): a request stepped alone
    pays the device's single-request curve; one of a batch pays its share of the batch's
    forward plus what its extra rows add, and time is worth the batch's rate, so
    speculation backs off under load where verifying extra rows no longer pays."""

    def __init__(self, costs: CostCurve, max_block: int, cfg: SpeculativeConfig, estimates: dict | None = None,
                 priced=None):
        """`priced`: the model drafter's own prices (its proposer's `priced`: the step's prices
        with its drafts at what they cost); None: the cost curve's, the DFlash drafter's."""
        self.cfg = cfg
        self._priced = priced or (lambda prices: prices)
        self.prices: Prices = self._priced(costs.solo())
        self.max_block = min(max_block, costs.max_block)
        self.estimates = dict(estimates or {})
        deferred = [name for name, e in self.estimates.items() if e.deferred]
        if len(deferred) > 1:
            raise ValueError(f"one model drafter per request, got {deferred}")
        self.drafter: Drafter | None = self.estimates[deferred[0]] if deferred else None
        self.tokens, self.cost = 0.0, 0.0  # what the request has committed and spent so far (`rate`)
        # The drafter's probe schedule.
        self.plain_run = 0  # consecutive steps it did not draft
        self.probe_every = cfg.probe_after
        self.probing = False
        # The rate at which "do not draft" was last decided (None: decide afresh). A plain
        # step changes none of the counts the decision rests on, only the going rate, so the
        # decision stands until a drafted step or a lower rate (which makes drafting cheaper);
        # deciding again every plain step would cost a noticeable share of the step on a CPU.
        self._plain_at_rate: float | None = None
        self._plain_prices: Prices | None = None
        self._draft_values: list[float] | None = None  # what the last draft_length() weighed
        self._excess_for: Prices | None = None
        self._excess: float | None = None
        self.pending_rows = 0  # target feature rows the drafter has not seen (its next pass takes them)
        prior = self.drafter.prior if self.drafter is not None else None
        if self.max_block > 1 and prior is not None and prior.judged and prior.judged[0] >= cfg.informed_prior_steps:
            if best(self.draft_values()) == 0:
                self.probe_every = cfg.informed_gap

    @classmethod
    def drafting(cls, costs: CostCurve, max_block: int, prior: Prior, cfg: SpeculativeConfig,
                 name: str = "drafter") -> "BlockPolicy":
        """A policy for a request whose only proposer is a model drafter (offers named `name`)."""
        width = max(min(max_block, costs.max_block) - 1, 0)
        return cls(costs, max_block, cfg, {name: Drafter(cfg, width, prior)})

    def drop(self, name: str) -> None:
        """The request goes on without this proposer."""
        if self.estimates.pop(name, None) is self.drafter:
            self.drafter = None

    # --- estimates -------------------------------------------------------------------

    def price(self, prices: Prices) -> None:
        """The prices of the step about to be planned (its drafts at the model drafter's own)."""
        self.prices = self._priced(prices)

    @property
    def rate(self) -> float:
        """Tokens per second to price time at: plain decoding's in this step, or what this
        request already achieves when that is better. Certain drafts (a grammar's forced run)
        are left out of the latter, tokens and rows: they come at a rate no choice changes,
        and would price the rows of a JSON answer's values, which the request must find, at
        the rate of its keys."""
        plain = self.prices.plain_rate
        return max(plain, self.tokens / self.cost) if self.cost > 0 else plain

    def _verify_values(self, acceptance: list[float], rate: float) -> list[float]:
        """For L = 1..max_block: expected tokens of verifying L, minus its price at `rate`."""
        verify_s = self.prices.verify_s
        out = [1.0 - rate * verify_s[0]]
        total = run = 1.0
        for L in range(2, self.max_block + 1):
            run *= acceptance[L - 2]
            total += run
            out.append(total - rate * verify_s[L - 1])
        return out

    def _best_verify(self, acceptance: list[float], draft_len: int) -> tuple[int, float]:
        """(L, value) maximising expected tokens - rate * verify price, L in 1..draft_len."""
        values = self._verify_values(acceptance, self.rate)[:draft_len]
        i = best(values)
        return i + 1, values[i]

    def ready_verify(self, name: str, confidences: list[float], certain: int = 0) -> tuple[int, float]:
        """(L, value) for a ready draft of offer `name` with these confidences, its first
        `certain` kept for sure and the rest calibrated by this request's outcomes of that
        proposer's drafts at similar confidence."""
        width = self.max_block - 1
        certain = min(certain, width)
        acc = [1.0] * certain + self.estimates[name].acceptance(confidences[certain:width])
        return self._best_verify(acc + [0.0] * (width - len(acc)), len(acc) + 1)

    def draft_values(self) -> list[float]:
        """Expected net tokens of a step for each draft length D = 1..max_block (index D - 1):
        per remembered confidence vector the best verify length up to D (a running maximum
        over L, so every D costs one pass), averaged, minus the drafter's price for D."""
        rate = self.rate
        vectors, rates = self.drafter.vectors()
        earned = [0.0] * self.max_block
        for vec in vectors:
            top = float("-inf")
            for i, value in enumerate(self._verify_values(self.drafter.acceptance(vec, rates), rate)):
                top = max(top, value)
                earned[i] += top
        n = len(vectors)
        context = self.pending_rows * self.prices.context_row_s
        return [earned[0] / n] + [earned[D - 1] / n - rate * (self.prices.draft_s[D - 1] + context)
                                  for D in range(2, self.max_block + 1)]

    @property
    def probe_gap(self) -> int | float:
        """Plain steps before the next probe: the backed-off gap, at least what keeps failed
        probes under `probe_overhead` of the time at this step's prices (inf: no probes)."""
        return max(self.probe_every, self._probe_floor(self.prices, self.pending_rows))

    def _probe_floor(self, prices: Prices, pending_rows: int = 0) -> int | float:
        """The fewest plain steps per probe that keep failed probes under `probe_overhead`:
        a probe's price beyond its own token, in plain steps, over that share. The price
        includes the drafter's pass over the target rows it has not seen yet
        (`pending_rows`: at a request's first probe its prompt and every token so far),
        which in the loop cost more than the short draft itself: priced without it, probes
        took ~4 % of a request's time instead of 1 % (docs/benchmarks.md, Zen 4)."""
        if self._excess_for is not prices:
            self._excess_for, self._excess = prices, self._probe_excess(prices)
        if self._excess is None:
            return float("inf")
        excess = self._excess + pending_rows * prices.context_row_s / prices.verify_s[0]
        return math.ceil(excess / self.cfg.probe_overhead) if excess > 0 else 0

    def _probe_excess(self, prices: Prices) -> float | None:
        """Plain steps a probe with nothing pending costs beyond its own token; None where no
        draft can pay at these prices (then there are no probes)."""
        P = min(self.cfg.probe_len, self.max_block)
        if P < 2:
            return None
        rate = 1.0 / prices.verify_s[0]
        # Could drafting pay at all? Every draft kept: L tokens for a step of length L.
        if max(L - rate * prices.step_s(L, L) for L in range(2, self.max_block + 1)) <= 0:
            return None
        return rate * prices.step_s(P, P) - 1.0

    def drafter_sits_out(self, pending_rows: int, steps: int) -> bool:
        """Whether the drafter would run in none of a lone request's next `steps` steps, with
        `pending_rows` target rows it has not seen (the prompt, before the first step). Until
        the drafter itself has an outcome, nothing raises the value of drafting: the going
        rate never drops below plain decoding's and the pending rows only grow, so if plain
        beats every draft length now and the probe schedule (steps other proposers draft
        count as plain ones) puts no probe within `steps`, the drafter never runs, and the
        request can do without it (and without the target's features for it). Solo prices
        only: in a batch a request's share of a step is smaller, so its drafts cost
        relatively more still."""
        if self.max_block < 2:
            return True
        self.pending_rows = pending_rows
        values = self.draft_values()
        if max(values[1:]) > values[0]:
            return False
        # A probe after k plain steps, once k reaches the gap at the rows pending by then.
        return not any(k >= max(self.probe_every, self._probe_floor(self.prices, pending_rows + k))
                       for k in range(steps))

    # --- decisions ---------------------------------------------------------------------

    def draft_length(self) -> int:
        """D for the drafter's next step: 1 means a plain step with no drafter forward."""
        self.probing = False
        if self.max_block < 2:
            return 1
        rate = self.rate
        gap = self.probe_gap
        if (self._plain_at_rate is not None and self._plain_prices is self.prices and rate >= self._plain_at_rate
                and self.plain_run < gap):
            return 1
        values = self._draft_values = self.draft_values()
        D = best(values) + 1
        self._plain_at_rate = rate if D == 1 else None
        self._plain_prices = self.prices
        if D == 1 and self.plain_run >= gap:
            D = min(self.cfg.probe_len, self.max_block)
        # A probe, or a drafted step before the calibration has seen anything, verifies all
        # it drafted: without outcomes at low confidence it could never learn that low
        # confidence is sometimes right (a drafter whose peaks are flat but correct).
        self.probing = D > 1 and (self.plain_run >= gap or self.drafter.calibration.outcomes < self.cfg.warmup_outcomes)
        return D

    def choose(self, offers: list) -> tuple[object | None, int]:
        """The offer to take this step and its length (None, 1: a plain step). A ready offer
        comes with its verify length; the deferred one (the drafter's) with the positions to
        draft, its verify length chosen after (verify_length). The most expected net tokens
        wins (the earlier offer on a tie), except that the drafter's due probes still run
        (steps other offers win count as plain ones for its schedule), so a drafter that
        would do better is found even where a free proposer always has something to offer."""
        self._draft_values = None
        chosen, n, value = None, 1, 1.0 - self.rate * self.prices.verify_s[0]
        deferred = None
        for offer in offers:
            if offer.deferred:
                deferred = offer
                continue
            L, v = self.ready_verify(offer.name, offer.draft.confidence, offer.draft.certain)
            if L > 1 and v > value:
                chosen, n, value = offer, L, v
        if deferred is not None:
            # a cheaper drafter pass: decide afresh (a dearer one keeps "plain")
            if deferred.pending < self.pending_rows:
                self._plain_at_rate = None
            self.pending_rows = deferred.pending
            D = self.draft_length()
            # The drafter's due probe (it must learn too), the rarer the more requests share the
            # step: a probe's drafter pass delays all of them.
            due = self.probing and self.plain_run >= self.probe_gap * self.prices.batch
            if D > 1 and (due or (self._draft_values is not None and self._draft_values[D - 1] > value)):
                chosen, n = deferred, D
            elif D > 1:
                self.probing = False
        return chosen, n

    def verify_length(self, confidences: list[float]) -> int:
        """L for this step, given the drafter's confidence at each drafted position."""
        if self.probing:
            return len(confidences) + 1
        return self._best_verify(self.drafter.acceptance(confidences), len(confidences) + 1)[0]

    # --- learning ----------------------------------------------------------------------

    def observe(self, offer, confidences: list[float], verify_len: int, accepted: int, draft_len: int) -> None:
        """A step's outcome: `offer` (None: a plain step) verified `verify_len` tokens and kept
        `accepted` drafts; `draft_len`: the positions its drafter computed (1: none). Of a
        ready offer with certain drafts, the step passes the rest only (step.py)."""
        committed = accepted + 1
        estimate = self.estimates[offer.name] if offer is not None else None
        if estimate is not None and not estimate.deferred:  # for the drafter's schedule, a plain step
            self.tokens += committed
            self.cost += self.prices.verify_s[verify_len - 1] + offer.price.s
            estimate.record(confidences, verify_len, accepted, draft_len)
            self.plain_run += 1
            return
        self.tokens += committed
        self.cost += self.prices.step_s(draft_len, verify_len)
        if estimate is not None:
            estimate.record(confidences, verify_len, accepted, draft_len)
        if draft_len == 1:
            self.plain_run += 1
            return
        self.plain_run = 0
        self._plain_at_rate = None
        if self.probing:
            paid = committed - self.rate * self.prices.step_s(draft_len, verify_len) > (
                1.0 - self.rate * self.prices.verify_s[0])
            self.probe_every = self.cfg.probe_after if paid else min(self.probe_every * 2, self.cfg.probe_max_gap)

    def counts(self) -> dict:
        """The drafter's per-position counts (the workload prior of later requests)."""
        return self.drafter.counts() if self.drafter is not None else {"accepted": [], "judged": []}


def explain(costs: CostCurve, max_block: int, prior: Prior, cfg: SpeculativeConfig) -> dict:
    """What the policy expects from a prior alone: per verify length the expected τ and tokens
    per second at the device's prices, and the draft length it would start with."""
    policy = BlockPolicy.drafting(costs, max_block, prior, cfg)
    rates = policy.drafter.position_rates()
    rows = []
    for L in range(1, policy.max_block + 1):
        tau = expected_tokens(rates, L)
        rows.append({"block_size": L, "expected_tau": tau, "tokens_per_s": tau / costs.step_s(L, L),
                     "relative_cost": costs.step_s(L, L) / costs.verify_s[0]})
    return {"acceptance": rates, "lengths": rows, "start_block_size": policy.draft_length()}
