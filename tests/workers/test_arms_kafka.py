"""Two arms on the real local broker and redis (issue #13, part S), with the FakeEngine.

* shares 30/70 over 1,000 conversations of 3 turns: every request answered exactly once, the
  split within 3 points of the shares, every conversation on one arm (the one `choose_arm`
  names), the replies' `model_version` carrying the arm;
* a share change written through the control topic (`tolk arms set`, then a tombstone with
  `tolk arms clear`) is applied by both running workers within 5 s (measured and printed);
* mirror mode: both arms answer every request once, each from its own engine run.

Each test has its own topic prefix (so its own control topic) and consumer group.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import Producer
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

from schemas.codec import decode_result, encode_request
from tests.kafka_fixtures import kafka_bootstrap, redis_url  # noqa: F401
from tests.workers.fakes import FakeEngine, TopicReader
from tests.workers.polling import wait_for
from topics.admin import ensure_topics
from topics.catalog import REPLIES, arm_control_topic, catalog, request_topic
from workers.arms import MIRROR_METADATA_KEY, choose_arm, split_arm
from workers.cli import app
from workers.kafka.arm_control import publish_shares
from workers.settings import Settings
from workers.worker import Worker

pytestmark = [pytest.mark.kafka, pytest.mark.redis]

LANGS = ("de", "fr")
APPLY_LIMIT_S = 5.0  # the contract: a share change reaches every running worker within this


class ArmEnv:
    """A private topic set, two arm workers and the replies topic read from the start."""

    def __init__(self, bootstrap: str, redis: str) -> None:
        self.bootstrap = bootstrap
        self.redis = redis
        self.prefix = f"t{uuid.uuid4().hex[:10]}."
        self.run = uuid.uuid4().hex[:8]  # request ids unique per run (redis outlives runs)
        self.group = f"tolk-arms-{self.run}"
        ensure_topics(bootstrap, catalog(LANGS, partitions=2, prefix=self.prefix), timeout=30)
        self.control = arm_control_topic(self.prefix)
        self.producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
        self.replies = TopicReader(bootstrap, self.prefix + REPLIES)
        self.workers: dict[str, tuple[Worker, Any]] = {}

    def set_shares(self, language: str, shares: dict[str, float] | None) -> None:
        conf = {"bootstrap.servers": self.bootstrap}
        publish_shares(conf, self.control, language, shares, updated_by="test")

    def start_arm(self, arm: str) -> Worker:
        settings = Settings(
            bootstrap=self.bootstrap,
            redis_url=self.redis,
            group_id=self.group,
            languages=LANGS,
            topic_prefix=self.prefix,
            metrics_port=0,
            worker_id=f"w-{arm}-{self.run}",
            arm=arm,
            session_timeout_ms=10_000,
            drain_timeout_s=5.0,
            max_in_flight=4096,
        )
        worker = Worker(
            settings, FakeEngine(languages=("en", *LANGS)), registry=CollectorRegistry()
        )
        thread = worker.run_in_thread()
        self.workers[arm] = (worker, thread)
        return worker

    def wait_assigned(self) -> None:
        for arm, (worker, _thread) in self.workers.items():
            assert worker.assigned_event.wait(30), f"arm {arm} got no assignment"

    def send(self, rid: str, conversation: str, lang: str, **kw: Any) -> None:
        record: dict[str, Any] = {
            "request_id": rid,
            "conversation_id": conversation,
            "source_lang": "en",
            "target_lang": lang,
            "text": f"turn of {conversation}",
            "created_at": int(time.time() * 1000),
            "deadline": None,
            "reply_topic": self.prefix + REPLIES,
            "metadata": {},
        }
        record.update(kw)
        topic = self.prefix + request_topic(lang)
        while True:
            try:
                self.producer.produce(topic, encode_request(record), key=conversation.encode())
                break
            except BufferError:
                self.producer.poll(0.1)
        self.producer.poll(0)

    def reply_list(self) -> list[dict[str, Any]]:
        return [decode_result(v) for _k, v in list(self.replies.records)]

    def by_request(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for r in self.reply_list():
            out.setdefault(r["request_id"], []).append(r)
        return out

    def close(self) -> None:
        for worker, _thread in self.workers.values():
            worker.stop()
        for _worker, thread in self.workers.values():
            thread.join(20)
        self.producer.flush(5)
        self.replies.close()


@pytest.fixture
def arm_env(kafka_bootstrap: str, redis_url: str) -> Iterator[ArmEnv]:  # noqa: F811
    env = ArmEnv(kafka_bootstrap, redis_url)
    yield env
    env.close()


def test_shares_30_70_answer_each_request_once_and_keep_conversations(arm_env: ArmEnv) -> None:
    shares = {"A": 30.0, "B": 70.0}
    arm_env.set_shares("*", shares)  # before the workers start: read in their catch-up
    arm_env.start_arm("A")
    arm_env.start_arm("B")
    arm_env.wait_assigned()
    conversations = [f"conv-{i:04d}" for i in range(1000)]  # fixed ids: a fixed split
    turns = 3
    for turn in range(turns):
        for i, conv in enumerate(conversations):
            arm_env.send(f"{arm_env.run}-{conv}-{turn}", conv, LANGS[i % 2])
    arm_env.producer.flush(30)
    total = len(conversations) * turns
    wait_for(lambda: len(arm_env.replies.records) >= total, 180, "a reply to every request")
    time.sleep(2.0)  # a late duplicate would show up here

    by_rid = arm_env.by_request()
    assert len(by_rid) == total
    assert [rid for rid, rs in by_rid.items() if len(rs) != 1] == []  # exactly once
    arm_of_conversation: dict[str, set[str | None]] = {}
    for rid, (reply,) in by_rid.items():
        assert reply["status"] == "OK"
        version, arm = split_arm(reply["model_version"])
        assert version == "fake-1"
        conv = rid[len(arm_env.run) + 1 : -2]
        arm_of_conversation.setdefault(conv, set()).add(arm)
    assert all(len(arms) == 1 for arms in arm_of_conversation.values())  # never changes arm
    for conv, arms in arm_of_conversation.items():
        assert arms == {choose_arm(shares, conv)}
    split = Counter(next(iter(arms)) for arms in arm_of_conversation.values())
    share_a = 100 * split["A"] / len(conversations)
    print(f"ARMS split over {len(conversations)} conversations: A {share_a:.1f} % (want 30)")
    assert abs(share_a - 30.0) <= 3.0
    # each arm read every request and left the other arm's to it, counted
    worker_a = arm_env.workers["A"][0]
    skipped_a = sum(
        worker_a.registry.get_sample_value("tolk_arm_skipped_total", {"lang": lang}) or 0.0
        for lang in LANGS
    )
    assert skipped_a == split["B"] * turns


def _applied_within(workers: list[Worker], lang: str, want: Any, start: float) -> float:
    """Seconds from `start` until every worker's table has `want` for `lang`."""

    def applied() -> bool:
        return all(
            w.arms is not None and w.arms.shares.table().shares_for(lang) == want for w in workers
        )

    wait_for(applied, 3 * APPLY_LIMIT_S, f"shares {want} for {lang}", interval=0.01)
    return time.monotonic() - start


