"""Which offset each partition may commit, when records finish out of order.

The worker hands many records of one partition to the engine at once and they finish in any
order (a short sentence overtakes a long one). Kafka keeps one committed offset per partition,
meaning "everything below this is done; read from here on restart". So the offset to commit is
the lowest offset handed to processing and not yet done; while every handed offset is done, it
is the last handed offset + 1.

Offsets are not contiguous (compaction, transaction markers), so the tracker never assumes
`offset + 1` is the next record: it only knows the offsets it was given, in the order the
consumer delivered them. A record that was never handed (e.g. skipped during shutdown) lies at
or above the commit point, so it is read again after a restart.

Assignment generations: every `assign()` of a partition gives it a new generation number
(increasing over the tracker's life), so a record taken under one assignment can be told apart
from the same partition assigned again later (`generation()`); `revoke()` remembers the last
committed offset of the partitions it forgets (`committed_when_revoked()`), so the worker can
tell whether an in-flight record of a revoked partition was committed already.

Pure bookkeeping: no Kafka imports, not thread-safe (the worker's poll thread owns it; delivery
callbacks run on that thread inside `producer.poll()`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["OffsetTracker", "TopicPartitionKey"]

TopicPartitionKey = tuple[str, int]  # (topic, partition)


@dataclass(slots=True)
class _PartitionState:
    pending: deque[int] = field(default_factory=deque)  # handed offsets, ascending, head not done
    done_ahead: set[int] = field(default_factory=set)  # done offsets still behind a pending head
    next_offset: int | None = None  # last handed offset + 1 (None: nothing handed yet)
    committed: int | None = None  # what we last committed (None: nothing this assignment)
    generation: int = 0  # which assignment of the partition this state belongs to

    def commit_point(self) -> int | None:
        if self.pending:
            return self.pending[0]
        return self.next_offset


class OffsetTracker:
    """Per (topic, partition): offsets handed to processing, offsets done, the commit point."""

    def __init__(self) -> None:
        self._parts: dict[TopicPartitionKey, _PartitionState] = {}
        self._generations = 0  # assignments so far (the last generation handed out)
        self._revoked_committed: dict[TopicPartitionKey, int | None] = {}

    # -- assignment ---------------------------------------------------------------------------

    def assign(self, partitions: Iterable[TopicPartitionKey]) -> None:
        """Start tracking these partitions (already tracked ones keep their state)."""
        for tp in partitions:
            if tp not in self._parts:
                self._generations += 1
                self._parts[tp] = _PartitionState(generation=self._generations)
                self._revoked_committed.pop(tp, None)

    def revoke(self, partitions: Iterable[TopicPartitionKey]) -> None:
        """Forget these partitions: their late completions are ignored from now on."""
        for tp in partitions:
            state = self._parts.pop(tp, None)
            if state is not None:
                self._revoked_committed[tp] = state.committed

    def generation(self, tp: TopicPartitionKey) -> int | None:
        """The current assignment generation of `tp` (None: not assigned)."""
        state = self._parts.get(tp)
        return None if state is None else state.generation

    def committed_when_revoked(self, tp: TopicPartitionKey) -> int | None:
        """The offset last committed for `tp` before it was revoked (None: unknown)."""
        return self._revoked_committed.get(tp)

    def assigned(self) -> frozenset[TopicPartitionKey]:
        return frozenset(self._parts)

    # -- records ------------------------------------------------------------------------------

    def track(self, tp: TopicPartitionKey, offset: int) -> bool:
        """Record that `offset` was handed to processing. Offsets must arrive in increasing order
        per partition. An offset at or below the last one handed means the consumer went back
        (a seek or a re-fetch): the partition's state restarts from it, so nothing below is
        committed as done that was not. Returns False when the partition is not assigned.
        """
        state = self._parts.get(tp)
        if state is None:
            return False
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset!r}")
        if state.next_offset is not None and offset < state.next_offset:
            state = _PartitionState(committed=state.committed, generation=state.generation)
            self._parts[tp] = state
        state.pending.append(offset)
        state.next_offset = offset + 1
        return True

    def done(self, tp: TopicPartitionKey, offset: int) -> bool:
        """Mark a handed offset done. Returns False (and changes nothing) when the partition is
        not assigned any more, or the offset is not pending (never handed, or already done)."""
        state = self._parts.get(tp)
        if state is None or not state.pending or offset < state.pending[0]:
            return False
        if offset >= (state.next_offset or 0) or offset in state.done_ahead:
            return False
        if offset == state.pending[0]:
            state.pending.popleft()
            while state.pending and state.pending[0] in state.done_ahead:
                state.done_ahead.discard(state.pending.popleft())
            return True
        # Not the head: it must be one of the pending offsets (they are ascending, so a miss is
        # an offset that was never handed, e.g. a gap). Bisecting a deque is O(n); the common
        # case is a membership test over a short window, so keep it simple.
        if offset not in state.pending:
            return False
        state.done_ahead.add(offset)
        return True

    # -- committing ---------------------------------------------------------------------------

    def committable(self) -> dict[TopicPartitionKey, int]:
        """Next offset to commit per partition, only where it moved since the last commit."""
        out: dict[TopicPartitionKey, int] = {}
        for tp, state in self._parts.items():
            point = state.commit_point()
            if point is not None and point != state.committed:
                out[tp] = point
        return out

    def mark_committed(self, offsets: Mapping[TopicPartitionKey, int]) -> None:
        """The broker accepted these commits (ignored for partitions no longer assigned)."""
        for tp, offset in offsets.items():
            state = self._parts.get(tp)
            if state is not None:
                state.committed = offset

    # -- introspection ------------------------------------------------------------------------

    def pending(self, tp: TopicPartitionKey) -> int:
        """Handed offsets of `tp` not yet done (0 when not assigned)."""
        state = self._parts.get(tp)
        if state is None:
            return 0
        return len(state.pending) - len(state.done_ahead)

    def total_pending(self) -> int:
        return sum(self.pending(tp) for tp in self._parts)
