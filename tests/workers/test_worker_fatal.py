"""A fatal consumer error stops the worker (it used to log a warning and stay up for good,
alive, ready and without partitions). The real case, KIP-848 refusing a restarted static
member, is in tests/faults/test_kip848_sigkill.py; here the same error event, from a fake."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException
from prometheus_client import CollectorRegistry

from tests.workers.fakes import FakeBroker, FakeConsumer, FakeEngine, FakeMessage
from tests.workers.polling import wait_for
from tests.workers.test_worker_fake_engine import request_bytes
from topics.catalog import DEAD_LETTERS, REPLIES, request_topic
from workers.kafka.config import is_fatal
from workers.settings import Settings
from workers.store.results import InMemoryResultStore
from workers.worker import Worker

FATAL = KafkaError(
    KafkaError._FATAL,
    "Fatal error: Broker: The instance ID is still used by another member in the consumer group",
)


def test_is_fatal_reads_the_fatal_event_code_as_well_as_the_flag() -> None:
    assert not FATAL.fatal()  # how librdkafka reports it on a consumer: flag not set
    assert is_fatal(FATAL)
    assert not is_fatal(KafkaError(KafkaError._TRANSPORT, "broker down"))
    assert not is_fatal(KafkaError(KafkaError._PARTITION_EOF))


class FatalOnDemand(FakeConsumer):
    """A fake consumer that returns one fatal error event once `fail` is set."""

    fail = threading.Event()

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[FakeMessage]:
        if self.fail.is_set():
            return [FakeMessage("", -1, -1, None, None, 0, error=FATAL)]
        return super().consume(num_messages, timeout)


def test_fatal_consumer_error_stops_the_worker_after_flushing_its_replies() -> None:
    broker = FakeBroker()
    broker.create_topic(request_topic("de"), 1)
    broker.create_topic(REPLIES, 1)
    broker.create_topic(DEAD_LETTERS, 1)
    consumers: list[FatalOnDemand] = []
    FatalOnDemand.fail = threading.Event()

    def consumer_factory(conf: dict[str, Any]) -> FatalOnDemand:
        consumers.append(FatalOnDemand(broker, conf))
        return consumers[-1]

    settings = Settings(
        languages=("de",), metrics_port=0, health_port=0, worker_id="w-fatal", poll_timeout_s=0.01
    )
    worker = Worker(
        settings,
        FakeEngine(),
        consumer_factory,
        broker.producer_factory(),
        store=InMemoryResultStore(),
        registry=CollectorRegistry(),
    )
    raised: list[BaseException] = []

    def run() -> None:
        try:
            worker.run(threading.Event())
        except BaseException as exc:  # noqa: BLE001 (the test inspects it)
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    for i in range(3):
        broker.append(request_topic("de"), f"r{i}".encode(), request_bytes(f"r{i}", f"hi {i}"))
    wait_for(lambda: len(broker.records(REPLIES)) == 3, what="3 replies")

    FatalOnDemand.fail.set()
    thread.join(10)
    assert not thread.is_alive(), "the worker kept running on a consumer that cannot go on"
    assert len(raised) == 1 and isinstance(raised[0], KafkaException)
    assert is_fatal(raised[0].args[0])
    assert consumers[0].closed  # left the group; its records go to the next owner
    assert len(broker.records(REPLIES)) == 3  # nothing answered was dropped
    assert worker.stopped_event.is_set()


@pytest.mark.parametrize("code", [KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN])
def test_a_passing_consumer_error_does_not_stop_the_worker(code: int) -> None:
    broker = FakeBroker()
    broker.create_topic(request_topic("de"), 1)
    broker.create_topic(REPLIES, 1)
    broker.create_topic(DEAD_LETTERS, 1)
    sent = threading.Event()

    class OneError(FakeConsumer):
        def consume(self, num_messages: int = 1, timeout: float = -1) -> list[FakeMessage]:
            if not sent.is_set():
                sent.set()
                return [FakeMessage("", -1, -1, None, None, 0, error=KafkaError(code))]
            return super().consume(num_messages, timeout)

    worker = Worker(
        Settings(languages=("de",), metrics_port=0, health_port=0, poll_timeout_s=0.01),
        FakeEngine(),
        lambda conf: OneError(broker, conf),
        broker.producer_factory(),
        store=InMemoryResultStore(),
        registry=CollectorRegistry(),
    )
    thread = worker.run_in_thread()
    try:
        broker.append(request_topic("de"), b"r0", request_bytes("r0", "hi"))
        wait_for(lambda: len(broker.records(REPLIES)) == 1, what="a reply after the error")
        assert sent.is_set() and thread.is_alive()
    finally:
        worker.stop()
        thread.join(10)
