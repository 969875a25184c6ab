"""asyncio client for bots: send a TranslationRequest, await the matching TranslationResult.

    async with TranslationClient("127.0.0.1:9092") as client:
        reply = await client.translate("Good morning", to="de", src="en", deadline=5)
        print(reply.text)

Requests go to `tolk.requests.<to>` with a fresh request id (uuid4) and `reply_topic` set to
the client's reply topic (default `tolk.replies`, shared with other clients). The client reads
every partition of that topic itself (`assign()`, no consumer group: every client sees every
reply, and a broker restart never re-assigns anything) and resolves the future whose request
id matches; replies for other clients are ignored.

No reply may be missed: before the first request goes out the client pins each reply partition
at its current end (the high watermark), so every reply to a request sent afterwards lies at or
after the pinned offset; the positions then only move forward, through broker restarts too.

confluent-kafka is blocking, so one background thread polls the consumer (and serves the
producer's delivery reports) and hands results to the event loop with `call_soon_threadsafe`.
That thread alone uses the consumer once it is started, and closes it when `close()` ends its
loop (no `close()` may race a `poll()` on one handle).

No request is lost silently, and no `translate()` waits forever (`RequestSender`, in
`workers.client.delivery`): a full local queue is backed off (then `TranslationQueueFull`); a
request librdkafka could not deliver within the client's `delivery_timeout` (default:
`default_timeout` + `deadline_grace`, the longest a request without a deadline is waited for)
is sent again while `translate()` still waits for it (its deadline + grace, or its `timeout`),
so a request sent during a broker restart is delivered once the broker is back; one that
cannot be delivered fails with `TranslationNotDelivered`; a timeout says whether the broker
ever acknowledged the request.

The reply and error types live in `workers.client.types` (re-exported here); the reply side
(pinning the reply partitions, the poll thread, resolving the waiting futures) is
`workers.client.replies.ReplyListener`, which `TranslationClient` inherits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any

from confluent_kafka import Consumer, KafkaError, Producer

from schemas.wire import WireRequest, write_request
from topics.catalog import REPLIES, request_topic
from topics.cluster import KafkaConnectionError, check_broker
from workers.client.delivery import PendingSend, RequestSender
from workers.client.replies import ReplyListener
from workers.client.types import (
    TranslationError,
    TranslationFailed,
    TranslationNotDelivered,
    TranslationQueueFull,
    TranslationReply,
    TranslationTimeout,
)
from workers.tracing import client_span, inject_traceparent

__all__ = [
    "TranslationClient",
    "TranslationError",
    "TranslationFailed",
    "TranslationNotDelivered",
    "TranslationQueueFull",
    "TranslationReply",
    "TranslationTimeout",
]

log = logging.getLogger(__name__)


def _seconds(value: timedelta | float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, timedelta):
        return value.total_seconds()
    return float(value)


class TranslationClient(ReplyListener):  # the reply side: workers/client/replies.py
    """Request/reply over Kafka; use as `async with` (or `await start()` / `await close()`)."""

    def __init__(
        self,
        bootstrap: str = "127.0.0.1:9092",
        reply_topic: str | None = None,
        *,
        topic_prefix: str = "",
        default_timeout: float = 30.0,
        deadline_grace: float = 5.0,
        raise_on_error: bool = True,
        start_timeout: float = 30.0,
        kafka_config: Mapping[str, Any] | None = None,
        delivery_timeout: float | None = None,
        producer_factory: Callable[[dict[str, Any]], Any] = Producer,
        consumer_factory: Callable[[dict[str, Any]], Any] = Consumer,
        check_connection: bool = True,
        tracer: Any = None,
    ) -> None:
        """`topic_prefix` is prepended to the request topics (and to the default reply topic),
        matching the worker's setting. `default_timeout`: how long `translate` waits when no
        deadline is given; with a deadline it waits the deadline plus `deadline_grace` (the
        worker answers EXPIRED once it passes). `kafka_config`: extra properties (security)
        for both the producer and the consumer. `delivery_timeout` (seconds): how long
        librdkafka keeps retrying a request the broker does not acknowledge (a broker outage)
        before reporting it failed (then the client sends it again while the request is still
        waited for); default `default_timeout + deadline_grace`. The factories build the Kafka
        clients from their config (tests).
        `check_connection`: `start()` first makes one metadata request with `kafka_config`
        (`topics.cluster.check_broker`) and fails at once with a readable reason (a
        security protocol mismatch, bad credentials, an unknown CA); skipped with a custom
        producer factory.
        Tracing: each request carries the W3C `traceparent` of the caller's current
        OpenTelemetry span, if one is active; with a `tracer` (an OpenTelemetry `Tracer`),
        `translate` opens its own span,
        `tolk translate <lang>`, around the request and its reply (a worker with tracing on
        continues the trace; `TranslationReply.trace_parent` names the worker's span)."""
        self.bootstrap = bootstrap
        self.topic_prefix = topic_prefix
        self.reply_topic = reply_topic or topic_prefix + REPLIES
        self.default_timeout = default_timeout
        self.deadline_grace = deadline_grace
        self.raise_on_error = raise_on_error
        self.start_timeout = start_timeout
        self.group_id = f"tolk-client-{uuid.uuid4().hex}"
        self._extra = dict(kafka_config or {})
        self._check_connection = check_connection and producer_factory is Producer
        self.delivery_timeout = (
            default_timeout + deadline_grace if delivery_timeout is None else delivery_timeout
        )
        if self.delivery_timeout <= 0:
            raise ValueError(f"delivery_timeout must be > 0, got {self.delivery_timeout!r}")
        self._producer_factory = producer_factory
        self._consumer_factory = consumer_factory
        self._tracer = tracer
        self._producer: Any = None
        self._consumer: Any = None
        self._thread: threading.Thread | None = None
        self.close_wait_s = 10.0  # how long close() waits for the poll thread to end
        self._closing = threading.Event()
        self._ready = threading.Event()
        self._assigned: set[int] = set()
        self.partition_check_s = 10.0  # new reply partitions are looked for this often
        self._start_error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[str, asyncio.Future[TranslationReply]] = {}
        # produce, back off, send again (workers/client/delivery.py)
        self._sender = RequestSender(self._pending, self._closing, self.delivery_timeout)

    # -- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> TranslationClient:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def start(self) -> None:
        """Connect, take the reply topic's partitions and wait until they are pinned."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        common = {"bootstrap.servers": self.bootstrap, **self._extra}
        if self._check_connection:
            try:
                await asyncio.to_thread(check_broker, common, min(self.start_timeout, 10.0))
            except KafkaConnectionError as exc:
                raise TranslationError(f"client could not start: {exc}") from None
        self._producer = self._producer_factory(
            {
                **common,
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 0,  # a request goes out at once (see workers/kafka/config.py)
                "message.timeout.ms": max(1, round(self.delivery_timeout * 1000)),
            }
        )
        self._sender.producer = self._producer
        self._consumer = self._consumer_factory(
            {
                **common,
                "group.id": self.group_id,
                "auto.offset.reset": "latest",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
            }
        )
        self._thread = threading.Thread(target=self._poll_loop, name="tolk-client", daemon=True)
        self._thread.start()
        ready = await asyncio.to_thread(self._ready.wait, self.start_timeout)
        if self._start_error is not None or not ready:
            why = self._start_error or f"no assignment of {self.reply_topic!r} yet"
            await self.close()
            raise TranslationError(
                f"client could not start within {self.start_timeout:.0f}s: {why}"
            )

    async def close(self) -> None:
        """Stop polling, flush pending requests, fail the futures still waiting.

        The consumer is closed by the poll thread when it leaves its loop (or here when no poll
        thread was started): a `close()` from this thread could race a `poll()` or a rebalance
        callback still running there and free the handle under it (issue 26). A poll thread
        still busy after `close_wait_s` closes it when its call returns."""
        self._closing.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            await asyncio.to_thread(thread.join, self.close_wait_s)
            if thread.is_alive():
                log.warning(
                    "client poll thread still in a Kafka call after %.1f s: it closes the "
                    "consumer when the call returns",
                    self.close_wait_s,
                )
        if self._producer is not None:  # flush() beside the poll thread's poll(): allowed
            await asyncio.to_thread(self._producer.flush, 5.0)
            self._producer = None
            self._sender.producer = None
        consumer, self._consumer = self._consumer, None
        if thread is None and consumer is not None:  # never handed to a poll thread
            with contextlib.suppress(Exception):
                await asyncio.to_thread(consumer.close)
        for rid, fut in list(self._pending.items()):
            if not fut.done():
                fut.set_exception(TranslationError(f"client closed before the reply to {rid}"))
        self._pending.clear()

    # -- requests -----------------------------------------------------------------------------

    async def translate(
        self,
        text: str,
        to: str,
        src: str = "",
        *,
        deadline: timedelta | float | None = None,
        timeout: float | None = None,
        conversation_id: str | None = None,
        model_version: str | None = None,
        metadata: Mapping[str, str] | None = None,
        raise_on_error: bool | None = None,
    ) -> TranslationReply:
        """Translate `text` into `to` (from `src`, "" = detect).

        `deadline` (seconds or timedelta from now) goes on the request: past it the worker
        answers EXPIRED instead of translating. `timeout`: how long to wait for the reply
        (default: deadline + grace, else `default_timeout`); past it `TranslationTimeout`.
        A non-OK reply raises `TranslationFailed` unless `raise_on_error=False`.
        """
        span = contextlib.nullcontext() if self._tracer is None else client_span(self._tracer, to)
        with span:
            return await self._translate(
                text,
                to,
                src,
                deadline,
                timeout,
                conversation_id,
                model_version,
                metadata,
                raise_on_error,
            )

    async def _translate(
        self,
        text: str,
        to: str,
        src: str,
        deadline: timedelta | float | None,
        timeout: float | None,
        conversation_id: str | None,
        model_version: str | None,
        metadata: Mapping[str, str] | None,
        raise_on_error: bool | None,
    ) -> TranslationReply:
        if self._thread is None or self._loop is None or self._producer is None:
            raise TranslationError("client not started (use `async with TranslationClient(...)`)")
        loop = self._loop
        rid = uuid.uuid4().hex
        deadline_s = _seconds(deadline)
        now_ms = int(time.time() * 1000)
        deadline_ms = None if deadline_s is None else now_ms + int(deadline_s * 1000)
        if timeout is None:
            timeout = (
                self.default_timeout if deadline_s is None else deadline_s + self.deadline_grace
            )
        value = write_request(
            WireRequest(
                request_id=rid,
                conversation_id=conversation_id,
                source_lang=src,
                target_lang=to,
                text=text,
                created_at=now_ms,
                deadline=deadline_ms,
                reply_topic=self.reply_topic,
                model_version=model_version,
                metadata=dict(metadata or {}),
            )
        )
        topic = self.topic_prefix + request_topic(to)
        fut: asyncio.Future[TranslationReply] = loop.create_future()
        self._pending[rid] = fut

        started = time.monotonic()
        key = (conversation_id or rid).encode()
        send = PendingSend(rid, topic, value, key, give_up_at=started + timeout)
        send.headers = inject_traceparent() or None  # the current span, if any

        def on_delivery(err: KafkaError | None, _msg: Any) -> None:  # poll thread
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._sender.on_delivery, send, err)

        send.on_delivery = on_delivery
        try:
            await self._sender.produce(send)
            left = timeout - (time.monotonic() - started)
            reply = await asyncio.wait_for(fut, max(0.0, left))
        except TimeoutError:
            if rid in self._sender.acked:
                detail = f"sent to {topic}, waiting on {self.reply_topic}; is a worker running?"
            else:
                detail = f"the request to {topic} was not acknowledged by the broker yet"
            raise TranslationTimeout(rid, time.monotonic() - started, detail) from None
        finally:
            self._pending.pop(rid, None)
            self._sender.acked.discard(rid)
        check = self.raise_on_error if raise_on_error is None else raise_on_error
        if check and not reply.ok:
            raise TranslationFailed(reply.status, reply.error, reply)
        return reply

    async def translate_many(
        self,
        texts: Sequence[str],
        to: str,
        src: str = "",
        *,
        deadline: timedelta | float | None = None,
        timeout: float | None = None,
        raise_on_error: bool | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Translate several texts concurrently; replies in the order of `texts`. With
        `return_exceptions=True` a failed item is its exception instead of raising."""
        coros = [
            self.translate(
                t, to, src, deadline=deadline, timeout=timeout, raise_on_error=raise_on_error
            )
            for t in texts
        ]
        return list(await asyncio.gather(*coros, return_exceptions=return_exceptions))
