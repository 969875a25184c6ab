"""The client's reply side: the reply topic's consumer, its poll thread, the waiting futures.

Split out of workers/client/__init__.py (issue 27: no product file over 400 lines).
`TranslationClient` inherits `ReplyListener`, which holds what happens after `start()` has
made the reply topic's consumer:

* `_pin_reply_partitions`: the consumer takes every partition of the reply topic itself
  (`assign()`, no consumer group: nothing to join, nothing to rebalance), each pinned at its
  high watermark before the first request goes out (`_end_offset`, retried while a
  just-created topic elects its leader), so no reply to a later request is skipped. It used to
  `subscribe()` with a group of its own and pin in the assignment callback; after a broker
  restart the group re-assigned the partitions and the callback pinned them again at the new
  end, past the replies produced meanwhile: every `translate()` sent from the outage on timed
  out (tests/faults/test_broker_restart.py, once in CI). Assigned partitions keep their fetch
  position through a broker restart; a partition added to the topic later is taken from its
  beginning within `partition_check_s` (all of its records are newer than the client's start);
* `_poll_loop` / `_poll_until_closing`: the one background thread that pins, polls the
  consumer (and serves the producer's delivery reports), decodes replies and hands each to the
  event loop; it alone uses the consumer and closes it when it leaves its loop (issue 26);
* `_resolve` (on the event loop): the future waiting for that request id gets the reply;
  other clients' replies are ignored.

The attributes it reads are the client's (declared below for the type checker).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException, TopicPartition

from schemas.codec import SchemaError
from schemas.wire import WireResult, read_result
from workers.client.types import TranslationReply
from workers.tracing import traceparent_of

__all__ = ["ReplyListener"]

log = logging.getLogger("workers.client")  # the client's logger, as before the split

# Answers a just-created topic may give for a moment.
_TRANSIENT_METADATA_CODES = frozenset(
    {
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError._TIMED_OUT,
    }
)


class ReplyListener:
    """The reply side of `workers.client.TranslationClient` (module notes)."""

    # the client's, set in TranslationClient.__init__ / start()
    reply_topic: str
    start_timeout: float
    _consumer: Any
    _producer: Any
    _closing: threading.Event
    _ready: threading.Event
    _start_error: BaseException | None
    _loop: asyncio.AbstractEventLoop | None
    _pending: dict[str, asyncio.Future[TranslationReply]]
    _assigned: set[int]  # the reply partitions taken
    partition_check_s: float  # how often the poll thread looks for new reply partitions

    def _pin_reply_partitions(self, consumer: Any) -> None:
        """Assign every partition of the reply topic at its end (module notes); raises when
        the topic is not there within half of `start_timeout` (a just-created one may take a
        moment; half, so that the reason reaches `start()` before it stops waiting)."""
        partitions = self._reply_partitions(consumer, self.start_timeout / 2)
        pinned = []
        for p in partitions:
            high = self._end_offset(consumer, TopicPartition(self.reply_topic, p))
            pinned.append(TopicPartition(self.reply_topic, p, high))
        consumer.assign(pinned)
        self._assigned = set(partitions)

    def _reply_partitions(self, consumer: Any, timeout_s: float, ask_s: float = 5.0) -> list[int]:
        """The reply topic's partition ids, asked again (each ask waits up to `ask_s`) while
        the topic is missing, has no leader yet or the broker does not answer, until
        `timeout_s`; then the broker's answer as an error."""
        end = time.monotonic() + timeout_s
        while True:
            try:
                meta = consumer.list_topics(topic=self.reply_topic, timeout=ask_s)
                topic = meta.topics.get(self.reply_topic)
                err = None if topic is None else topic.error
            except KafkaException as exc:
                topic, err = None, exc
            if topic is not None and err is None and topic.partitions:
                return sorted(topic.partitions)
            if time.monotonic() >= end or self._closing.is_set():
                why = err if err is not None else "no partitions"
                raise RuntimeError(f"reply topic {self.reply_topic!r}: {why}")
            time.sleep(0.2)

    def _take_new_partitions(self, consumer: Any) -> None:
        """Partitions added to the reply topic since the last look, taken from their start."""
        try:
            partitions = self._reply_partitions(consumer, 0.0, ask_s=1.0)  # polls wait
        except Exception as exc:  # a broker away for a moment: the next look
            log.debug("client: reply topic metadata: %s", exc)
            return
        new = [p for p in partitions if p not in self._assigned]
        if new:
            consumer.incremental_assign(
                [TopicPartition(self.reply_topic, p, OFFSET_BEGINNING) for p in new]
            )
            self._assigned.update(new)
            log.info("client: reply topic %s grew: partitions %s taken", self.reply_topic, new)

    def _end_offset(self, consumer: Any, tp: TopicPartition) -> int:
        """The partition's high watermark; retried while a fresh topic elects its leader."""
        end = time.monotonic() + self.start_timeout
        while True:
            try:
                _low, high = consumer.get_watermark_offsets(tp, timeout=5.0, cached=False)
                return int(high)
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                transient = isinstance(err, KafkaError) and (
                    err.retriable() or err.code() in _TRANSIENT_METADATA_CODES
                )
                if not transient or time.monotonic() >= end or self._closing.is_set():
                    raise
                time.sleep(0.1)

    def _poll_loop(self) -> None:
        """The poll thread: it owns the consumer from `start()` on and closes it itself."""
        consumer = self._consumer
        try:
            try:
                self._pin_reply_partitions(consumer)
            except Exception as exc:  # reported by start()
                self._start_error = exc
                return
            finally:
                self._ready.set()
            self._poll_until_closing(consumer, self._producer)
        finally:
            with contextlib.suppress(Exception):
                consumer.close()

    def _poll_until_closing(self, consumer: Any, producer: Any) -> None:
        next_look = time.monotonic() + self.partition_check_s
        while not self._closing.is_set():
            if time.monotonic() >= next_look:
                self._take_new_partitions(consumer)
                next_look = time.monotonic() + self.partition_check_s
            try:
                producer.poll(0)
                msg = consumer.poll(0.05)
            except Exception:
                log.exception("client poll failed")
                time.sleep(0.1)
                continue
            if msg is None:
                continue
            err = msg.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    log.warning("client consumer error: %s", err)
                continue
            try:
                record = read_result(msg.value() or b"")
            except SchemaError:
                log.debug("ignoring an undecodable record on %s", msg.topic())
                continue
            loop = self._loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self._resolve, record, traceparent_of(msg.headers()))

    def _resolve(self, record: WireResult, trace_parent: str | None = None) -> None:
        # on the event loop
        fut = self._pending.pop(record.request_id, None)
        if fut is None or fut.done():
            return  # another client's reply, or one that arrived after its timeout
        fut.set_result(TranslationReply.from_wire(record, trace_parent))
