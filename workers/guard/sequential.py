"""The guard's sequential mode (issue #29): evidence that accumulates over a step's windows and
may be looked at after every window without inflating false alarms.

A rule of "3 bad windows of 30 s" cannot judge a 5 % canary: at a few replies a window it waits
for traffic it never gets, or fires on noise. Here a step's replies are counted from the moment
its share was set, per arm, as three counts: replies, *bad* replies (ERROR, EXPIRED, and
answers the faithfulness checks withheld: what a customer does not get) and replies *over the
SLO*. For each count the guard keeps an anytime-valid confidence sequence (CS) of each arm's
rate, and from the two a CS of the difference canary - stable:

* **Per arm**, the beta-binomial mixture martingale (Robbins 1970; Howard, Ramdas, McAuliffe
  and Sekhon, "Time-uniform, nonparametric, nonasymptotic confidence sequences", Ann. Statist.
  49(2), 2021, section on conjugate mixtures): for a null rate p,

      M_n(p) = B(a + S, b + n - S) / (B(a, b) p^S (1 - p)^(n - S)),

  S bad replies of n, a Beta(a, b) mixing prior (Jeffreys, a = b = 1/2: tight near 0, where
  error rates live). Under p it is a nonnegative martingale starting at 1, so by Ville's
  inequality {p : M_n(p) < 1/alpha} holds p at every n at once with probability >= 1 - alpha.
  It depends on (n, S) only, so judging cumulative counts at window ends is judging at
  stopping times, which Ville's inequality allows.
* **The difference** canary - stable lies in [L_c - U_s, U_c - L_s] when both arms' CSs hold
  (each at alpha / 2: a union bound).

Decisions against a margin declared per metric (`GuardPolicy.max_rate_increase` for bad
replies, `max_slow_increase` for replies over the SLO):
- **harm**: the difference's lower bound is above the margin for either metric: roll back now;
- **non-inferior**: its upper bound is below the margin for both: promote once the step has
  lasted `min_step_s`;
- otherwise hold, with the running bounds and counts in the event's figures and reasons.

The false-alarm level `alpha` is split over the guard's languages and the two metrics
(`level_per_test`). Assumed: within a step each arm's replies are exchangeable (a rate that
drifts with time of day shifts both arms alike, as they share the traffic).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

PRIOR_A = 0.5  # Jeffreys' Beta(1/2, 1/2) mixing prior
PRIOR_B = 0.5
METRICS = ("bad", "slow")  # bad replies; replies over the SLO
_BISECT_STEPS = 40  # the bracket shrinks to 1e-12


def _log_mixture(n: int, s: int, p: float) -> float:
    """log M_n(p) of the beta-binomial mixture (+inf where p cannot have produced the data)."""
    log_marginal = (
        math.lgamma(PRIOR_A + s)
        + math.lgamma(PRIOR_B + n - s)
        - math.lgamma(PRIOR_A + PRIOR_B + n)
        - (math.lgamma(PRIOR_A) + math.lgamma(PRIOR_B) - math.lgamma(PRIOR_A + PRIOR_B))
    )
    if (s > 0 and p <= 0.0) or (n - s > 0 and p >= 1.0):
        return math.inf
    log_null = (s * math.log(p) if s else 0.0) + ((n - s) * math.log1p(-p) if n - s else 0.0)
    return log_marginal - log_null


def rate_cs(n: int, s: int, alpha: float) -> tuple[float, float]:
    """The CS of a rate after `s` events in `n` trials: [lower, upper] (the whole [0, 1] when
    n = 0). The set {p : M_n(p) < 1/alpha} is an interval around s / n (log M is convex in p);
    its ends are found by bisection."""
    if not 0 <= s <= n:
        raise ValueError(f"counts must satisfy 0 <= events <= trials, got {s} of {n}")
    if n == 0:
        return 0.0, 1.0
    bound = math.log(1.0 / alpha)
    centre = s / n  # the MLE: log M is smallest there

    def edge(inside: float, outside: float) -> float:
        if _log_mixture(n, s, outside) < bound:
            return outside  # never rejected up to the end of the range
        for _ in range(_BISECT_STEPS):
            mid = (inside + outside) / 2
            inside, outside = (mid, outside) if _log_mixture(n, s, mid) < bound else (inside, mid)
        return outside  # the conservative side: the interval never comes out too narrow

    return edge(centre, 0.0), edge(centre, 1.0)


def difference_cs(
    canary: tuple[int, int], stable: tuple[int, int], alpha: float
) -> tuple[float, float]:
    """The CS of canary rate - stable rate from (trials, events) of each, alpha / 2 each."""
    lc, uc = rate_cs(*canary, alpha / 2)
    ls, us = rate_cs(*stable, alpha / 2)
    return lc - us, uc - ls


def level_per_test(alpha: float, languages: int) -> float:
    """The level of one language's test of one metric: alpha over languages x metrics."""
    return alpha / (max(1, languages) * len(METRICS))


