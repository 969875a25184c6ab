"""replay.stats on synthetic data with known answers: identical arms give a zero difference
whose interval contains 0, a constructed shift is detected, the 95 % interval covers the true
difference about 95 % of the time, the numpy score formulas equal sacrebleu's, and the noise
rule turns a difference smaller than the A-A' one into "no detectable difference"."""

from __future__ import annotations

import numpy as np
import pytest
from sacrebleu.metrics import BLEU, CHRF

from replay import quality, stats
from replay.datasets import bcontrast
from tests.replay.synthetic_run import drop_words


@pytest.fixture(scope="module")
def turns():
    return list(bcontrast("dev"))[:200]


def test_identical_outputs_give_zero_difference(turns):
    hyps = [u.target for u in turns]
    refs = [drop_words(u.target, 0.2, i) for i, u in enumerate(turns)]
    rows = quality.chrf_statistics(hyps, refs)
    diff = stats.paired_bootstrap(rows, rows.copy(), stats.chrf_from_sums)
    assert diff.estimate == 0.0
    assert diff.low <= 0.0 <= diff.high
    assert not diff.excludes_zero
    assert stats.verdict(diff, higher_is_better=True) == stats.NO_DIFFERENCE
    lat = np.random.default_rng(1).lognormal(5, 0.5, size=len(turns))
    ldiff = stats.percentile_difference(lat, lat.copy(), 95)
    assert (ldiff.estimate, ldiff.low, ldiff.high) == (0.0, 0.0, 0.0)


def test_constructed_quality_shift_is_detected(turns):
    refs = [u.target for u in turns]
    good = [drop_words(r, 0.1, i) for i, r in enumerate(refs)]
    bad = [drop_words(r, 0.5, i) for i, r in enumerate(refs)]
    a, b = quality.chrf_statistics(good, refs), quality.chrf_statistics(bad, refs)
    diff = stats.paired_bootstrap(a, b, stats.chrf_from_sums)
    assert diff.high < 0.0 and diff.low <= diff.estimate <= diff.high
    assert stats.verdict(diff, higher_is_better=True) == stats.WORSE
    # the same the other way round: B better than A
    assert (
        stats.verdict(stats.paired_bootstrap(b, a, stats.chrf_from_sums), higher_is_better=True)
        == stats.BETTER
    )


def test_tail_percentile_of_too_few_requests_gets_no_interval_nor_verdict():
    # a real A-A' run: 54 requests, the copy a little faster by chance at the top
    rng = np.random.default_rng(3)
    a = rng.lognormal(np.log(15000), 0.8, size=54)
    b = a - 900.0
    assert [stats.min_items_for_percentile(q) for q in (50, 95, 99)] == [20, 200, 1000]
    p99 = stats.percentile_difference(a, b, 99)
    assert p99.estimate < 0 and p99.draws == 0 and "54 < 1000" in p99.note
    assert stats.verdict(p99, higher_is_better=False) == stats.NO_DIFFERENCE
    p50 = stats.percentile_difference(a, b, 50)  # 54 >= 20: judged
    assert p50.draws > 0 and stats.verdict(p50, higher_is_better=False) == stats.BETTER


def test_constructed_latency_shift_is_detected():
    rng = np.random.default_rng(7)
    a = rng.lognormal(np.log(200), 0.3, size=1000)  # enough for a P99 interval
    b = a * 0.8 + rng.normal(0, 2, size=1000)  # 20 % faster
    for q in (50, 95, 99):
        diff = stats.percentile_difference(a, b, q)
        assert diff.high < 0.0, (q, diff)
        assert stats.verdict(diff, higher_is_better=False) == stats.BETTER


def test_interval_coverage_near_95_percent():
    """200 synthetic paired data sets with a true mean difference of 0.3: the 95 % interval
    should contain 0.3 in about 95 % of them."""
    rng = np.random.default_rng(2024)
    true_delta, covered, trials, n = 0.3, 0, 200, 120
    for t in range(trials):
        a = rng.normal(1.0, 1.0, size=n)
        b = a + true_delta + rng.normal(0.0, 1.0, size=n)
        # the population mean of a is 1.0, of b 1.3: compare population-level deltas
        diff = stats.paired_bootstrap(
            a[:, None], b[:, None], stats.mean_score(n), draws=800, seed=t
        )
        covered += diff.low <= true_delta <= diff.high
    assert 0.90 <= covered / trials <= 0.99, covered


