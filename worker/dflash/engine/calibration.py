"""How a proposer's confidences become acceptance estimates: one calibration, shared by all.

A proposer says, per drafted position, how sure it is (its distribution's peak, a match
count's share, 1 for a token a grammar forces). What that is worth differs by proposer and
by request, so every request calibrates every proposer on that proposer's own outcomes:
confidences fall into `bins`, and a bin's estimate is its outcomes so far over an a-priori
guess worth a few pseudo-outcomes. Written once here, for every proposer:

- `judged(accepted, verify_len)`: the positions a verify judged (verified, with every
  earlier draft kept): the only outcomes a step gives;
- `shrink(accepted, judged, strength)`: pooled counts (of a workload, of recent requests)
  scaled so they never outweigh `strength` outcomes of the request itself;
- `best(values)`: the index of the largest value, the earliest on ties (the shortest
  length: the cheaper of two equal choices);
- `Calibration`: one request's outcomes of one proposer by confidence bin, over a prior;
- `PointMass` and `Drafter`: the two estimates built on it. A point mass (a chain looked up,
  a guess, a forced token: drafted before the policy chooses, for nothing or its lookup) is
  trusted at a share of its confidence until outcomes say otherwise. A model drafter (drafted
  only when chosen, for a price) is also judged by position, and remembers its recent
  confidence vectors, which the policy replays to price drafting before it drafts.
"""

from __future__ import annotations

from collections import deque

from dflash.engine.knobs import SpeculativeConfig


def judged(accepted: int, verify_len: int) -> int:
    """Draft positions a verify of `verify_len` judged when it kept `accepted` drafts."""
    return min(accepted + 1, verify_len - 1)


def shrink(accepted, judged_, strength: float) -> tuple[list[float], list[float]]:
    """Pooled counts scaled so that none outweighs `strength` outcomes (zeros stay zeros)."""
    scale = [min(1.0, strength / n) if n > 0 else 0.0 for n in judged_]
    return [a * s for a, s in zip(accepted, scale)], [n * s for n, s in zip(judged_, scale)]


def bin_of(confidence: float, bins: int) -> int:
    """The bin of a confidence in [0, 1] among `bins` equal ones."""
    return min(int(confidence * bins), bins - 1)


def best(values: list[float]) -> int:
    """The index of the largest value; the earliest of equal ones."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


class Calibration:
    """One proposer's outcomes in one request by confidence bin, over a prior of pooled
    outcomes per bin (`prior`: accepted and judged pseudo-counts, already shrunk)."""

    def __init__(self, bins: int, prior: tuple[list[float], list[float]] | None = None):
        self.bins = bins
        self.acc = [0] * bins
        self.n = [0] * bins
        self.prior = prior or ([0.0] * bins, [0.0] * bins)

    def rate(self, confidence: float, pseudo: float, a_priori: float) -> float:
        """The estimate at this confidence: the bin's outcomes and prior over `pseudo`
        pseudo-outcomes at `a_priori` (passed as pseudo * estimate)."""
        b = bin_of(confidence, self.bins)
        pa, pn = self.prior
        return (self.acc[b] + pa[b] + a_priori) / (self.n[b] + pn[b] + pseudo)

    def record(self, confidences: list[float], verify_len: int, accepted: int) -> None:
        for i in range(judged(accepted, verify_len)):
            b = bin_of(confidences[i], self.bins)
            self.n[b] += 1
            self.acc[b] += i < accepted

    @property
    def outcomes(self) -> int:
        return sum(self.n)


class PointMass:
    """The estimate for drafts made before the choice (a suffix chain, a guess, a forced
    token): each position's confidence, trusted at `cfg.point_mass_trust` of its face value
    until outcomes in its bin say otherwise."""

    deferred = False

    def __init__(self, cfg: SpeculativeConfig, width: int, prior: tuple[list[float], list[float]] | None = None):
        self.cfg = cfg
        self.width = width  # the most draft positions a step verifies
        self.calibration = Calibration(cfg.calibration_bins, prior)

    def acceptance(self, confidences: list[float]) -> list[float]:
        """Conditional acceptance of each drafted position (at most `width`)."""
        k, trust = self.cfg.point_mass_strength, self.cfg.point_mass_trust
        return [self.calibration.rate(c, k, k * trust * c) for c in confidences[: self.width]]

    def record(self, confidences: list[float], verify_len: int, accepted: int, draft_len: int) -> None:
        self.calibration.record(confidences, verify_len, accepted)


class Drafter:
    """The estimate for a model drafter's drafts (drafted only when chosen): per position,
    the request's acceptance so far over a prior of pooled counts (`prior`, a policy.Prior),
    and per confidence bin its calibration. Its recent confidence vectors are what the
    policy replays to price a draft before drafting."""

    deferred = True

    def __init__(self, cfg: SpeculativeConfig, width: int, prior):
        self.cfg = cfg
        self.width = width
        self.prior = prior
        self.acc = [0] * width
        self.judged = [0] * width
        self.calibration = Calibration(cfg.calibration_bins)
        self.history: deque[list[float]] = deque(maxlen=cfg.history)

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

    def acceptance(self, confidences: list[float], rates: list[float] | None = None) -> list[float]:
        """Conditional acceptance per draft position: each position's confidence calibrated by
        this request's outcomes at similar confidence. Before any outcome in its bin, a
        weighted geometric mean of the confidence and the position's acceptance so far, the
        confidence weighing most; positions with no confidence: the latter alone."""
        rates = self.position_rates() if rates is None else rates
        w, k = self.cfg.confidence_weight, self.cfg.calibration_strength
        out = list(rates)
        for i, c in enumerate(confidences[: len(rates)]):
            h = rates[i]
            a_priori = c**w * h ** (1 - w) if c > 0 and h > 0 else 0.0
            out[i] = self.calibration.rate(c, k, k * a_priori)
        return out

    def vectors(self) -> tuple[list[list[float]], list[float]]:
        """The confidence vectors to replay (none yet: one empty one) and the position rates."""
        return list(self.history) or [[]], self.position_rates()

    def record(self, confidences: list[float], verify_len: int, accepted: int, draft_len: int) -> None:
        if draft_len > 1:
            self.history.append(list(confidences))
        for i in range(judged(accepted, verify_len)):
            self.judged[i] += 1
            self.acc[i] += i < accepted
        self.calibration.record(confidences, verify_len, accepted)

    def counts(self) -> dict:
        return {"accepted": list(self.acc), "judged": list(self.judged)}
