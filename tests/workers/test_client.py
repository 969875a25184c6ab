"""TranslationClient round trips through the real broker to a worker with the fake engine."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
from prometheus_client import CollectorRegistry

from tests.kafka_fixtures import kafka_bootstrap, redis_url  # noqa: F401
from tests.workers.fakes import FakeEngine, create_prefixed_topics, fake_translation
from workers.client import (
    TranslationClient,
    TranslationError,
    TranslationFailed,
    TranslationReply,
    TranslationTimeout,
)
from workers.settings import Settings
from workers.worker import Worker

pytestmark = [pytest.mark.kafka, pytest.mark.redis]


@pytest.fixture
def served(kafka_bootstrap: str, redis_url: str) -> Iterator[tuple[str, str]]:  # noqa: F811
    """A worker serving de and fr under a private prefix; es has a topic but no worker."""
    prefix = f"c{uuid.uuid4().hex[:10]}."
    create_prefixed_topics(kafka_bootstrap, prefix, ("de", "fr", "es"))
    settings = Settings(
        bootstrap=kafka_bootstrap,
        redis_url=redis_url,
        group_id=f"tolk-client-test-{uuid.uuid4().hex[:8]}",
        languages=("de", "fr"),
        topic_prefix=prefix,
        metrics_port=0,
        worker_id="w-client-test",
    )
    worker = Worker(settings, FakeEngine(delay_s=0.02), registry=CollectorRegistry())
    thread = worker.run_in_thread()
    assert worker.assigned_event.wait(30)
    yield kafka_bootstrap, prefix
    worker.stop()
    thread.join(20)


def test_round_trip_many_and_errors(served: tuple[str, str]) -> None:
    bootstrap, prefix = served

    async def main() -> None:
        async with TranslationClient(bootstrap, topic_prefix=prefix) as client:
            reply = await client.translate("good morning all", to="de", src="en", deadline=10)
            assert isinstance(reply, TranslationReply)
            assert reply.ok and reply.text == fake_translation("good morning all", "de")
            assert reply.worker_id == "w-client-test" and reply.model_version == "fake-1"

            texts = [f"sentence {i}" for i in range(20)]
            many = await client.translate_many(texts, to="fr", deadline=timedelta(seconds=10))
            assert [r.text for r in many] == [fake_translation(t, "fr") for t in texts]

            with pytest.raises(TranslationFailed) as failed:
                await client.translate("", to="de")
            assert failed.value.status == "REJECTED" and "empty" in (failed.value.error or "")
            soft = await client.translate("  ", to="de", raise_on_error=False)
            assert soft.status == "REJECTED" and not soft.ok

            started = time.monotonic()
            with pytest.raises(TranslationTimeout) as timed_out:
                await client.translate("nobody serves Spanish here", to="es", timeout=1.5)
            assert 1.4 < time.monotonic() - started < 5
            message = str(timed_out.value)
            assert timed_out.value.request_id in message and "1.5s" in message
            assert isinstance(timed_out.value, TimeoutError)

    asyncio.run(main())


def test_two_clients_share_the_reply_topic(served: tuple[str, str]) -> None:
    bootstrap, prefix = served

    async def main() -> None:
        async with (
            TranslationClient(bootstrap, topic_prefix=prefix) as a,
            TranslationClient(bootstrap, topic_prefix=prefix) as b,
        ):
            ra, rb = await asyncio.gather(
                a.translate("from a", to="de", timeout=15),
                b.translate("from b", to="fr", timeout=15),
            )
            assert ra.text == fake_translation("from a", "de")
            assert rb.text == fake_translation("from b", "fr")

    asyncio.run(main())


def test_tiny_producer_queue_is_waited_out_not_an_error(served: tuple[str, str]) -> None:
    """A local queue of one message: every concurrent request but one meets BufferError at
    first; each must back off and go out once the queue has room, none is lost."""
    bootstrap, prefix = served

    async def main() -> None:
        tiny = {"queue.buffering.max.messages": 1}
        async with TranslationClient(bootstrap, topic_prefix=prefix, kafka_config=tiny) as c:
            texts = [f"queued sentence {i}" for i in range(12)]
            many = await c.translate_many(texts, to="de", timeout=20)
            assert [r.text for r in many] == [fake_translation(t, "de") for t in texts]

    asyncio.run(main())


def test_translate_before_start_is_an_error() -> None:
    async def main() -> None:
        client = TranslationClient("127.0.0.1:1")
        with pytest.raises(TranslationError, match="not started"):
            await client.translate("x", to="de")

    asyncio.run(main())


def test_a_reply_on_a_partition_added_while_the_client_runs_reaches_it(
    served: tuple[str, str],
) -> None:
    """The client takes the reply topic's partitions itself (it joins no group, so a broker
    restart re-assigns nothing): one added while it runs is taken from its beginning within
    `partition_check_s`."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewPartitions

    from schemas.codec import decode_request, encode_result
    from tests.workers.fakes import TopicReader
    from topics.catalog import REPLIES, request_topic

    bootstrap, prefix = served
    reply_topic = prefix + REPLIES
    requests = TopicReader(bootstrap, prefix + request_topic("es"))  # es: no worker

    async def main() -> None:
        client = TranslationClient(bootstrap, topic_prefix=prefix)
        client.partition_check_s = 0.5
        async with client:
            before = len(client._assigned)
            admin = AdminClient({"bootstrap.servers": bootstrap})
            groups = admin.list_consumer_groups().result(30).valid
            assert client.group_id not in {g.group_id for g in groups}  # joined none
            grown = admin.create_partitions([NewPartitions(reply_topic, before + 1)])
            grown[reply_topic].result(30)
            pending = asyncio.ensure_future(client.translate("hola", to="es", timeout=30))
            for _ in range(200):  # the request on the broker, and the new partition taken
                if requests.snapshot() and len(client._assigned) == before + 1:
                    break
                await asyncio.sleep(0.05)
            request = decode_request(requests.snapshot()[0][1])
            reply = {
                "request_id": request["request_id"], "status": "OK", "text": "hola!",
                "error": None, "model_version": "by-hand", "source_lang": "es",
                "target_lang": "es", "timings": {"queue_ms": 0.0, "prefill_ms": 0.0,
                "decode_ms": 0.0, "total_ms": 0.0}, "tokens_in": 1, "tokens_out": 1,
                "cached_prefix_tokens": 0, "worker_id": "hand", "completed_at": 0,
                "conversation_id": None,
            }  # fmt: skip
            producer = Producer({"bootstrap.servers": bootstrap})
            producer.produce(reply_topic, encode_result(reply), partition=before)
            assert producer.flush(10) == 0
            answer = await asyncio.wait_for(pending, 30)
            assert answer.text == "hola!" and len(client._assigned) == before + 1

    try:
        asyncio.run(main())
    finally:
        requests.close()
