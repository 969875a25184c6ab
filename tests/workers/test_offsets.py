"""OffsetTracker: exact commit points under out-of-order completion, gaps and revocation."""

from __future__ import annotations

import pytest

from workers.kafka.offsets import OffsetTracker

TP = ("tolk.requests.de", 0)
TP2 = ("tolk.requests.de", 1)


def tracker(*tps: tuple[str, int]) -> OffsetTracker:
    t = OffsetTracker()
    t.assign(tps or [TP])
    return t


def test_nothing_handed_nothing_to_commit() -> None:
    assert tracker().committable() == {}


def test_in_order_completion_commits_next_offset() -> None:
    t = tracker()
    for o in range(3):
        assert t.track(TP, o)
    assert t.committable() == {TP: 0}  # nothing done: the head itself
    t.done(TP, 0)
    assert t.committable() == {TP: 1}
    t.done(TP, 1)
    t.done(TP, 2)
    assert t.committable() == {TP: 3}


def test_out_of_order_completion_waits_for_the_lowest() -> None:
    t = tracker()
    for o in range(5):
        t.track(TP, o)
    t.mark_committed({TP: 0})
    assert t.done(TP, 3)
    assert t.done(TP, 1)
    assert t.committable() == {}  # 0 still pending: commit point unchanged since last commit
    assert t.done(TP, 0)
    assert t.committable() == {TP: 2}  # 0, 1 done; 2 pending
    assert t.done(TP, 2)
    assert t.committable() == {TP: 4}  # 3 was already done
    assert t.done(TP, 4)
    assert t.committable() == {TP: 5}
    assert t.pending(TP) == 0


def test_gaps_in_offsets_are_not_waited_for() -> None:
    # offsets 11 and 12 are transaction markers / compacted away: never handed
    t = tracker()
    for o in (10, 13, 14):
        t.track(TP, o)
    t.done(TP, 13)
    assert t.committable() == {TP: 10}
    t.done(TP, 10)
    assert t.committable() == {TP: 14}
    t.done(TP, 14)
    assert t.committable() == {TP: 15}
    assert not t.done(TP, 11)  # never handed: ignored


def test_only_partitions_that_advanced_since_last_commit() -> None:
    t = tracker(TP, TP2)
    t.track(TP, 0)
    t.track(TP2, 0)
    t.done(TP, 0)
    t.done(TP2, 0)
    assert t.committable() == {TP: 1, TP2: 1}
    t.mark_committed({TP: 1, TP2: 1})
    assert t.committable() == {}
    t.track(TP2, 1)
    t.done(TP2, 1)
    assert t.committable() == {TP2: 2}


def test_done_twice_or_unknown_is_ignored() -> None:
    t = tracker()
    t.track(TP, 0)
    t.track(TP, 1)
    assert t.done(TP, 1)
    assert not t.done(TP, 1)
    assert not t.done(TP, 7)
    assert t.done(TP, 0)
    assert not t.done(TP, 0)
    assert t.committable() == {TP: 2}


def test_revoke_drops_state_and_ignores_late_completions() -> None:
    t = tracker(TP, TP2)
    t.track(TP, 5)
    t.track(TP2, 9)
    t.revoke([TP])
    assert not t.done(TP, 5)
    assert not t.track(TP, 6)  # not assigned any more
    t.done(TP2, 9)
    assert t.committable() == {TP2: 10}
    assert t.assigned() == frozenset({TP2})
    t.mark_committed({TP: 6})  # ignored for a revoked partition
    # reassigned later: starts clean, from whatever the consumer delivers next
    t.assign([TP])
    assert TP not in t.committable()
    t.track(TP, 5)
    assert t.committable()[TP] == 5


def test_assign_keeps_existing_state() -> None:
    t = tracker()
    t.track(TP, 3)
    t.assign([TP])
    assert t.committable() == {TP: 3}


def test_consumer_going_back_restarts_the_partition() -> None:
    t = tracker()
    for o in (4, 5, 6):
        t.track(TP, o)
    t.done(TP, 4)
    t.mark_committed({TP: 5})
    t.track(TP, 2)  # a seek back: 2.. will be processed again
    assert t.committable() == {TP: 2}
    assert not t.done(TP, 5)  # pre-seek offsets are no longer tracked
    t.done(TP, 2)
    assert t.committable() == {TP: 3}


def test_pending_counts() -> None:
    t = tracker(TP, TP2)
    for o in range(4):
        t.track(TP, o)
    t.track(TP2, 0)
    t.done(TP, 2)
    assert t.pending(TP) == 3
    assert t.total_pending() == 4
    assert t.pending(("other", 0)) == 0


def test_negative_offset_rejected() -> None:
    with pytest.raises(ValueError):
        tracker().track(TP, -1)


def test_each_assignment_is_a_new_generation_kept_across_a_seek_back() -> None:
    t = tracker(TP, TP2)
    first, other = t.generation(TP), t.generation(TP2)
    assert first is not None and other is not None and first != other
    t.assign([TP])  # already assigned: same generation
    assert t.generation(TP) == first
    t.track(TP, 5)
    t.track(TP, 2)  # the consumer went back: the state restarts, the assignment does not
    assert t.generation(TP) == first
    t.revoke([TP])
    assert t.generation(TP) is None
    t.assign([TP])
    again = t.generation(TP)
    assert again is not None and again > max(first, other)


def test_revoke_remembers_the_last_committed_offset() -> None:
    t = tracker(TP, TP2)
    for o in range(4):
        t.track(TP, o)
    t.done(TP, 0)
    t.done(TP, 1)
    t.mark_committed(t.committable())  # committed up to 2
    t.revoke([TP, TP2])
    assert t.committed_when_revoked(TP) == 2
    assert t.committed_when_revoked(TP2) is None  # nothing committed in that assignment
    t.assign([TP])
    assert t.committed_when_revoked(TP) is None  # assigned again: its own state counts
