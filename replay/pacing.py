"""What the replay job sends and when: selection, the schedule, and conversation order.

Pure logic (no Kafka, no clock of its own: every function takes `now_ms`), so the rules are
tested without a broker.

- **Selection** (`select_records`): keep the records whose target language is one of the run's
  languages, group them by conversation (in log order, each sorted by turn), and with a
  `limit` take whole conversations in an order shuffled by `seed` until `limit` turns are taken
  (the last one cut to its first turns, so a limit is exact and a conversation is never missing
  a middle turn).
- **Log time** (`log_times`): the log's own timestamps, relative to the earliest, when every
  selected record has one; otherwise a synthetic clock: `DEFAULT_TURN_GAP_MS` (2 s) of log time
  per turn, the n conversations' starts spread evenly over one gap (conversation i starts at
  i * gap / n), so a log without timestamps replays as a steady stream of n / 2 turns per second
  at speed 1 instead of bursts. Within a conversation log time never goes backwards.
- **Schedule** (`schedule`): with `speed` X, a turn is due at its log time / X (GoReplay's
  `200%` is X = 2); with `rate` R (open loop), the turns are due every 1000 / R ms in log-time
  order. Either way the turns of one conversation are due in turn order.
- **Order** (`Pacer`): a turn is handed out only after the previous turn of its conversation
  was sent, and, closed loop, only once every arm answered it (then it is due at
  max(its schedule, that answer)); a previous turn still unanswered after `closed_loop_timeout_ms`
  releases the next one anyway (counted), so a dead arm cannot stall the run.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from replay.logs import ReplayRecord

DEFAULT_TURN_GAP_MS = 2000.0  # log time per turn for logs without timestamps


@dataclass(frozen=True, slots=True)
class Planned:
    """One record of the run with its place in the schedule."""

    index: int  # position in the selection (the request id is derived from it)
    record: ReplayRecord
    log_ms: float  # log time, ms after the earliest selected turn
    scheduled_ms: float  # when it is due, ms after the schedule's start


def group_conversations(records: Iterable[ReplayRecord]) -> list[list[ReplayRecord]]:
    """Conversations in order of first appearance, each sorted by turn."""
    groups: dict[str, list[ReplayRecord]] = {}
    for record in records:
        groups.setdefault(record.conversation_id, []).append(record)
    return [sorted(turns, key=lambda r: r.turn) for turns in groups.values()]


def select_records(
    records: Iterable[ReplayRecord],
    languages: Sequence[str] | None = None,
    limit: int | None = None,
    seed: int = 0,
) -> list[ReplayRecord]:
    """The records a run replays, grouped by conversation (see the module notes)."""
    wanted = set(languages) if languages else None
    kept = [r for r in records if wanted is None or r.target_lang in wanted]
    conversations = group_conversations(kept)
    if limit is None:
        return [r for conv in conversations for r in conv]
    if limit < 0:
        raise ValueError(f"limit must be >= 0, not {limit}")
    random.Random(seed).shuffle(conversations)
    out: list[ReplayRecord] = []
    for conv in conversations:
        if len(out) >= limit:
            break
        out.extend(conv[: limit - len(out)])
    return out


def log_times(
    records: Sequence[ReplayRecord], turn_gap_ms: float = DEFAULT_TURN_GAP_MS
) -> list[float]:
    """Log time (ms) of each record of a selection (grouped by conversation, in turn order)."""
    if not records:
        return []
    conversations = list(dict.fromkeys(r.conversation_id for r in records))
    if all(r.timestamp_ms is not None for r in records):
        start = min(r.timestamp_ms for r in records if r.timestamp_ms is not None)
        raw = [float((r.timestamp_ms or 0) - start) for r in records]
    else:
        offset = {c: i * turn_gap_ms / len(conversations) for i, c in enumerate(conversations)}
        position: dict[str, int] = {}
        raw = []
        for r in records:
            k = position.get(r.conversation_id, 0)
            position[r.conversation_id] = k + 1
            raw.append(offset[r.conversation_id] + k * turn_gap_ms)
    # never backwards within a conversation (a log whose clock jumps back keeps turn order)
    latest: dict[str, float] = {}
    out = []
    for r, t in zip(records, raw, strict=True):
        t = max(t, latest.get(r.conversation_id, t))
        latest[r.conversation_id] = t
        out.append(t)
    first = min(out)
    return [t - first for t in out]  # the schedule starts at 0


def schedule(
    records: Sequence[ReplayRecord],
    *,
    speed: float | None = None,
    rate: float | None = None,
    turn_gap_ms: float = DEFAULT_TURN_GAP_MS,
) -> list[Planned]:
    """The selection with due times, sorted by due time (ties in selection order, so a
    conversation's turns stay in turn order)."""
    if speed is not None and rate is not None:
        raise ValueError("give --speed or --rate, not both")
    if speed is not None and speed <= 0:
        raise ValueError(f"speed must be > 0, not {speed}")
    if rate is not None and rate <= 0:
        raise ValueError(f"rate must be > 0, not {rate}")
    times = log_times(records, turn_gap_ms)
    by_log_time = sorted(range(len(records)), key=lambda i: (times[i], i))
    if rate is not None:
        due = {i: rank * 1000.0 / rate for rank, i in enumerate(by_log_time)}
    else:
        factor = speed if speed is not None else 1.0
        due = {i: times[i] / factor for i in range(len(records))}
    planned = [Planned(i, records[i], times[i], due[i]) for i in by_log_time]
    return sorted(planned, key=lambda p: (p.scheduled_ms, p.index))


class Pacer:
    """Hands out the planned turns when they are due, one conversation turn after the other.

    The caller sends what `due(now_ms)` returns, in that order, and calls `mark_sent`;
    closed loop, it calls `mark_answered` once every arm answered a turn. `shift_ms` moves
    the whole schedule (a resumed run starts its remaining turns now)."""

    def __init__(
        self,
        planned: Iterable[Planned],
        *,
        closed_loop: bool = False,
        closed_loop_timeout_ms: float = 120_000.0,
        shift_ms: float = 0.0,
    ) -> None:
        self.closed_loop = closed_loop
        self.closed_loop_timeout_ms = closed_loop_timeout_ms
        self.shift_ms = shift_ms
        self._queues: dict[str, deque[Planned]] = {}
        for p in sorted(planned, key=lambda p: (p.scheduled_ms, p.index)):
            self._queues.setdefault(p.record.conversation_id, deque()).append(p)
        self._waiting_on: dict[str, tuple[int, float]] = {}  # conv -> (index, sent_ms)
        self._answered_at: dict[int, float] = {}
        self._in_flight: set[str] = set()  # conversations whose head was handed out, not sent
        self.closed_loop_timeouts = 0

    def remaining(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def done(self) -> bool:
        return not self._queues

    def _eligible_ms(self, conv: str, head: Planned) -> float | None:
        """When the conversation's next turn may go (None: not before an answer)."""
        if conv in self._in_flight:
            return None
        due = head.scheduled_ms + self.shift_ms
        waiting = self._waiting_on.get(conv)
        if not self.closed_loop or waiting is None:
            return due
        index, sent_ms = waiting
        answered = self._answered_at.get(index)
        if answered is not None:
            return max(due, answered)
        return max(due, sent_ms + self.closed_loop_timeout_ms)

    def next_due_ms(self) -> float | None:
        """The earliest time something may be due (None: nothing left, or all in flight)."""
        times = [
            t
            for conv, queue in self._queues.items()
            if (t := self._eligible_ms(conv, queue[0])) is not None
        ]
        return min(times) if times else None

    def due(self, now_ms: float) -> list[tuple[Planned, float]]:
        """The turns to send now, each with the time it was due (its effective schedule),
        earliest first; at most one per conversation."""
        ready = []
        for conv, queue in self._queues.items():
            t = self._eligible_ms(conv, queue[0])
            if t is not None and t <= now_ms:
                ready.append((queue[0], t))
        ready.sort(key=lambda pair: (pair[1], pair[0].index))
        for planned, _ in ready:
            self._in_flight.add(planned.record.conversation_id)
        return ready

    def mark_sent(self, planned: Planned, sent_ms: float) -> None:
        conv = planned.record.conversation_id
        queue = self._queues[conv]
        if queue[0] is not planned:
            raise ValueError(f"turn {planned.record.turn} of {conv!r} sent out of order")
        waiting = self._waiting_on.get(conv)
        if self.closed_loop and waiting is not None and waiting[0] not in self._answered_at:
            self.closed_loop_timeouts += 1
        queue.popleft()
        self._in_flight.discard(conv)
        self._waiting_on[conv] = (planned.index, sent_ms)
        if not queue:
            del self._queues[conv]

    def mark_answered(self, index: int, now_ms: float) -> None:
        self._answered_at.setdefault(index, now_ms)