def test_a_share_change_reaches_running_workers_within_5_s(arm_env: ArmEnv) -> None:
    arm_env.set_shares("de", {"A": 100.0, "B": 0.0})
    workers = [arm_env.start_arm("A"), arm_env.start_arm("B")]
    arm_env.wait_assigned()
    runner = CliRunner()
    env = {"TOLK_TOPIC_PREFIX": arm_env.prefix}

    def answered_by(tag: str, n: int, copies: int) -> Counter[str | None]:
        for i in range(n):
            arm_env.send(f"{arm_env.run}-{tag}-{i}", f"{tag}-{i}", "de")
        arm_env.producer.flush(10)
        ids = {f"{arm_env.run}-{tag}-{i}" for i in range(n)}
        wait_for(
            lambda: sum(len(arm_env.by_request().get(rid, [])) for rid in ids) >= n * copies,
            60,
            f"{tag} answered",
        )
        time.sleep(1.0)
        replies = [r for rid in ids for r in arm_env.by_request().get(rid, [])]
        return Counter(split_arm(r["model_version"])[1] for r in replies)

    assert answered_by("before", 20, 1) == {"A": 20}

    start = time.monotonic()
    result = runner.invoke(
        app, ["arms", "set", "de", "A=0", "B=100", "-b", arm_env.bootstrap], env=env
    )
    assert result.exit_code == 0, result.output
    changed_s = _applied_within(workers, "de", {"A": 0.0, "B": 100.0}, start)
    print(f"ARMS share change applied by both workers in {changed_s:.3f} s")
    assert changed_s < APPLY_LIMIT_S
    assert answered_by("after", 20, 1) == {"B": 20}

    shown = runner.invoke(app, ["arms", "show", "-b", arm_env.bootstrap], env=env)
    assert shown.exit_code == 0 and "de: A=0 B=100" in shown.output

    start = time.monotonic()
    result = runner.invoke(app, ["arms", "clear", "de", "-b", arm_env.bootstrap], env=env)
    assert result.exit_code == 0, result.output
    cleared_s = _applied_within(workers, "de", None, start)
    print(f"ARMS tombstone applied by both workers in {cleared_s:.3f} s")
    assert cleared_s < APPLY_LIMIT_S
    # nothing configured for de (no '*' either): every arm answers
    assert answered_by("cleared", 10, 2) == {"A": 10, "B": 10}


def test_mirror_mode_every_arm_answers_every_request(arm_env: ArmEnv) -> None:
    arm_env.set_shares("*", {"A": 30.0, "B": 70.0})
    arm_env.start_arm("A")
    arm_env.start_arm("B")
    arm_env.wait_assigned()
    n = 200
    for i in range(n):
        arm_env.send(
            f"{arm_env.run}-m-{i}", f"m-{i}", LANGS[i % 2], metadata={MIRROR_METADATA_KEY: "1"}
        )
    arm_env.producer.flush(10)
    wait_for(lambda: len(arm_env.replies.records) >= 2 * n, 120, "both arms' replies")
    time.sleep(1.5)
    by_rid = arm_env.by_request()
    assert len(by_rid) == n
    for rid, replies in by_rid.items():
        assert sorted(r["model_version"] for r in replies) == ["fake-1@A", "fake-1@B"], rid
        assert len({r["text"] for r in replies}) == 1
        assert all(r["status"] == "OK" for r in replies)
