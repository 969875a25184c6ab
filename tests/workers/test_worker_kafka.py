"""The worker against the real local broker and redis (`bash compose/stack.sh up`).

Each test uses its own topic prefix and consumer group, so tests never see each other's
records; the engine is the in-memory FakeEngine, so only Kafka and redis are real here.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from confluent_kafka import Producer
from prometheus_client import CollectorRegistry

from schemas.codec import decode_dead_letter, decode_result, encode_request
from tests.kafka_fixtures import kafka_bootstrap, redis_url  # noqa: F401
from tests.workers.fakes import (
    FAIL_MARKER,
    FakeEngine,
    TopicReader,
    create_prefixed_topics,
    fake_translation,
)
from tests.workers.polling import wait_for as _wait_for
from topics.catalog import DEAD_LETTERS, REPLIES, request_topic
from workers.settings import Settings
from workers.worker import Worker

pytestmark = [pytest.mark.kafka, pytest.mark.redis]

LANGS = ("de", "fr", "es", "it")


def now_ms() -> int:
    return int(time.time() * 1000)


def wait_for(pred: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    """Broker round trips: a longer default than the in-memory tests."""
    _wait_for(pred, timeout, what)


class Env:
    def __init__(self, bootstrap: str, redis: str) -> None:
        self.bootstrap = bootstrap
        self.redis = redis
        self.prefix = f"t{uuid.uuid4().hex[:10]}."
        self.group = f"tolk-test-{uuid.uuid4().hex[:10]}"
        create_prefixed_topics(bootstrap, self.prefix, LANGS)
        self.producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 2})
        self.replies = TopicReader(bootstrap, self.prefix + REPLIES)
        self.dead = TopicReader(bootstrap, self.prefix + DEAD_LETTERS)
        self.workers: list[tuple[Worker, Any]] = []

    def settings(self, **kw: Any) -> Settings:
        base: dict[str, Any] = {
            "bootstrap": self.bootstrap,
            "redis_url": self.redis,
            "group_id": self.group,
            "languages": LANGS,
            "topic_prefix": self.prefix,
            "metrics_port": 0,
            "worker_id": f"w-{uuid.uuid4().hex[:6]}",
            "session_timeout_ms": 10_000,
            "drain_timeout_s": 5.0,
        }
        base.update(kw)
        return Settings(**base)

    def start_worker(self, engine: FakeEngine | None = None, **kw: Any) -> Worker:
        worker = Worker(self.settings(**kw), engine or FakeEngine(), registry=CollectorRegistry())
        thread = worker.run_in_thread()
        self.workers.append((worker, thread))
        assert worker.assigned_event.wait(30), "worker got no assignment"
        return worker

    def send(self, value: bytes, lang: str, key: str | None = None) -> None:
        self.producer.produce(
            self.prefix + request_topic(lang), value=value, key=key.encode() if key else None
        )
        self.producer.poll(0)

    def request(self, rid: str, text: str, target: str, **kw: Any) -> bytes:
        record: dict[str, Any] = {
            "request_id": rid,
            "conversation_id": None,
            "source_lang": "en",
            "target_lang": target,
            "text": text,
            "created_at": now_ms(),
            "deadline": None,
            "reply_topic": self.prefix + REPLIES,
            "metadata": {},
        }
        record.update(kw)
        return encode_request(record)

    def reply_map(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for v in self.replies.values():
            r = decode_result(v)
            out.setdefault(r["request_id"], []).append(r)
        return out

    def close(self) -> None:
        for worker, thread in self.workers:
            worker.stop()
            thread.join(20)
        self.producer.flush(5)
        self.replies.close()
        self.dead.close()


@pytest.fixture
def env(kafka_bootstrap: str, redis_url: str) -> Iterator[Env]:  # noqa: F811
    e = Env(kafka_bootstrap, redis_url)
    yield e
    e.close()


@pytest.mark.parametrize("group_protocol", ["classic", "consumer"])
def test_200_requests_get_exactly_one_reply_each(env: Env, group_protocol: str) -> None:
    worker = env.start_worker(group_protocol=group_protocol)
    expected: dict[str, str] = {}
    run = uuid.uuid4().hex[:8]
    for i in range(200):
        lang = LANGS[i % 4]
        rid = f"{run}-{i}"
        text = f"request {i} in {lang} goes here"
        expected[rid] = fake_translation(text, lang)
        env.send(env.request(rid, text, lang), lang, key=rid)
    env.producer.flush(10)
    wait_for(lambda: len(env.replies) >= 200, what="200 replies")
    time.sleep(1.0)  # anything extra would show up now
    replies = env.reply_map()
    assert len(env.replies) == 200
    assert set(replies) == set(expected)
    for rid, text in expected.items():
        (r,) = replies[rid]
        assert r["status"] == "OK" and r["text"] == text, r
    # every offset is committed once the replies are delivered
    wait_for(lambda: worker.life.tracker.total_pending() == 0, what="nothing pending")
    wait_for(lambda: worker.life.tracker.committable() == {}, what="all committed")
    assert worker.registry.get_sample_value("tolk_worker_duplicates_total") == 0


def test_bad_inputs_answered_while_valid_traffic_flows(env: Env) -> None:
    worker = env.start_worker(engine=FakeEngine(delay_s=0.01))
    thread = env.workers[-1][1]
    run = uuid.uuid4().hex[:8]
    bad = {
        f"{run}-lang": (env.request(f"{run}-lang", "hi", "xx"), "de", "REJECTED"),
        f"{run}-empty": (env.request(f"{run}-empty", "", "de"), "de", "REJECTED"),
        f"{run}-huge": (env.request(f"{run}-huge", "é" * 60_000, "fr"), "fr", "REJECTED"),
        f"{run}-late": (
            env.request(f"{run}-late", "hi", "es", deadline=now_ms() - 1),
            "es",
            "EXPIRED",
        ),
    }
    boom = env.request(f"{run}-boom", FAIL_MARKER, "it")  # fails every run: dead letter "poison"
    good = {}
    for i in range(40):
        lang = LANGS[i % 4]
        rid = f"{run}-ok{i}"
        good[rid] = fake_translation(f"valid text {i}", lang)
        env.send(env.request(rid, f"valid text {i}", lang), lang, key=rid)
        if i == 10:
            for _rid, (value, topic_lang, _status) in bad.items():
                env.send(value, topic_lang)
            env.send(boom, "it")
            env.send(b"\xc3\x01not avro at all", "de", key="junk")
            env.send(
                env.request(f"{run}-noreply", "hi", "de", reply_topic=env.prefix + "gone"), "de"
            )
    env.producer.flush(10)
    wait_for(lambda: len(env.replies) >= 45, what="45 replies")
    wait_for(lambda: len(env.dead) >= 3, what="3 dead letters")
    replies = env.reply_map()
    for rid, (_value, _lang, status) in bad.items():
        (r,) = replies[rid]
        assert r["status"] == status, r
        assert r["error"], r
    for rid, text in good.items():
        assert replies[rid][0]["text"] == text
    dls = sorted((decode_dead_letter(v) for v in env.dead.values()), key=lambda d: d["reason"])
    poison = [d for d in dls if d["reason"] == "poison"]
    assert len(poison) == 1 and "fake failure" in poison[0]["exception"]
    (boom_reply,) = replies[f"{run}-boom"]  # after its dead letter, the client is told
    assert boom_reply["status"] == "ERROR" and "fake failure" in boom_reply["error"]
    dls = [d for d in dls if d["reason"] != "poison"]
    assert [d["reason"] for d in dls] == ["reply_topic_missing", "undecodable"]
    assert dls[1]["original"] == b"\xc3\x01not avro at all" and dls[1]["key"] == b"junk"
    assert "does not exist" in dls[0]["exception"]
    assert thread.is_alive()
    wait_for(lambda: worker.life.tracker.total_pending() == 0, what="dead letters marked done")
    wait_for(lambda: worker.life.tracker.committable() == {}, what="all committed")


def test_redelivery_after_crash_reuses_stored_results(env: Env) -> None:
    engine1 = FakeEngine()
    w1 = env.start_worker(engine=engine1, commit_interval_s=3600.0, commit_every=10**9)
    run = uuid.uuid4().hex[:8]
    n = 24
    for i in range(n):
        lang = LANGS[i % 4]
        env.send(env.request(f"{run}-{i}", f"crash test {i}", lang), lang, key=f"{run}-{i}")
    env.producer.flush(10)
    wait_for(lambda: len(env.replies) >= n, what="first replies")
    wait_for(lambda: w1.life.tracker.total_pending() == 0, what="all delivered and stored")
    w1.crash()  # no commit
    env.workers[-1][1].join(20)
    assert len(engine1.submitted) == n

    engine2 = FakeEngine()
    w2 = env.start_worker(engine=engine2)
    wait_for(lambda: len(env.replies) >= 2 * n, what="redelivered replies")
    assert engine2.submitted == []  # nothing recomputed
    assert w2.registry.get_sample_value("tolk_worker_duplicates_total") == n
    replies = env.reply_map()
    for i in range(n):
        first, second = replies[f"{run}-{i}"]
        assert first == second  # the same bytes: same text, same worker id, same timings
        assert first["worker_id"] == w1.settings.worker_id
    wait_for(lambda: w2.life.tracker.committable() == {}, what="successor committed")
