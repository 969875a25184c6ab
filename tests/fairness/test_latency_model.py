"""Latency model fits and deadline admission decisions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from workers.engine.types import FinishReason, GenerationRequest, SamplingParams
from workers.fairness.latency_model import (
    DeadlineAdmission,
    LatencyModel,
    LatencyPrior,
    Verdict,
    prior_from_step_costs,
)

TRUE = {
    "base": 0.05,
    "uncached": 0.002,
    "cached": 0.0002,
    "out": 0.02,
    "batch": 0.003,
    "out_x_batch": 0.001,
}


def synthetic(rng: np.random.Generator, n: int) -> list[tuple[int, int, int, int]]:
    return [
        (
            int(rng.integers(1, 400)),
            int(rng.integers(1, 128)),
            int(rng.integers(1, 33)),
            int(rng.integers(0, 300)),
        )
        for _ in range(n)
    ]


def truth(uncached: int, out: int, batch: int, cached: int, coef: dict[str, float] = TRUE) -> float:
    return (
        coef["base"]
        + coef["uncached"] * uncached
        + coef["cached"] * cached
        + coef["out"] * out
        + coef["batch"] * batch
        + coef["out_x_batch"] * out * batch
    )


def test_prior_is_used_before_enough_samples() -> None:
    prior = LatencyPrior(
        base_s=0.1,
        prefill_s_per_token=0.01,
        cached_s_per_token=0.0,
        decode_s_per_token=0.02,
        batch_s=0.0,
        decode_s_per_token_per_seq=0.001,
    )
    m = LatencyModel(prior, min_samples=10, refit_every=5)
    expected = 0.1 + 0.01 * 100 + 0.02 * 10 + 0.001 * 10 * 4
    assert m.predict(100, 10, 4, 50) == pytest.approx(expected)
    for _ in range(9):
        m.observe(100, 10, 4, 50, latency_s=99.0)
    assert not m.fitted and m.predict(100, 10, 4, 50) == pytest.approx(expected)
    assert math.isnan(LatencyModel().median_abs_error())


def test_recovers_known_linear_coefficients() -> None:
    rng = np.random.default_rng(7)
    noise = 0.01
    m = LatencyModel(capacity=4096, refit_every=64, min_samples=64, holdout=500)
    for u, o, b, c in synthetic(rng, 3000):
        m.observe(u, o, b, c, truth(u, o, b, c) + float(rng.normal(0.0, noise)))
    m.refit()
    assert m.fitted
    for name, value in m.coefficients.items():
        assert value == pytest.approx(TRUE[name], rel=0.03, abs=2e-4), name
    # held-out error: |N(0, s)| has median 0.674 s once the model is right
    assert m.median_abs_error() == pytest.approx(0.674 * noise, rel=0.15)
    u, o, b, c = 200, 64, 16, 100
    assert m.predict(u, o, b, c) == pytest.approx(truth(u, o, b, c), rel=0.01)


def test_ring_buffer_forgets_old_regime() -> None:
    rng = np.random.default_rng(1)
    m = LatencyModel(capacity=256, refit_every=32, min_samples=32)
    slow = {k: 3 * v for k, v in TRUE.items()}
    for u, o, b, c in synthetic(rng, 600):
        m.observe(u, o, b, c, truth(u, o, b, c, slow))
    for u, o, b, c in synthetic(rng, 600):  # the engine got 3x faster
        m.observe(u, o, b, c, truth(u, o, b, c))
    assert m.predict(200, 64, 16, 100) == pytest.approx(truth(200, 64, 16, 100), rel=0.01)
    assert m.median_abs_error() < 0.01


def test_degenerate_columns_stay_at_the_prior() -> None:
    # no cached tokens ever observed: the cached coefficient keeps its prior value
    prior = LatencyPrior(cached_s_per_token=0.0007)
    m = LatencyModel(prior, min_samples=32, refit_every=32)
    rng = np.random.default_rng(3)
    for u, o, b, _ in synthetic(rng, 200):
        m.observe(u, o, b, 0, truth(u, o, b, 0))
    assert m.coefficients["cached"] == pytest.approx(0.0007)


def test_observe_rejects_bad_latency() -> None:
    with pytest.raises(ValueError):
        LatencyModel().observe(1, 1, 1, 0, latency_s=-1.0)
    with pytest.raises(ValueError):
        LatencyModel().observe(1, 1, 1, 0, latency_s=math.nan)


# -- deadline admission ------------------------------------------------------------------------

PRIOR = LatencyPrior(
    base_s=0.0,
    prefill_s_per_token=0.01,
    cached_s_per_token=0.0,
    decode_s_per_token=0.1,
    batch_s=0.0,
    decode_s_per_token_per_seq=0.0,
)  # latency = 0.01 * uncached + 0.1 * out


def admission() -> DeadlineAdmission:
    return DeadlineAdmission(LatencyModel(PRIOR), margin_s=0.1, margin_ratio=0.1)


def test_expired_when_deadline_passed() -> None:
    adm = admission()
    for now in (10.0, 12.5):
        d = adm.decide(
            now=now,
            deadline=10.0,
            prompt_tokens_uncached=10,
            expected_output_tokens=1,
            batch_size=1,
        )
        assert d.verdict is Verdict.EXPIRED and not d.admitted
        assert d.finish_reason is FinishReason.EXPIRED
        assert "deadline passed" in d.reason


def test_rejected_when_prediction_misses_deadline() -> None:
    adm = admission()
    # service = 0.01*100 + 0.1*10 = 2.0 s; needs 2.0 + 0.2 (10%) + 0.1 = 2.3 s plus queue wait
    common = {"prompt_tokens_uncached": 100, "expected_output_tokens": 10, "batch_size": 8}
    ok = adm.decide(now=0.0, deadline=2.31, **common)
    assert ok.verdict is Verdict.ADMIT and ok.admitted and ok.finish_reason is None
    assert ok.predicted_s == pytest.approx(2.0) and ok.slack_s == pytest.approx(0.31)
    tight = adm.decide(now=0.0, deadline=2.29, **common)  # inside the margin
    assert tight.verdict is Verdict.REJECTED and tight.finish_reason is FinishReason.REJECTED
    assert "would miss deadline" in tight.reason
    queued = adm.decide(now=0.0, deadline=3.0, queue_wait_s=1.0, **common)
    assert queued.verdict is Verdict.REJECTED and queued.predicted_s == pytest.approx(3.0)
    assert adm.decide(now=0.0, deadline=3.4, queue_wait_s=1.0, **common).admitted


def test_no_deadline_always_admitted() -> None:
    d = admission().decide(
        now=1e9,
        deadline=None,
        prompt_tokens_uncached=10**6,
        expected_output_tokens=10**6,
        batch_size=64,
    )
    assert d.verdict is Verdict.ADMIT and d.reason == "no deadline"


def test_decide_request_uses_cached_tokens_and_max_new_tokens() -> None:
    adm = admission()
    r = GenerationRequest(
        request_id="x",
        prompt_ids=list(range(150)),
        params=SamplingParams(max_new_tokens=20),
        deadline=5.0,
        arrival=0.0,
    )
    # 100 cached -> 50 uncached: 0.5 s + 20 * 0.1 = 2.5 s
    d = adm.decide_request(r, now=0.0, batch_size=4, cached_tokens=100)
    assert d.admitted and d.predicted_s == pytest.approx(2.5)
    r.expected_output_tokens = 40  # 0.5 + 4.0 = 4.5 s, + 0.45 + 0.1 margin > 5
    assert adm.decide_request(r, now=0.0, batch_size=4, cached_tokens=100).verdict is (
        Verdict.REJECTED
    )


def test_prior_from_step_costs_matches_the_step_model() -> None:
    m = LatencyModel(prior_from_step_costs(0.1, 0.004, 0.02))
    # 30 uncached tokens, 10 output tokens at batch 8: one prefill step + 10 decode steps
    want = 0.1 + 0.004 * 30 + 10 * (0.1 + 0.02 * 8)
    assert m.predict(30, 10, 8, 150) == pytest.approx(want)
