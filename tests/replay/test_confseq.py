"""The betting confidence sequence (replay/confseq.py): the formulas, coverage at every time at
once, width, and the four verdicts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from replay import confseq
from replay.confseq import (
    Interval,
    RunningCS,
    betting_cs,
    decide,
    final_cs,
    paired_difference_cs,
)


def _rejected_by_formula(x: np.ndarray, m: float, alpha: float) -> list[bool]:
    """Waudby-Smith & Ramdas's hedged capital at one candidate mean, one step at a time in
    plain Python: whether m is outside the CS after each observation (running intersection)."""
    k_plus = k_minus = 1.0
    total = 0.0
    dev_sum = 0.0
    out: list[bool] = []
    rejected = False
    for i, xi in enumerate(x, start=1):
        s2_before = (0.25 + dev_sum) / i  # s2_{i-1} = (1/4 + sum_{j<i} (x_j - mu_j)^2) / i
        lam = math.sqrt(2 * math.log(2 / alpha) / (s2_before * i * math.log(1 + i)))
        k_plus *= 1 + min(lam, confseq.C_TRUNC / m) * (xi - m)
        k_minus *= 1 - min(lam, confseq.C_TRUNC / (1 - m)) * (xi - m)
        total += xi
        mu_i = (0.5 + total) / (i + 1)
        dev_sum += (xi - mu_i) ** 2
        rejected = rejected or max(0.5 * k_plus, 0.5 * k_minus) >= 1 / alpha
        out.append(rejected)
    return out


def test_the_vectorised_cs_is_the_hull_of_the_means_the_formula_keeps() -> None:
    rng = np.random.default_rng(7)
    x = rng.beta(2, 5, size=700)  # crosses a chunk boundary (512)
    grid = 100
    seq = betting_cs(x, alpha=0.05, grid=grid)
    m = (np.arange(grid) + 0.5) / grid
    rejected = np.array([_rejected_by_formula(x, float(mj), 0.05) for mj in m])  # [G, T]
    for t in (0, 9, 99, 511, 512, 699):
        kept = m[~rejected[:, t]]
        assert kept.size, t
        assert seq[t].lower == pytest.approx(max(0.0, kept.min() - 0.5 / grid)), t
        assert seq[t].upper == pytest.approx(min(1.0, kept.max() + 0.5 / grid)), t
    assert rejected[:, 699].sum() > grid // 2  # 700 observations rule most means out
    assert seq[699].lower <= 2 / 7 <= seq[699].upper  # Beta(2, 5) has mean 2/7


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5])
def test_the_cs_covers_the_mean_at_every_time_at_once(p: float) -> None:
    """P(the mean ever leaves the CS) <= alpha: 300 Bernoulli runs of 400 observations, each
    checked at every one of the 400 times; a fixed-horizon interval looked at that often
    would miss far more often."""
    rng = np.random.default_rng(int(p * 1000))
    misses = fixed_misses = 0
    runs = 300
    t = np.arange(1, 401)
    for _ in range(runs):
        x = (rng.random(400) < p).astype(float)
        seq = betting_cs(x, alpha=0.05, grid=400)
        if any(not (c.lower <= p <= c.upper) for c in seq):
            misses += 1
        mean = np.cumsum(x) / t  # the 95 % normal interval, looked at from the 10th on
        sd = np.sqrt(np.maximum(mean * (1 - mean), 1e-9) / t)
        fixed_misses += bool(np.any((np.abs(mean - p) > 1.96 * sd)[9:]))
    assert misses / runs <= 0.05 + 0.03  # alpha plus binomial slack (sd ~0.013); seen 0.02
    assert fixed_misses / runs > 0.3  # seen 0.44-0.71: why a CS, not a repeated interval


def test_the_cs_narrows_and_stays_wider_than_a_fixed_horizon_interval() -> None:
    rng = np.random.default_rng(3)
    x = (rng.random(4000) < 0.5).astype(float)
    seq = betting_cs(x, alpha=0.05)
    widths = [seq[n - 1].upper - seq[n - 1].lower for n in (50, 500, 4000)]
    assert widths[0] > widths[1] > widths[2]
    normal_width = 2 * 1.96 * 0.5 / math.sqrt(4000)  # the fixed-n CLT interval: 0.031
    assert normal_width < widths[2] < 3 * normal_width  # anytime-valid costs a factor, bounded
    assert seq[-1].lower <= 0.5 <= seq[-1].upper


def test_the_cs_is_a_running_intersection() -> None:
    rng = np.random.default_rng(11)
    seq = betting_cs(rng.random(800), alpha=0.05, grid=500)
    lowers = [c.lower for c in seq]
    uppers = [c.upper for c in seq]
    assert lowers == sorted(lowers) and uppers == sorted(uppers, reverse=True)
    assert [c.n for c in seq] == list(range(1, 801))


def test_the_final_cs_is_the_last_of_the_sequence() -> None:
    x = np.random.default_rng(2).random(1100)  # three chunks
    assert final_cs(x) == betting_cs(x)[-1]
    assert final_cs(x[:5], grid=300) == betting_cs(x[:5], grid=300)[-1]


def test_a_stream_fed_in_pieces_gives_the_cs_of_the_whole() -> None:
    x = np.random.default_rng(4).random(900)
    cs = RunningCS()
    for a, b in ((0, 1), (1, 7), (7, 600), (600, 900)):
        cs.extend(x[a:b])
        assert cs.n == b and cs.interval() == final_cs(x[:b]), b
    assert RunningCS().interval() == Interval(0.0, 1.0, 0, confseq.ALPHA)


def test_observations_outside_the_unit_interval_are_refused() -> None:
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        betting_cs([0.2, 1.5])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        betting_cs([0.2, float("nan")])
    assert final_cs([]) == Interval(0.0, 1.0, 0, confseq.ALPHA)


def test_paired_differences_of_identical_arms_are_equivalent_within_a_margin() -> None:
    rng = np.random.default_rng(5)
    a = rng.random(3000)
    cs = paired_difference_cs(a, a)
    assert cs.lower <= 0.0 <= cs.upper and cs.upper - cs.lower < 0.02
    assert decide(cs, 0.02) == confseq.EQUIVALENT


def test_a_real_difference_is_found_with_its_direction() -> None:
    rng = np.random.default_rng(9)
    a = rng.random(2000) * 0.8
    b = np.clip(a + 0.1 + rng.normal(0, 0.05, size=2000), 0, 1)
    cs = paired_difference_cs(a, b)
    assert 0.08 < cs.lower < 0.1 < cs.upper < 0.12
    assert decide(cs, 0.02) == confseq.BETTER
    assert decide(cs, 0.02, higher_is_better=False) == confseq.WORSE
    with pytest.raises(ValueError, match="length"):
        paired_difference_cs(a, b[:10])


@pytest.mark.parametrize(
    ("lower", "upper", "higher", "verdict"),
    [
        (-0.01, 0.01, True, confseq.EQUIVALENT),
        (0.001, 0.01, True, confseq.EQUIVALENT),  # shown smaller than the margin: equivalent
        (0.01, 0.2, True, confseq.BETTER),
        (-0.2, -0.01, True, confseq.WORSE),
        (-0.2, -0.01, False, confseq.BETTER),  # lower is better: a fall is an improvement
        (-0.1, 0.1, True, confseq.INCONCLUSIVE),
        (-0.03, 0.01, True, confseq.INCONCLUSIVE),  # within the margin on one side only
    ],
)
def test_decide(lower: float, upper: float, higher: bool, verdict: str) -> None:
    assert decide(Interval(lower, upper, 100, 0.05), 0.02, higher_is_better=higher) == verdict


def test_decide_needs_observations_and_a_positive_margin() -> None:
    assert decide(Interval(-1.0, 1.0, 0, 0.05), 0.02) == confseq.INCONCLUSIVE
    with pytest.raises(ValueError, match="margin"):
        decide(Interval(0.0, 0.0, 10, 0.05), 0.0)
