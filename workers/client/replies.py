"""The client's reply side: the reply topic's consumer, its poll thread, the waiting futures.

Split out of workers/client/__init__.py (issue 27: no product file over 400 lines), bodies
unchanged:
`TranslationClient` inherits `ReplyListener`, which holds what happens after `start()` has
subscribed to the reply topic (the client's notes say why):

* `_on_assign`: every assigned reply partition is pinned at its high watermark before the
  first request goes out (`_end_offset`, retried while a just-created topic elects its
  leader), so no reply to a later request is skipped;
* `_poll_loop` / `_poll_until_closing`: the one background thread that polls the consumer
  (and serves the producer's delivery reports), decodes replies and hands each to the event
  loop; it alone uses the consumer and closes it when it leaves its loop (issue 26);
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

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from schemas.codec import SchemaError, decode_result
from workers.client.types import TranslationError, TranslationReply
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

    def _on_assign(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        # Pin every partition at its end now, so no reply to a later request is skipped by a
        # lazily resolved "latest".
        try:
            pinned = []
            for p in partitions:
                high = self._end_offset(consumer, p)
                pinned.append(TopicPartition(p.topic, p.partition, high))
            consumer.incremental_assign(pinned)
            if pinned:
                self._ready.set()
        except Exception as exc:  # reported by start()
            self._start_error = exc
            self._ready.set()

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
            self._poll_until_closing(consumer, self._producer)
        finally:
            with contextlib.suppress(Exception):
                consumer.close()

    def _poll_until_closing(self, consumer: Any, producer: Any) -> None:
        while not self._closing.is_set():
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
                if err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART and not self._ready.is_set():
                    self._start_error = RuntimeError(f"reply topic {self.reply_topic!r}: {err}")
                    self._ready.set()
                elif err.code() != KafkaError._PARTITION_EOF:
                    log.warning("client consumer error: %s", err)
                continue
            try:
                record = decode_result(msg.value() or b"")
            except SchemaError:
                log.debug("ignoring an undecodable record on %s", msg.topic())
                continue
            loop = self._loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self._resolve, record, traceparent_of(msg.headers()))

    def _resolve(self, record: dict[str, Any], trace_parent: str | None = None) -> None:
        # on the event loop
        fut = self._pending.pop(str(record.get("request_id", "")), None)
        if fut is None or fut.done():
            return  # another client's reply, or one that arrived after its timeout
        try:
            fut.set_result(TranslationReply.from_record(record, trace_parent))
        except (KeyError, TypeError, ValueError) as exc:
            fut.set_exception(TranslationError(f"malformed reply: {exc!r}"))
