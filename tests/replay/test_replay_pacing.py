"""replay.pacing: selection, schedules from timestamps / speed / rate, and conversation order,
as pure functions with hand-computed answers (no broker, no clock)."""

from __future__ import annotations

import pytest

from replay.logs import ReplayRecord
from replay.pacing import (
    DEFAULT_TURN_GAP_MS,
    Pacer,
    log_times,
    schedule,
    select_records,
)


def rec(conv: str, turn: int, target: str = "de", ts: int | None = None) -> ReplayRecord:
    return ReplayRecord(
        conv, turn, "en" if target == "de" else "de", target, f"{conv}{turn}", timestamp_ms=ts
    )


def test_selection_filters_target_languages_and_sorts_turns():
    records = [rec("a", 1), rec("b", 0, "en"), rec("a", 0), rec("b", 1)]
    assert [(r.conversation_id, r.turn) for r in select_records(records)] == [
        ("a", 0),
        ("a", 1),
        ("b", 0),
        ("b", 1),
    ]
    assert [(r.conversation_id, r.turn) for r in select_records(records, ["en"])] == [("b", 0)]


def test_limit_takes_whole_conversations_chosen_by_seed():
    records = [rec(c, t) for c in "abcdefgh" for t in range(3)]
    chosen = select_records(records, limit=7, seed=1)
    assert len(chosen) == 7
    convs = list(dict.fromkeys(r.conversation_id for r in chosen))
    assert len(convs) == 3
    # whole conversations, the last one cut to its first turn(s): never a gap in the middle
    assert [r.turn for r in chosen] == [0, 1, 2, 0, 1, 2, 0]
    assert select_records(records, limit=7, seed=1) == chosen  # seeded: repeatable
    others = {
        tuple(r.conversation_id for r in select_records(records, limit=7, seed=s))
        for s in range(10)
    }
    assert len(others) > 1  # the seed does choose
    assert select_records(records, limit=0) == []


def test_log_times_from_timestamps_never_go_backwards_in_a_conversation():
    records = [rec("a", 0, ts=10_000), rec("a", 1, ts=9_000), rec("b", 0, ts=11_500)]
    assert log_times(records) == [0.0, 0.0, 1500.0]


def test_log_times_without_timestamps_stagger_conversations():
    records = [rec("a", 0), rec("a", 1), rec("a", 2), rec("b", 0), rec("b", 1)]
    gap = DEFAULT_TURN_GAP_MS
    assert log_times(records) == [0.0, gap, 2 * gap, gap / 2, gap / 2 + gap]
    # one record without a timestamp makes the whole selection use the synthetic clock
    mixed = [rec("a", 0, ts=5), rec("a", 1)]
    assert log_times(mixed) == [0.0, gap]


def test_speed_scales_the_log_time():
    records = [rec("a", 0, ts=0), rec("a", 1, ts=4000), rec("b", 0, ts=1000)]
    at_2x = schedule(records, speed=2.0)
    assert [(p.record.conversation_id, p.record.turn, p.scheduled_ms) for p in at_2x] == [
        ("a", 0, 0.0),
        ("b", 0, 500.0),
        ("a", 1, 2000.0),
    ]
    default = schedule(records)
    assert [p.scheduled_ms for p in default] == [0.0, 1000.0, 4000.0]


def test_rate_is_open_loop_in_log_time_order():
    records = [rec("a", 0, ts=0), rec("a", 1, ts=60_000), rec("b", 0, ts=30_000)]
    planned = schedule(records, rate=4.0)
    assert [(p.record.conversation_id, p.record.turn, p.scheduled_ms) for p in planned] == [
        ("a", 0, 0.0),
        ("b", 0, 250.0),
        ("a", 1, 500.0),
    ]
    assert [p.index for p in planned] == [0, 2, 1]  # index: position in the selection


def test_schedule_rejects_bad_pacing():
    with pytest.raises(ValueError, match="not both"):
        schedule([rec("a", 0)], speed=1.0, rate=1.0)
    with pytest.raises(ValueError):
        schedule([rec("a", 0)], speed=0)
    with pytest.raises(ValueError):
        schedule([rec("a", 0)], rate=-1)


def _drain(pacer: Pacer, until_ms: float, step_ms: float = 10.0) -> list[tuple[str, int, float]]:
    """Run the pacer on a simulated clock, sending whatever is due; (conv, turn, sent)."""
    sent = []
    now = 0.0
    while now <= until_ms and not pacer.done():
        for planned, _due in pacer.due(now):
            pacer.mark_sent(planned, now)
            sent.append((planned.record.conversation_id, planned.record.turn, now))
        now += step_ms
    return sent


def test_pacer_keeps_turn_order_even_when_behind_schedule():
    # all due at once (a rate far beyond what is sent): still one turn of a conversation per
    # round, each after the previous one was sent
    records = [rec(c, t) for c in "ab" for t in range(4)]
    pacer = Pacer(schedule(records, rate=1e6))
    sent = _drain(pacer, 1000)
    for conv in "ab":
        mine = [(t, s) for c, t, s in sent if c == conv]
        assert [t for t, _ in mine] == [0, 1, 2, 3]
        assert all(a[1] < b[1] for a, b in zip(mine, mine[1:], strict=False))


def test_pacer_hands_out_nothing_before_it_is_due_and_shifts():
    pacer = Pacer(schedule([rec("a", 0, ts=0), rec("a", 1, ts=1000)]), shift_ms=500)
    assert pacer.due(499) == []
    assert pacer.next_due_ms() == 500
    [(first, due)] = pacer.due(500)
    assert due == 500 and first.record.turn == 0
    assert pacer.due(2000) == []  # turn 1 waits until turn 0 is marked sent
    pacer.mark_sent(first, 501)
    [(second, due)] = pacer.due(2000)
    assert (second.record.turn, due) == (1, 1500)


def test_closed_loop_waits_for_every_arm_then_times_out():
    planned = schedule([rec("a", 0), rec("a", 1), rec("a", 2)], rate=1000.0)
    pacer = Pacer(planned, closed_loop=True, closed_loop_timeout_ms=5000)
    [(t0, _)] = pacer.due(0)
    pacer.mark_sent(t0, 0)
    assert pacer.due(3000) == []  # turn 0 not answered yet
    pacer.mark_answered(t0.index, 3200)
    [(t1, due)] = pacer.due(3200)
    assert due == 3200  # effective schedule: the answer's time
    pacer.mark_sent(t1, 3201)
    assert pacer.next_due_ms() == 3201 + 5000  # no answer: released after the timeout
    [(t2, _)] = pacer.due(8201)
    pacer.mark_sent(t2, 8201)
    assert pacer.closed_loop_timeouts == 1 and pacer.done()


def test_marking_out_of_order_is_refused():
    planned = schedule([rec("a", 0), rec("a", 1)], rate=10.0)
    pacer = Pacer(planned)
    with pytest.raises(ValueError, match="out of order"):
        pacer.mark_sent(planned[1], 0)
