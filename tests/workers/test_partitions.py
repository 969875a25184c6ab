"""PartitionState: rewinds that fail hold their partition, and who answers a record of a
partition revoked while it was in flight."""

from __future__ import annotations

from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition
from prometheus_client import CollectorRegistry

from workers.kafka.partitions import PartitionState
from workers.metrics import WorkerMetrics

DE = ("tolk.requests.de", 0)
FR = ("tolk.requests.fr", 0)


class SeekFails:
    """Consumer stand-in: seek raises `failures` times, then works; pauses are recorded."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.seeks: list[tuple[tuple[str, int], int]] = []
        self.paused: set[tuple[str, int]] = set()

    def seek(self, p: TopicPartition) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise KafkaException(KafkaError(KafkaError._STATE))
        self.seeks.append(((p.topic, p.partition), p.offset))

    def pause(self, parts: list[TopicPartition]) -> None:
        self.paused.update((p.topic, p.partition) for p in parts)

    def resume(self, parts: list[TopicPartition]) -> None:
        self.paused.difference_update((p.topic, p.partition) for p in parts)

    def incremental_assign(self, parts: list[TopicPartition]) -> None:
        pass


def state(consumer: Any) -> tuple[PartitionState, CollectorRegistry]:
    registry = CollectorRegistry()
    ps = PartitionState(
        {DE[0]: "de", FR[0]: "fr"}, WorkerMetrics(registry), commit_every=1, commit_interval_s=1
    )
    ps.assign(consumer, [TopicPartition(*DE), TopicPartition(*FR)], paused_langs=())
    return ps, registry


def test_failed_rewind_holds_the_partition_until_a_retry_works() -> None:
    consumer = SeekFails(failures=2)
    ps, registry = state(consumer)
    assert not ps.rewind(consumer, DE, 7)
    assert ps.held == {DE: 7} and DE in consumer.paused
    ps.reconcile(consumer, paused_langs=())  # the language is not paused: still held
    assert DE in consumer.paused
    ps.retry_rewinds(consumer)  # fails again
    assert ps.held == {DE: 7}
    ps.retry_rewinds(consumer)  # works
    assert ps.held == {} and consumer.seeks == [(DE, 7)]
    ps.reconcile(consumer, paused_langs=())
    assert DE not in consumer.paused
    assert registry.get_sample_value("tolk_worker_seek_failures_total", {"lang": "de"}) == 2


def test_revoke_clears_a_pending_rewind() -> None:
    consumer = SeekFails(failures=5)
    ps, _ = state(consumer)
    ps.rewind(consumer, DE, 3)
    ps.forget({DE})
    assert ps.held == {}
    ps.retry_rewinds(consumer)
    assert consumer.failures == 4  # no further seek of a partition that is not ours


def test_ownership_of_a_record_by_assignment_generation() -> None:
    consumer = SeekFails(failures=0)
    ps, _ = state(consumer)
    gen = ps.generation(DE)
    for o in range(3):
        ps.tracker.track(DE, o)
    ps.mark_done(DE, 0)
    ps.tracker.mark_committed(ps.tracker.committable())  # offset 0 done and committed: 1
    assert ps.ownership(DE, gen, 1) == "owned"
    ps.forget({DE})
    assert ps.ownership(DE, gen, 1) == "gone"  # not committed: the new owner answers it
    assert ps.ownership(DE, gen, 0) == "committed"  # nobody reads it again
    ps.assign(consumer, [TopicPartition(*DE)], paused_langs=())
    assert ps.generation(DE) != gen
    assert ps.ownership(DE, gen, 1) == "reassigned"  # ours again: answered here
    assert ps.ownership(DE, ps.generation(DE), 1) == "owned"
