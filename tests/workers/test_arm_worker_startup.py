"""An arm worker's start-up survives a control topic whose watermarks do not come in time.

`Worker.run` reads the arms' control topic to its end (`ArmControlReader.start`) before its
consumer subscribes. The catch-up asks the broker for each partition's watermarks
(`get_watermark_offsets`, 5 s); when that timed out (a loaded broker, a leader this client did
not know yet) the KafkaException left `Worker.run`: the worker thread ended before it
subscribed, so it never got an assignment, and a test waiting for one (tests/workers/guard/
test_rollout_e2e.py) failed after its wait whatever the wait was. Now the reader logs it and
goes on; its poll thread reads the table.

* the reader alone, with a consumer whose first watermark request fails: `start()` returns,
  not caught up, and the table arrives from its poll thread;
* an in-process arm worker on the real broker with that reader: it subscribes, is assigned,
  and answers a request by the shares it read afterwards.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from prometheus_client import CollectorRegistry

from schemas.codec import decode_result, encode_request
from tests.kafka_fixtures import kafka_bootstrap, redis_url  # noqa: F401
from tests.workers.fakes import FakeEngine, TopicReader
from tests.workers.polling import wait_for
from topics.admin import ensure_topics
from topics.catalog import REPLIES, arm_control_topic, catalog, request_topic
from workers.kafka.arm_control import publish_shares
from workers.kafka.arm_reader import ArmControlReader
from workers.settings import Settings
from workers.worker import Worker

pytestmark = [pytest.mark.kafka]


class FirstWatermarksTimeOut:
    """A real consumer whose first `get_watermark_offsets` raises as a broker timeout does."""

    def __init__(self, conf: dict[str, Any]) -> None:
        self._inner = Consumer(conf)
        self.failed = 0

    def get_watermark_offsets(self, *args: Any, **kwargs: Any) -> Any:
        if not self.failed:
            self.failed += 1
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT))
        return self._inner.get_watermark_offsets(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _topics(bootstrap: str) -> str:
    prefix = f"t-armstart-{uuid.uuid4().hex[:8]}."
    ensure_topics(bootstrap, catalog(("de",), partitions=1, prefix=prefix), timeout=30)
    return prefix


def test_reader_start_survives_a_watermark_timeout(kafka_bootstrap: str) -> None:  # noqa: F811
    prefix = _topics(kafka_bootstrap)
    kafka = {"bootstrap.servers": kafka_bootstrap}
    publish_shares(kafka, arm_control_topic(prefix), "de", {"A": 30.0, "B": 70.0})
    made: list[FirstWatermarksTimeOut] = []

    def factory(conf: dict[str, Any]) -> FirstWatermarksTimeOut:
        made.append(FirstWatermarksTimeOut(conf))
        return made[-1]

    reader = ArmControlReader(kafka, arm_control_topic(prefix), consumer_factory=factory)
    try:
        reader.start()  # raised KafkaException before the fix
        assert made[0].failed == 1 and not reader.caught_up
        wait_for(lambda: "de" in reader.table().entries, 15, "the table from the poll thread")
        assert dict(reader.table().entries["de"]) == {"A": 30.0, "B": 70.0}
    finally:
        reader.stop()


def test_arm_worker_is_assigned_and_serves_after_a_watermark_timeout(
    kafka_bootstrap: str,  # noqa: F811
    redis_url: str,  # noqa: F811
) -> None:
    prefix = _topics(kafka_bootstrap)
    kafka = {"bootstrap.servers": kafka_bootstrap}
    run = uuid.uuid4().hex[:8]
    settings = Settings(
        bootstrap=kafka_bootstrap, redis_url=redis_url, group_id=f"tolk-armstart-{run}",
        languages=("de",), topic_prefix=prefix, metrics_port=0, health_port=0,
        worker_id=f"w-{run}", arm="A", session_timeout_ms=10_000, drain_timeout_s=5.0,
    )  # fmt: skip
    shares = ArmControlReader(
        settings.kafka_common(), arm_control_topic(prefix), consumer_factory=FirstWatermarksTimeOut
    )
    worker = Worker(
        settings, FakeEngine(languages=("en", "de")), registry=CollectorRegistry(),
        arm_shares=shares,
    )  # fmt: skip
    died: list[BaseException] = []
    thread = threading.Thread(target=lambda: _run(worker, died), daemon=True)
    thread.start()
    reader = TopicReader(kafka_bootstrap, prefix + REPLIES)
    try:
        assert worker.assigned_event.wait(30), f"not assigned; worker thread died: {died}"
        publish_shares(kafka, arm_control_topic(prefix), "de", {"A": 100.0})
        time.sleep(1.0)  # the entry reaches the reader's poll thread
        request = {
            "request_id": f"r-{run}", "conversation_id": None, "source_lang": "en",
            "target_lang": "de", "text": "hello", "created_at": int(time.time() * 1000),
            "deadline": None, "reply_topic": prefix + REPLIES, "metadata": {},
        }  # fmt: skip
        producer = Producer(kafka)
        producer.produce(prefix + request_topic("de"), encode_request(request), key=b"r")
        producer.flush(10)
        wait_for(lambda: bool(reader.snapshot()), 30, "the reply")
        reply = decode_result(reader.snapshot()[0][1])
        assert reply["request_id"] == f"r-{run}" and reply["model_version"].endswith("@A")
    finally:
        worker.stop()
        thread.join(20)
        reader.close()
    assert not died


def _run(worker: Worker, died: list[BaseException]) -> None:
    try:
        worker.run()
    except BaseException as exc:  # what the thread would have died of
        died.append(exc)
        raise
