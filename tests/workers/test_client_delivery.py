"""`TranslationClient` when producing is hard: a full local queue, a broker outage, a failed
delivery. No broker: the client is given fake Kafka clients (`producer_factory`,
`consumer_factory`) that play the worker too, so each test decides when a request is
accepted, delivered and answered.

What must hold: a request is never lost silently and its future never dangles. It is either
answered, or `translate()` raises a `TranslationError` subclass that names the cause.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException, TopicPartition

from schemas.codec import decode_request, encode_result
from topics.catalog import REPLIES
from workers.client import (
    TranslationClient,
    TranslationError,
    TranslationNotDelivered,
    TranslationQueueFull,
    TranslationTimeout,
)


class _Msg:
    def __init__(self, topic: str, value: bytes) -> None:
        self._topic, self._value = topic, value

    def topic(self) -> str:
        return self._topic

    def value(self) -> bytes:
        return self._value

    def error(self) -> None:
        return None

    def headers(self) -> None:
        return None


def _reply_to(request_bytes: bytes) -> bytes:
    req = decode_request(request_bytes)
    return encode_result(
        {
            "request_id": req["request_id"],
            "status": "OK",
            "text": "[de] " + req["text"],
            "error": None,
            "model_version": "fake-1",
            "source_lang": req["source_lang"],
            "target_lang": req["target_lang"],
            "timings": {"queue_ms": 1.0, "prefill_ms": 1.0, "decode_ms": 1.0, "total_ms": 3.0},
            "tokens_in": 1,
            "tokens_out": 1,
            "cached_prefix_tokens": 0,
            "worker_id": "w-fake",
            "completed_at": 0,
            "conversation_id": None,
        }
    )


class FakeWorld:
    """One fake broker with a worker behind it: a delivered request is answered at once.

    `refuse_next` produce() calls raise BufferError (`refuse_all` every one); while `down` is
    set, accepted requests wait (librdkafka retrying them); `fail_with` fails the next delivery
    report, `fail_always` every one.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.producer_conf: dict[str, Any] = {}
        self.refuse_next = 0
        self.refuse_all = False
        self.produce_calls = 0
        self.down = threading.Event()
        self.fail_with: KafkaError | None = None
        self.fail_always: KafkaError | None = None
        self.raise_on_produce: BaseException | None = None
        self.waiting: list[tuple[Callable[..., None], bytes]] = []  # accepted, not delivered
        self.replies: list[_Msg] = []
        self.partitions = 1  # of the reply topic
        self.high: dict[int, int] = {}  # its partitions' high watermarks
        self.consumers: list[FakeConsumer] = []

    def producer(self, conf: dict[str, Any]) -> FakeProducer:
        self.producer_conf = conf
        return FakeProducer(self)

    def consumer(self, conf: dict[str, Any]) -> FakeConsumer:
        self.consumers.append(FakeConsumer(self))
        return self.consumers[-1]


class FakeProducer:
    def __init__(self, world: FakeWorld) -> None:
        self.world = world

    def produce(
        self, topic: str, value: bytes, key: bytes, on_delivery: Any, headers: Any = None
    ) -> None:
        w = self.world
        with w.lock:
            w.produce_calls += 1
            if w.raise_on_produce is not None:
                raise w.raise_on_produce
            if w.refuse_all or w.refuse_next > 0:
                w.refuse_next -= 1
                raise BufferError("Local: Queue full")
            w.waiting.append((on_delivery, value))

    def poll(self, timeout: float = 0) -> int:
        w = self.world
        if w.down.is_set():
            return 0
        with w.lock:
            waiting, w.waiting = w.waiting, []
            fail = (w.fail_with or w.fail_always) if waiting else None
            if waiting:
                w.fail_with = None
        for on_delivery, value in waiting:
            on_delivery(fail, None)
            if fail is None:
                with w.lock:
                    w.replies.append(_Msg(REPLIES, _reply_to(value)))
        return len(waiting)

    def flush(self, timeout: float = -1) -> int:
        return 0 if self.world.down.is_set() else self.poll(0)


class _TopicMeta:
    def __init__(self, partitions: dict[int, object]) -> None:
        self.partitions, self.error = partitions, None


