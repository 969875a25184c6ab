"""bench/cascade.py's arithmetic on hand-made translations: a signal that is low exactly where
the small model is wrong recovers all of the large model's gain at the share of wrong answers,
as the oracle does, and the calibration built from it meets Done-when 1 in and out of sample;
a signal unrelated to the errors does not. The scoring itself runs on real models in
tests/engine/test_scoring.py."""

from __future__ import annotations

import numpy as np

from bench.cascade import (
    best_signal,
    calibrate_and_evaluate,
    cascade_stats,
    chrf,
    curves,
    deferred_lowest,
    rankings,
)
from bench.model_quality import Item
from replay.quality import chrf_statistics
from replay.stats import chrf_from_sums
from workers.stages.cascade.rules import CascadeThresholds

SENTENCES = [
    "The parcel arrives on Monday morning.",
    "Please send us your order number.",
    "We have refunded the full amount.",
    "Your account was locked for your safety.",
    "The technician will call you tomorrow.",
    "Thank you for waiting so patiently.",
    "Can you describe the problem in more detail?",
    "The invoice is attached to this message.",
    "I have forwarded your request to billing.",
    "Is there anything else I can do for you?",
] * 2


def _case() -> tuple[list[Item], np.ndarray, np.ndarray, list[bool], np.ndarray]:
    items = [Item("set", "de", "en", f"src {i}", ref) for i, ref in enumerate(SENTENCES)]
    wrong = np.zeros(len(items), dtype=bool)
    wrong[[1, 4, 7, 12, 15, 18]] = True  # 30 %: the small model says something else there
    pairs = zip(wrong, SENTENCES, strict=True)
    small_texts = ["Nothing at all like it, sorry." if w else r for w, r in pairs]
    small = chrf_statistics(small_texts, SENTENCES)
    large = chrf_statistics(SENTENCES, SENTENCES)
    return items, small, large, [False] * len(items), wrong


def test_a_signal_low_on_the_errors_recovers_the_whole_gain_like_the_oracle() -> None:
    items, small, large, flags, wrong = _case()
    good = [-2.0 - i * 0.01 if w else -0.5 - i * 0.01 for i, w in enumerate(wrong)]
    unrelated = [-0.1 * (i % 7) for i in range(len(items))]
    gain = chrf_from_sums(large) - chrf_from_sums(small)
    ranks = rankings({"large_logprob": good, "small_logprob": unrelated}, flags, gain, seed=0)
    row = curves(list(range(len(items))), ranks, small, large, [0.1, 0.3])
    assert row["large_chrF"] == 100.0 and row["small_chrF"] < 80
    assert row["rankings"]["large_logprob"]["0.3"]["recovered"] == 1.0
    assert row["rankings"]["oracle"]["0.3"]["recovered"] == 1.0
    assert row["rankings"]["small_logprob"]["0.3"]["recovered"] < 0.7
    assert 0 < row["rankings"]["large_logprob"]["0.1"]["recovered"] < 1.0
    assert best_signal(row, 0.3) == "large_logprob"
    # the least share within 1 chrF of the large model: 30 % for a ranking that finds the
    # errors, none of the shares for one that does not
    assert row["within_at"]["oracle"] == row["within_at"]["large_logprob"] == 0.3
    assert row["within_at"]["small_logprob"] is None
    # with the checks: a flagged answer ranks first (None), whatever its score
    flagged = [i == 0 for i in range(len(items))]
    with_checks = rankings({"large_logprob": good}, flagged, gain, seed=0)
    assert with_checks["large_logprob+checks"][0] is None
    assert deferred_lowest(with_checks["large_logprob+checks"], 0.05)[0]


def test_calibration_in_and_out_of_sample() -> None:
    items, small, large, flags, wrong = _case()
    good = [-2.0 - i * 0.01 if w else -0.5 - i * 0.01 for i, w in enumerate(wrong)]

    def make(by_pair: dict[str, list[float]], checked: dict[str, int]) -> CascadeThresholds:
        return CascadeThresholds.calibrate(
            by_pair, 0.3, small="s", large="l", signal="large_logprob", checked=checked
        )

    report = calibrate_and_evaluate(items, good, flags, small, large, make)
    inside = report["in_sample"]["all"]
    assert inside["deferred_share"] == 0.3 and inside["met"]
    assert inside["cascade_chrF"] == inside["large_chrF"] == 100.0
    assert report["held_out"]["all"]["met"] and report["held_out"]["all"]["n"] == len(items)
    assert set(report["in_sample"]) >= {"all", "set:de-en", "de-en"}
    # scores that rank the errors last: the same share fixes nothing
    bad = [-g for g in good]
    worse = calibrate_and_evaluate(items, bad, flags, small, large, make)["in_sample"]["all"]
    assert not worse["met"] and worse["cascade_chrF"] == round(chrf(small), 2)
    assert chrf(cascade_stats(small, large, wrong)) == 100.0


def test_the_served_comparison_reports_the_deferred_share_in_service(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`--serving`: three workers under one load; the cascade's P50 over the small model's, its
    P99 of OK over the large model's, and the share it deferred (from its metrics)."""
    from bench import cascade as bench_cascade
    from bench import serving as bench_serving

    served = {  # worker model + flags -> (P50, P99 of OK, cascade outcomes or None)
        "small": (0.10, 0.30, None),
        "cascade": (0.12, 1.50, {"small": 40, "deferred": 18, "deadline": 2}),
        "cascade_whole": (0.15, 2.00, {"small": 40, "deferred": 18, "deadline": 2}),
        "large": (0.50, 1.80, None),
    }
    arms: list[str] = []

    def run(ns):  # type: ignore[no-untyped-def]
        arm = "cascade" if "--cascade" in ns.worker_args else (
            "large" if ns.model == "qwen2.5-coder-1.5b" else "small")  # fmt: skip
        if "--no-cascade-early" in ns.worker_args:
            arm = "cascade_whole"
        arms.append(arm)
        p50, p99, outcomes = served[arm]
        row = {
            "total_rate": 1.0,
            "languages": {
                "all": {"p50_s": p50, "p99_ok_s": p99, "p99_s": p99, "statuses": {"OK": 60}}
            },
        }
        if outcomes:
            row["cascade_outcomes"] = outcomes
        return {"runs": [row]}

    monkeypatch.setattr(bench_serving, "run", run)
    result = bench_cascade.serving(bench_cascade.parse_args(["--serving"]))
    ratio = result["ratios"]["1"]
    assert ratio["p50_over_small"] == 1.2 and ratio["p99_ok_over_large"] == 0.833
    assert ratio["met"] is True
    assert ratio["deferred_share"] == 0.3 and ratio["deadline_share"] == 0.033
    assert arms == ["small", "cascade", "large"] and "p50_over_whole" not in ratio
    arms.clear()  # --compare-early: the cascade without early deferral, as a fourth arm
    result = bench_cascade.serving(bench_cascade.parse_args(["--serving", "--compare-early"]))
    assert arms == ["small", "cascade", "cascade_whole", "large"]
    ratio = result["ratios"]["1"]
    assert ratio["p50_over_whole"] == 0.8 and ratio["p99_ok_over_whole"] == 0.75
