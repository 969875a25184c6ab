"""The worker's Kafka client settings and its check that a reply topic exists.

The consumer stores and commits offsets itself (never auto), so an offset moves only once the
record's reply is delivered (PITFALLS: turn both `enable.auto.*` off). The producer is
idempotent with `acks=all`, and must not create a reply topic by asking for its metadata: a
request naming a topic that does not exist is dead-lettered instead.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from workers.settings import Settings

__all__ = ["MISSING_TOPIC_CODES", "ReplyTopicChecker", "consumer_config", "producer_config"]

log = logging.getLogger(__name__)

TOPIC_NAME_RE = re.compile(r"^[a-zA-Z0-9._-]{1,249}$")

# Errors that mean "no such topic (for us)": a reply there can never be delivered.
MISSING_TOPIC_CODES = frozenset(
    {
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError._UNKNOWN_TOPIC,
        KafkaError._UNKNOWN_PARTITION,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.TOPIC_EXCEPTION,
    }
)


def consumer_config(settings: Settings) -> dict[str, Any]:
    return {
        **settings.kafka_common(),
        "group.id": settings.group_id,
        "client.id": settings.worker_id,
        "partition.assignment.strategy": "cooperative-sticky",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "session.timeout.ms": settings.session_timeout_ms,
        "logger": logging.getLogger("tolk.kafka.consumer"),
    }


def producer_config(settings: Settings) -> dict[str, Any]:
    return {
        **settings.kafka_common(),
        "client.id": settings.worker_id,
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 5,
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
