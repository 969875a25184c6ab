"""The guard's pure decisions (workers/guard/policy.py): verdicts, rollback, promotion steps,
idempotence, duplicate decisions of two guards."""

from __future__ import annotations

import math

import pytest

from workers.fairness.policy import LanguagePolicy
from workers.guard.events import RolloutBook, decision_event, operator_event
from workers.guard.policy import (
    GuardPolicy,
    RolloutState,
    apply_event,
    decide,
    judge_window,
    next_step,
    validate_steps,
)
from workers.guard.windows import WindowStats

W = 30_000
SLO = LanguagePolicy(weight=1.0, slo_p99_s=2.0, max_queue=10, max_new_tokens=10)
POLICY = GuardPolicy(
    decision="windows", min_requests=10, bad_windows_to_rollback=3, good_windows_to_promote=2
)


def stats(
    arm: str,
    start: int,
    n: int = 50,
    p95: float = 300,
    p99: float = 400,
    errors: int = 0,
    expired: int = 0,
    lang: str = "de",
    withheld: int = 0,
    flagged: int = 0,
) -> WindowStats:
    return WindowStats(
        lang,
        arm,
        start,
        start + W,
        n,
        errors,
        expired,
        0,
        p95 if n else math.nan,
        p99 if n else math.nan,
        withheld,
        flagged,
    )


def good(start: int, lang: str = "de") -> tuple[WindowStats, WindowStats]:
    return stats("v2", start, lang=lang), stats("stable", start, lang=lang)


def bad(start: int, lang: str = "de") -> tuple[WindowStats, WindowStats]:
    return stats("v2", start, p95=4000, p99=5000, lang=lang), stats("stable", start, lang=lang)


def state(lang: str = "de", share: float = 5.0) -> RolloutState:
    return RolloutState("r1", lang, "stable", "v2", share, judge_from_ms=0)


def run(st: RolloutState, windows: list[tuple[WindowStats, WindowStats]]) -> list:
    out = []
    for canary, stable in windows:
        d = decide(st, canary, stable, SLO, POLICY)
        if d is not None:
            out.append(d)
            st = d.state
    return out


def test_fewer_than_minimum_canary_requests_is_inconclusive_and_keeps_streaks() -> None:
    v = judge_window(stats("v2", 0, n=9, p99=9000), stats("stable", 0), SLO, POLICY)
    assert v.kind == "inconclusive" and "9 canary replies < minimum 10" in v.reasons[0]
    few = (stats("v2", W, n=3, p99=9000), stats("stable", W))
    decisions = run(state(), [bad(0), few, bad(2 * W), bad(3 * W)])
    assert [d.action for d in decisions] == ["HOLD", "INCONCLUSIVE", "HOLD", "ROLLBACK"]
    assert decisions[1].share_after == 5.0 and decisions[1].state.bad_streak == 1


def test_three_consecutive_bad_windows_roll_back_and_a_good_one_resets_the_count() -> None:
    decisions = run(state(), [bad(0), bad(W), good(2 * W), bad(3 * W), bad(4 * W), bad(5 * W)])
    assert [d.action for d in decisions] == ["HOLD", "HOLD", "HOLD", "HOLD", "HOLD", "ROLLBACK"]
    last = decisions[-1]
    assert last.share_after == 0.0 and last.state.phase == "rolled_back"
    assert last.state.shares() == {"stable": 100.0, "v2": 0.0}
    assert any("P99 5000 ms > SLO 2000 ms" in r for r in last.verdict.reasons)
    assert decide(last.state, *bad(6 * W), SLO, POLICY) is None  # no more judging


def test_rollback_is_for_that_language_only() -> None:
    de, fr = state("de"), state("fr")
    for i in range(3):
        d_de = decide(de, *bad(i * W, "de"), SLO, POLICY)
        d_fr = decide(fr, *good(i * W, "fr"), SLO, POLICY)
        assert d_de is not None and d_fr is not None
        de, fr = d_de.state, d_fr.state
    assert de.phase == "rolled_back" and de.share == 0.0
    assert fr.phase == "active" and fr.share == 25.0  # promoted once, still in rollout


def test_promotion_goes_through_the_steps_to_complete() -> None:
    st = state(share=5.0)
    actions, shares = [], []
    start = 0
    while st.active and start < 40 * W:
        d = decide(st, *good(start), SLO, POLICY)
        if d is not None:
            actions.append(d.action)
            shares.append(d.share_after)
            st = d.state
        start += W
    steps = [s for a, s in zip(actions, shares, strict=True) if a in ("PROMOTE", "COMPLETE")]
    assert steps == [25, 50, 100]
    assert (
        actions[-1] == "COMPLETE"
        and st.phase == "complete"
        and st.shares() == {"stable": 0.0, "v2": 100.0}
    )


def test_the_window_after_a_promotion_is_judged_and_earlier_ones_are_not() -> None:
    decisions = run(state(), [good(0), good(W)])
    promoted = decisions[-1].state
    assert decisions[-1].action == "PROMOTE" and promoted.judge_from_ms == 2 * W
    assert decide(promoted, *good(W), SLO, POLICY) is None  # already judged
    assert decide(promoted, *good(2 * W), SLO, POLICY) is not None