class _Metadata:
    def __init__(self, topics: dict[str, _TopicMeta]) -> None:
        self.topics = topics


class FakeConsumer:
    """The reply topic with `world_partitions` partitions, taken with assign() (no group)."""

    def __init__(self, world: FakeWorld) -> None:
        self.world = world
        self.assigned: list[TopicPartition] = []

    def list_topics(self, topic: str, timeout: float = -1) -> _Metadata:
        return _Metadata({topic: _TopicMeta({p: object() for p in range(self.world.partitions)})})

    def get_watermark_offsets(self, tp: TopicPartition, **_kw: Any) -> tuple[int, int]:
        return 0, self.world.high.get(tp.partition, 0)

    def assign(self, partitions: list[TopicPartition]) -> None:
        self.assigned = list(partitions)

    def incremental_assign(self, partitions: list[TopicPartition]) -> None:
        self.assigned += partitions

    def poll(self, timeout: float = 0) -> _Msg | None:
        with self.world.lock:
            if self.world.replies:
                return self.world.replies.pop(0)
        time.sleep(min(timeout, 0.01))
        return None

    def close(self) -> None:
        pass


def client_for(world: FakeWorld, **kw: Any) -> TranslationClient:
    return TranslationClient(
        "fake:9092", producer_factory=world.producer, consumer_factory=world.consumer, **kw
    )


def test_full_local_queue_is_backed_off_and_retried() -> None:
    world = FakeWorld()
    world.refuse_next = 3

    async def main() -> None:
        async with client_for(world) as client:
            reply = await client.translate("hello", to="de", timeout=5)
            assert reply.ok and reply.text == "[de] hello"
            assert world.produce_calls == 4  # three refusals, then accepted
            assert client._pending == {}

    asyncio.run(main())


def test_queue_that_stays_full_raises_a_clear_error_and_leaves_nothing_pending() -> None:
    world = FakeWorld()
    world.refuse_all = True

    async def main() -> None:
        async with client_for(world) as client:
            started = time.monotonic()
            with pytest.raises(TranslationQueueFull) as full:
                await client.translate("hello", to="de", timeout=0.6)
            assert 0.3 < time.monotonic() - started < 3.0
            message = str(full.value)
            assert "queue full" in message and "queue.buffering.max.messages" in message
            assert full.value.request_id in message and "tolk.requests.de" in message
            assert isinstance(full.value, TranslationNotDelivered)
            assert isinstance(full.value, TranslationError)
            assert world.produce_calls > 3  # it did back off and retry before giving up
            assert client._pending == {}

    asyncio.run(main())


@pytest.mark.parametrize(
    ("code", "says"),
    [
        (KafkaError.UNKNOWN_TOPIC_OR_PART, "unknown topic"),
        (KafkaError.MSG_SIZE_TOO_LARGE, "too large"),
        (KafkaError.TOPIC_AUTHORIZATION_FAILED, "authorization"),
    ],
)
def test_delivery_failed_for_good_resolves_the_future_at_once(code: int, says: str) -> None:
    world = FakeWorld()
    world.fail_with = KafkaError(code)

    async def main() -> None:
        async with client_for(world) as client:
            started = time.monotonic()
            with pytest.raises(TranslationNotDelivered) as failed:
                await client.translate("hello", to="de", timeout=20)
            assert time.monotonic() - started < 5  # the delivery report, not the timeout
            message = str(failed.value)
            assert "tolk.requests.de" in message and says in message.lower()
            assert world.produce_calls == 1  # not sent again
            assert client._pending == {}

    asyncio.run(main())


def test_timed_out_delivery_is_sent_again_while_the_request_is_waited_for() -> None:
    world = FakeWorld()
    world.fail_with = KafkaError(KafkaError._MSG_TIMED_OUT)  # the first try only

    async def main() -> None:
        async with client_for(world) as client:
            reply = await client.translate("hello again", to="de", timeout=10)
            assert reply.text == "[de] hello again"
            assert world.produce_calls == 2

    asyncio.run(main())


