"""The guard's sequential mode (workers/guard/sequential.py and policy.decide with
decision="sequential"): the rate CS against its closed form and its coverage at every window at
once, harm / non-inferiority / undecided, and rollouts at a 5 % canary share that roll back a
bad canary, promote a good one after the step's minimum time, and almost never roll back a
canary as good as the stable arm."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from workers.guard.events import decision_event
from workers.guard.policy import GuardPolicy, RolloutState, apply_event, decide
from workers.guard.sequential import (
    StepCounts,
    difference_cs,
    judge_step,
    level_per_test,
    rate_cs,
)
from workers.guard.windows import WindowStats, over_ms, stats_of

W = 30_000
MARGINS = {"bad": 0.05, "slow": 0.05}
POLICY = GuardPolicy(min_step_s=120.0, languages=2)  # sequential: the default


def test_the_upper_bound_with_no_events_is_the_closed_form():
    """S = 0: M_n(p) = B(1/2, n + 1/2) / (B(1/2, 1/2) (1 - p)^n) >= 1/alpha exactly when
    p >= 1 - (alpha B(1/2, n + 1/2) / pi)^(1/n)."""
    for n, alpha in ((1, 0.05), (50, 0.05), (200, 0.0125), (5000, 0.001)):
        log_b = math.lgamma(0.5) + math.lgamma(n + 0.5) - math.lgamma(n + 1.0)
        closed = 1 - math.exp((math.log(alpha) + log_b - math.log(math.pi)) / n)
        lo, hi = rate_cs(n, 0, alpha)
        assert lo == 0.0 and hi == pytest.approx(closed, abs=1e-9), (n, alpha)
    assert rate_cs(0, 0, 0.05) == (0.0, 1.0)
    assert 0.03 < rate_cs(200, 0, 0.0125)[1] < 0.04  # 200 clean replies: under 4 %
    with pytest.raises(ValueError, match="events"):
        rate_cs(3, 4, 0.05)


@pytest.mark.parametrize("p", [0.02, 0.3])
def test_the_rate_cs_covers_the_rate_at_every_window_at_once(p: float):
    """300 runs of 60 windows of 10 Bernoulli replies each, the CS checked after every
    window: the rate leaves it in <= alpha of the runs (plus binomial slack)."""
    rng = random.Random(int(p * 100))
    misses = 0
    for _ in range(300):
        n = s = 0
        for _ in range(60):
            n += 10
            s += sum(rng.random() < p for _ in range(10))
            lo, hi = rate_cs(n, s, 0.05)
            if not lo <= p <= hi:
                misses += 1
                break
    assert misses / 300 <= 0.05 + 0.03


def test_the_difference_is_the_two_arms_bounds_at_half_the_level_each():
    lc, uc = rate_cs(100, 10, 0.025)
    ls, us = rate_cs(2000, 40, 0.025)
    assert difference_cs((100, 10), (2000, 40), 0.05) == (lc - us, uc - ls)


def test_harm_non_inferiority_and_undecided():
    alpha = level_per_test(0.05, 2)
    assert alpha == 0.0125
    harm = judge_step(StepCounts(100, 30, 0, 2000, 40, 0), alpha=alpha, margins=MARGINS)
    assert harm.kind == "harm" and "bad (error/expired/withheld)" in harm.reasons[0]
    assert harm.figures["bad_diff_lower"] > 0.05 and harm.figures["step_canary_bad"] == 30
    clean = judge_step(StepCounts(300, 3, 2, 6000, 60, 40), alpha=alpha, margins=MARGINS)
    assert clean.kind == "non_inferior" and clean.figures["bad_diff_upper"] < 0.05
    few = judge_step(StepCounts(12, 0, 0, 240, 3, 1), alpha=alpha, margins=MARGINS)
    assert few.kind == "undecided" and few.reasons[0] == "undecided after 12 canary replies"
    slow = judge_step(StepCounts(200, 0, 60, 4000, 0, 40), alpha=alpha, margins=MARGINS)
    assert slow.kind == "harm" and "over-SLO" in slow.reasons[0]


def _window(arm: str, start: int, n: int, bad: int = 0, slow: int = 0) -> WindowStats:
    return WindowStats("de", arm, start, start + W, n, bad, 0, 0, 300.0, 400.0, over_slo=slow)


def _state(share: float = 5.0) -> RolloutState:
    return RolloutState("r1", "de", "stable", "v2", share, judge_from_ms=0)


def _run(state: RolloutState, windows: list[tuple[int, int, int, int]], policy=POLICY):
    """Decide windows of (canary n, canary bad, stable n, stable bad); the decisions."""
    out = []
    for i, (cn, cb, sn, sb) in enumerate(windows):
        start = i * W
        d = decide(
            state, _window("v2", start, cn, cb), _window("stable", start, sn, sb), None, policy
        )
        assert d is not None
        out.append(d)
        state = d.state
        if not state.active:
            break
    return out


def test_a_bad_canary_at_five_percent_is_rolled_back_within_minutes():
    """Canary 30 % errors against the stable's 1 %, ~1.5 canary replies a window (5 % of
    1 req/s): rolled back once the evidence is there, not on the first window."""
    rng = random.Random(5)
    windows = []
    for _ in range(40):
        cn = rng.choice((1, 1, 2, 2, 2))
        windows.append((cn, sum(rng.random() < 0.3 for _ in range(cn)), 28, rng.random() < 0.3))
    decisions = _run(_state(), windows)
    assert decisions[-1].action == "ROLLBACK" and decisions[-1].share_after == 0.0
    assert 3 <= len(decisions) <= 30, len(decisions)  # within 15 minutes of 30 s windows
    assert all(d.action == "HOLD" for d in decisions[:-1])
    assert "bad (error/expired/withheld)" in decisions[-1].verdict.reasons[0]


def test_a_good_canary_is_promoted_after_the_minimum_time_and_its_counts_restart():
    """60 clean replies a window on each arm: non-inferior after 3 windows (90 s), held until
    the step's 120 s, then promoted."""
    decisions = _run(_state(share=25.0), [(60, 0, 60, 0)] * 40)
    promote = next(d for d in decisions if d.action == "PROMOTE")
    assert promote.window_end_ms >= POLICY.min_step_s * 1000  # non-inferior early, held
    held = [d for d in decisions if d.window_end_ms < promote.window_end_ms]
    assert any("minimum 120 s" in r for d in held for r in d.verdict.reasons)
    assert promote.share_after == 50.0 and promote.state.step == StepCounts()
    assert promote.verdict.figures["step_canary_requests"] > 0


