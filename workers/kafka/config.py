"""The worker's Kafka client settings and its check that a reply topic exists.

The consumer stores and commits offsets itself (never auto), so an offset moves only once the
record's reply is delivered (both `enable.auto.commit` and `enable.auto.offset.store` off: with
either on, librdkafka could commit a record whose reply was never produced). The producer is
idempotent with `acks=all`, and must not create a reply topic by asking for its metadata: a
request naming a topic that does not exist is dead-lettered instead.

Security (TLS, SASL) comes from `Settings.kafka_common()`. The start-up check that the broker
answers with it, and the produce errors no retry fixes, are shared with the client and the
replay job: `topics/cluster.py`.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from topics.cluster import MISSING_TOPIC_CODES
from workers.settings import Settings

__all__ = [
    "ReplyTopicChecker",
    "consumer_config",
    "is_fatal",
    "producer_config",
]

log = logging.getLogger(__name__)

TOPIC_NAME_RE = re.compile(r"^[a-zA-Z0-9._-]{1,249}$")


def is_fatal(err: KafkaError) -> bool:
    """True when the client that reported `err` cannot go on (it must be closed and the process
    restarted). A consumer reports a fatal error as an error event whose code is `_FATAL` and
    whose own `fatal()` flag is not set (librdkafka keeps the underlying error apart, e.g.
    KIP-848's "instance ID is still used by another member"), so both are checked."""
    return bool(err.fatal()) or err.code() == KafkaError._FATAL


def consumer_config(settings: Settings) -> dict[str, Any]:
    """The worker's consumer. Both group protocols rebalance incrementally (the worker's
    callbacks take and give back single partitions). Classic: cooperative-sticky, which
    balances the number of partitions per worker but may give one worker every partition of
    a language. KIP-848 (`group_protocol="consumer"`): the broker assigns with `range`, topic by
    topic, so with at least as many partitions per language as workers each worker holds
    every language; its session timeout is the broker's (`group.consumer.session.timeout.ms`)."""
    if settings.group_protocol == "consumer":
        group: dict[str, Any] = {"group.protocol": "consumer", "group.remote.assignor": "range"}
    else:
        group = {
            "partition.assignment.strategy": "cooperative-sticky",
            "session.timeout.ms": settings.session_timeout_ms,
        }
    return {
        **settings.kafka_common(),
        "group.id": settings.consumer_group(),  # <group>.<arm> for an arm's worker
        "client.id": settings.worker_id,
        **group,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "logger": logging.getLogger("tolk.kafka.consumer"),
    }


def producer_config(settings: Settings) -> dict[str, Any]:
    return {
        **settings.kafka_common(),
        "client.id": settings.worker_id,
        "enable.idempotence": True,
        "acks": "all",
        # A reply goes out at once: librdkafka's default waits 5 ms to batch, which was 5 ms of
        # every reply's latency (bench/serving.py stages at 1 req/s: "outside" 8-10 -> 4 ms).
        # Under load replies still batch: those queued while a produce is in flight go together.
        "linger.ms": 0,
        # librdkafka retries a produce until this runs out, then reports it failed; the
        # ReplyPublisher retries from there with backoff (300 s default: too long to notice).
        "message.timeout.ms": settings.delivery_timeout_ms,
        # A reply topic that does not exist must fail, not be created by a metadata request.
        "allow.auto.create.topics": False,
        "logger": logging.getLogger("tolk.kafka.producer"),
    }


class ReplyTopicChecker:
    """Says whether a reply topic exists; each answer is trusted for `ttl_s` (a metadata round
    trip on the poll thread, so once per topic, not once per record)."""

    def __init__(self, ttl_s: float, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._checks: dict[str, tuple[str | None, float]] = {}  # topic -> (problem, when)

    def forget(self, topic: str) -> None:
        """Drop a cached answer (a delivery to the topic failed: ask the broker again)."""
        self._checks.pop(topic, None)

    def problem(self, producer: Any, topic: str) -> str | None:
        """None when `topic` exists; else why no reply can go there."""
        if not TOPIC_NAME_RE.match(topic):
            return f"reply_topic {topic!r} is not a valid Kafka topic name"
        now = time.monotonic()
        cached = self._checks.get(topic)
        if cached is not None and now - cached[1] < self.ttl_s:
            return cached[0]
        problem: str | None
        try:
            md = producer.list_topics(topic=topic, timeout=5.0)
            info = md.topics.get(topic)
            if info is None:
                problem = f"reply_topic {topic!r} does not exist"
            elif info.error is not None and info.error.code() in MISSING_TOPIC_CODES:
                problem = f"reply_topic {topic!r} does not exist ({info.error.str()})"
            else:
                problem = None  # exists (maybe still electing a leader: the producer waits)
        except KafkaException as exc:
            log.warning("metadata check of %r failed (assuming it exists): %s", topic, exc)
            return None
        if len(self._checks) > self.max_entries:
            self._checks.clear()
        self._checks[topic] = (problem, now)
        return problem
