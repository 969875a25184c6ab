"""Getting the worker's replies and dead letters delivered: produce, classify a failure, wait,
try again.

`workers.kafka.reply_publisher.ReplyPublisher` decides what to answer and what a delivery means
(store the reply, mark the offset done); this module gets each `Outgoing` entry delivered,
independent of how an answer is built (`Deliveries`).

librdkafka already retries a produce inside the producer until `message.timeout.ms`
(`Settings.delivery_timeout_ms`, 30 s); a delivery report with an error means that time is
spent. What happens then:

* A reply that failed for good (`topics.cluster.PERMANENT_PRODUCE_CODES`: the reply
  topic is missing or not ours to write, the record is too large, the request is invalid)
  becomes a dead letter at once (a missing topic also drops it from the `ReplyTopicChecker`
  cache).
* Any other failure of a reply (timeout, NOT_ENOUGH_REPLICAS, throttling, brokers down, a
  produce() that raised) puts it on the retry queue (`RetryQueue`): produced again after
  `retry_delay_s()` (0.5 s doubling up to 30 s). After `reply_attempts` failed deliveries it
  becomes a dead letter.
* A dead letter whose delivery fails (or whose produce() raises) is retried the same way, with
  no bound: its offset stays pending, so its partition's commit point stays behind it while the
  records after it keep being answered. One too large for the dead-letter topic goes out again
  at once without the original bytes (topic, partition and offset still point at them).
* The local queue full (`BufferError`): a first produce waits it out by serving delivery
  reports for up to `QUEUE_FULL_ATTEMPTS` x 0.1 s; if it stays full the record goes on the
  retry queue (never dead-lettered for that, and without spending one of its attempts), and
  until a produce succeeds again later records go straight there instead of stalling the poll
  loop.

What an operator sees while the dead-letter topic is unavailable (deleted, no leader, no ACL):
`tolk_reply_retry_pending` stays above 0, `tolk_reply_retries_total{kind="dead_letter"}` and
`tolk_worker_errors_total{reason="dead_letter_failed"}` rise, an ERROR log line per failed try
("dead letter ... not delivered (try N), retrying in S s"), and the partition's consumer lag
grows because its committed offset stays at the oldest undelivered dead letter. Nothing is
lost: once the topic is back the dead letters go out and the commits move on. A worker stopped
meanwhile leaves those offsets uncommitted; their records are read again by the next owner.

The worker serves the queue with `ReplyPublisher.retry_due(time.monotonic())` once per loop
iteration. The pieces:

* `Outgoing`: one record the publisher has to get delivered (a reply or a dead letter), with
  its failed attempts so far and, for a poison request, the answer sent once it is delivered;
* `error_code()`, the KafkaError code inside a raised `KafkaException` (the codes no retry
  can fix are `topics.cluster.PERMANENT_PRODUCE_CODES`, shared with the client);
* `retry_delay_s()`: the wait before producing again, 0.5 s doubling up to 30 s;
* `slim_down()`: a dead letter the topic refused as too large, rebuilt without the original
  bytes;
* `RetryQueue`: the entries waiting for another produce, ordered by when they are due (equal
  due times keep their order), and those that failed at least once and are not delivered yet
  (`tolk_reply_retry_pending`); an entry is settled when delivered, or a reply given up for a
  dead letter;
* `Deliveries`: produces entries with the worker's producer, and on each outcome calls back
  the publisher (`DeliveryOutcomes`: delivered, reply given up, reply topic missing).

Threads: none of its own; everything runs on the worker's poll thread, like the publisher.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from confluent_kafka import KafkaError, KafkaException

from topics.cluster import MISSING_TOPIC_CODES, PERMANENT_PRODUCE_CODES, TOO_LARGE_CODES
from workers.kafka.records import ConsumedRecord
from workers.kafka.replies import dead_letter_value
from workers.metrics import WorkerMetrics
from workers.tracing import RequestTrace

__all__ = [
    "QUEUE_FULL_ATTEMPTS",
    "Deliveries",
    "DeliveryOutcomes",
    "Outgoing",
    "RetryQueue",
    "error_code",
    "retry_delay_s",
    "slim_down",
]

log = logging.getLogger(__name__)

# Produce attempts of a first produce while the producer's local queue stays full (each waits
# up to 0.1 s serving delivery reports); past them the record goes on the retry queue.
QUEUE_FULL_ATTEMPTS = 20
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


class DeliveryOutcomes(Protocol):
    """What `Deliveries` reports back (the `ReplyPublisher`)."""

    def delivered(self, entry: Outgoing) -> None: ...

    def reply_given_up(self, entry: Outgoing, reason: str, why: str) -> None: ...

    def reply_topic_missing(self, topic: str) -> None: ...


class Deliveries:
    """Produces `Outgoing` entries and retries the failed ones (module notes); every outcome
    goes to `outcomes`. Poll thread only (delivery callbacks are served from `poll()`)."""

    def __init__(
        self,
        outcomes: DeliveryOutcomes,
        metrics: WorkerMetrics,
        *,
        reply_attempts: int,
        clock_ms: Callable[[], int],
        monotonic: Callable[[], float],
    ) -> None:
        self._outcomes = outcomes
        self._metrics = metrics
        self._reply_attempts = reply_attempts
        self._now_ms = clock_ms
        self.queue = RetryQueue(metrics, monotonic)
        self._producer: Any = None
        self._queue_full = False  # the last produce found the local queue full for good

    def attach(self, producer: Any) -> None:
        """Use `producer` (a confluent-kafka `Producer`, idempotent) from now on."""
        self._producer = producer

    def retry_due(self, now_monotonic: float) -> int:
        """Produce again every queued entry due at `now_monotonic`; returns how many."""
        due = self.queue.pop_due(now_monotonic)
        for entry in due:
            self._metrics.reply_retries_total.labels(kind=entry.kind).inc()
            self.send(entry, queue_full_attempts=1)
        return len(due)

    def send(self, entry: Outgoing, queue_full_attempts: int = QUEUE_FULL_ATTEMPTS) -> None:
        """Produce `entry`; its outcome arrives in `delivered` or `_failed`."""

        def on_delivery(err: KafkaError | None, _msg: Any) -> None:
            if err is None:
                self.queue.settle(entry)
                self._outcomes.delivered(entry)
            else:
                self._failed(entry, err.code(), str(err))

        try:
            self._produce(entry, on_delivery, 1 if self._queue_full else queue_full_attempts)
        except Exception as exc:
            code = error_code(exc)
            if code == KafkaError._QUEUE_FULL:
                self.queue.schedule(entry)  # a full local queue is not an attempt
            else:
                self._failed(entry, code, repr(exc))

    def _failed(self, entry: Outgoing, code: int | None, error: str) -> None:
        """A produce of `entry` raised (`code` None for a non-Kafka exception) or its delivery
        failed: retry it, give the reply up for a dead letter, or (a dead letter too large)
        slim it down."""
        entry.failures += 1
        rec = entry.rec
        if entry.kind == "reply":
            why = f"reply to {entry.topic!r} failed: {error}"
            if code in MISSING_TOPIC_CODES:
                self._outcomes.reply_topic_missing(entry.topic)
                self._give_up(entry, "reply_topic_missing", why)
            elif code in PERMANENT_PRODUCE_CODES:
                self._give_up(entry, "reply_undeliverable", why)
            elif entry.failures >= self._reply_attempts:
                why = f"reply to {entry.topic!r} failed after {entry.failures} attempts: {error}"
                self._give_up(entry, "reply_undeliverable", why)
            else:
                log.warning(
                    "reply for %s@%d not delivered (try %d of %d): %s",
                    rec.tp,
                    rec.offset,
                    entry.failures,
                    self._reply_attempts,
                    error,
                )
                self.queue.schedule(entry)
            return
        self._metrics.errors_total.labels(lang=rec.lang, reason="dead_letter_failed").inc()
        if code in TOO_LARGE_CODES and not entry.slim:
            slim_down(entry, error, self._now_ms())
            self.send(entry)
            return
        log.error(
            "dead letter for %s@%d not delivered (try %d), retrying in %.1f s: %s",
            rec.tp,
            rec.offset,
            entry.failures,
            retry_delay_s(entry.failures),
            error,
        )
        self.queue.schedule(entry)

    def _give_up(self, entry: Outgoing, reason: str, why: str) -> None:
        self.queue.settle(entry)
        self._outcomes.reply_given_up(entry, reason, why)

    def _produce(
        self,
        entry: Outgoing,
        on_delivery: Callable[[KafkaError | None, Any], None],
        queue_full_attempts: int,
    ) -> None:
        if self._producer is None:
            raise KafkaException(KafkaError(KafkaError._STATE, "no producer attached"))
        for attempt in range(queue_full_attempts):
            if attempt:
                self._producer.poll(0.1)  # local queue full: serve delivery reports, retry
            try:
                self._producer.produce(
                    entry.topic,
                    value=entry.value,
                    key=entry.key,
                    headers=entry.headers,
                    on_delivery=on_delivery,
                )
            except BufferError:
                continue
            self._queue_full = False
            return
        self._queue_full = True
        raise KafkaException(KafkaError(KafkaError._QUEUE_FULL, "producer queue stays full"))
