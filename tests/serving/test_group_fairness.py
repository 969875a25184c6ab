"""workers.serving.group_fairness: the fair-share guarantee across the workers of a group."""

from __future__ import annotations

import pytest

from workers.serving.group_fairness import simulate_group
from workers.serving.sim_config import LanguageLoad, SimConfig, estimate_capacity_rps

WEIGHTS = {"de": 1.0, "fr": 2.0, "es": 1.0}


def _overloaded(workers: int) -> SimConfig:
    """Each language alone offers the whole group's capacity: every language stays backlogged
    on every worker that holds a partition of it."""
    cap = estimate_capacity_rps(80, 30)  # one worker, the simulator's default lengths
    return SimConfig(
        languages={
            lang: LanguageLoad(rate_rps=workers * cap, weight=w) for lang, w in WEIGHTS.items()
        },
        duration_s=60.0,
        warmup_s=10.0,
    )


def test_shares_follow_the_weights_when_every_worker_holds_every_language():
    even = [{lang: 0.5 for lang in WEIGHTS}, {lang: 0.5 for lang in WEIGHTS}]
    result = simulate_group(_overloaded(2), even)
    assert result.jain_index > 0.98, result.normalized_service
    share = {lang: s / sum(result.service.values()) for lang, s in result.service.items()}
    assert share["fr"] == pytest.approx(0.5, abs=0.03)  # weight 2 of 4


def test_uneven_partition_counts_still_fair_while_every_worker_stays_backlogged():
    uneven = [{"de": 0.75, "fr": 0.25, "es": 0.5}, {"de": 0.25, "fr": 0.75, "es": 0.5}]
    result = simulate_group(_overloaded(2), uneven)
    assert result.jain_index > 0.98, result.normalized_service


def test_a_worker_without_a_language_breaks_the_global_shares():
    """Worker 0 holds every German partition and nothing else: German gets a whole worker,
    twice its weighted share; the guarantee is per worker only."""
    split = [{"de": 1.0}, {"fr": 1.0, "es": 1.0}]
    result = simulate_group(_overloaded(2), split)
    assert result.jain_index < 0.9, result.normalized_service
    assert result.normalized_service["de"] > 1.5 * result.normalized_service["fr"]
    # ... while each worker is fair among what it holds: fr (weight 2) gets twice es there
    second = result.per_worker[1]
    assert second["fr"] / second["es"] == pytest.approx(2.0, rel=0.1)


def test_holdings_must_cover_each_language_once():
    with pytest.raises(ValueError, match="'es'"):
        simulate_group(_overloaded(2), [{"de": 1.0, "fr": 0.5}, {"fr": 0.5, "es": 0.5}])