def test_as_good_as_stable_at_five_percent_is_almost_never_rolled_back():
    """200 rollouts of 60 windows, both arms at 3 % bad replies, a 5 % share: false rollbacks
    stay under the level (0.05 split over 2 languages x 2 metrics: 0.0125 per test)."""
    rng = random.Random(11)
    policy = dataclasses.replace(POLICY, min_step_s=1e9)  # never promote: watch the whole run
    rollbacks = 0
    for _ in range(200):
        windows = []
        for _ in range(60):
            cn = rng.choice((1, 1, 2, 2, 2))
            cb = sum(rng.random() < 0.03 for _ in range(cn))
            sb = sum(rng.random() < 0.03 for _ in range(28))
            windows.append((cn, cb, 28, sb))
        rollbacks += _run(_state(), windows, policy)[-1].action == "ROLLBACK"
    assert rollbacks / 200 <= 0.0125 * 2 + 0.02


def test_a_restarted_guard_folds_the_step_counts_back_from_the_events():
    decisions = _run(_state(share=25.0), [(8, 1, 22, 0), (7, 0, 23, 1), (9, 0, 21, 0)])
    state = _state(share=25.0)
    for d in decisions:
        state = apply_event(state, decision_event(d, decided_by="g", now_ms=1))
    assert state is not None and state.step == decisions[-1].state.step
    assert state.step == StepCounts(24, 1, 0, 66, 1, 0)


def test_windows_mode_is_unchanged_and_a_bad_decision_name_is_refused():
    with pytest.raises(ValueError, match="decision"):
        GuardPolicy(decision="bayes")
    assert GuardPolicy().decision == "sequential"  # the default (issue #29)
    windows_mode = GuardPolicy(decision="windows")
    d = decide(_state(25.0), _window("v2", 0, 50), _window("stable", 0, 50), None, windows_mode)
    assert (
        d is not None
        and d.state.step == StepCounts()
        and "bad_diff_upper" not in (d.verdict.figures)
    )


def test_replies_over_the_slo_are_counted_from_the_histogram():
    counts = {
        "requests": 4,
        "status": {"OK": 4},
        "hist": {"0": 1, "300": 1, "400": 2},  # bucket 300 ~ 376 ms, 400 ~ 2,720 ms
        "quality": {},
        "last_offset": 9,
    }
    st = stats_of(counts, lang="de", arm="v2", start_ms=0, window_ms=W, slo_ms=2000.0)
    assert st.over_slo == 2 and over_ms(counts["hist"], math.inf) == 0
