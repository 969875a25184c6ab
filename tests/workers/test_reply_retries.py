"""The reply path never loses a request: retried replies, retried dead letters, a full queue.

`ReplyPublisher` on the in-memory broker (tests/workers/fakes.py) with a real `OffsetTracker`
behind `mark_done`, so each test can check the commit point while deliveries fail: a record
whose reply or dead letter is not delivered yet must hold its partition's commit point, while
the records after it keep being answered. Retries are served by `retry_due(now)`; the tests
pass `now` themselves (the publisher schedules on `time.monotonic()`), so nothing sleeps.

The last test runs a whole `Worker` on the fake broker to check that its loop serves the retry
queue.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException
from prometheus_client import CollectorRegistry

from schemas.codec import decode_dead_letter, decode_result, encode_request
from schemas.wire import read_request
from tests.workers.fakes import FakeBroker, FakeEngine, FakeProducer, fake_translation
from tests.workers.polling import wait_for
from topics.catalog import DEAD_LETTERS, REPLIES, request_topic
from workers.fairness.policy import DEFAULT_POLICIES
from workers.kafka.config import ReplyTopicChecker
from workers.kafka.offsets import OffsetTracker
from workers.kafka.records import ConsumedRecord
from workers.kafka.reply_publisher import ReplyConfig, ReplyPublisher
from workers.kafka.reply_retry import retry_delay_s
from workers.metrics import WorkerMetrics
from workers.settings import Settings
from workers.store.results import InMemoryResultStore
from workers.worker import Worker

NOW_MS = 1_700_000_000_000
TOPIC = request_topic("de")
TP = (TOPIC, 0)

RETRIABLE = [
    KafkaError._MSG_TIMED_OUT,
    KafkaError._QUEUE_FULL,
    KafkaError.NOT_ENOUGH_REPLICAS,
    KafkaError.THROTTLING_QUOTA_EXCEEDED,
    KafkaError._TRANSPORT,
    KafkaError._ALL_BROKERS_DOWN,
    KafkaError.REQUEST_TIMED_OUT,
]


class FlakyProducer(FakeProducer):
    """A FakeProducer whose produce() can fail per topic: a queue of delivery errors
    (`fail_deliveries`), or an exception raised by produce() itself (`raise_on_produce`)."""

    def __init__(self, broker: FakeBroker) -> None:
        super().__init__(broker, {})
        self.fail_deliveries: dict[str, list[KafkaError]] = {}
        self.raise_on_produce: dict[str, list[BaseException]] = {}
        self.produced: list[str] = []  # topics, one per produce() call that was accepted

    def produce(
        self,
        topic: str,
        value: Any = None,
        key: Any = None,
        on_delivery: Any = None,
        headers: Any = None,
    ) -> None:
        raising = self.raise_on_produce.get(topic)
        if raising:
            raise raising.pop(0)
        failing = self.fail_deliveries.get(topic)
        if failing:
            self.fail_next[topic] = failing.pop(0)
        self.produced.append(topic)
        super().produce(topic, value=value, key=key, on_delivery=on_delivery)


@dataclass
class Setup:
    broker: FakeBroker
    producer: FlakyProducer
    store: InMemoryResultStore
    registry: CollectorRegistry
    publisher: ReplyPublisher
    tracker: OffsetTracker

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def replies(self) -> list[tuple[bytes | None, bytes | None]]:
        return self.broker.records(REPLIES)

    def dead_letters(self) -> list[dict[str, Any]]:
        return [decode_dead_letter(v) for _k, v in self.broker.records(DEAD_LETTERS) if v]

    def commit_point(self) -> int | None:
        return self.tracker.committable().get(TP)

    def retry_all_due(self) -> None:
        """Serve the retry queue as if its earliest entry were due now, then deliver."""
        due = self.publisher.next_retry_at()
        assert due is not None, "nothing is waiting for a retry"
        self.publisher.retry_due(due)
        self.producer.flush()


def make_setup(offsets: tuple[int, ...] = (5, 6, 7)) -> Setup:
    broker = FakeBroker()
    for topic in (TOPIC, REPLIES, DEAD_LETTERS):
        broker.create_topic(topic)
    producer = FlakyProducer(broker)
    registry = CollectorRegistry()
    tracker = OffsetTracker()
    tracker.assign([TP])
    for offset in offsets:
        tracker.track(TP, offset)
    store = InMemoryResultStore()
    publisher = ReplyPublisher(
        ReplyConfig(DEAD_LETTERS, "w-retry", DEFAULT_POLICIES),
        store=store,
        metrics=WorkerMetrics(registry),
        reply_topics=ReplyTopicChecker(ttl_s=3600.0),
        mark_done=tracker.done,
        clock_ms=lambda: NOW_MS,
    )
    publisher.attach(producer)
    return Setup(broker, producer, store, registry, publisher, tracker)


def record(rid: str, offset: int) -> ConsumedRecord:
    value = encode_request(
        {
            "request_id": rid,
            "conversation_id": None,
            "source_lang": "en",
            "target_lang": "de",
            "text": "hello world",
            "created_at": NOW_MS - 500,
            "deadline": None,
            "reply_topic": REPLIES,
            "metadata": {},
        }
    )
    return ConsumedRecord(
        tp=TP,
        offset=offset,
        key=rid.encode(),
        value=value,
        lang="de",
        broker_ts_ms=NOW_MS - 400,
        request=read_request(value),
    )


def test_retry_delay_doubles_from_half_a_second_to_thirty() -> None:
    assert [retry_delay_s(n) for n in range(1, 9)] == [0.5, 1, 2, 4, 8, 16, 30, 30]


# -- dead letters -----------------------------------------------------------------------------


def test_undelivered_dead_letter_holds_the_commit_point_and_is_retried_with_backoff() -> None:
    s = make_setup()
    with s.broker.lock:
        del s.broker.topics[DEAD_LETTERS]  # the dead-letter topic is unavailable
    s.publisher.dead_letter(record("bad", 5), "poison", "boom")
    s.publisher.produce_reply(record("r6", 6), b"reply 6", store=True)
    s.publisher.produce_reply(record("r7", 7), b"reply 7", store=True)
    before = time.monotonic()
    s.producer.flush()
    after = time.monotonic()

    assert len(s.replies()) == 2  # the records after it were answered ...
    assert s.commit_point() == 5  # ... but nothing is committed past the dead letter
    assert s.tracker.pending(TP) == 1
    assert s.metric("tolk_reply_retry_pending") == 1
    due = s.publisher.next_retry_at()
    assert due is not None and before + 0.5 <= due <= after + 0.5

    s.publisher.retry_due(due - 0.01)  # not due yet: nothing produced
    assert s.producer.produced.count(DEAD_LETTERS) == 1
    before = time.monotonic()
    s.publisher.retry_due(due)  # due: produced again, fails again (topic still missing)
    s.producer.flush()
    after = time.monotonic()
    assert s.producer.produced.count(DEAD_LETTERS) == 2
    second = s.publisher.next_retry_at()
    assert second is not None and before + 1.0 <= second <= after + 1.0  # the delay doubled
    assert s.commit_point() == 5

    s.broker.create_topic(DEAD_LETTERS)  # the topic is back
    s.retry_all_due()
    (dl,) = s.dead_letters()
    assert dl["reason"] == "poison" and dl["offset"] == 5 and dl["exception"] == "boom"
    assert s.commit_point() == 8  # everything through offset 7 is done now
    assert s.publisher.next_retry_at() is None
    assert s.metric("tolk_reply_retry_pending") == 0
    assert s.metric("tolk_reply_retries_total", kind="dead_letter") == 2
    assert s.metric("tolk_worker_dead_letters_total", reason="poison") == 1  # counted once


def test_poison_is_dead_lettered_then_answered_error_and_done_only_after_both() -> None:
    s = make_setup(offsets=(5,))
    with s.broker.lock:
        del s.broker.topics[DEAD_LETTERS]  # the dead letter fails first ...
    s.publisher.dead_letter_and_reply_error(record("bad", 5), "poison", "3 engine runs failed")
    s.producer.flush()
    assert s.replies() == []  # ... so the ERROR reply waits behind it
    assert s.commit_point() == 5
    assert s.publisher.pending_reply("bad") is not None  # a duplicate read now gets these bytes

    s.broker.create_topic(DEAD_LETTERS)
    s.retry_all_due()
    (dl,) = s.dead_letters()
    assert dl["reason"] == "poison" and dl["offset"] == 5
    ((key, value),) = s.replies()
    reply = decode_result(value or b"")
    assert key == b"bad" and reply["status"] == "ERROR"
    assert reply["error"] == "poison: 3 engine runs failed"
    assert s.commit_point() == 6  # done once both are out
    assert s.store.get_many(["bad"]) == [value]  # a redelivery is answered from the store
    assert s.publisher.pending_reply("bad") is None


@pytest.mark.parametrize(
    "raised",
    [
        KafkaException(KafkaError(KafkaError._TRANSPORT)),
        BufferError("Local: Queue full"),
        RuntimeError("producer went away"),
    ],
)
def test_dead_letter_whose_produce_raises_is_kept_and_retried(raised: BaseException) -> None:
    s = make_setup(offsets=(5,))
    # BufferError: more refusals than the publisher's in-place attempts, so it must queue
    s.producer.raise_on_produce[DEAD_LETTERS] = [raised] * 150
    s.publisher.dead_letter(record("bad", 5), "undecodable", "bad magic byte")
    s.producer.flush()
    assert s.dead_letters() == [] and s.commit_point() == 5

    s.producer.raise_on_produce[DEAD_LETTERS] = []
    s.retry_all_due()
    assert len(s.dead_letters()) == 1 and s.commit_point() == 6


def test_dead_letter_too_large_goes_out_without_the_original_bytes() -> None:
    s = make_setup(offsets=(5,))
    s.producer.fail_deliveries[DEAD_LETTERS] = [KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)]
    rec = record("huge", 5)
    s.publisher.dead_letter(rec, "poison", "boom")
    s.producer.flush()
    (dl,) = s.dead_letters()  # no retry needed: a slimmer dead letter went out at once
    assert dl["original"] == b"" and dl["offset"] == 5 and dl["topic"] == TOPIC
    assert dl["reason"] == "poison"
    assert f"original of {len(rec.value)} bytes left out" in dl["exception"]
    assert s.commit_point() == 6


# -- replies ----------------------------------------------------------------------------------


@pytest.mark.parametrize("code", RETRIABLE)
def test_retriable_reply_failure_is_produced_again_not_dead_lettered(code: int) -> None:
    s = make_setup(offsets=(5, 6))
    s.producer.fail_deliveries[REPLIES] = [KafkaError(code)]
    s.publisher.answer_without_engine(record("r5", 5), "REJECTED", "empty_text", "text is empty")
    s.publisher.produce_reply(record("r6", 6), b"reply 6", store=True)
    s.producer.flush()

    assert s.dead_letters() == []
    assert [k for k, _v in s.replies()] == [b"r6"]
    held = s.publisher.pending_reply("r5")  # a duplicate read meanwhile gets the same bytes
    assert held is not None and s.store.get("r5") is None
    assert s.commit_point() == 5

    s.retry_all_due()
    assert [k for k, _v in s.replies()] == [b"r6", b"r5"]
    assert s.broker.records(REPLIES)[1][1] == held and s.store.get("r5") == held
    assert s.publisher.pending_reply("r5") is None
    assert s.commit_point() == 7 and s.dead_letters() == []
    assert s.metric("tolk_reply_retries_total", kind="reply") == 1
    assert s.metric("tolk_reply_retry_pending") == 0


def test_reply_becomes_a_dead_letter_after_the_configured_attempts() -> None:
    s = make_setup(offsets=(5,))
    s.producer.fail_deliveries[REPLIES] = [KafkaError(KafkaError._MSG_TIMED_OUT)] * 10
    s.publisher.produce_reply(record("r5", 5), b"reply 5", store=True)
    s.producer.flush()
    for _ in range(4):  # reply_attempts = 5: the first produce and 4 retries
        assert s.dead_letters() == [] and s.commit_point() == 5
        s.retry_all_due()
    assert s.producer.produced.count(REPLIES) == 5
    (dl,) = s.dead_letters()
    assert dl["reason"] == "reply_undeliverable" and "after 5 attempts" in dl["exception"]
    assert s.replies() == [] and s.publisher.pending_reply("r5") is None
    assert s.commit_point() == 6 and s.publisher.next_retry_at() is None
    assert s.metric("tolk_reply_retries_total", kind="reply") == 4


@pytest.mark.parametrize(
    "code",
    [
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    ],
)
def test_permanent_reply_failure_is_dead_lettered_at_once(code: int) -> None:
    s = make_setup(offsets=(5,))
    s.producer.fail_deliveries[REPLIES] = [KafkaError(code)]
    s.publisher.produce_reply(record("r5", 5), b"reply 5", store=True)
    s.producer.flush()
    assert len(s.dead_letters()) == 1 and s.commit_point() == 6
    assert s.publisher.next_retry_at() is None


def test_producer_queue_full_past_the_in_place_attempts_queues_the_reply() -> None:
    s = make_setup(offsets=(5,))
    full = [BufferError("Local: Queue full")] * 150
    s.producer.raise_on_produce[REPLIES] = list(full)
    s.producer.raise_on_produce[DEAD_LETTERS] = list(full)
    s.publisher.produce_reply(record("r5", 5), b"reply 5", store=True)
    s.producer.flush()
    assert s.dead_letters() == [] and s.replies() == []  # neither dead-lettered ...
    assert s.commit_point() == 5  # ... nor marked done (lost)
    assert s.publisher.pending_reply("r5") == b"reply 5"

    s.producer.raise_on_produce[REPLIES] = []
    s.retry_all_due()
    assert s.replies() == [(b"r5", b"reply 5")] and s.commit_point() == 6


def test_a_retry_meeting_a_full_queue_waits_without_spending_an_attempt() -> None:
    s = make_setup(offsets=(5,))
    s.producer.fail_deliveries[REPLIES] = [KafkaError(KafkaError._MSG_TIMED_OUT)] * 4
    s.publisher.produce_reply(record("r5", 5), b"reply 5", store=True)
    s.producer.flush()
    for _ in range(3):  # a retry that meets a full queue does not count as an attempt
        s.producer.raise_on_produce[REPLIES] = [BufferError("Local: Queue full")]
        s.retry_all_due()
    for _ in range(4):  # 3 more failed deliveries, then it goes through
        s.retry_all_due()
    assert s.dead_letters() == [] and len(s.replies()) == 1 and s.commit_point() == 6


# -- the worker's loop serves the retry queue -------------------------------------------------


@pytest.fixture
def worker_rig() -> Iterator[tuple[FakeBroker, Worker]]:
    broker = FakeBroker()
    broker.create_topic(TOPIC, 1)
    broker.create_topic(REPLIES, 1)  # no dead-letter topic yet
    settings = Settings(
        languages=("de",),
        metrics_port=0,
        worker_id="w-loop",
        commit_interval_s=0.05,
        poll_timeout_s=0.01,
        drain_timeout_s=2.0,
    )
    worker = Worker(
        settings,
        FakeEngine(),
        broker.consumer_factory(),
        broker.producer_factory(),
        store=InMemoryResultStore(),
        registry=CollectorRegistry(),
    )
    thread: threading.Thread = worker.run_in_thread()
    yield broker, worker
    worker.stop()
    thread.join(10)


def test_worker_loop_retries_a_dead_letter_until_the_topic_exists(
    worker_rig: tuple[FakeBroker, Worker],
) -> None:
    broker, worker = worker_rig
    broker.append(TOPIC, b"k0", b"\x00garbage")  # offset 0: undecodable -> dead letter
    broker.append(TOPIC, b"k1", record("ok-1", 1).value)  # offset 1: translated
    wait_for(lambda: len(broker.records(REPLIES)) == 1, what="the valid request's reply")
    time.sleep(0.3)  # several commit intervals
    group = worker.settings.group_id
    assert broker.committed.get((group, TOPIC, 0), 0) == 0  # held by the dead letter
    assert worker.life.tracker.pending((TOPIC, 0)) == 1

    broker.create_topic(DEAD_LETTERS, 1)
    wait_for(lambda: len(broker.records(DEAD_LETTERS)) == 1, what="the retried dead letter")
    wait_for(lambda: broker.committed.get((group, TOPIC, 0)) == 2, what="the commit past it")
    ((_key, value),) = broker.records(REPLIES)
    assert value is not None and fake_translation("hello world", "de").encode() in value
