"""Stopping a replay run once it is decided (replay/early_stop.py): the watch's verdicts on a
growing run, its first-reply rule, and the stop rule's errors."""

from __future__ import annotations

import pytest

from replay import confseq
from replay.early_stop import DecisionWatch, parse_stop_metrics, stop_setting


def _feed(watch: DecisionWatch, n: int, *, b_slow_every: int = 0, start: int = 0) -> None:
    for i in range(start, start + n):
        rid, lang = f"r{i}", ("de", "en")[i % 2]
        watch.sent(rid, lang, "the parcel is on its way", float(i))
        watch.replied(rid, "A", "OK", "the parcel is on its way", i + 300.0)
        slow = b_slow_every and i % b_slow_every == 0
        watch.replied(rid, "B", "OK", "the parcel is on its way", i + (5000.0 if slow else 300.0))


def test_identical_arms_are_decided_equivalent_once_there_is_enough_evidence():
    watch = DecisionWatch(
        ["A", "B"], ["chrf", "within_slo"], margins={"chrf": 0.1, "within_slo": 0.1}
    )
    _feed(watch, 40)  # 20 pairs a language: the CS of a zero difference is still wider than 0.1
    assert watch.decided() is None
    assert watch.verdicts()["de"]["B vs A"]["within_slo"] == confseq.INCONCLUSIVE
    _feed(watch, 200, start=40)  # 120 pairs a language
    verdicts = watch.decided()
    assert verdicts == {
        lang: {"B vs A": {"chrf": "equivalent", "within_slo": "equivalent"}}
        for lang in ("de", "en")
    }


def test_a_slower_arm_is_decided_worse_within_the_slo():
    watch = DecisionWatch(["A", "B"], ["within_slo"], slo_ms=2000.0)
    _feed(watch, 200, b_slow_every=3)  # every third B reply over the SLO, in both languages
    verdicts = watch.decided()
    assert verdicts is not None
    assert {v["B vs A"]["within_slo"] for v in verdicts.values()} == {"worse"}


def test_only_the_first_reply_of_an_arm_counts_and_unknown_replies_are_ignored():
    watch = DecisionWatch(["A", "B"], ["within_slo"], slo_ms=1000.0)
    watch.sent("r1", "de", None, 0.0)
    watch.replied("r1", "A", "OK", "x", 100.0)
    watch.replied("r1", "A", "OK", "x", 9000.0)  # a duplicate: not counted again
    watch.replied("r1", "C", "OK", "x", 100.0)  # an arm the run does not compare
    watch.replied("r9", "A", "OK", "x", 100.0)  # a request the run never sent
    assert watch.measures["A"]["r1"]["latency_ms"] == 100.0
    assert set(watch.measures) == {"A", "B"} and set(watch.measures["A"]) == {"r1"}


def test_the_stop_rule_refuses_what_it_cannot_judge_while_running():
    assert parse_stop_metrics("chrf, within_slo") == ("chrf", "within_slo")
    with pytest.raises(ValueError, match="off_target"):
        parse_stop_metrics("off_target")
    with pytest.raises(ValueError, match="two expected arms"):
        DecisionWatch(["A"], ["chrf"])
    assert stop_setting((), None, 2000.0) is None
    setting = stop_setting(("chrf",), {"chrf": 0.05}, 1500.0)
    watch = DecisionWatch.from_info({"arms": ["A", "B"], "stop_when_decided": setting})
    assert watch is not None and watch.margins["chrf"] == 0.05 and watch.slo_ms == 1500.0