def test_numpy_formulas_equal_sacrebleu(turns):
    """chrf_from_sums / bleu_from_sums against sacrebleu's own scoring of the same summed
    statistics, on resampled corpora and on edge cases (no match, empty hypotheses)."""
    refs = [u.target for u in turns]
    hyps = [drop_words(r, 0.4, i) for i, r in enumerate(refs)]
    hyps[:5] = ["", "", "xyz", "", "qqq"]
    chrf_rows, bleu_rows = quality.chrf_statistics(hyps, refs), quality.bleu_statistics(hyps, refs)
    weights = stats.resample_weights(len(refs), 20, seed=3)
    edge = np.zeros((1, len(refs)))
    edge[0, :5] = 1.0  # only the empty / garbage hypotheses
    weights = np.vstack([weights, edge])
    chrf_ours = stats.chrf_from_sums(weights @ chrf_rows)
    bleu_ours = stats.bleu_from_sums(weights @ bleu_rows)
    chrf, bleu = CHRF(), BLEU()
    for i, w in enumerate(weights):
        assert chrf_ours[i] == pytest.approx(
            chrf._compute_score_from_stats(w @ chrf_rows).score, abs=1e-9
        )
        assert bleu_ours[i] == pytest.approx(
            bleu._compute_score_from_stats(list(w @ bleu_rows)).score, abs=1e-9
        )
    assert bleu_ours[-1] == 0.0


def test_ratio_and_mean_scores():
    sums = np.array([[3.0, 4.0], [0.0, 0.0]])
    ratio = stats.ratio_from_sums(sums)
    assert ratio[0] == 0.75 and np.isnan(ratio[1])
    assert stats.mean_from_sums(np.array([[6.0]]), 8)[0] == 0.75


def test_noise_rule_needs_more_than_the_noise_pair_difference():
    real = stats.Difference(estimate=-2.0, low=-3.0, high=-1.0, n=100, draws=1000)
    small_noise = stats.Difference(estimate=0.5, low=-0.5, high=1.5, n=100, draws=1000)
    big_noise = stats.Difference(estimate=-2.5, low=-4.0, high=-1.0, n=100, draws=1000)
    assert stats.verdict(real, higher_is_better=True) == stats.WORSE
    assert stats.verdict(real, higher_is_better=True, noise=small_noise) == stats.WORSE
    assert stats.verdict(real, higher_is_better=True, noise=big_noise) == stats.NO_DIFFERENCE
    assert stats.verdict(real, higher_is_better=False) == stats.BETTER


def test_bootstrap_is_seeded_and_refuses_unpaired_input():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(50, 1)), rng.normal(size=(50, 1))
    one = stats.paired_bootstrap(a, b, stats.mean_score(50), seed=9)
    assert one == stats.paired_bootstrap(a, b, stats.mean_score(50), seed=9)
    assert one != stats.paired_bootstrap(a, b, stats.mean_score(50), seed=10)
    with pytest.raises(ValueError, match="unpaired"):
        stats.paired_bootstrap(a, b[:40], stats.mean_score(50))
    empty = stats.paired_bootstrap(np.zeros((0, 1)), np.zeros((0, 1)), stats.mean_score(0))
    assert empty.n == 0 and stats.verdict(empty, higher_is_better=True) == stats.NO_DIFFERENCE


def _ar1(rng: np.random.Generator, n: int, phi: float, sd: float) -> np.ndarray:
    x = np.empty(n)
    x[0] = rng.normal(0.0, sd)
    for i in range(1, n):
        x[i] = phi * x[i - 1] + rng.normal(0.0, sd * np.sqrt(1.0 - phi * phi))
    return x


def test_moving_blocks_are_runs_of_consecutive_requests():
    idx = stats.moving_block_indices(10, draws=50, seed=3, block=4)
    assert idx.shape == (50, 10) and idx.min() >= 0 and idx.max() <= 9
    for row in idx:
        for start in (0, 4):  # the first two blocks are whole
            assert list(row[start : start + 4]) == list(range(row[start], row[start] + 4))
    assert np.array_equal(stats.moving_block_indices(5, 20, 1, block=1).shape, (20, 5))
    rng = np.random.default_rng(5)
    assert stats.block_length(rng.normal(size=343)) == 7  # independent: n^(1/3)
    assert stats.block_length(_ar1(rng, 343, 0.95, 1.0)) > 7  # bursts: longer blocks


def test_bursty_identical_arms_are_rarely_called_different():
    """Two identical arms whose latencies share the machine's bursts (as in a mirror replay)
    and wander in runs of their own: the plain bootstrap calls their P95 different in about a
    fifth of the runs; the moving-block bootstrap of `percentile_difference` near the nominal
    5 %."""
    rng = np.random.default_rng(11)
    n, trials = 300, 100
    called = {"plain": 0, "blocks": 0}
    for t in range(trials):
        load = 1000.0 * np.exp(_ar1(rng, n, 0.9, 0.8))  # shared by both arms
        a = load * np.exp(_ar1(rng, n, 0.8, 0.3))
        b = load * np.exp(_ar1(rng, n, 0.8, 0.3))
        plain = stats.percentile_difference(a, b, 95, draws=500, seed=t, block=1)
        blocks = stats.percentile_difference(a, b, 95, draws=500, seed=t)
        called["plain"] += plain.excludes_zero
        called["blocks"] += blocks.excludes_zero
    assert called["blocks"] <= 0.10 * trials, called
    assert called["plain"] >= 2 * called["blocks"], called
