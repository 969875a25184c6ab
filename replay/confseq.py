"""Anytime-valid confidence sequences for bounded means, by betting (issue #29).

A confidence sequence (CS) is a sequence of intervals C_1, C_2, ... that holds the true mean at
*every* time at once with probability >= 1 - alpha: P(exists t: mu not in C_t) <= alpha. So the
report may be read after every segment and a run stopped as soon as a verdict is reached,
without the inflation of looking again at a fixed-horizon test (a two-sample z test looked at
daily for 30 days had 29.4 % false positives in `ville`'s benchmark, a CS 1.6 %).

The construction is the hedged betting CS of Waudby-Smith and Ramdas, "Estimating means of
bounded random variables by betting" (JRSS B 86(1), 2024, arXiv 2010.09686), Theorem 3 with
the predictable plug-in bets of their eq. (26)-(27) ("hedged capital", theta = 1/2, c = 3/4,
the larger of the paper's two truncations: with c = 1/2 two identical arms, every difference 0,
needed 370 segments for a CS within +-0.02, with 3/4 about 250):
for every candidate mean m, two gamblers bet that the next observation lies above / below m,

    K+_t(m) = prod_{i<=t} (1 + l+_i(m) (x_i - m)),   K-_t(m) = prod_{i<=t} (1 - l-_i(m) (x_i - m))
    l_i = sqrt(2 log(2/alpha) / (s2_{i-1} i log(1+i))),  l+_i(m) = min(l_i, c/m),
                                                          l-_i(m) = min(l_i, c/(1-m))
    s2_t = (1/4 + sum_{i<=t} (x_i - mu_i)^2) / (t+1),    mu_t = (1/2 + sum_{i<=t} x_i) / (t+1)

and m is rejected once max(theta K+, (1-theta) K-) >= 1/alpha (Ville's inequality: under the
true m both capitals are nonnegative martingales). C_t is the set of m not rejected so far (a
running intersection, itself a CS). Each observation must lie in [0, 1] and have conditional
mean m given the past: segments replayed in any order, paired per request, qualify.

Paired differences d in [-1, 1] (arm B's per-segment score minus arm A's, scores in [0, 1]) map
to x = (d + 1) / 2; `paired_difference_cs` maps the interval back. `decide` turns an interval
and a margin fixed before the run into better / equivalent / worse / inconclusive.

The candidate means are a grid of `GRID` midpoints; an interval's ends are widened by half a
grid step, so the grid never makes the interval narrower than the exact one. numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ALPHA = 0.05
GRID = 2000  # candidate means in (0, 1): resolution 5e-4
THETA = 0.5  # hedge: half the capital bets up, half down
C_TRUNC = 0.75  # a bet risks at most 3/4 of the capital (l(m) <= c/m, c/(1-m))
_CHUNK = 512  # observations per vectorised step (memory: _CHUNK x GRID floats)

BETTER = "better"
WORSE = "worse"
EQUIVALENT = "equivalent"
INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True, slots=True)
class Interval:
    """The CS after `n` observations: the mean lies in [lower, upper] (at every n at once, with
    probability >= 1 - alpha). `n` = 0: nothing seen, the whole range."""

    lower: float
    upper: float
    n: int
    alpha: float

    def as_dict(self) -> dict[str, float | int]:
        return {"lower": self.lower, "upper": self.upper, "n": self.n, "alpha": self.alpha}


class RunningCS:
    """The betting CS of one stream, fed as it grows (`extend`), read at any time
    (`interval`): a run that checks its evidence every few seconds pays only for what is new.
    The state is the bets' running sums and, per grid mean, both log-capitals and whether it
    is still in the CS."""

    def __init__(self, alpha: float = ALPHA, grid: int = GRID) -> None:
        self.alpha, self.grid = alpha, grid
        self.means = (np.arange(grid, dtype=np.float64) + 0.5) / grid  # [G] candidate means
        self.n = 0
        self._sum = 0.0  # sum of x
        self._dev = 0.0  # sum of (x_i - mu_i)^2
        self._log_plus = np.zeros(grid)
        self._log_minus = np.zeros(grid)
        self._alive = np.ones(grid, dtype=bool)
        self._hedged = np.zeros(grid)
        self._threshold = math.log(1.0 / alpha)

    def _bets(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The predictable plug-in bet l_i of each new observation (x_1..x_{i-1} only), and
        the running sums of squared deviations after each (the next bets' variance)."""
        i = self.n + np.arange(1, len(x) + 1, dtype=np.float64)
        mu = (0.5 + self._sum + np.cumsum(x)) / (i + 1)  # mu_i, after x_i
        dev = self._dev + np.cumsum((x - mu) ** 2)
        s2 = (0.25 + dev) / (i + 1)  # s2_i, after x_i
        s2_before = np.concatenate(([(0.25 + self._dev) / (self.n + 1)], s2[:-1]))  # s2_{i-1}
        bets = np.sqrt(2.0 * math.log(2.0 / self.alpha) / (s2_before * i * np.log1p(i)))
        return bets, dev

    def extend(self, x: Sequence[float] | np.ndarray, *, each: bool = False) -> list[Interval]:
        """Take new observations (in [0, 1]); with `each`, the interval after every one."""
        xs = np.asarray(x, dtype=np.float64)
        if xs.size and (xs.min() < 0.0 or xs.max() > 1.0 or not np.isfinite(xs).all()):
            raise ValueError("betting_cs needs observations in [0, 1]")
        out: list[Interval] = []
        m = self.means
        for start in range(0, len(xs), _CHUNK):
            xc = xs[start : start + _CHUNK]
            bets, dev = self._bets(xc)
            lc = bets[:, None]  # [T, 1]
            up = np.minimum(lc, C_TRUNC / m)  # [T, G]
            down = np.minimum(lc, C_TRUNC / (1.0 - m))
            lp = self._log_plus + np.cumsum(np.log1p(up * (xc[:, None] - m)), axis=0)
            lm = self._log_minus + np.cumsum(np.log1p(-down * (xc[:, None] - m)), axis=0)
            hedged = np.maximum(math.log(THETA) + lp, math.log(1.0 - THETA) + lm)  # [T, G]
            kept = np.logical_and.accumulate(hedged < self._threshold, axis=0) & self._alive
            if each:
                out += [self._hull(kept[t], hedged[t], self.n + t + 1) for t in range(len(xc))]
            self._dev = float(dev[-1])
            self._sum += float(xc.sum())
            self.n += len(xc)
            self._log_plus, self._log_minus = lp[-1], lm[-1]
            self._alive, self._hedged = kept[-1], hedged[-1]
        return out

    def _hull(self, kept: np.ndarray, hedged: np.ndarray, n: int) -> Interval:
        """The kept grid means' hull, widened by half a grid step (never too narrow)."""
        idx, half_step = np.flatnonzero(kept), 0.5 / self.grid
        if idx.size:
            lo, hi = self.means[idx[0]] - half_step, self.means[idx[-1]] + half_step
        else:  # every grid mean rejected: the CS is narrower than the grid; keep its spot
            j = int(np.argmin(hedged))
            lo, hi = self.means[j] - half_step, self.means[j] + half_step
        return Interval(max(0.0, float(lo)), min(1.0, float(hi)), n, self.alpha)

    def interval(self) -> Interval:
        """The CS now (the whole range before the first observation)."""
        if self.n == 0:
            return Interval(0.0, 1.0, 0, self.alpha)
        return self._hull(self._alive, self._hedged, self.n)