def test_below_the_minimum_share_the_guard_does_not_judge() -> None:
    policy = GuardPolicy(decision="windows", min_share=10.0, good_windows_to_promote=1)
    d = decide(state(share=5.0), *bad(0), SLO, policy)
    assert d is not None and d.action == "INCONCLUSIVE" and "below minimum" in d.verdict.reasons[0]


def test_error_and_expired_rates_compare_with_the_stable_arm() -> None:
    assert (
        judge_window(stats("v2", 0, errors=10), stats("stable", 0, errors=8), SLO, POLICY).kind
        == "good"
    )  # 20 % vs 16 %: within 5 points
    v = judge_window(stats("v2", 0, expired=10), stats("stable", 0), SLO, POLICY)
    assert v.kind == "bad" and "expired rate 20.0% vs stable 0.0%" in v.reasons


def test_withheld_answers_are_judged_by_the_quality_rule_not_the_error_rule() -> None:
    """Issue #28: a canary that withholds or flags more answers than the stable arm is bad for
    that reason; one withholding as often as the stable is not, and neither is a handful."""
    v = judge_window(stats("v2", 0, withheld=6, flagged=2), stats("stable", 0), SLO, POLICY)
    assert v.kind == "bad" and v.reasons == ("withheld/flagged rate 16.0% vs stable 0.0%",)
    assert v.figures["canary_withheld_rate"] == 0.12 and v.figures["canary_error_rate"] == 0.0
    same = judge_window(
        stats("v2", 0, withheld=8), stats("stable", 0, withheld=5, flagged=2), SLO, POLICY
    )
    assert same.kind == "good"  # 16 % vs 14 %: a small model withholds on either arm
    few = GuardPolicy(
        decision="windows", min_requests=3
    )  # a small window: 4 of 4 withheld, but only 4 (< 5)
    assert judge_window(stats("v2", 0, n=4, withheld=4), stats("stable", 0), SLO, few).kind == (
        "good"
    )
    assert judge_window(stats("v2", 0, n=5, withheld=5), stats("stable", 0), SLO, few).kind == (
        "bad"
    )
    lone = judge_window(stats("v2", 0, withheld=20), stats("stable", 0, n=3), SLO, POLICY)
    assert lone.kind == "good"  # no stable arm with enough replies to compare with


def test_a_slow_stable_arm_does_not_make_the_canary_bad() -> None:
    canary = stats("v2", 0, p95=2500, p99=3000)
    stable = stats("stable", 0, p95=2400, p99=2900)
    assert judge_window(canary, stable, SLO, POLICY).kind == "good"  # both past the SLO alike


def test_a_regression_inside_the_slo_is_bad() -> None:
    v = judge_window(stats("v2", 0, p95=1200, p99=1500), stats("stable", 0, p95=300), SLO, POLICY)
    assert v.kind == "bad" and v.reasons[0].startswith("P95 1200 ms > 1.5x stable 300 ms")


def test_replayed_windows_give_the_same_decisions_and_change_nothing_twice() -> None:
    windows = [bad(0), good(W), bad(2 * W), bad(3 * W), bad(4 * W)]
    first = run(state(), windows)
    again = run(state(), windows)
    assert [(d.event_id, d.action, d.share_after, d.verdict) for d in first] == [
        (d.event_id, d.action, d.share_after, d.verdict) for d in again
    ]
    final = first[-1].state
    assert all(decide(final, c, s, SLO, POLICY) is None for c, s in windows)


def test_two_guards_duplicate_decisions_are_harmless() -> None:
    start = operator_event(
        "START",
        rollout_id="r1",
        lang="de",
        stable="stable",
        canary="v2",
        share_before=0,
        share_after=5,
        steps=(5, 25, 50, 100),
        decided_by="op",
        now_ms=0,
    )
    st = apply_event(None, start)
    assert st is not None
    d = decide(st, *bad(0), SLO, POLICY)
    assert d is not None
    from_a = decision_event(d, decided_by="guard-a", now_ms=31_000)
    from_b = decision_event(d, decided_by="guard-b", now_ms=31_500)
    assert from_a["event_id"] == from_b["event_id"]
    book = RolloutBook()
    for e in (start, from_a, from_b, from_a):
        book.apply(e)
    assert book.states["de"] == d.state and len(book.history["de"]) == 2
    assert apply_event(d.state, from_b) == d.state  # the fold alone skips it too


def test_events_of_another_rollout_do_not_apply_and_an_abort_stops_it() -> None:
    st = state()
    other = {
        "action": "ROLLBACK",
        "rollout_id": "other",
        "language": "de",
        "share_after": 0.0,
        "window_start": 0,
        "window_end": W,
    }
    assert apply_event(st, other) == st
    abort = {**other, "rollout_id": "r1", "action": "ABORT", "window_start": None}
    aborted = apply_event(st, abort)
    assert aborted is not None and aborted.phase == "aborted" and aborted.share == 0.0
    assert decide(aborted, *good(0), SLO, POLICY) is None


def test_steps_are_validated() -> None:
    assert validate_steps([5, 25, 100]) == (5.0, 25.0, 100.0)
    for bad_steps in ([5, 25], [25, 5, 100], [0, 100], []):
        with pytest.raises(ValueError):
            validate_steps(bad_steps)
    assert next_step((5, 25, 50, 100), 25) == 50 and next_step((5, 100), 100) == 100
