"""The cascade's deferral rule (workers/stages/cascade/rules.py): thresholds that defer a target
share, the checks' doubt deferring first, the file the worker reads at start, and the packaged
calibration of the default pair of models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.engine.presets import PRESETS
from workers.stages.cascade.rules import (
    SCORER,
    SIGNALS,
    CascadeThresholds,
    packaged_thresholds,
    signal_value,
    threshold_for_share,
)


def test_threshold_defers_the_share_of_scores_strictly_below_it() -> None:
    scores = [-2.0, -0.5, -1.0, -0.1, -3.0, -0.7, -1.5, -0.2, -0.9, -0.3]
    for share in (0.0, 0.1, 0.3, 0.5, 0.9, 1.0):
        t = threshold_for_share(scores, share)
        assert sum(s < t for s in scores) == round(share * len(scores))
    assert threshold_for_share(scores, 0.3) == pytest.approx((-1.5 + -1.0) / 2)
    with pytest.raises(ValueError, match="no scores"):
        threshold_for_share([], 0.3)
    with pytest.raises(ValueError, match="not in"):
        threshold_for_share(scores, 1.5)


def test_calibration_counts_what_the_checks_defer_toward_the_share() -> None:
    """10 de-en answers scored and 2 more the checks doubt: a 0.25 share is 3 of 12, so the
    threshold defers 1 of the 10 scored ones; en-de had none flagged: 2 of its 8."""
    de_en = [-0.1 * i for i in range(10)]
    en_de = [-0.2 * i for i in range(8)]
    t = CascadeThresholds.calibrate(
        {"de-en": de_en, "en-de": en_de}, 0.25, small="s", large="l",
        signal="large_logprob", checked={"de-en": 2},
    )  # fmt: skip
    assert sum(s < t.threshold("de", "en") for s in de_en) == 1
    assert sum(s < t.threshold("en", "de") for s in en_de) == 2
    # a pair it never saw: the threshold of every score pooled (20 items, 5 deferred, 2 checked)
    pooled = de_en + en_de
    assert t.threshold("fr", "en") == t.pooled
    assert sum(s < t.pooled for s in pooled) == 3


def test_decide_defers_doubted_low_and_missing_scores() -> None:
    t = CascadeThresholds("s", "l", "large_logprob", {"de-en": -1.0}, pooled=-0.5)
    assert not t.decide("de", "en", -0.8).defer
    low = t.decide("de", "en", -1.2)
    assert low.defer and low.reason == "score" and low.threshold == -1.0
    assert t.decide("de", "en", -0.1, suspect=True).reason == "check"
    assert t.decide("de", "en", None).defer  # no score: the better model answers
    assert t.decide("fr", "en", -0.8).defer  # the pooled threshold (-0.5) for an unseen pair


def test_thresholds_file_round_trip_and_clear_errors(tmp_path: Path) -> None:
    t = CascadeThresholds.calibrate(
        {"de-en": [-1.0, -0.5, -0.2]}, 0.34, small="gemma3-270m", large="qwen2.5-coder-1.5b",
        signal="small_logprob", calibrated_on="3 items",
    )  # fmt: skip
    path = tmp_path / "t.json"
    t.save(path)
    assert CascadeThresholds.load(path) == t
    with pytest.raises(ValueError, match="not found"):
        CascadeThresholds.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="is not JSON"):
        CascadeThresholds.load(tmp_path / "bad.json")
    (tmp_path / "wrong.json").write_text(json.dumps({"small": "s"}))
    with pytest.raises(ValueError, match="wrong.json: not a cascade thresholds file"):
        CascadeThresholds.load(tmp_path / "wrong.json")
    with pytest.raises(ValueError, match="unknown cascade signal"):
        CascadeThresholds("s", "l", "bleu", {}, pooled=0.0)
    with pytest.raises(ValueError, match="finite"):
        CascadeThresholds("s", "l", "large_logprob", {"de-en": float("nan")}, pooled=0.0)


def test_the_packaged_calibration_names_presets_and_covers_the_dev_pairs() -> None:
    t = packaged_thresholds()
    assert t.small in PRESETS and t.large in PRESETS and t.small != t.large
    assert {"de-en", "en-de", "en-fr", "fr-en"} <= set(t.thresholds)
    assert all(-1000.0 < v < 0.0 for v in t.thresholds.values())  # log-probabilities
    assert t.defer_share is not None and 0.0 < t.defer_share <= 0.5


def test_each_signal_names_its_scoring_model_and_totals_multiply_by_tokens() -> None:
    assert set(SCORER) == set(SIGNALS) and set(SCORER.values()) == {"small", "large"}
    assert signal_value("small_logprob", -0.5, 10) == -0.5
    assert signal_value("small_total", -0.5, 10) == -5.0  # the answer's whole log-probability
