"""Worker logic against in-memory Kafka (tests/workers/fakes.py) and the fake engine.

Fast and deterministic: validation, dead letters, duplicates, intake pauses, commits and
shutdown. test_worker_kafka.py runs the same kinds of traffic through the real broker.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from confluent_kafka import KafkaError
from prometheus_client import CollectorRegistry

from schemas.codec import decode_dead_letter, decode_result, encode_request, encode_result
from tests.workers.fakes import FAIL_MARKER, FakeBroker, FakeEngine, fake_translation
from tests.workers.polling import wait_for
from topics.catalog import DEAD_LETTERS, REPLIES, request_topic
from workers.engine.types import FinishReason, TranslationRequest
from workers.fairness.policy import DEFAULT_POLICIES, LanguagePolicy
from workers.settings import Settings
from workers.store.results import InMemoryResultStore
from workers.worker import STATUS_OF, Worker

LANGS = ("en", "de", "fr", "es", "it")


def now_ms() -> int:
    return int(time.time() * 1000)


def request_bytes(
    rid: str,
    text: str = "hello big world",
    target: str = "de",
    src: str = "en",
    reply_topic: str = REPLIES,
    deadline: int | None = None,
    conversation_id: str | None = None,
) -> bytes:
    return encode_request(
        {
            "request_id": rid,
            "conversation_id": conversation_id,
            "source_lang": src,
            "target_lang": target,
            "text": text,
            "created_at": now_ms(),
            "deadline": deadline,
            "reply_topic": reply_topic,
            "metadata": {},
        }
    )


@dataclass
class Rig:
    broker: FakeBroker
    engine: FakeEngine
    store: Any  # an InMemoryResultStore unless the test gave another
    worker: Worker
    thread: threading.Thread
    registry: CollectorRegistry

    def send(self, value: bytes | None, lang: str = "de", key: bytes | None = None) -> None:
        topic = request_topic(lang)
        partition = hash(key or b"") % len(self.broker.topics[topic])
        self.broker.append(topic, key, value, partition)

    def replies(self, topic: str = REPLIES) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for _k, v in self.broker.records(topic):
            assert v is not None
            r = decode_result(v)
            out[r["request_id"]] = r
        return out

    def reply_count(self, topic: str = REPLIES) -> int:
        return len(self.broker.records(topic))

    def dead_letters(self) -> list[dict[str, Any]]:
        return [decode_dead_letter(v) for _k, v in self.broker.records(DEAD_LETTERS) if v]

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def committed(self) -> int:
        """Sum of committed offsets over the request topics."""
        return sum(o for (_g, t, _p), o in self.broker.committed.items() if t.startswith("tolk."))

    def sent(self) -> int:
        return sum(len(p) for t, ps in self.broker.topics.items() if "requests" in t for p in ps)


def make_rig(**settings_kw: Any) -> Rig:
    broker = FakeBroker()
    for lang in LANGS:
        broker.create_topic(request_topic(lang), 2)
    broker.create_topic(REPLIES, 1)
    broker.create_topic(DEAD_LETTERS, 1)
    engine = settings_kw.pop("engine", None) or FakeEngine()
    clock_ms = settings_kw.pop("clock_ms", None)
    store = settings_kw.pop("store", None) or InMemoryResultStore()
    kw: dict[str, Any] = {
        "metrics_port": 0,
        "worker_id": "w-test",
        "commit_interval_s": 0.05,
        "drain_timeout_s": 2.0,
        "poll_timeout_s": 0.01,
    }
    kw.update(settings_kw)
    registry = CollectorRegistry()
    worker = Worker(
        Settings(**kw),
        engine,
        broker.consumer_factory(),
        broker.producer_factory(),
        store=store,
        registry=registry,
        clock_ms=clock_ms,
    )
    thread = worker.run_in_thread()
    return Rig(broker, engine, store, worker, thread, registry)


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = make_rig()
    yield r
    r.worker.stop()
    r.thread.join(10)
    assert not r.thread.is_alive()


def test_translates_every_request_once_and_commits(rig: Rig) -> None:
    ids = []
    for i in range(40):
        lang = LANGS[1 + i % 4]
        rid = f"r{i}"
        ids.append((rid, lang, f"sentence number {i}"))
        rig.send(request_bytes(rid, f"sentence number {i}", target=lang), lang, key=rid.encode())
    wait_for(lambda: rig.reply_count() == 40, what="40 replies")
    # a reply is in the topic before its delivery report is served: stored (then done, then
    # committed) only once the worker's loop polls the producer
    wait_for(lambda: rig.committed() == 40, what="all offsets committed")
    replies = rig.replies()
    for rid, lang, text in ids:
        r = replies[rid]
        assert r["status"] == "OK", r
        assert r["text"] == fake_translation(text, lang)
        assert r["target_lang"] == lang and r["source_lang"] == "en"
        assert r["model_version"] == "fake-1" and r["worker_id"] == "w-test"
        assert r["tokens_out"] == len(r["text"].split()) and r["cached_prefix_tokens"] == 10
        assert r["timings"]["total_ms"] >= r["timings"]["queue_ms"] >= 0
        assert rig.store.get(rid) is not None
    # reply keys are the request ids
    assert {k for k, _ in rig.broker.records(REPLIES)} == {rid.encode() for rid, _, _ in ids}
    assert rig.metric("tolk_worker_requests_total", lang="de", status="OK") == 10
    assert rig.metric("tolk_worker_tokens_generated_total", lang="fr") > 0


def test_bad_inputs_are_answered_and_the_worker_lives_on(rig: Rig) -> None:
    past = now_ms() - 5_000
    rig.send(b"\x00\x01garbage", "de", key=b"k-garbage")  # undecodable
    rig.send(b"", "fr")  # empty value
    rig.send(request_bytes("bad-lang", target="xx"), "de")
    rig.send(request_bytes("wrong-topic", target="fr"), "de")
    rig.send(request_bytes("bad-src", src="zz"), "de")
    rig.send(request_bytes("empty", text="   "), "de")
    rig.send(request_bytes("huge", text="a" * 100_001), "de")
    rig.send(request_bytes("late", deadline=past), "de")
    rig.send(request_bytes("no-reply-topic", reply_topic="tolk.nowhere"), "de")
    rig.send(request_bytes("illegal-reply-topic", reply_topic="bad topic!"), "de")
    rig.send(request_bytes("boom", text=f"x {FAIL_MARKER}"), "de")
    rig.send(request_bytes("", text="no id"), "de")
    rig.send(request_bytes("good", text="still works", target="it"), "it")

    wait_for(lambda: rig.reply_count() == 8, what="8 replies")
    wait_for(lambda: len(rig.dead_letters()) == 6, what="6 dead letters")
    replies = rig.replies()
    expect = {
        "bad-lang": ("REJECTED", "unknown target language 'xx'"),
        "wrong-topic": ("REJECTED", "does not match topic"),
        "bad-src": ("REJECTED", "unknown source language 'zz'"),
        "empty": ("REJECTED", "text is empty"),
        "huge": ("REJECTED", "100001 bytes; the limit is 100000"),
        "late": ("EXPIRED", "deadline passed"),
    }
    for rid, (status, fragment) in expect.items():
        assert replies[rid]["status"] == status, replies[rid]
        assert fragment in (replies[rid]["error"] or ""), replies[rid]
        assert replies[rid]["text"] == ""
    assert replies["good"]["status"] == "OK"
    assert replies["good"]["text"] == fake_translation("still works", "it")

    dls = rig.dead_letters()
    reasons = sorted(d["reason"] for d in dls)
    assert reasons == [
        "invalid",
        "poison",  # "boom": its engine run fails every time (Settings.max_attempts runs)
        "reply_topic_missing",
        "reply_topic_missing",
        "undecodable",
        "undecodable",
    ]
    garbage = next(d for d in dls if d["key"] == b"k-garbage")
    assert garbage["original"] == b"\x00\x01garbage"
    assert garbage["topic"] == request_topic("de") and "SchemaError" in garbage["exception"]
    boom = next(d for d in dls if d["reason"] == "poison")
    assert "3 engine runs failed" in boom["exception"] and "fake failure" in boom["exception"]
    assert rig.engine.submitted.count("boom") == 3
    assert replies["boom"]["status"] == "ERROR"
    assert "3 engine runs failed" in replies["boom"]["error"]
    missing = next(d for d in dls if "tolk.nowhere" in (d["exception"] or ""))
    assert "does not exist" in missing["exception"]
    assert rig.thread.is_alive()
    wait_for(lambda: rig.committed() == rig.sent(), what="every offset committed")
    assert rig.metric("tolk_worker_dead_letters_total", reason="undecodable") == 2
    assert rig.metric("tolk_worker_errors_total", lang="de", reason="too_large") == 1


class _RecordsDeadlines(FakeEngine):
    """A FakeEngine that notes the deadline each request reached it with, and the monotonic
    clock at that moment (just after the worker converted the deadline)."""

    def __init__(self) -> None:
        super().__init__()
        self.received: dict[str, tuple[float | None, float]] = {}

    def submit_translation(self, request: TranslationRequest) -> Any:
        self.received[request.request_id] = (request.deadline, time.monotonic())
        return super().submit_translation(request)


def test_deadline_reaching_the_engine_is_converted_to_monotonic() -> None:
    """The Avro deadline (epoch ms) reaches the engine as `monotonic at submit + time left`.

    The worker's wall clock is frozen, so the time left is exact: (deadline - frozen) / 1000 s.
    The monotonic reading the worker used lies between the test's reading before the send and
    the engine's reading at submit, so the engine's deadline must lie in that window shifted
    by the time left (a window of milliseconds: off by 1000x, or ignoring the field, fails).
    At the boundary a deadline exactly now or 1 ms past never reaches the engine (EXPIRED);
    1 ms ahead does, with 1 ms left."""
    frozen_ms = now_ms()
    engine = _RecordsDeadlines()
    r = make_rig(engine=engine, clock_ms=lambda: frozen_ms)
    cases = {"ahead-5s": 5_000, "ahead-90s": 90_000, "ahead-1ms": 1, "now": 0, "past-1ms": -1}
    try:
        before = time.monotonic()
        for rid, ahead_ms in cases.items():
            r.send(request_bytes(rid, deadline=frozen_ms + ahead_ms), "de")
        r.send(request_bytes("none", deadline=None), "de")
        wait_for(lambda: r.reply_count() == len(cases) + 1, what="every request answered")
        replies = r.replies()
    finally:
        r.worker.stop()
        r.thread.join(10)

    for rid in ("ahead-5s", "ahead-90s", "ahead-1ms"):
        deadline, engine_mono = engine.received[rid]
        assert deadline is not None, rid
        left_s = cases[rid] / 1000.0
        assert before + left_s <= deadline <= engine_mono + left_s, (rid, deadline - before)
    assert engine.received["none"][0] is None
    assert replies["ahead-5s"]["status"] == replies["ahead-90s"]["status"] == "OK"
    assert "now" not in engine.received and "past-1ms" not in engine.received
    assert replies["now"]["status"] == "EXPIRED"
    assert replies["now"]["error"] == "deadline passed 0 ms before the worker read the request"
    assert replies["past-1ms"]["status"] == "EXPIRED"
    assert replies["past-1ms"]["error"] == "deadline passed 1 ms before the worker read the request"


def test_stored_result_is_reused_without_recompute(rig: Rig) -> None:
    stored = encode_result(
        {
            "request_id": "seen",
            "status": "OK",
            "text": "from the store",
            "error": None,
            "model_version": "older",
            "source_lang": "en",
            "target_lang": "de",
            "timings": {"queue_ms": 1.0, "prefill_ms": 1.0, "decode_ms": 1.0, "total_ms": 3.0},
            "tokens_in": 1,
            "tokens_out": 3,
            "cached_prefix_tokens": 0,
            "worker_id": "w-old",
            "completed_at": now_ms(),
            "conversation_id": None,
        }
    )
    rig.store.put("seen", stored)
    puts = rig.store.puts
    rig.send(request_bytes("seen", deadline=now_ms() - 1000), "de")  # late now, answered before
    wait_for(lambda: rig.reply_count() == 1)
    assert rig.broker.records(REPLIES)[0][1] == stored  # byte for byte
    assert "seen" not in rig.engine.submitted
    assert rig.metric("tolk_worker_duplicates_total") == 1
    assert rig.store.puts == puts  # not stored again
    wait_for(lambda: rig.committed() == 1)


def test_same_request_id_in_flight_is_translated_once(rig: Rig) -> None:
    rig.engine.hold()
    rig.send(request_bytes("twice", text="one two"), "de", key=b"a")
    rig.send(request_bytes("twice", text="one two"), "de", key=b"a")
    wait_for(lambda: rig.engine.pending() == 1 and rig.metric("tolk_worker_duplicates_total") == 1)
    rig.engine.release()
    wait_for(lambda: rig.reply_count() == 2)
    assert rig.engine.submitted == ["twice"]
    texts = {decode_result(v)["text"] for _k, v in rig.broker.records(REPLIES) if v}
    assert texts == {fake_translation("one two", "de")}
    wait_for(lambda: rig.committed() == 2)


def test_intake_pauses_a_flooded_language_and_resumes_at_low_water() -> None:
    policies = dict(DEFAULT_POLICIES)
    policies["de"] = LanguagePolicy(weight=4.0, slo_p99_s=2.0, max_queue=4, max_new_tokens=64)
    r = make_rig(policies=policies)
    try:
        r.engine.hold()
        for i in range(6):  # fetched in one poll: 4 taken (high water), the partition rewound
            r.send(request_bytes(f"de{i}"), "de", key=str(i).encode())
        wait_for(lambda: r.worker.paused_languages() == {"de"}, what="de paused")
        for i in range(6, 30):  # arrive while paused: not fetched
            r.send(request_bytes(f"de{i}"), "de", key=str(i).encode())
        # the other languages keep flowing while German is paused
        r.send(request_bytes("fr1", target="fr"), "fr")
        wait_for(lambda: "fr1" in r.engine.submitted, what="fr accepted while de paused")
        time.sleep(0.1)
        assert r.worker.paused_languages() == {"de"}
        assert r.engine.pending() == 5  # 4 German (its high water) + 1 French
        seeks = r.worker._consumer.seeks  # the 2 records over high water were rewound
        assert seeks and {tp[0] for tp, _ in seeks} == {request_topic("de")}
        wait_for(lambda: r.metric("tolk_worker_paused", lang="de") == 1, what="paused gauge")
        assert r.metric("tolk_worker_in_flight", lang="de") == 4
        r.engine.release()
        wait_for(lambda: r.reply_count() == 31, what="all answered after resume")
        assert r.worker.paused_languages() == set()
    finally:
        r.worker.stop()
        r.thread.join(10)


def test_global_in_flight_cap_pauses_everything() -> None:
    r = make_rig(max_in_flight=3)
    try:
        r.engine.hold()
        for i in range(6):
            r.send(request_bytes(f"x{i}", target="fr"), "fr", key=str(i).encode())
        wait_for(lambda: r.worker.paused_languages() == set(LANGS), what="all paused")
        r.engine.release()
        wait_for(lambda: r.reply_count() == 6)
        wait_for(lambda: r.worker.paused_languages() == set(), what="all resumed")
    finally:
        r.worker.stop()
        r.thread.join(10)


def test_reply_delivery_failure_becomes_dead_letter(rig: Rig) -> None:
    producer = None
    wait_for(lambda: rig.worker._producer is not None)
    producer = rig.worker._producer
    producer.fail_next[REPLIES] = KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)
    rig.send(request_bytes("lost-reply"), "de")
    wait_for(lambda: len(rig.dead_letters()) == 1)
    dl = rig.dead_letters()[0]
    assert dl["reason"] == "reply_topic_missing"
    assert rig.store.get("lost-reply") is None  # only delivered replies are stored
    wait_for(lambda: rig.committed() == 1)


def test_graceful_stop_drains_in_flight_commits_and_stops_engine() -> None:
    r = make_rig(engine=FakeEngine(delay_s=0.3))
    for i in range(5):
        r.send(request_bytes(f"s{i}"), "de")
    wait_for(lambda: r.worker.in_flight() == 5 or r.reply_count() > 0)
    r.worker.stop()
    r.thread.join(10)
    assert not r.thread.is_alive()
    assert r.reply_count() == 5
    assert r.committed() == 5
    assert r.engine.stopped == 1
    assert r.worker.stopped_event.is_set()


def test_crash_leaves_offsets_uncommitted_and_successor_reuses_results() -> None:
    r = make_rig(commit_interval_s=3600.0, commit_every=10**9)
    for i in range(6):
        r.send(request_bytes(f"c{i}", text=f"word {i}"), "es" if i % 2 else "it")
    wait_for(lambda: r.reply_count() == 6)
    wait_for(lambda: len(r.store) == 6)
    r.worker.crash()
    r.thread.join(10)
    assert r.committed() == 0
    # a new worker in the same group reads everything again
    engine2 = FakeEngine()
    registry2 = CollectorRegistry()
    w2 = Worker(
        Settings(metrics_port=0, worker_id="w2", commit_interval_s=0.05),
        engine2,
        r.broker.consumer_factory(),
        r.broker.producer_factory(),
        store=r.store,
        registry=registry2,
    )
    t2 = w2.run_in_thread()
    try:
        wait_for(lambda: r.reply_count() == 12)
        assert engine2.submitted == []
        assert registry2.get_sample_value("tolk_worker_duplicates_total") == 6
        first, second = r.broker.records(REPLIES)[:6], r.broker.records(REPLIES)[6:]
        assert sorted(v for _k, v in first if v) == sorted(v for _k, v in second if v)
        wait_for(lambda: r.committed() == 6)
    finally:
        w2.stop()
        t2.join(10)


def test_revoke_commits_first() -> None:
    r = make_rig(commit_interval_s=3600.0, commit_every=10**9)
    try:
        for i in range(3):
            r.send(request_bytes(f"v{i}"), "de", key=b"same")
        wait_for(lambda: r.reply_count() == 3)
        wait_for(lambda: r.worker.life.tracker.total_pending() == 0)
        assert r.committed() == 0
        consumer = r.worker._consumer
        r.worker.stop()  # the loop is stopping; call the revoke path as librdkafka would
        r.thread.join(10)
        assert r.committed() == 3  # shutdown commit
        consumer.revoke_all()  # revoking after the commit is a no-op
        assert r.worker.life.tracker.assigned() == frozenset()
    finally:
        r.worker.stop()


def test_status_mapping_covers_every_finish_reason() -> None:
    assert set(STATUS_OF) == set(FinishReason)
    assert STATUS_OF[FinishReason.STOP] == STATUS_OF[FinishReason.LENGTH] == "OK"
    assert STATUS_OF[FinishReason.CANCELLED] == "ERROR"


def test_settings_from_env_and_secret_masking() -> None:
    s = Settings.from_env(
        {
            "TOLK_LANGUAGES": "de, FR,,de",
            "TOLK_SASL_PASSWORD": "hunter2",
            "TOLK_MAX_TEXT_BYTES": "10",
            "TOLK_POLICIES": "de:5:1.5:8",
            "TOLK_BURST_TOKENS": "64",
        },
        metrics_port=0,
    )
    assert s.languages == ("de", "fr")
    assert s.burst_tokens == 64 and Settings().burst_tokens == 256
    assert s.max_text_bytes == 10 and s.metrics_port == 0
    assert s.policies["de"].max_queue == 8 and s.policies["it"] == DEFAULT_POLICIES["it"]
    assert "hunter2" not in repr(s) and "***" in repr(s)
    assert s.kafka_common()["sasl.password"] == "hunter2"
    assert Settings(worker_id="x").group_id == "tolk-workers"
    with pytest.raises(ValueError, match="TOLK_MAX_IN_FLIGHT"):
        Settings.from_env({"TOLK_MAX_IN_FLIGHT": "many"})
    with pytest.raises(ValueError, match="burst_tokens"):
        Settings.from_env({"TOLK_BURST_TOKENS": "-1"})
    assert Settings().max_attempts == 3 and Settings().store_timeout_s == 0.3
    tuned = Settings.from_env({"TOLK_MAX_ATTEMPTS": "5", "TOLK_STORE_TIMEOUT_S": "0.5"})
    assert tuned.max_attempts == 5 and tuned.store_timeout_s == 0.5
    with pytest.raises(ValueError, match="max_attempts"):
        Settings(max_attempts=0)
    with pytest.raises(ValueError, match="TOLK_STORE_TIMEOUT_S"):
        Settings.from_env({"TOLK_STORE_TIMEOUT_S": "soon"})
    with pytest.raises(AttributeError):
        s.bootstrap = "x"  # type: ignore[misc]


class _IgnoresDeadlines(FakeEngine):
    """An engine that finishes OK whatever the deadline (as a plain Engine may, once admitted)."""

    def submit_translation(self, request: TranslationRequest) -> Any:
        return super().submit_translation(dataclasses.replace(request, deadline=None))


def test_no_ok_reply_after_the_deadline() -> None:
    r = make_rig(engine=_IgnoresDeadlines(delay_s=0.4))
    try:
        r.send(request_bytes("late-ok", deadline=now_ms() + 150), "de")
        r.send(request_bytes("in-time", deadline=now_ms() + 60_000), "de")
        wait_for(lambda: r.reply_count() == 2)
        replies = r.replies()
        assert replies["late-ok"]["status"] == "EXPIRED"
        assert "after the request's deadline" in replies["late-ok"]["error"]
        assert replies["late-ok"]["text"] == ""
        assert replies["in-time"]["status"] == "OK"
    finally:
        r.worker.stop()
        r.thread.join(10)


def test_the_engine_gets_each_request_conversation_id() -> None:
    """`EngineRuns` hands every engine the request's `conversation_id` (an empty one as None),
    and the stages of `tolk worker --protect-spans` without `--context` (the cache, span
    protection, the faithfulness guard, as the builder composes them) pass it on to the engine,
    a masked run included."""
    from workers.serving.pipeline import ServingOptions, build_served_engine
    from workers.stages.cache.redis_l2 import InMemoryTranslationCache

    plain = make_rig()
    inner = FakeEngine()
    options = ServingOptions.of(
        Settings(), protect_spans=True, cache=True, cache_l2=InMemoryTranslationCache()
    )
    wrapped = make_rig(engine=build_served_engine(inner, options))
    try:
        for rig in (plain, wrapped):
            rig.send(request_bytes("c1", conversation_id="conv-7"), "de", key=b"c1")
            rig.send(request_bytes("c2", "Order A-12345 now", conversation_id="conv-8"), "de")
            rig.send(request_bytes("c3", "good morning", conversation_id=""), "de", key=b"c3")
            rig.send(request_bytes("c4", "no conversation at all"), "de", key=b"c4")
        for rig in (plain, wrapped):
            wait_for(lambda rig=rig: rig.reply_count() == 4, what="4 replies")
        want = {"c1": "conv-7", "c2": "conv-8", "c3": None, "c4": None}
        assert plain.engine.conversations == want
        assert inner.conversations == want
        assert wrapped.replies()["c2"]["metadata"]["tolk.protected_spans"] == "restored"
    finally:
        for rig in (plain, wrapped):
            rig.worker.stop()
            rig.thread.join(10)


def test_worker_reports_its_lags_around_the_engine() -> None:
    """Issue 25, item 6: per language, record consumed -> handed to the engine -> first
    scheduled, and engine finished -> reply produced -> reply delivered, as histograms."""
    rig = make_rig(engine=FakeEngine(delay_s=0.02))
    try:
        sent = {"de": 6, "en": 4}
        for lang, n in sent.items():
            for i in range(n):
                rid = f"{lang}-lag-{i}"
                rig.send(request_bytes(rid, f"text {i}", target=lang, src="fr"), lang, rid.encode())
        wait_for(lambda: rig.reply_count() == 10, what="10 replies")

        def count(lag: str, lang: str) -> float:
            return rig.metric(f"tolk_worker_{lag}_seconds_count", lang=lang)

        def total(lag: str, lang: str) -> float:
            return rig.metric(f"tolk_worker_{lag}_seconds_sum", lang=lang)

        wait_for(
            lambda: all(count("finish_to_delivered", g) == n for g, n in sent.items()),
            what="every delivery report",
        )
        for lang, n in sent.items():
            for lag in ("consume_to_submit", "consume_to_schedule", "finish_to_produce"):
                assert count(lag, lang) == n, (lag, lang)
                assert 0.0 <= total(lag, lang) < 5.0 * n, (lag, lang)
            # the schedule lag is the submit lag + the engine's queue wait (1 ms in the fake)
            lower = total("consume_to_submit", lang) + n * 0.001
            assert total("consume_to_schedule", lang) >= lower - 1e-6
            assert total("finish_to_delivered", lang) >= total("finish_to_produce", lang)
    finally:
        rig.worker.stop()
        rig.thread.join(10)
