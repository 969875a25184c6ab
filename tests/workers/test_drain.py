"""Time to drain (workers/kafka/drain.py): the pure math by hand, then the lag read from the broker.

The unit tests feed known offsets and a known clock and compare the exported gauges with the
hand computation. The Kafka test produces a known backlog to a fresh topic and group, commits
known offsets for the group the way a worker would, and checks that the lag read from the real
broker equals what was produced and not committed, and that the gauge equals lag / rate
computed by hand from the committed offsets' advance.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping, Sequence

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from prometheus_client import CollectorRegistry

from tests.kafka_fixtures import kafka_bootstrap  # noqa: F401
from tests.workers.fakes import create_prefixed_topics
from topics.catalog import request_topic
from workers.kafka.drain import (
    BrokerOffsetsReader,
    DrainMonitor,
    PartitionOffsets,
    RateSmoother,
    partition_lag,
    time_to_drain,
)
from workers.metrics import WorkerMetrics


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ScriptedOffsets:
    """An offsets reader whose answer the test sets before each refresh."""

    def __init__(self) -> None:
        self.offsets: dict[str, list[PartitionOffsets]] = {}

    def __call__(self) -> Mapping[str, Sequence[PartitionOffsets]]:
        return self.offsets


def gauge(registry: CollectorRegistry, name: str, lang: str) -> float | None:
    return registry.get_sample_value(name, {"lang": lang})


# -- the pure parts ---------------------------------------------------------------------------


def test_partition_lag_counts_from_the_commit_or_the_earliest_retained_offset() -> None:
    assert partition_lag(PartitionOffsets("t", 0, committed=40, low=0, high=100)) == 60
    # never committed: the group would start at the earliest retained record
    assert partition_lag(PartitionOffsets("t", 0, committed=-1001, low=30, high=100)) == 70
    # committed below what retention kept: the deleted records cannot be served
    assert partition_lag(PartitionOffsets("t", 0, committed=10, low=30, high=100)) == 70
    assert partition_lag(PartitionOffsets("t", 0, committed=100, low=0, high=100)) == 0


def test_time_to_drain_is_lag_over_rate_with_zero_and_infinity_at_the_edges() -> None:
    assert time_to_drain(120, 4.0) == 30.0
    assert time_to_drain(0, 0.0) == 0.0  # nothing to drain
    assert time_to_drain(5, 0.0) == math.inf  # a backlog and no progress


def test_rate_smoother_blends_each_interval_by_its_half_life() -> None:
    s = RateSmoother(half_life_s=10.0)
    assert s.observe(0, now=0.0) == 0.0  # the baseline
    # 100 served in 10 s = 10/s, weight 1 - 2**-1 = 0.5 -> 5.0
    assert s.observe(100, now=10.0) == pytest.approx(5.0)
    # 200 in 10 s = 20/s -> 5 + 0.5 * (20 - 5) = 12.5
    assert s.observe(300, now=20.0) == pytest.approx(12.5)
    # 20 s at 0/s: weight 1 - 2**-2 = 0.75 -> 12.5 * 0.25
    assert s.observe(300, now=40.0) == pytest.approx(3.125)
    # a total going backwards (offsets reset) re-bases without a negative rate
    assert s.observe(10, now=50.0) == pytest.approx(3.125)
    assert s.observe(10, now=60.0) == pytest.approx(3.125 / 2)


def test_monitor_exports_lag_rate_and_time_to_drain_by_hand_computation() -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    offsets = ScriptedOffsets()
    clock = Clock()
    monitor = DrainMonitor(offsets, metrics, half_life_s=10.0, clock=clock)

    # de: two partitions, 500 records each, the group at 100 and 300 -> lag 400 + 200 = 600
    offsets.offsets = {
        "de": [PartitionOffsets("de", 0, 100, 0, 500), PartitionOffsets("de", 1, 300, 0, 500)],
        "fr": [PartitionOffsets("fr", 0, -1001, 0, 0)],  # empty topic, never committed
    }
    first = monitor.refresh()
    assert first["de"].lag == 600 and first["de"].rate_per_s == 0.0
    assert gauge(registry, "tolk_time_to_drain_seconds", "de") == math.inf  # no rate yet
    assert gauge(registry, "tolk_time_to_drain_seconds", "fr") == 0.0
    assert gauge(registry, "tolk_consumer_lag", "de") == 600

    # 10 s later the group committed 200 more on partition 0 and 100 more on partition 1:
    # 300 served in 10 s = 30/s, smoothed with weight 0.5 -> 15/s; 100 new records arrived
    # on partition 1: lag = (500 - 300) + (600 - 400) = 400; time to drain 400 / 15
    clock.now += 10.0
    offsets.offsets["de"] = [
        PartitionOffsets("de", 0, 300, 0, 500),
        PartitionOffsets("de", 1, 400, 0, 600),
    ]
    second = monitor.refresh()
    assert second["de"].rate_per_s == pytest.approx(15.0)
    assert gauge(registry, "tolk_consumer_lag", "de") == 400
    assert gauge(registry, "tolk_group_served_rate", "de") == pytest.approx(15.0)
    assert gauge(registry, "tolk_time_to_drain_seconds", "de") == pytest.approx(400 / 15.0)


# -- the broker ---------------------------------------------------------------------------------


@pytest.mark.kafka
def test_lag_read_from_the_broker_equals_the_backlog_and_the_gauge_the_hand_computation(
    kafka_bootstrap: str,  # noqa: F811
) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}."
    create_prefixed_topics(kafka_bootstrap, prefix, ["de"], partitions=3)
    topic = prefix + request_topic("de")
    group = f"tolk-drain-{uuid.uuid4().hex[:10]}"

    backlog = 37
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 2})
    for i in range(backlog):
        producer.produce(topic, value=b"request %d" % i, key=b"conversation-%d" % (i % 7))
    assert producer.flush(30) == 0

    reader = BrokerOffsetsReader({"bootstrap.servers": kafka_bootstrap}, group, {"de": [topic]})
    parts = reader()["de"]
    assert sorted(p.partition for p in parts) == [0, 1, 2]
    assert all(p.committed < 0 for p in parts)  # a fresh group: nothing committed
    assert sum(partition_lag(p) for p in parts) == backlog

    registry = CollectorRegistry()
    clock = Clock()
    monitor = DrainMonitor(reader, WorkerMetrics(registry), half_life_s=10.0, clock=clock)
    monitor.refresh()
    assert gauge(registry, "tolk_consumer_lag", "de") == backlog
    assert gauge(registry, "tolk_time_to_drain_seconds", "de") == math.inf

    # The group answers records the way a worker does: commit offsets (no member joins).
    fullest = max(parts, key=lambda p: p.high)
    served = fullest.high - 2
    committer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group})
    try:
        committer.commit(
            offsets=[TopicPartition(topic, fullest.partition, served)], asynchronous=False
        )
    finally:
        committer.close()

    clock.now += 10.0  # served records in 10 s, weight 0.5
    estimate = monitor.refresh()["de"]
    rate = 0.5 * served / 10.0
    assert estimate.lag == backlog - served
    assert gauge(registry, "tolk_consumer_lag", "de") == backlog - served
    assert gauge(registry, "tolk_group_served_rate", "de") == pytest.approx(rate)
    assert gauge(registry, "tolk_time_to_drain_seconds", "de") == pytest.approx(
        (backlog - served) / rate
    )


@pytest.mark.kafka
@pytest.mark.redis
def test_a_running_worker_exports_its_groups_lag_until_the_backlog_is_answered(
    kafka_bootstrap: str,  # noqa: F811
    redis_url: str,  # noqa: F811
) -> None:
    from schemas.codec import encode_request
    from tests.workers.fakes import FakeEngine
    from tests.workers.polling import wait_for
    from topics.catalog import REPLIES
    from workers.settings import Settings
    from workers.worker import Worker

    prefix = f"t{uuid.uuid4().hex[:10]}."
    create_prefixed_topics(kafka_bootstrap, prefix, ["de"], partitions=2)
    engine = FakeEngine()
    engine.hold()  # answered nothing, committed nothing: the whole backlog is lag
    registry = CollectorRegistry()
    settings = Settings(
        bootstrap=kafka_bootstrap,
        redis_url=redis_url,
        group_id=f"tolk-drain-{uuid.uuid4().hex[:10]}",
        languages=("de",),
        topic_prefix=prefix,
        metrics_port=0,
        health_port=0,
        drain_refresh_s=0.2,
        worker_id="drain-test",
    )
    worker = Worker(settings, engine, registry=registry)
    thread = worker.run_in_thread()
    try:
        assert worker.assigned_event.wait(30)
        producer = Producer({"bootstrap.servers": kafka_bootstrap})
        backlog = 12
        for i in range(backlog):
            request = {
                "request_id": f"drain-{uuid.uuid4().hex}",
                "conversation_id": None,
                "source_lang": "en",
                "target_lang": "de",
                "text": f"message {i}",
                "created_at": 0,
                "deadline": None,
                "reply_topic": prefix + REPLIES,
                "metadata": {},
            }
            producer.produce(prefix + request_topic("de"), encode_request(request))
        assert producer.flush(10) == 0

        def lag() -> float | None:
            return gauge(registry, "tolk_consumer_lag", "de")

        wait_for(lambda: lag() == backlog, 30, f"lag {backlog}")
        assert gauge(registry, "tolk_time_to_drain_seconds", "de") == math.inf
        engine.release()
        wait_for(lambda: lag() == 0, 30, "lag 0 once answered and committed")
        assert gauge(registry, "tolk_time_to_drain_seconds", "de") == 0.0
        rate = gauge(registry, "tolk_group_served_rate", "de")
        assert rate is not None and rate > 0
    finally:
        worker.stop()
        thread.join(20)
