"""No Kafka handle is closed under another thread's call (issue 26, the native crash).

confluent-kafka-python's `Consumer.close()` destroys the librdkafka handle and its queue with
the GIL released; a `consume()`/`poll()` still running on another thread keeps using the queue
it captured at entry (its wakeable loop re-enters librdkafka every 200 ms): a use-after-free.
Before the fix, `ArmControlReader.stop()` and `TranslationClient.close()` joined their polling
thread with a bound (5 s, 10 s) and closed the consumer anyway when the thread was still inside
a call, and the drain monitor's AdminClient outlived its thread into interpreter shutdown.
Each race is made deterministic here with a call that blocks past the bound
(`tests/workers/handle_witness.py` records what was running when `close()` came), on fakes and
on the real broker.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from tests.kafka_fixtures import kafka_bootstrap  # noqa: F401
from tests.workers.handle_witness import HandleWitness
from workers.client import TranslationClient
from workers.kafka.arm_reader import ArmControlReader
from workers.kafka.drain import BrokerOffsetsReader, DrainMonitor


class _Meta:
    def __init__(self, topic: str) -> None:
        part = type("P", (), {})()
        self.topics = {topic: type("T", (), {"error": None, "partitions": {0: part}})()}


class GatedConsumer:
    """A fake consumer whose `consume()`/`poll()` on a thread other than the creating one
    blocks (once `gate_on` is set) until `release` is set: a call still running when the
    stopping thread gives up waiting."""

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self.owner = threading.get_ident()
        self.gate_on = threading.Event()
        self.entered = threading.Event()
        self.release = threading.Event()
        self.on_assign: Any = None
        self.assigned = False

    def _gate(self) -> None:
        if self.gate_on.is_set() and threading.get_ident() != self.owner:
            self.entered.set()
            self.release.wait(30)

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> _Meta:
        return _Meta(self.topic)

    def assign(self, partitions: list[TopicPartition]) -> None:
        pass

    def get_watermark_offsets(self, tp: TopicPartition, **kw: Any) -> tuple[int, int]:
        return (0, 0)

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Any]:
        self._gate()
        time.sleep(0.01)
        return []

    def subscribe(self, topics: list[str], on_assign: Any = None, **kw: Any) -> None:
        self.on_assign = on_assign

    def incremental_assign(self, partitions: list[TopicPartition]) -> None:
        pass

    def poll(self, timeout: float = -1) -> None:
        if not self.assigned and self.on_assign is not None:
            self.assigned = True
            self.on_assign(self, [TopicPartition(self.topic, 0)])
        self._gate()
        time.sleep(0.01)
        return None

    def close(self) -> None:
        pass


class _Producer:
    def poll(self, timeout: float = 0) -> int:
        return 0

    def flush(self, timeout: float = -1) -> int:
        return 0


def _create_topic(conf: dict[str, Any], topic: str) -> None:
    admin = AdminClient(conf)  # kept until the result is in (a dropped client cancels it)
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)


def _wait(cond: Any, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


# -- the arm control reader ------------------------------------------------------------------


def _stop_reader_while_consume_blocks(witness: HandleWitness, reader: ArmControlReader) -> None:
    """`stop()` with its default bound while the reader thread sits in a consume() that lasts
    longer; then let the call return."""
    stopper = threading.Thread(target=reader.stop)
    stopper.start()
    stopper.join(30)
    assert not stopper.is_alive()
    assert witness.closed_during == []  # nothing was closed under the running consume()


def test_arm_reader_stop_never_closes_the_consumer_under_a_running_consume() -> None:
    fake = GatedConsumer("ctl")
    witness = HandleWitness(fake)
    reader = ArmControlReader({}, "ctl", consumer_factory=lambda conf: witness)
    reader.start()
    fake.gate_on.set()
    assert fake.entered.wait(10)
    _stop_reader_while_consume_blocks(witness, reader)
    fake.release.set()
    assert _wait(lambda: witness.close_threads)  # the reader thread closes it on its way out
    assert witness.close_threads == ["tolk-arm-control"]
    assert witness.closed_during == [] and witness.calls_after_close == []


def test_arm_reader_without_a_thread_closes_on_the_callers_thread() -> None:
    witness = HandleWitness(GatedConsumer("ctl"))
    reader = ArmControlReader({}, "ctl", consumer_factory=lambda conf: witness)
    assert reader.read_to_end()
    reader.stop()
    assert witness.close_threads == [threading.current_thread().name]


@pytest.mark.kafka
def test_arm_reader_on_the_broker_closes_only_after_its_long_consume_returned(
    kafka_bootstrap: str,  # noqa: F811
) -> None:
    topic = f"t26.{uuid.uuid4().hex[:8]}.control"
    conf = {"bootstrap.servers": kafka_bootstrap}
    _create_topic(conf, topic)
    witnesses: list[HandleWitness] = []

    def factory(c: dict[str, Any]) -> HandleWitness:
        witnesses.append(HandleWitness(Consumer(c)))
        return witnesses[-1]

    # each consume() of the reader thread waits 7 s on an empty topic: longer than stop()'s 5 s
    reader = ArmControlReader(conf, topic, consumer_factory=factory, poll_timeout_s=7.0)
    reader.start()
    (witness,) = witnesses
    assert _wait(lambda: witness.in_call("consume"))
    _stop_reader_while_consume_blocks(witness, reader)
    assert _wait(lambda: witness.close_threads, timeout=15)
    assert witness.close_threads == ["tolk-arm-control"]
    assert witness.closed_during == [] and witness.calls_after_close == []


# -- the client -------------------------------------------------------------------------------


async def _close_while_poll_blocks(client: TranslationClient, witness: HandleWitness) -> None:
    client.close_wait_s = 0.5  # close()'s wait for the poll thread (10 s before: same race)
    await client.close()
    assert witness.closed_during == []  # close() did not close it under the running poll()


def test_client_close_never_closes_the_consumer_under_a_running_poll() -> None:
    fake = GatedConsumer("replies")
    witness = HandleWitness(fake)

    async def run() -> None:
        client = TranslationClient(
            "unused:1",
            reply_topic="replies",
            producer_factory=lambda conf: _Producer(),
            consumer_factory=lambda conf: witness,
        )
        await client.start()
        fake.gate_on.set()
        assert await asyncio.to_thread(fake.entered.wait, 10)
        closing = asyncio.create_task(_close_while_poll_blocks(client, witness))
        await asyncio.sleep(0)
        await asyncio.wait_for(closing, 30)

    asyncio.run(run())
    fake.release.set()
    assert _wait(lambda: witness.close_threads)
    assert witness.close_threads == ["tolk-client"]  # the poll thread closed it, once
    assert witness.closed_during == [] and witness.calls_after_close == []


class _GatedRealConsumer:
    """A real consumer whose `poll()` on the client's thread waits at a gate first."""

    def __init__(self, conf: dict[str, Any]) -> None:
        self.real = Consumer(conf)
        self.gate_on = threading.Event()
        self.entered = threading.Event()
        self.release = threading.Event()

    def poll(self, timeout: float = -1) -> Any:
        if self.gate_on.is_set():
            self.entered.set()
            self.release.wait(30)
        return self.real.poll(timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@pytest.mark.kafka
def test_client_on_the_broker_closes_its_consumer_on_the_poll_thread(
    kafka_bootstrap: str,  # noqa: F811
) -> None:
    topic = f"t26.{uuid.uuid4().hex[:8]}.replies"
    conf = {"bootstrap.servers": kafka_bootstrap}
    _create_topic(conf, topic)
    made: list[tuple[_GatedRealConsumer, HandleWitness]] = []

    def factory(c: dict[str, Any]) -> HandleWitness:
        gated = _GatedRealConsumer(c)
        made.append((gated, HandleWitness(gated)))
        return made[-1][1]

    async def run() -> None:
        client = TranslationClient(kafka_bootstrap, reply_topic=topic, consumer_factory=factory)
        await client.start()
        gated, witness = made[0]
        gated.gate_on.set()
        assert await asyncio.to_thread(gated.entered.wait, 10)
        await _close_while_poll_blocks(client, witness)

    asyncio.run(run())
    gated, witness = made[0]
    gated.release.set()
    assert _wait(lambda: witness.close_threads)
    assert witness.close_threads == ["tolk-client"]
    assert witness.closed_during == [] and witness.calls_after_close == []
    with pytest.raises(RuntimeError):  # really closed: the handle refuses calls
        gated.real.assignment()


# -- the drain monitor's AdminClient ----------------------------------------------------------


def _rdk_threads() -> set[str]:
    """The ids of this process's librdkafka threads (rdk:main, rdk:broker..., rdk:background)."""
    out = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().startswith("rdk:"):
                out.add(task.name)
        except OSError:  # the thread ended meanwhile
            pass
    return out


@pytest.mark.kafka
def test_drain_monitor_destroys_its_admin_client_on_its_thread_when_stopped(
    kafka_bootstrap: str,  # noqa: F811
) -> None:
    before = _rdk_threads()
    reader = BrokerOffsetsReader(
        {"bootstrap.servers": kafka_bootstrap}, f"g26-{uuid.uuid4().hex[:6]}", {"de": ["none"]}
    )
    monitor = DrainMonitor(reader, interval_s=0.2).start()
    assert _wait(lambda: monitor.estimates)  # one refresh went through the admin client
    admin_threads = _rdk_threads() - before
    assert admin_threads
    monitor.stop()
    # the handle is gone (its librdkafka threads joined) while the monitor is still referenced
    assert _wait(lambda: not (_rdk_threads() & admin_threads), timeout=10)
    with pytest.raises(RuntimeError):
        reader()
