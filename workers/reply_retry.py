"""What the worker's reply path does with a produce that failed: classify it, wait, try again.

`workers.reply_publisher.ReplyPublisher` produces replies and dead letters; this module holds
the pieces of its failure handling that do not depend on how an answer is built:

* `Outgoing`: one record the publisher has to get delivered (a reply or a dead letter), with
  its failed attempts so far and, for a poison request, the answer sent once it is delivered;
* `error_code()`, the KafkaError code inside a raised `KafkaException` (the codes no retry
  can fix are `workers.kafka_config.PERMANENT_PRODUCE_CODES`, shared with the client);
* `retry_delay_s()`: the wait before producing again, 0.5 s doubling up to 30 s;
* `slim_down()`: a dead letter the topic refused as too large, rebuilt without the original
  bytes;
* `RetryQueue`: the entries waiting for another produce, ordered by when they are due (equal
  due times keep their order), and those that failed at least once and are not delivered yet
  (`tolk_reply_retry_pending`). The publisher decides what goes on it and when an entry is
  settled (delivered, or a reply given up for a dead letter); the worker's loop serves it
  through `ReplyPublisher.retry_due()`.

Threads: none of its own; everything runs on the worker's poll thread, like the publisher.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from workers.metrics import WorkerMetrics
from workers.records import ConsumedRecord
from workers.replies import dead_letter_value
from workers.tracing import RequestTrace

__all__ = [
    "Outgoing",
    "RetryQueue",
    "error_code",
    "retry_delay_s",
    "slim_down",
]

RETRY_FIRST_DELAY_S = 0.5  # the wait after the first failure; doubled after each one more
RETRY_MAX_DELAY_S = 30.0
_DEAD_LETTER_DETAIL_CHARS = 1000  # the exception text kept on a slimmed-down dead letter


def retry_delay_s(failures: int) -> float:
    """The wait before producing again after `failures` failed attempts (1, 2, ...): 0.5 s,
    doubling, at most 30 s."""
    return min(RETRY_MAX_DELAY_S, RETRY_FIRST_DELAY_S * 2.0 ** min(max(failures, 1) - 1, 16))


def error_code(exc: BaseException) -> int | None:
    """The KafkaError code inside a KafkaException (None for any other exception)."""
    err = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    return err.code() if isinstance(err, KafkaError) else None


@dataclass(eq=False, slots=True)
class Outgoing:
    """One record the publisher has to get delivered: a reply or a dead letter."""

    kind: str  # "reply" | "dead_letter" (the label of tolk_reply_retries_total)
    rec: ConsumedRecord  # the consumed record it answers
    topic: str
    key: bytes | None
    value: bytes
    store: bool = False  # a reply: store it in the results store once delivered
    failures: int = 0  # failed attempts so far (a full local queue does not count)
    reason: str = ""  # a dead letter: why (its `reason` field) ...
    detail: str = ""  # ... and the exception's text
    slim: bool = False  # a dead letter already sent without the original bytes
    then: Outgoing | None = None  # sent once this one is delivered; the offset waits for it
    headers: list[tuple[str, bytes]] | None = None  # a reply's traceparent (tracing on)
    trace: tuple[Any, RequestTrace] | None = None  # its open request span, ended on delivery
    finished_at: float | None = None  # a stored engine reply: monotonic time the engine finished


def slim_down(entry: Outgoing, error: str, now_ms: int) -> None:
    """Rebuild a dead letter the topic refused as too large without the original bytes
    (topic, partition and offset on it still say where they are)."""
    rec = entry.rec
    note = f"original of {len(rec.value)} bytes left out: dead letter too large ({error})"
    slim = ConsumedRecord(rec.tp, rec.offset, rec.key, b"", rec.lang, rec.broker_ts_ms)
    detail = entry.detail[:_DEAD_LETTER_DETAIL_CHARS]
    entry.value = dead_letter_value(slim, entry.reason, f"{detail}; {note}", now_ms)
    entry.slim = True


class RetryQueue:
    """Failed replies and dead letters waiting for another produce, by due time; keeps the
    `tolk_reply_retry_pending` gauge at the number not delivered yet."""

    def __init__(self, metrics: WorkerMetrics, monotonic: Callable[[], float]) -> None:
        self._metrics = metrics
        self._monotonic = monotonic  # the queue's clock (that of `pop_due`'s argument)
        self._heap: list[tuple[float, int, Outgoing]] = []  # (due, seq, what)
        self._seq = 0  # tie-breaker: equal due times keep their order
        self._retrying: set[Outgoing] = set()  # failed at least once, not delivered yet

    def __len__(self) -> int:
        """Entries that failed at least once and are not settled yet."""
        return len(self._retrying)

    def next_due(self) -> float | None:
        """When (on the monotonic clock) the earliest queued entry is due; None if none is."""
        return self._heap[0][0] if self._heap else None

    def schedule(self, entry: Outgoing) -> None:
        """Queue `entry` for a produce `retry_delay_s(entry.failures)` from now."""
        self._retrying.add(entry)
        self._update_gauge()
        due = self._monotonic() + retry_delay_s(entry.failures)
        self._seq += 1
        heapq.heappush(self._heap, (due, self._seq, entry))

    def pop_due(self, now_monotonic: float) -> list[Outgoing]:
        """Take every entry due at `now_monotonic` off the queue, earliest first (they count
        as pending until `settle`d)."""
        due: list[Outgoing] = []
        while self._heap and self._heap[0][0] <= now_monotonic:
            due.append(heapq.heappop(self._heap)[2])
        return due

    def settle(self, entry: Outgoing) -> None:
        """`entry` needs no more retries (delivered, or given up): no longer pending."""
        self._retrying.discard(entry)
        self._update_gauge()

    def _update_gauge(self) -> None:
        self._metrics.reply_retry_pending.set(len(self._retrying))
