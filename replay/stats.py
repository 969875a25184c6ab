"""Paired bootstrap statistics for the replay report: B-A differences with 95 % intervals.

Both arms of a replay answer the same requests, so every comparison is *paired*: one bootstrap
draw resamples request indices once and scores both arms on that same resample (Koehn 2004's
paired bootstrap, as sacrebleu's `--paired-bs`). The interval is the percentile interval of the
B-A differences over the draws. Everything is seeded (`seed`), so a report is reproducible.

Corpus metrics are not means of sentence scores: chrF and BLEU are computed from *summed*
sufficient statistics (n-gram counts). So each request contributes one row of statistics
(`quality.chrf_statistics` / `bleu_statistics`), a draw is a vector of multiplicities
`W[b, i]` (how often request i was drawn, a multinomial), the resampled corpus statistics are
one matrix product `W @ stats`, and the score formula runs vectorised over all draws at once
(`chrf_from_sums`, `bleu_from_sums`: numpy versions of sacrebleu's formulas, tested equal to
it). Rates are the same machinery with one statistic (`mean_from_sums`) or a numerator and a
denominator (`ratio_from_sums`, e.g. spans preserved / spans in the sources). Latency
percentiles are not sums, so they resample indices and take `np.percentile` along each draw;
and latencies are not independent: requests sent close together queue behind the same burst, so
a plain bootstrap treats one slow burst as many independent tail samples and called two copies
of one greedy arm different at P95 in a real 400-turn run. Latency draws therefore resample
*blocks* of consecutive requests in send order (a moving-block bootstrap; `block_length`: about
n^(1/3), longer when the B-A differences stay correlated longer); quality statistics of different
sentences are independent and keep the plain paired bootstrap.
A tail percentile needs tail samples: the bootstrap of the q-th percentile of n values is only
trustworthy with at least `TAIL_SAMPLES` values beyond it, i.e. n >= TAIL_SAMPLES / (1 - q/100)
(`min_items_for_percentile`: 20 for P50, 200 for P95, 1000 for P99). Below that no interval is
drawn (the difference keeps its point estimate, `note` says why) and the verdict is no
detectable difference: with 54 requests the P99 is the largest latency, and a bootstrap over it
called two copies of one greedy arm "better" in a real run.

The verdict (`verdict`) turns a difference into better / worse / no detectable difference:
the interval must exclude zero and, when the run has a noise pair (two copies of one arm,
A and A'), the difference must also be larger in magnitude than the A-A' difference of the
same metric on the same group (Diffy's idea: what two identical arms already disagree by is
noise, not a change).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

DEFAULT_DRAWS = 1000
DEFAULT_SEED = 12345
CONFIDENCE = 0.95

TAIL_SAMPLES = 10  # values beyond a percentile needed before its interval is drawn

BETTER = "better"
WORSE = "worse"
NO_DIFFERENCE = "no detectable difference"

# Summed statistics [draws, k] -> one score per draw [draws].
ScoreFromSums = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True, slots=True)
class Difference:
    """B - A of one metric: the estimate on all paired items and its bootstrap interval."""

    estimate: float  # the metric of B minus that of A, on every paired item
    low: float  # lower end of the percentile interval (2.5 % for 95 %)
    high: float  # upper end (97.5 %)
    n: int  # paired items (requests answered by both arms)
    draws: int  # bootstrap draws; 0 when there were no items (or too few, see `note`)
    note: str = ""  # why there is no interval, when there is none

    @property
    def excludes_zero(self) -> bool:
        return self.draws > 0 and (self.low > 0.0 or self.high < 0.0)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def resample_weights(n: int, draws: int, seed: int) -> np.ndarray:
    """[draws, n] multiplicities: row b says how often each of the n items is in draw b
    (each row sums to n; the same as drawing n indices with replacement)."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(n, np.full(n, 1.0 / n), size=draws).astype(np.float64)


def _interval(deltas: np.ndarray, confidence: float) -> tuple[float, float]:
    tail = 100.0 * (1.0 - confidence) / 2.0
    low, high = np.percentile(deltas, [tail, 100.0 - tail])
    return float(low), float(high)