def betting_cs(
    x: Sequence[float] | np.ndarray, alpha: float = ALPHA, grid: int = GRID
) -> list[Interval]:
    """The running CS for the mean of `x` (values in [0, 1]), one interval per observation."""
    return RunningCS(alpha, grid).extend(x, each=True)


def final_cs(x: Sequence[float] | np.ndarray, alpha: float = ALPHA, grid: int = GRID) -> Interval:
    """The CS after the last observation (the whole range when there is none)."""
    cs = RunningCS(alpha, grid)
    cs.extend(x)
    return cs.interval()


def to_difference(cs: Interval) -> Interval:
    """A CS of the mean of x = (d + 1) / 2 as one of the mean of d in [-1, 1]."""
    return Interval(2.0 * cs.lower - 1.0, 2.0 * cs.upper - 1.0, cs.n, cs.alpha)


def paired_difference_cs(
    a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray, alpha: float = ALPHA
) -> Interval:
    """A CS for mean(b - a), per-item scores of A and B in [0, 1], paired by position."""
    aa, bb = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if aa.shape != bb.shape:
        raise ValueError(f"paired scores differ in length: {aa.shape} vs {bb.shape}")
    return to_difference(final_cs((np.clip(bb - aa, -1.0, 1.0) + 1.0) / 2.0, alpha))


def decide(cs: Interval, margin: float, *, higher_is_better: bool = True) -> str:
    """better / equivalent / worse / inconclusive for a CS of mean(B - A) and a margin > 0.

    equivalent: the whole CS lies within (-margin, +margin) (checked first: a difference shown
    to be smaller than the margin is no difference that matters); better: the CS lies above 0
    in the better direction; worse: below 0; otherwise inconclusive."""
    if margin <= 0:
        raise ValueError("the equivalence margin must be > 0")
    lo, hi = (cs.lower, cs.upper) if higher_is_better else (-cs.upper, -cs.lower)
    if cs.n == 0:
        return INCONCLUSIVE
    if -margin < lo and hi < margin:
        return EQUIVALENT
    if lo > 0:
        return BETTER
    if hi < 0:
        return WORSE
    return INCONCLUSIVE
