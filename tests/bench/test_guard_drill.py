"""The canary drill's pure parts (bench/rollout_drill.py, bench/guard_drill.py): conversations
that give the canary exactly its share, the routing checks against the rollout events, and the
figures read from the events. No services (the drill itself runs in
tests/faults/test_rollout_real_workers.py and `python -m bench.guard_drill`)."""

from __future__ import annotations

from typing import Any

import pytest

from bench.guard_drill import parse_rates, summarize_events, verdict
from bench.rollout_drill import (
    CANARY,
    STABLE,
    balanced_conversations,
    check_arm_changes,
    check_routing,
)
from workers.arms import choose_arm
from workers.guard.events import SHARE_LEAD_MS


@pytest.mark.parametrize(("n", "share", "on_canary"), [(200, 5.0, 10), (10, 50.0, 5), (30, 1.0, 1)])
def test_balanced_conversations_give_the_canary_exactly_its_share_spread_evenly(
    n: int, share: float, on_canary: int
) -> None:
    convs = balanced_conversations("r1", "fr", n, share)
    shares = {STABLE: 100.0 - share, CANARY: share}
    arms = [choose_arm(shares, c) for c in convs]
    assert len(set(convs)) == n
    assert arms.count(CANARY) == on_canary
    at = [i for i, arm in enumerate(arms) if arm == CANARY]
    gaps = [b - a for a, b in zip(at, at[1:], strict=False)]
    assert at[0] == 0 and all(g <= -(-n // on_canary) for g in gaps), at


def test_balanced_conversations_at_half_alternate() -> None:
    arms = [
        choose_arm({STABLE: 50.0, CANARY: 50.0}, c)
        for c in balanced_conversations("x", "de", 10, 50)
    ]
    assert arms == [CANARY, STABLE] * 5


def event(
    lang: str, action: str, at_ms: int, before: float, after: float, **figures: float
) -> dict[str, Any]:
    return {
        "language": lang, "action": action,
        "window_start": None if action == "START" else at_ms - 30_000,
        "decided_at": at_ms, "share_before": before, "share_after": after,
        "stable_arm": STABLE, "canary_arm": CANARY, "reasons": [action.lower()],
        "figures": {f"step_{k}": v for k, v in figures.items()},
    }  # fmt: skip


def test_routing_checks_accept_moves_across_a_share_change_only() -> None:
    conv = next(
        c
        for c in balanced_conversations("r", "de", 20, 50)
        if choose_arm({STABLE: 50, CANARY: 50}, c) == CANARY
    )
    start = event("de", "START", 1_000_000, 0, 50)
    rollback = event("de", "ROLLBACK", 1_060_000, 50, 0, canary_requests=8)
    effect_s = (1_060_000 + SHARE_LEAD_MS) / 1000
    sent = {"a": ("de", conv, 1_010.0), "b": ("de", conv, effect_s + 5)}
    arm_of = {"a": CANARY, "b": STABLE}
    events = [start, rollback]
    assert check_arm_changes(sent, arm_of, events) == {"de": 1}
    assert check_routing(sent, arm_of, events) == 2
    with pytest.raises(AssertionError):  # the same move with no rollback in between
        check_arm_changes(sent, arm_of, [start])
    with pytest.raises(AssertionError):  # answered by the canary after the rollback
        check_routing({"b": sent["b"]}, {"b": CANARY}, events)


def test_summarize_events_and_verdict_read_times_counts_and_outcomes() -> None:
    t0 = 5_000_000
    events = [
        event("de", "START", t0, 0, 5), event("fr", "START", t0, 0, 5),
        event("de", "HOLD", t0 + 30_000, 5, 5),
        event("de", "ROLLBACK", t0 + 150_500, 5, 0, canary_requests=7, canary_slow=7),
        event("fr", "PROMOTE", t0 + 900_000, 5, 25, canary_requests=181, stable_requests=3400),
        event("fr", "COMPLETE", t0 + 1_200_000, 50, 100, canary_requests=180),
    ]  # fmt: skip
    summary = summarize_events(events, t0)
    assert summary["de"]["outcome"] == "ROLLBACK" and summary["de"]["windows"] == 2
    (rollback,) = summary["de"]["changes"]
    assert rollback["after_s"] == 150.5 and rollback["canary_requests"] == 7
    assert rollback["canary_slow"] == 7 and rollback["share_after"] == 0
    assert [c["action"] for c in summary["fr"]["changes"]] == ["PROMOTE", "COMPLETE"]
    assert summary["fr"]["changes"][0]["stable_requests"] == 3400
    run = {"languages": summary, "lost": 0, "duplicates": 1}
    undecided = {"languages": {"de": {"outcome": "undecided", "changes": []},
                               "fr": {"outcome": "ROLLBACK", "changes": [
                                   {"action": "ROLLBACK", "after_s": 99.0}]}},
                 "lost": 2, "duplicates": 0}  # fmt: skip
    v = verdict([run, undecided], "de", "fr")
    assert v["de_rolled_back"] == 1 and v["fr_completed"] == 1 and v["false_rollbacks"] == 1
    assert v["de_rollback_after_s"] == [150.5, None] and v["fr_complete_after_s"] == [1200.0, None]
    assert v["lost"] == 2 and v["duplicates"] == 1


def test_parse_rates() -> None:
    assert parse_rates("de=1.5, fr=4") == {"de": 1.5, "fr": 4.0}
    with pytest.raises(ValueError):
        parse_rates("de")
