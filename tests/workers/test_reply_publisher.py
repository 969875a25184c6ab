"""`ReplyPublisher` on the in-memory broker (tests/workers/fakes.py), without a worker loop.

Delivery callbacks run only when the test calls `producer.poll()`, so each test can look at the
state between "produced" and "delivered": nothing may be stored or marked done before the
delivery report, and a failed delivery must never mark the record done as answered.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from confluent_kafka import KafkaError
from prometheus_client import CollectorRegistry

from schemas.codec import decode_dead_letter, decode_result, encode_request
from schemas.wire import read_request
from tests.workers.fakes import FakeBroker, FakeProducer
from topics.catalog import DEAD_LETTERS, REPLIES, request_topic
from workers.engine.types import FinishReason, GenerationResult, RequestHandle, Timings
from workers.fairness.policy import DEFAULT_POLICIES
from workers.kafka.config import ReplyTopicChecker
from workers.kafka.records import ConsumedRecord, InFlight
from workers.kafka.reply_publisher import ReplyConfig, ReplyPublisher
from workers.metrics import WorkerMetrics
from workers.store.results import InMemoryResultStore, ResultStoreError

NOW_MS = 1_700_000_000_000  # the publisher's (frozen) wall clock
TOPIC = request_topic("de")


class _FailingStore(InMemoryResultStore):
    def put(self, request_id: str, value: bytes) -> None:
        raise ResultStoreError("redis is down")


@dataclass
class Setup:
    broker: FakeBroker
    producer: FakeProducer
    store: InMemoryResultStore
    registry: CollectorRegistry
    reply_topics: ReplyTopicChecker
    publisher: ReplyPublisher
    done: list[tuple[tuple[str, int], int]] = field(default_factory=list)

    def deliver(self) -> None:
        """Serve every delivery report, including those produced by the reports themselves."""
        self.producer.flush()

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def replies(self) -> list[tuple[bytes | None, bytes | None]]:
        return self.broker.records(REPLIES)

    def dead_letters(self) -> list[dict[str, Any]]:
        return [decode_dead_letter(v) for _k, v in self.broker.records(DEAD_LETTERS) if v]


def make_setup(store: InMemoryResultStore | None = None) -> Setup:
    broker = FakeBroker()
    for topic in (TOPIC, REPLIES, DEAD_LETTERS):
        broker.create_topic(topic)
    producer = FakeProducer(broker, {})
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    reply_topics = ReplyTopicChecker(ttl_s=3600.0)
    done: list[tuple[tuple[str, int], int]] = []
    store = store if store is not None else InMemoryResultStore()
    publisher = ReplyPublisher(
        ReplyConfig(DEAD_LETTERS, "w-pub", DEFAULT_POLICIES),
        store=store,
        metrics=metrics,
        reply_topics=reply_topics,
        mark_done=lambda tp, offset: done.append((tp, offset)),
        clock_ms=lambda: NOW_MS,
    )
    publisher.attach(producer)
    return Setup(broker, producer, store, registry, reply_topics, publisher, done)


def record(rid: str, offset: int = 7, deadline: int | None = None) -> ConsumedRecord:
    value = encode_request(
        {
            "request_id": rid,
            "conversation_id": None,
            "source_lang": "en",
            "target_lang": "de",
            "text": "hello world",
            "created_at": NOW_MS - 500,
            "deadline": deadline,
            "reply_topic": REPLIES,
            "metadata": {},
        }
    )
    return ConsumedRecord(
        tp=(TOPIC, 0),
        offset=offset,
        key=rid.encode(),
        value=value,
        lang="de",
        broker_ts_ms=NOW_MS - 400,
        request=read_request(value),
    )


def ok_result(rid: str, text: str = "hallo Welt") -> GenerationResult:
    return GenerationResult(
        rid,
        [1, 2],
        text,
        FinishReason.STOP,
        tokens_in=12,
        tokens_out=2,
        timings=Timings(queue_s=0.01, prefill_s=0.02, decode_s=0.03, total_s=0.06),
    )


def inflight(*records: ConsumedRecord) -> InFlight:
    first = records[0]
    handle = RequestHandle(first.request_id, lambda _rid: None)
    return InFlight(first.request_id, first.lang, handle, list(records), NOW_MS - 300)


def test_delivered_reply_is_stored_and_marked_done_only_after_delivery() -> None:
    s = make_setup()
    rec = record("r1", offset=7)
    s.publisher.answer_from_engine(inflight(rec), ok_result("r1"), model_version="m-1")

    # produced, not yet delivered: held for duplicates, neither stored nor done
    pending = s.publisher.pending_reply("r1")
    assert pending is not None and decode_result(pending)["text"] == "hallo Welt"
    assert s.store.get("r1") is None
    assert s.done == []

    s.deliver()
    assert s.done == [((TOPIC, 0), 7)]
    assert s.store.get("r1") == pending
    assert s.publisher.pending_reply("r1") is None
    ((key, value),) = s.replies()
    assert key == b"r1" and value == pending
    reply = decode_result(pending)
    assert reply["status"] == "OK" and reply["worker_id"] == "w-pub"
    assert reply["model_version"] == "m-1" and reply["completed_at"] == NOW_MS
    assert reply["timings"]["total_ms"] == 400.0  # broker timestamp -> the publisher's clock
    assert s.metric("tolk_worker_requests_total", lang="de", status="OK") == 1
    assert s.metric("tolk_worker_tokens_generated_total", lang="de") == 2


def test_every_waiting_record_is_answered_but_only_the_first_reply_stored() -> None:
    store = InMemoryResultStore()
    s = make_setup(store)
    first, again = record("dup", offset=3), record("dup", offset=4)
    s.publisher.answer_from_engine(inflight(first, again), ok_result("dup"), model_version="m")
    s.deliver()
    assert sorted(s.done) == [((TOPIC, 0), 3), ((TOPIC, 0), 4)]
    assert [k for k, _ in s.replies()] == [b"dup", b"dup"]
    assert store.puts == 1


def test_reply_from_the_store_is_resent_byte_for_byte_and_not_stored_again() -> None:
    store = InMemoryResultStore()
    s = make_setup(store)
    s.publisher.produce_reply(record("old", offset=9), b"stored reply bytes", store=False)
    assert s.publisher.pending_reply("old") is None  # nothing new to hold for duplicates
    s.deliver()
    assert s.replies() == [(b"old", b"stored reply bytes")]
    assert store.puts == 0 and s.done == [((TOPIC, 0), 9)]


@pytest.mark.parametrize(
    ("error_code", "reason"),
    [
        (KafkaError.UNKNOWN_TOPIC_OR_PART, "reply_topic_missing"),
        (KafkaError.MSG_SIZE_TOO_LARGE, "reply_undeliverable"),
    ],
)
def test_failed_delivery_is_not_marked_done_and_becomes_a_dead_letter(
    error_code: int, reason: str
) -> None:
    s = make_setup()
    s.producer.fail_next[REPLIES] = KafkaError(error_code)
    rec = record("lost", offset=11)
    s.publisher.answer_without_engine(rec, "REJECTED", "empty_text", "text is empty")

    s.producer.poll(0)  # the reply's report: failed; the dead letter is produced meanwhile
    assert s.done == []  # a failed reply does not count as answered
    assert s.store.get("lost") is None
    assert s.publisher.pending_reply("lost") is None
    assert s.replies() == []

    s.producer.poll(0)  # the dead letter's report
    assert s.done == [((TOPIC, 0), 11)]  # answered by the dead letter
    (dl,) = s.dead_letters()
    assert dl["reason"] == reason
    assert "reply to 'tolk.replies' failed" in dl["exception"]
    assert s.store.get("lost") is None
    assert s.metric("tolk_worker_dead_letters_total", reason=reason) == 1


def test_missing_reply_topic_drops_the_cached_topic_check() -> None:
    s = make_setup()
    assert s.reply_topics.problem(s.producer, REPLIES) is None  # cached as existing for 1 h
    with s.broker.lock:
        del s.broker.topics[REPLIES]
    assert s.reply_topics.problem(s.producer, REPLIES) is None  # still the cached answer
    s.publisher.produce_reply(record("gone"), b"bytes", store=True)
    s.deliver()
    problem = s.reply_topics.problem(s.producer, REPLIES)  # asks the broker again
    assert problem is not None and "does not exist" in problem


def test_dead_letter_carries_the_record_and_its_reason() -> None:
    s = make_setup()
    rec = ConsumedRecord(
        tp=(TOPIC, 1), offset=42, key=b"k-1", value=b"\x00garbage", lang="de", broker_ts_ms=1
    )
    s.publisher.dead_letter(rec, "undecodable", ValueError("bad magic byte"))
    assert s.done == []  # not before the dead letter is delivered
    s.deliver()
    (dl,) = s.dead_letters()
    assert dl["reason"] == "undecodable"
    assert dl["exception"] == "ValueError('bad magic byte')"
    assert dl["original"] == b"\x00garbage" and dl["key"] == b"k-1"
    assert (dl["topic"], dl["partition"], dl["offset"]) == (TOPIC, 1, 42)
    assert dl["failed_at"] == NOW_MS
    assert s.broker.records(DEAD_LETTERS)[0][0] == b"k-1"  # keyed like the original
    assert s.done == [((TOPIC, 1), 42)]
    assert s.metric("tolk_worker_dead_letters_total", reason="undecodable") == 1


def test_undelivered_dead_letter_is_not_marked_done_but_queued_for_a_retry() -> None:
    s = make_setup()
    s.producer.fail_next[DEAD_LETTERS] = KafkaError(KafkaError._MSG_TIMED_OUT)
    s.publisher.dead_letter(record("x", offset=5), "poison", "boom")
    s.deliver()
    assert s.dead_letters() == []
    assert s.done == []  # a lost dead letter would lose the record: it holds the commit
    assert s.publisher.pending_retries() == 1 and s.publisher.next_retry_at() is not None
    assert s.metric("tolk_worker_errors_total", lang="de", reason="dead_letter_failed") == 1
    # (the retries themselves: tests/workers/test_reply_retries.py)


def test_store_failure_still_marks_the_delivered_reply_done() -> None:
    s = make_setup(_FailingStore())
    s.publisher.answer_from_engine(
        inflight(record("r", offset=2)), ok_result("r"), model_version="m"
    )
    s.deliver()
    assert len(s.replies()) == 1 and s.done == [((TOPIC, 0), 2)]
    assert s.metric("tolk_worker_errors_total", lang="de", reason="store_failed") == 1


def test_ok_finished_past_the_deadline_goes_out_expired() -> None:
    s = make_setup()
    late = record("late", offset=1, deadline=NOW_MS - 250)
    at_deadline = record("edge", offset=2, deadline=NOW_MS)
    s.publisher.answer_from_engine(inflight(late), ok_result("late"), model_version="m")
    s.publisher.answer_from_engine(inflight(at_deadline), ok_result("edge"), model_version="m")
    s.deliver()
    replies = {decode_result(v)["request_id"]: decode_result(v) for _k, v in s.replies() if v}
    assert replies["late"]["status"] == "EXPIRED" and replies["late"]["text"] == ""
    assert replies["late"]["error"] == "translated 250 ms after the request's deadline"
    assert replies["edge"]["status"] == "OK" and replies["edge"]["text"] == "hallo Welt"
    assert s.metric("tolk_worker_errors_total", lang="de", reason="engine_stop") == 1


def test_full_producer_queue_is_waited_out() -> None:
    s = make_setup()
    real_produce = s.producer.produce
    refusals = iter([True, True, False])
    polls: list[float] = []
    real_poll = s.producer.poll

    def produce(*args: Any, **kw: Any) -> None:
        if next(refusals):
            raise BufferError("queue full")
        real_produce(*args, **kw)

    def poll(timeout: float = 0) -> int:
        polls.append(timeout)
        return real_poll(timeout)

    s.producer.produce = produce  # type: ignore[method-assign]
    s.producer.poll = poll  # type: ignore[method-assign]
    s.publisher.produce_reply(record("q"), b"v", store=False)
    assert polls == [0.1, 0.1]  # delivery reports served between the attempts
    s.deliver()
    assert s.replies() == [(b"q", b"v")]


def test_token_rate_counts_only_the_window() -> None:
    s = make_setup()
    s.publisher.answer_from_engine(inflight(record("t")), ok_result("t"), model_version="m")
    s.publisher.update_token_rate(time.monotonic())  # within the 5 s window
    assert s.metric("tolk_worker_tokens_per_second") == pytest.approx(2 / 5.0)
    s.publisher.update_token_rate(time.monotonic() + 6.0)  # past the window
    assert s.metric("tolk_worker_tokens_per_second") == 0.0


def test_a_withheld_answer_is_counted_apart_from_service_errors() -> None:
    """Issue #28: the reply is an ERROR on the wire, but the worker's metrics count it WITHHELD
    (a quality outcome, in tolk_faithful_outcomes_total), not as a service error."""

    s = make_setup()
    withheld = dataclasses.replace(
        ok_result("w"),
        text="",
        finish_reason=FinishReason.WITHHELD,
        error="unfaithful translation withheld: leak (retry: suspect too)",
    )
    failed = dataclasses.replace(ok_result("f"), text="", finish_reason=FinishReason.ERROR)
    s.publisher.answer_from_engine(inflight(record("w", offset=1)), withheld, model_version="m")
    s.publisher.answer_from_engine(inflight(record("f", offset=2)), failed, model_version="m")
    s.deliver()
    replies = {decode_result(v)["request_id"]: decode_result(v) for _k, v in s.replies() if v}
    assert replies["w"]["status"] == "ERROR" and replies["f"]["status"] == "ERROR"
    assert s.metric("tolk_worker_requests_total", lang="de", status="WITHHELD") == 1
    assert s.metric("tolk_worker_requests_total", lang="de", status="ERROR") == 1
    assert s.metric("tolk_worker_errors_total", lang="de", reason="engine_error") == 1
    assert s.metric("tolk_worker_errors_total", lang="de", reason="engine_withheld") == 0
