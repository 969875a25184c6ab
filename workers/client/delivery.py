"""Getting a `TranslationClient` request to the broker: produce, back off, send again, or fail.

`workers.client.TranslationClient` builds a request and waits for its reply; `RequestSender`
owns the way from `produce()` to the broker's acknowledgement, so that no request is lost
silently and no `translate()` waits forever:

* a full local queue (`BufferError` from produce) is backed off on the event loop (5 ms
  doubling to 0.25 s, while the client's poll thread serves delivery reports that free room)
  until the request's wait runs out, then `TranslationQueueFull` says so;
* while the broker is unreachable librdkafka keeps retrying an accepted request until its
  `message.timeout.ms`, the client's `delivery_timeout`; a request whose delivery timed out (or
  failed for another passing reason) is sent again, with the same request id, for as long as
  `translate()` still waits for it (`PendingSend.give_up_at`);
* a delivery that fails for good (no such topic, too large, not authorized), or still fails
  when the request's wait is over, resolves the request's future at once with
  `TranslationNotDelivered` (the topic and librdkafka's reason); a produce() that raises
  likewise;
* the request ids the broker acknowledged are kept (`acked`), so a timeout can say whether the
  request ever reached the broker.

The sender shares the client's table of waiting futures (request id -> future): a request no
longer in it (answered, timed out) is neither sent again nor failed. Threads: everything runs
on the event loop except the delivery callbacks, which the client hands over with
`call_soon_threadsafe` to `on_delivery`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from topics.cluster import PERMANENT_PRODUCE_CODES  # no resend can fix these
from workers.client.types import (
    TranslationError,
    TranslationNotDelivered,
    TranslationQueueFull,
    TranslationReply,
)

__all__ = ["PendingSend", "RequestSender"]

log = logging.getLogger(__name__)

# Backing off a full local producer queue: the first wait, doubled up to the last.
_QUEUE_FULL_FIRST_DELAY_S = 0.005
_QUEUE_FULL_MAX_DELAY_S = 0.25
_RESEND_DELAY_S = 0.1  # before sending an undelivered request again (doubled, up to 1.6 s)


@dataclass(slots=True)
class PendingSend:
    """One request on its way to the broker (the event loop's view)."""

    rid: str
    topic: str
    value: bytes
    key: bytes
    give_up_at: float  # monotonic: when translate() stops waiting for it
    on_delivery: Callable[[KafkaError | None, Any], None] | None = None
    resends: int = 0  # times it was produced again after a failed delivery
    headers: list[tuple[str, bytes]] | None = None  # W3C trace context (workers/tracing.py)


class RequestSender:
    """Produces a client's requests and follows their delivery reports (on the event loop)."""

    def __init__(
        self,
        pending: dict[str, asyncio.Future[TranslationReply]],
        closing: threading.Event,
        delivery_timeout: float,
    ) -> None:
        """`pending`: the client's waiting futures by request id (shared, not copied);
        `closing`: set when the client closes; `delivery_timeout`: librdkafka's
        `message.timeout.ms` in seconds (named in the error of a timed-out delivery)."""
        self.producer: Any = None  # the client's Producer, set once it has started
        self.acked: set[str] = set()  # request ids the broker acknowledged (event loop only)
        self._pending = pending
        self._closing = closing
        self._delivery_timeout = delivery_timeout
        self._resends: set[asyncio.Task[None]] = set()  # requests being sent again

    async def produce(self, send: PendingSend) -> None:
        """Produce one request; a full local queue is backed off on the event loop (the poll
        thread serves the delivery reports that make room) until `send.give_up_at`."""
        delay = _QUEUE_FULL_FIRST_DELAY_S
        attempts = 0
        started = time.monotonic()
        while True:
            attempts += 1
            try:
                self.producer.produce(
                    send.topic,
                    value=send.value,
                    key=send.key,
                    headers=send.headers,
                    on_delivery=send.on_delivery,
                )
                return
            except BufferError:
                now = time.monotonic()
                if now >= send.give_up_at or self._closing.is_set():
                    raise TranslationQueueFull(
                        send.rid, send.topic, attempts, now - started
                    ) from None
                await asyncio.sleep(min(delay, send.give_up_at - now))
                delay = min(delay * 2, _QUEUE_FULL_MAX_DELAY_S)
            except KafkaException as exc:
                err = exc.args[0] if exc.args else exc
                raise TranslationNotDelivered(send.rid, send.topic, str(err)) from exc

    def on_delivery(self, send: PendingSend, err: KafkaError | None) -> None:  # event loop
        """The delivery report of `send`: acknowledged, sent again, or the request failed."""
        if send.rid not in self._pending:
            return  # translate() has returned (timed out, or the reply came first)
        if err is None:
            self.acked.add(send.rid)
            return
        cause = str(err)
        if err.code() == KafkaError._MSG_TIMED_OUT:
            cause += f" (no broker acknowledged it within {self._delivery_timeout:g} s)"
        time_left = send.give_up_at - time.monotonic()
        if err.code() in PERMANENT_PRODUCE_CODES or time_left <= 0 or self._closing.is_set():
            self._fail(send.rid, TranslationNotDelivered(send.rid, send.topic, cause))
            return
        # Passing (the broker was unreachable for the whole delivery timeout, ...): send it
        # again while the request is still waited for; the worker answers a request id once.
        send.resends += 1
        log.warning("request %s not delivered (%s); sending it again", send.rid, cause)
        task = asyncio.get_running_loop().create_task(self._resend(send, time_left))
        self._resends.add(task)
        task.add_done_callback(self._resends.discard)

    async def _resend(self, send: PendingSend, time_left: float) -> None:
        await asyncio.sleep(min(time_left, _RESEND_DELAY_S * 2 ** min(send.resends - 1, 4)))
        if send.rid not in self._pending:
            return
        try:
            await self.produce(send)
        except TranslationError as exc:
            self._fail(send.rid, exc)

    def _fail(self, rid: str, error: TranslationError) -> None:
        fut = self._pending.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_exception(error)