def _paired(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both sides as float arrays of one shape (row i of each is the same request)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"unpaired values: {a.shape} vs {b.shape}")
    return a, b


_NO_ITEMS = Difference(float("nan"), float("nan"), float("nan"), 0, 0)


def paired_bootstrap(
    stats_a: np.ndarray,
    stats_b: np.ndarray,
    score: ScoreFromSums,
    *,
    draws: int = DEFAULT_DRAWS,
    seed: int = DEFAULT_SEED,
    confidence: float = CONFIDENCE,
) -> Difference:
    """B - A of a metric computed from summed per-item statistics ([n, k] each, row i of both
    belongs to the same request)."""
    stats_a, stats_b = _paired(stats_a, stats_b)
    n = stats_a.shape[0]
    if n == 0:
        return _NO_ITEMS
    estimate = score(stats_b.sum(axis=0)[None, :])[0] - score(stats_a.sum(axis=0)[None, :])[0]
    weights = resample_weights(n, draws, seed)  # [draws, n]
    deltas = score(weights @ stats_b) - score(weights @ stats_a)  # [draws]
    low, high = _interval(deltas, confidence)
    return Difference(float(estimate), low, high, n, draws)


def block_length(deltas: np.ndarray) -> int:
    """The moving-block length for paired differences in send order: n^(1/3) (the usual order
    for a block bootstrap), or longer, the first lag at which their autocorrelation falls
    under the 2/sqrt(n) noise band, when bursts last longer than that; at most n // 4."""
    n = len(deltas)
    if n < 4:
        return 1
    centred = deltas - deltas.mean()
    variance = float(centred @ centred)
    lag = 1
    if variance > 0:
        band = 2.0 / np.sqrt(n)
        while lag < n // 4 and float(centred[:-lag] @ centred[lag:]) / variance >= band:
            lag += 1
    return max(1, min(max(round(n ** (1.0 / 3.0)), lag), n // 4))


def moving_block_indices(n: int, draws: int, seed: int, block: int) -> np.ndarray:
    """[draws, n] indices: each row concatenates blocks of `block` consecutive indices with
    random starts, cut to n (block 1 is the plain bootstrap)."""
    block = max(1, min(block, n))
    blocks = -(-n // block)  # ceil
    starts = np.random.default_rng(seed).integers(0, n - block + 1, size=(draws, blocks))
    idx = starts[:, :, None] + np.arange(block)[None, None, :]  # [draws, blocks, block]
    return idx.reshape(draws, blocks * block)[:, :n]


def min_items_for_percentile(q: float) -> int:
    """Paired items needed before the q-th percentile's difference gets an interval."""
    return int(np.ceil(TAIL_SAMPLES / max(1e-9, 1.0 - q / 100.0) - 1e-9))


def percentile_difference(
    values_a: np.ndarray,
    values_b: np.ndarray,
    q: float,
    *,
    draws: int = DEFAULT_DRAWS,
    seed: int = DEFAULT_SEED,
    confidence: float = CONFIDENCE,
    block: int | None = None,
) -> Difference:
    """B - A of the q-th percentile (0-100) of paired values: the latencies of the same
    requests, in send order. The draws resample blocks of `block` consecutive requests
    (default `block_length` of the differences), so a burst stays one burst."""
    a, b = _paired(values_a, values_b)
    n = a.shape[0]
    if n == 0:
        return _NO_ITEMS
    estimate = float(np.percentile(b, q) - np.percentile(a, q))
    need = min_items_for_percentile(q)
    if n < need:
        note = f"too few requests for P{q:g}: {n} < {need}"
        return Difference(estimate, float("nan"), float("nan"), n, 0, note)
    idx = moving_block_indices(n, draws, seed, block or block_length(b - a))  # [draws, n]
    deltas = np.percentile(b[idx], q, axis=1) - np.percentile(a[idx], q, axis=1)
    low, high = _interval(deltas, confidence)
    return Difference(estimate, low, high, n, draws)


# --- score formulas over summed statistics, vectorised over draws ---------------------------


def mean_from_sums(sums: np.ndarray, n: int) -> np.ndarray:
    """Mean of a per-item value whose sum over the (resampled) items is column 0."""
    return np.asarray(sums[:, 0] / n, dtype=np.float64)


def mean_score(n: int) -> ScoreFromSums:
    return lambda sums: mean_from_sums(sums, n)


def ratio_from_sums(sums: np.ndarray) -> np.ndarray:
    """sum(numerator) / sum(denominator) (columns 0 and 1); NaN where the denominator is 0."""
    num, den = sums[:, 0], sums[:, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def chrf_from_sums(sums: np.ndarray, beta: float = 2.0) -> np.ndarray:
    """sacrebleu's chrF (effective-order averaging, its default) from summed statistics:
    columns are [hyp, ref, match] per n-gram order, flattened ([draws, 3 * orders])."""
    eps = 1e-16
    stats = sums.reshape(sums.shape[0], -1, 3)  # [draws, orders, 3]
    n_hyp, n_ref, n_match = stats[..., 0], stats[..., 1], stats[..., 2]
    with np.errstate(divide="ignore", invalid="ignore"):
        prec = np.where(n_hyp > 0, n_match / np.where(n_hyp > 0, n_hyp, 1.0), eps)
        rec = np.where(n_ref > 0, n_match / np.where(n_ref > 0, n_ref, 1.0), eps)
    counted = (n_hyp > 0) & (n_ref > 0)
    effective = counted.sum(axis=1)
    safe_eff = np.maximum(effective, 1)
    avg_prec = np.where(effective > 0, (prec * counted).sum(axis=1) / safe_eff, 0.0)
    avg_rec = np.where(effective > 0, (rec * counted).sum(axis=1) / safe_eff, 0.0)
    factor = beta**2
    denom = factor * avg_prec + avg_rec
    with np.errstate(divide="ignore", invalid="ignore"):
        score = 100.0 * (1 + factor) * avg_prec * avg_rec / np.where(denom > 0, denom, 1.0)
    return np.where(avg_prec + avg_rec > 0, score, 0.0)


def bleu_from_sums(sums: np.ndarray, max_order: int = 4) -> np.ndarray:
    """sacrebleu's corpus BLEU with its default 'exp' smoothing from summed statistics:
    columns [sys_len, ref_len, correct_1..n, total_1..n] ([draws, 2 + 2 * max_order])."""
    sys_len, ref_len = sums[:, 0], sums[:, 1]
    correct = sums[:, 2 : 2 + max_order]
    total = sums[:, 2 + max_order : 2 + 2 * max_order]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        bp = np.where(
            sys_len < ref_len,
            np.where(sys_len > 0, np.exp(1 - ref_len / np.where(sys_len > 0, sys_len, 1.0)), 0.0),
            1.0,
        )
        # 'exp' smoothing: the k-th order without a match gets precision 100 / (2^k * total).
        zero_rank = np.cumsum(correct == 0, axis=1)
        safe_total = np.where(total > 0, total, 1.0)
        precision = np.where(
            correct > 0, 100.0 * correct / safe_total, 100.0 / (2.0**zero_rank * safe_total)
        )
        score = bp * np.exp(np.log(precision).mean(axis=1))
    # No match at all, or an order with no n-grams (sacrebleu's log(0) -> -1e10): BLEU 0.
    dead = ~(correct > 0).any(axis=1) | (total <= 0).any(axis=1)
    return np.where(dead, 0.0, score)


# --- verdicts ---------------------------------------------------------------------------------


def verdict(diff: Difference, *, higher_is_better: bool, noise: Difference | None = None) -> str:
    """better / worse / no detectable difference for B vs A.

    Real only when the interval excludes zero and, with a noise pair, |B-A| exceeds |A-A'|
    (the point estimate of the two identical arms' difference on the same group and metric)."""
    if not diff.excludes_zero or not np.isfinite(diff.estimate):
        return NO_DIFFERENCE
    if (
        noise is not None
        and np.isfinite(noise.estimate)
        and abs(diff.estimate) <= abs(noise.estimate)
    ):
        return NO_DIFFERENCE
    improved = diff.estimate > 0 if higher_is_better else diff.estimate < 0
    return BETTER if improved else WORSE