@dataclass(frozen=True, slots=True)
class StepCounts:
    """Replies counted since the step's share was set, per arm (the evidence so far)."""

    canary_requests: int = 0
    canary_bad: int = 0
    canary_slow: int = 0
    stable_requests: int = 0
    stable_bad: int = 0
    stable_slow: int = 0

    def plus(self, canary: tuple[int, int, int], stable: tuple[int, int, int]) -> StepCounts:
        """These counts and one window's (requests, bad, slow) of each arm."""
        return StepCounts(
            self.canary_requests + canary[0],
            self.canary_bad + canary[1],
            self.canary_slow + canary[2],
            self.stable_requests + stable[0],
            self.stable_bad + stable[1],
            self.stable_slow + stable[2],
        )

    def figures(self) -> dict[str, float]:
        """As an event's figures (`step_<field>`): a restarted guard folds them back."""
        return {f"step_{f.name}": float(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_figures(cls, figures: Mapping[str, float] | None) -> StepCounts:
        """The counts an event's figures carry (zeros when they carry none: windows mode)."""
        figs = figures or {}
        return cls(*(int(figs.get(f"step_{f.name}", 0)) for f in fields(cls)))


@dataclass(frozen=True, slots=True)
class StepJudgement:
    """The evidence of a step, judged: "harm" | "non_inferior" | "undecided"."""

    kind: str
    reasons: tuple[str, ...]
    figures: dict[str, float]


def judge_step(counts: StepCounts, *, alpha: float, margins: Mapping[str, float]) -> StepJudgement:
    """Harm, non-inferiority or neither for the counts (see the module docstring); `alpha` is
    one test's level (`level_per_test`), `margins` per metric ("bad", "slow")."""
    harm: list[str] = []
    fine: list[str] = []
    texts: list[str] = []
    figures = counts.figures()
    for metric in METRICS:
        c = (counts.canary_requests, getattr(counts, f"canary_{metric}"))
        s = (counts.stable_requests, getattr(counts, f"stable_{metric}"))
        lo, hi = difference_cs(c, s, alpha)
        margin = float(margins[metric])
        figures[f"{metric}_diff_lower"] = round(lo, 6)
        figures[f"{metric}_diff_upper"] = round(hi, 6)
        what = "bad (error/expired/withheld)" if metric == "bad" else "over-SLO"
        text = (
            f"{what} rate canary - stable in [{lo:+.3f}, {hi:+.3f}] (margin {margin:g}; "
            f"{c[1]}/{c[0]} vs {s[1]}/{s[0]})"
        )
        texts.append(text)
        if lo > margin:
            harm.append(text)
        elif hi < margin:
            fine.append(text)
    figures["alpha_per_test"] = alpha
    if harm:
        return StepJudgement("harm", tuple(harm), figures)
    if len(fine) == len(METRICS):
        return StepJudgement("non_inferior", tuple(fine), figures)
    undecided = f"undecided after {counts.canary_requests} canary replies"
    return StepJudgement("undecided", (undecided, *texts), figures)