def test_delivery_that_keeps_timing_out_fails_when_the_wait_is_over() -> None:
    world = FakeWorld()
    world.fail_always = KafkaError(KafkaError._MSG_TIMED_OUT)

    async def main() -> None:
        async with client_for(world, delivery_timeout=7.5) as client:
            started = time.monotonic()
            with pytest.raises(TranslationError) as failed:
                await client.translate("hello", to="de", timeout=1.0)
            assert time.monotonic() - started < 3.0  # never hangs past its wait
            assert world.produce_calls >= 3  # sent again (with backoff) meanwhile
            message = str(failed.value)
            if isinstance(failed.value, TranslationNotDelivered):
                assert "timed out" in message.lower() and "7.5 s" in message
            else:  # the wait ran out between two tries
                assert isinstance(failed.value, TranslationTimeout)
                assert "not acknowledged by the broker" in message
            assert client._pending == {}

    asyncio.run(main())


def test_produce_error_is_raised_as_a_translation_error() -> None:
    world = FakeWorld()
    world.raise_on_produce = KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))

    async def main() -> None:
        async with client_for(world) as client:
            with pytest.raises(TranslationNotDelivered, match="too large") as failed:
                await client.translate("hello", to="de", timeout=5)
            assert isinstance(failed.value.__cause__, KafkaException)
            assert client._pending == {}

    asyncio.run(main())


def test_request_sent_during_an_outage_is_answered_once_the_broker_is_back() -> None:
    world = FakeWorld()

    async def main() -> None:
        async with client_for(world, default_timeout=12.0) as client:
            # librdkafka keeps retrying a request until message.timeout.ms: by default as
            # long as the client waits for a reply without a deadline (+ grace)
            assert world.producer_conf["message.timeout.ms"] == 17_000
            world.down.set()
            pending = asyncio.ensure_future(client.translate("during the outage", to="de"))
            await asyncio.sleep(0.5)
            assert not pending.done() and len(world.waiting) == 1
            world.down.clear()  # the broker is back: delivered, then answered
            reply = await asyncio.wait_for(pending, 5)
            assert reply.text == "[de] during the outage"

    asyncio.run(main())


def test_delivery_timeout_follows_the_deadline_grace_and_can_be_set() -> None:
    world = FakeWorld()

    async def main() -> None:
        async with client_for(world, default_timeout=20.0, deadline_grace=2.0):
            assert world.producer_conf["message.timeout.ms"] == 22_000
        async with client_for(world, delivery_timeout=3.0):
            assert world.producer_conf["message.timeout.ms"] == 3_000

    asyncio.run(main())


def test_timeout_before_delivery_says_the_broker_never_acknowledged() -> None:
    world = FakeWorld()
    world.down.set()

    async def main() -> None:
        async with client_for(world) as client:
            with pytest.raises(TranslationTimeout, match="not acknowledged by the broker"):
                await client.translate("hello", to="de", timeout=0.4)
            assert client._pending == {}
        world.down.clear()

    asyncio.run(main())


def test_reply_partitions_are_pinned_at_their_end_and_new_ones_taken_from_their_start() -> None:
    """No consumer group (a group's re-assignment after a broker restart re-pinned the
    partitions past the replies produced meanwhile): the client assigns every partition itself
    at its high watermark, and one added later from its beginning."""
    world = FakeWorld()
    world.partitions, world.high = 2, {0: 7, 1: 3}

    async def main() -> None:
        client = client_for(world)
        client.partition_check_s = 0.05
        async with client:
            consumer = world.consumers[-1]
            assert [(tp.partition, tp.offset) for tp in consumer.assigned] == [(0, 7), (1, 3)]
            world.partitions = 3
            for _ in range(100):
                if len(consumer.assigned) == 3:
                    break
                await asyncio.sleep(0.02)
            assert (consumer.assigned[2].partition, consumer.assigned[2].offset) == (
                2,
                OFFSET_BEGINNING,
            )
            assert (await client.translate("still here", to="de", timeout=5)).ok

    asyncio.run(main())


def test_a_reply_topic_that_is_not_there_fails_the_start_naming_it() -> None:
    world = FakeWorld()
    world.partitions = 0

    async def main() -> None:
        async with client_for(world, start_timeout=0.5):
            pass

    with pytest.raises(TranslationError, match=r"reply topic 'tolk.replies': no partitions"):
        asyncio.run(main())
