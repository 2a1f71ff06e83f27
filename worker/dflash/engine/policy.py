"""Block length `auto`: per step, the draft and verify lengths that pay most on this device.

Two decisions per step, each maximising expected committed tokens minus their price at
the going rate (Dinkelbach's form of maximising tokens per second):

1. Before drafting, the draft length D (1 = no drafter forward: a plain step). The value
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
from collections import deque
from dataclasses import dataclass

from dflash.engine.knobs import PolicyConfig
from dflash.engine.costs import CostCurve, Prices


@dataclass
class Prior:
    """Per-position pseudo-counts: accepted[i] of judged[i] at draft position i + 1."""

    accepted: list[float]
    judged: list[float]

    @classmethod
    def from_counts(cls, accepted, judged, width: int, cfg: PolicyConfig) -> "Prior":
        """Pooled counts of earlier generations, shrunk so they never outweigh more than
        `cfg.max_prior_strength` steps of this request; positions nobody judged fall back to
        the default prior."""
        default = cls.default(width, cfg)
        acc, jud = list(default.accepted), list(default.judged)
        for i in range(min(width, len(accepted or []), len(judged or []))):
            n, k = float(judged[i] or 0), float(accepted[i] or 0)
            if n <= 0:
                continue
            k = min(max(k, 0.0), n)
            scale = min(1.0, cfg.max_prior_strength / n)
            acc[i], jud[i] = k * scale + acc[i] * 0.25, n * scale + jud[i] * 0.25
        return cls(acc, jud)

    @classmethod
    def default(cls, width: int, cfg: PolicyConfig) -> "Prior":
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
    """The per-request state of `auto`: counts, calibration, recent confidences, probing.

    Prices come with every step (`price(prices)` before deciding): a request stepped alone
    pays the device's single-request curve; one of a batch pays its share of the batch's
    forward plus what its extra rows add, and time is worth the batch's rate, so
    speculation backs off under load where verifying extra rows no longer pays."""

    def __init__(self, costs: CostCurve, max_block: int, prior: Prior, cfg: PolicyConfig,
                 suffix_prior: tuple[list[float], list[float]] | None = None):
        self.cfg = cfg
        self.prices: Prices = costs.solo()
        self.max_block = min(max_block, costs.max_block)
        width = max(self.max_block - 1, 0)
        self.acc = [0] * width
        self.judged = [0] * width
        self.prior = prior
        self.cal_acc = [0] * cfg.calibration_bins
        self.cal_n = [0] * cfg.calibration_bins
        self.history: deque[list[float]] = deque(maxlen=cfg.history)
        self.tokens, self.cost = 0.0, 0.0  # what the request has committed and spent so far
        self.plain_run = 0  # consecutive plain steps
        self.probe_every = cfg.probe_after
        self.probing = False
        # The rate at which "do not draft" was last decided (None: decide afresh). A plain
        # step changes none of the counts the decision rests on, only the going rate, so the
        # decision stands until a drafted step or a lower rate (which makes drafting cheaper);
        # deciding costs about a millisecond, ~2 % of a plain step on a CPU.
        self._plain_at_rate: float | None = None
        self._plain_prices: Prices | None = None
        self._draft_values: list[float] | None = None  # what the last draft_length() weighed
        self.pending_rows = 0  # target feature rows the drafter has not seen (its next pass takes them)
        # The suffix proposer's chains (point masses, priced by their lookup) are calibrated
        # on their own outcomes by their match-count confidence; they never enter the
        # drafter's counts or calibration.
        self.s_cal_acc = [0] * cfg.calibration_bins
        self.s_cal_n = [0] * cfg.calibration_bins
        self.s_prior = suffix_prior or ([0.0] * cfg.calibration_bins, [0.0] * cfg.calibration_bins)
        # The next-token head's one-token guesses (proposers/head.py), calibrated the same way
        # on their own outcomes by their softmax peak.
        self.g_cal_acc = [0] * cfg.calibration_bins
        self.g_cal_n = [0] * cfg.calibration_bins
        self.g_prior = ([0.0] * cfg.calibration_bins, [0.0] * cfg.calibration_bins)  # no pooled outcomes
        if self.max_block > 1 and prior.judged and prior.judged[0] >= cfg.informed_prior_steps:
            values = self.draft_values()
            if max(range(len(values)), key=lambda i: (values[i], -i)) == 0:
                self.probe_every = cfg.informed_gap

    # --- estimates -------------------------------------------------------------------

    def price(self, prices: Prices) -> None:
        """The prices of the step about to be planned."""
        self.prices = prices

    @property
    def rate(self) -> float:
        """Tokens per second to price time at: plain decoding's in this step, or what this
        request already achieves when that is better."""
        plain = self.prices.plain_rate
        return max(plain, self.tokens / self.cost) if self.cost > 0 else plain

    def position_rates(self) -> list[float]:
        """Conditional acceptance per draft position from this request's outcomes and the
        prior. A position this request never judged takes the estimate of the one before it
        when that one has outcomes: a drafter kept at positions 1-4 is likely kept at 5."""
        rates = []
        for i, (a, j, pa, pj) in enumerate(zip(self.acc, self.judged, self.prior.accepted, self.prior.judged)):
            if j == 0 and i > 0 and self.judged[i - 1] > 0:
                pa, pj = rates[-1] * pj, pj
            rates.append((a + pa) / (j + pj) if j + pj > 0 else 0.0)
        return rates

    def _bin(self, confidence: float) -> int:
        return min(int(confidence * self.cfg.calibration_bins), self.cfg.calibration_bins - 1)

    def acceptance(self, confidences: list[float], rates: list[float] | None = None) -> list[float]:
        """Conditional acceptance per draft position: each position's confidence calibrated by
        this request's outcomes at similar confidence. Before any outcome in its bin, a
        weighted geometric mean of the confidence and the position's acceptance so far, the
        confidence weighing most; positions with no confidence: the latter alone."""
        rates = self.position_rates() if rates is None else rates
        w, k, bins = self.cfg.confidence_weight, self.cfg.calibration_strength, self.cfg.calibration_bins
        cal_acc, cal_n = self.cal_acc, self.cal_n
        out = list(rates)
        for i, c in enumerate(confidences[: len(rates)]):
            b = min(int(c * bins), bins - 1)
            h = rates[i]
            a_priori = c**w * h ** (1 - w) if c > 0 and h > 0 else 0.0
            out[i] = (cal_acc[b] + k * a_priori) / (cal_n[b] + k)
        return out

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
        best = max(range(len(values)), key=lambda i: (values[i], -i))
        return best + 1, values[best]

    def draft_values(self) -> list[float]:
        """Expected net tokens of a step for each draft length D = 1..max_block (index D - 1):
        per remembered confidence vector the best verify length up to D (a running maximum
        over L, so every D costs one pass), averaged, minus the drafter's price for D."""
        rate = self.rate
        rates = self.position_rates()
        vectors = list(self.history) or [[]]
        earned = [0.0] * self.max_block
        for vec in vectors:
            best = float("-inf")
            for i, value in enumerate(self._verify_values(self.acceptance(vec, rates), rate)):
                best = max(best, value)
                earned[i] += best
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
        if getattr(self, "_excess_for", None) is not prices:
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
        beats every draft length now and the probe schedule (suffix steps count as plain
        ones) puts no probe within `steps`, the drafter never runs, and the request can do
        without it (and without the target's features for it). Solo prices only: in a batch
        a request's share of a step is smaller, so its drafts cost relatively more still."""
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
        """D for the next step: 1 means a plain step with no drafter forward."""
        self.probing = False
        if self.max_block < 2:
            return 1
        rate = self.rate
        gap = self.probe_gap
        if (self._plain_at_rate is not None and self._plain_prices is self.prices and rate >= self._plain_at_rate
                and self.plain_run < gap):
            return 1
        values = self._draft_values = self.draft_values()
        best = max(range(len(values)), key=lambda i: (values[i], -i)) + 1
        self._plain_at_rate = rate if best == 1 else None
        self._plain_prices = self.prices
        if best == 1 and self.plain_run >= gap:
            best = min(self.cfg.probe_len, self.max_block)
        # A probe, or a drafted step before the calibration has seen anything, verifies all
        # it drafted: without outcomes at low confidence it could never learn that low
        # confidence is sometimes right (a drafter whose peaks are flat but correct).
        self.probing = best > 1 and (self.plain_run >= gap or sum(self.cal_n) < self.cfg.warmup_outcomes)
        return best

    def plan(self, suffix: list[float] | None, suffix_s: float, dflash: bool = True,
             pending_rows: int = 0, guess: list[float] | None = None) -> tuple[str | None, int]:
        """Who drafts this step: ("suffix", L) verifies L - 1 tokens of the suffix proposer's
        chain (whose per-position confidences are `suffix`, at a lookup price of `suffix_s`
        seconds, already paid); ("head", 2) verifies the next-token head's guess (its
        confidence `guess`, asked only where there is no chain); ("dflash", D) runs the
        drafter over D positions (L chosen after, from its confidence); (None, 1) is a plain
        step. The most expected net tokens
        wins, except that the drafter's due probes still run (steps the suffix proposer
        drafts count as plain ones for its schedule), so a drafter that would do better is
        found even where the suffix proposer always has something to offer."""
        self._draft_values = None
        if pending_rows < self.pending_rows:  # a cheaper drafter pass: decide afresh (a dearer one keeps "plain")
            self._plain_at_rate = None
        self.pending_rows = pending_rows
        best, value = (None, 1), 1.0 - self.rate * self.prices.verify_s[0]
        if suffix:
            L, v = self.suffix_verify(suffix)
            if L > 1 and v > value:
                best, value = ("suffix", L), v
        elif guess:
            L, v = self.guess_verify(guess)
            if L > 1 and v > value:
                best, value = ("head", L), v
        if dflash:
            D = self.draft_length()
            # The drafter's due probe (it must learn too), the rarer the more requests share the
            # step: a probe's drafter pass delays all of them.
            due = self.probing and self.plain_run >= self.probe_gap * self.prices.batch
            if D > 1 and (due or (self._draft_values is not None and self._draft_values[D - 1] > value)):
                best = ("dflash", D)
            elif D > 1:
                self.probing = False
        return best

    def suffix_verify(self, confidences: list[float]) -> tuple[int, float]:
        """(L, value) for a suffix chain: its confidences calibrated by this request's
        outcomes of suffix drafts at similar confidence."""
        return self._point_mass_verify(confidences, self.s_cal_acc, self.s_cal_n, self.s_prior)

    def guess_verify(self, confidences: list[float]) -> tuple[int, float]:
        """(L, value) for the next-token head's guess, calibrated on its own outcomes."""
        return self._point_mass_verify(confidences, self.g_cal_acc, self.g_cal_n, self.g_prior)

    def _point_mass_verify(self, confidences: list[float], cal_acc: list, cal_n: list, prior) -> tuple[int, float]:
        cfg = self.cfg
        k, trust = cfg.suffix_strength, cfg.suffix_trust
        pa, pn = prior
        acc = []
        for c in confidences[: self.max_block - 1]:
            b = self._bin(c)
            acc.append((cal_acc[b] + pa[b] + k * trust * c) / (cal_n[b] + pn[b] + k))
        values = self._verify_values(acc + [0.0] * (self.max_block - 1 - len(acc)), self.rate)[: len(acc) + 1]
        L = max(range(len(values)), key=lambda i: (values[i], -i)) + 1
        return L, values[L - 1]

    def observe_suffix(self, confidences: list[float], verify_len: int, accepted: int, suffix_s: float) -> None:
        """A suffix-drafted step's outcome; for the drafter's schedule it was a plain step."""
        self._observe_point_mass(confidences, verify_len, accepted, suffix_s, self.s_cal_acc, self.s_cal_n)

    def observe_guess(self, confidences: list[float], verify_len: int, accepted: int, guess_s: float) -> None:
        """A step that verified the head's guess; for the drafter's schedule a plain step."""
        self._observe_point_mass(confidences, verify_len, accepted, guess_s, self.g_cal_acc, self.g_cal_n)

    def _observe_point_mass(self, confidences, verify_len, accepted, price_s, cal_acc, cal_n) -> None:
        self.tokens += accepted + 1
        self.cost += self.prices.verify_s[verify_len - 1] + price_s
        for i in range(min(accepted + 1, verify_len - 1)):
            b = self._bin(confidences[i])
            cal_n[b] += 1
            cal_acc[b] += i < accepted
        self.plain_run += 1

    def verify_length(self, confidences: list[float]) -> int:
        """L for this step, given the drafter's confidence at each drafted position."""
        if self.probing:
            return len(confidences) + 1
        return self._best_verify(self.acceptance(confidences), len(confidences) + 1)[0]

    # --- learning ----------------------------------------------------------------------

    def observe(self, confidences: list[float], verify_len: int, accepted: int, draft_len: int) -> None:
        committed = accepted + 1
        self.tokens += committed
        self.cost += self.prices.step_s(draft_len, verify_len)
        if draft_len > 1:
            self.history.append(list(confidences))
        for i in range(min(accepted + 1, verify_len - 1)):  # the positions that were judged
            kept = i < accepted
            self.judged[i] += 1
            self.acc[i] += kept
            b = self._bin(confidences[i])
            self.cal_n[b] += 1
            self.cal_acc[b] += kept
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
        return {"accepted": list(self.acc), "judged": list(self.judged)}


def explain(costs: CostCurve, max_block: int, prior: Prior, cfg: PolicyConfig) -> dict:
    """What the policy expects from a prior alone: per verify length the expected τ and tokens
    per second at the device's prices, and the draft length it would start with."""
    policy = BlockPolicy(costs, max_block, prior, cfg)
    rates = policy.position_rates()
    rows = []
    for L in range(1, policy.max_block + 1):
        tau = expected_tokens(rates, L)
        rows.append({"block_size": L, "expected_tau": tau, "tokens_per_s": tau / costs.step_s(L, L),
                     "relative_cost": costs.step_s(L, L) / costs.verify_s[0]})
    return {"acceptance": rates, "lengths": rows, "start_block_size": policy.draft_length()}
