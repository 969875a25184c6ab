"""An arm's worker without a broker: routing, replies, store keys (workers/kafka/arm_routing.py),
and
the control-topic reader over a scripted consumer (workers/kafka/arm_reader.py).

tests/workers/test_arms_kafka.py runs the same against the real broker with two arms.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from confluent_kafka import KafkaError, TopicPartition
from prometheus_client import CollectorRegistry

from schemas.codec import decode_result, encode_arm_shares, encode_request
from tests.workers.fakes import FakeBroker, FakeEngine, FakeMessage
from tests.workers.polling import wait_for
from topics.catalog import DEAD_LETTERS, REPLIES, request_topic
from workers.arms import MIRROR_METADATA_KEY, ShareTable, choose_arm
from workers.kafka.arm_control import StaticShares
from workers.kafka.arm_reader import ArmControlReader
from workers.kafka.arm_routing import ArmScopedStore
from workers.settings import Settings
from workers.store.results import InMemoryResultStore
from workers.worker import Worker

SHARES = {"A": 30.0, "B": 70.0}


def request_bytes(rid: str, conversation: str | None, **kw: Any) -> bytes:
    record: dict[str, Any] = {
        "request_id": rid,
        "conversation_id": conversation,
        "source_lang": "en",
        "target_lang": "de",
        "text": "hello big world",
        "created_at": 0,
        "deadline": None,
        "reply_topic": REPLIES,
        "metadata": {},
    }
    record.update(kw)
    return encode_request(record)


@dataclass
class ArmRig:
    broker: FakeBroker
    worker: Worker
    thread: threading.Thread
    store: InMemoryResultStore
    registry: CollectorRegistry

    def send(self, value: bytes) -> None:
        self.broker.append(request_topic("de"), None, value, 0)

    def replies(self) -> list[dict[str, Any]]:
        return [decode_result(v) for _k, v in self.broker.records(REPLIES) if v]

    def committed(self) -> int:
        return sum(o for (_g, t, _p), o in self.broker.committed.items() if "requests" in t)


@pytest.fixture
def arm_a() -> Iterator[ArmRig]:
    broker = FakeBroker()
    broker.create_topic(request_topic("de"), 1)
    broker.create_topic(REPLIES, 1)
    broker.create_topic(DEAD_LETTERS, 1)
    store = InMemoryResultStore()
    registry = CollectorRegistry()
    settings = Settings(
        languages=("de",),
        arm="A",
        metrics_port=0,
        worker_id="w-arm-a",
        commit_interval_s=0.05,
        poll_timeout_s=0.01,
        drain_timeout_s=2.0,
    )
    worker = Worker(
        settings,
        FakeEngine(),
        broker.consumer_factory(),
        broker.producer_factory(),
        store=store,
        registry=registry,
        arm_shares=StaticShares(ShareTable({"de": SHARES})),
    )
    rig = ArmRig(broker, worker, worker.run_in_thread(), store, registry)
    yield rig
    worker.stop()
    rig.thread.join(10)
    assert not rig.thread.is_alive()


def test_an_arm_answers_its_share_and_marks_the_rest_done(arm_a: ArmRig) -> None:
    conversations = [f"conv-{i}" for i in range(60)]
    for i, conv in enumerate(conversations):
        arm_a.send(request_bytes(f"r-{i}", conv))
    mine = {f"r-{i}" for i, c in enumerate(conversations) if choose_arm(SHARES, c) == "A"}
    assert 0 < len(mine) < len(conversations)
    wait_for(lambda: arm_a.committed() == len(conversations), what="every offset committed")
    wait_for(lambda: len(arm_a.replies()) >= len(mine), what="A's replies")
    replies = arm_a.replies()
    assert {r["request_id"] for r in replies} == mine
    assert len(replies) == len(mine)  # once each
    assert {r["model_version"] for r in replies} == {"fake-1@A"}
    skipped = arm_a.registry.get_sample_value("tolk_arm_skipped_total", {"lang": "de"})
    assert skipped == len(conversations) - len(mine)
    # the store is keyed per arm: a mirrored request answered by B too would not collide
    rid = sorted(mine)[0]
    assert arm_a.store.get(f"{rid}@A") is not None
    assert arm_a.store.get(rid) is None


def test_mirror_and_named_requests_and_plain_replies_carry_the_arm(arm_a: ArmRig) -> None:
    b_conv = next(f"c-{i}" for i in range(100) if choose_arm(SHARES, f"c-{i}") == "B")
    arm_a.send(request_bytes("mirrored", b_conv, metadata={MIRROR_METADATA_KEY: "1"}))
    arm_a.send(request_bytes("named-a", b_conv, model_version="gemma3-270m@A"))
    arm_a.send(request_bytes("named-b", b_conv, model_version="gemma3-270m@B"))
    arm_a.send(request_bytes("shares-b", b_conv))
    # the engine refuses the source language: a reply made without the engine
    arm_a.send(request_bytes("refused", b_conv, source_lang="xx", model_version="A"))
    wait_for(lambda: arm_a.committed() == 5, what="every offset committed")
    wait_for(lambda: len(arm_a.replies()) >= 3, what="A's replies")
    by_id = {r["request_id"]: r for r in arm_a.replies()}
    assert set(by_id) == {"mirrored", "named-a", "refused"}
    assert by_id["mirrored"]["model_version"] == "fake-1@A"
    assert by_id["refused"]["status"] == "REJECTED"
    assert by_id["refused"]["model_version"] == "@A"


def test_arm_scoped_store_keys() -> None:
    inner = InMemoryResultStore()
    a, b = ArmScopedStore(inner, "A"), ArmScopedStore(inner, "B")
    a.put("r-1", b"from A")
    assert a.get("r-1") == b"from A"
    assert b.get("r-1") is None
    assert b.get_many(["r-1", "r-2"]) == [None, None]
    assert inner.get("r-1@A") == b"from A"


def test_consumer_group_is_per_arm() -> None:
    assert Settings(group_id="g").consumer_group() == "g"
    assert Settings(group_id="g", arm="B").consumer_group() == "g.B"
    assert Settings.from_env({"TOLK_ARM": "cand-1"}).arm == "cand-1"
    with pytest.raises(ValueError, match="invalid arm name"):
        Settings(arm="a@b")


# -- the control-topic reader over a scripted consumer ---------------------------------------------


class _Meta:
    def __init__(self, partitions: dict[int, Any] | None, error: Any = None) -> None:
        self.partitions = partitions or {}
        self.error = error


class ScriptedConsumer:
    """What ArmControlReader uses of a confluent-kafka Consumer, over a list of records."""

    def __init__(self, topic: str, records: list[tuple[bytes | None, bytes | None]]) -> None:
        self.topic = topic
        self.log = [FakeMessage(topic, 0, i, k, v, 0) for i, (k, v) in enumerate(records)]
        self.position = 0
        self.assigned: list[TopicPartition] = []
        self.closed = False

    def list_topics(self, topic: str, timeout: float) -> Any:
        return type("M", (), {"topics": {topic: _Meta({0: None})}})()

    def assign(self, partitions: list[TopicPartition]) -> None:
        self.assigned = partitions

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float) -> tuple[int, int]:
        return 0, len(self.log)

    def consume(self, num_messages: int, timeout: float) -> list[FakeMessage]:
        out = self.log[self.position : self.position + num_messages]
        self.position += len(out)
        return out

    def close(self) -> None:
        self.closed = True


def shares_value(language: str, shares: dict[str, float]) -> bytes:
    return encode_arm_shares(
        {"language": language, "shares": shares, "updated_at": 1, "updated_by": "test"}
    )


def test_reader_applies_changes_tombstones_and_ignores_bad_values() -> None:
    records: list[tuple[bytes | None, bytes | None]] = [
        (b"de", shares_value("de", {"A": 30.0, "B": 70.0})),
        (b"*", shares_value("*", {"A": 100.0})),
        (b"fr", shares_value("fr", {"A": 50.0, "B": 50.0})),
        (b"de", shares_value("de", {"A": 40.0, "B": 60.0})),
        (b"fr", None),  # tombstone: fr falls back to '*'
        (b"de", b"not avro"),  # ignored: de keeps 40/60
        (b"de", shares_value("de", {"A": 10.0, "B": 10.0})),  # invalid sum: ignored
    ]
    consumer = ScriptedConsumer("ctl", records)
    reader = ArmControlReader({}, "ctl", consumer_factory=lambda conf: consumer)
    assert reader.read_to_end()
    table = reader.table()
    assert consumer.assigned and consumer.assigned[0].topic == "ctl"
    assert table.shares_for("de") == {"A": 40.0, "B": 60.0}
    assert table.shares_for("fr") == {"A": 100.0}  # the default entry
    assert "fr" not in table.entries
    assert reader.changes == 5
    reader.stop()
    assert consumer.closed


def test_reader_without_the_topic_serves_an_empty_table() -> None:
    class NoTopic(ScriptedConsumer):
        def list_topics(self, topic: str, timeout: float) -> Any:
            err = KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)
            return type("M", (), {"topics": {topic: _Meta(None, err)}})()

    consumer = NoTopic("ctl", [])
    reader = ArmControlReader({}, "ctl", consumer_factory=lambda conf: consumer)
    assert not reader.read_to_end()
    assert not reader.table()
    assert consumer.assigned == []


def test_arms_set_refuses_bad_shares_before_touching_kafka() -> None:
    from typer.testing import CliRunner

    from workers.cli import app

    runner = CliRunner()
    bad_sum = runner.invoke(app, ["arms", "set", "de", "A=30", "B=60", "-b", "127.0.0.1:1"])
    assert bad_sum.exit_code == 1
    assert "sum to 100" in bad_sum.output
    bad_lang = runner.invoke(app, ["arms", "set", "DE!", "A=100", "-b", "127.0.0.1:1"])
    assert bad_lang.exit_code == 1
    assert "invalid language code" in bad_lang.output
