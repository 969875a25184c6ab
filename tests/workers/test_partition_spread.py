"""How the group's assignor spreads the language topics over the workers, on the real broker.

The fair-share guarantee across workers (workers/serving/group_fairness.py) needs every worker
to hold partitions of every busy language. Measured here with the worker's own consumer
configuration (`workers.kafka.config.consumer_config`), 3 topics of 4 partitions, 3 workers then
2: both group protocols hand out every partition once (`_settled`); KIP-848 with the broker's
`range` assignor (`group_protocol="consumer"`) splits every topic evenly over the workers (4
partitions over 3 workers: 2/1/1 of each language). Classic cooperative-sticky balances each
worker's total count only: in a real run it gave one
worker all four French partitions and the other two none (a split the fair share cannot
correct; test_group_fairness shows what that costs).
"""

from __future__ import annotations

import time
import uuid
from collections import defaultdict

import pytest
from confluent_kafka import Consumer

from tests.workers.fakes import create_prefixed_topics
from topics.catalog import request_topic
from workers.kafka.config import consumer_config
from workers.settings import Settings

pytestmark = [pytest.mark.kafka]

LANGS = ("de", "fr", "es")


def _held(consumers: list[Consumer], seconds: float) -> list[dict[str, int]]:
    """Poll every member until `seconds` pass; then what each holds: topic -> partitions."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for c in consumers:
            c.poll(0.05)
    held: list[dict[str, int]] = []
    for c in consumers:
        per_topic: dict[str, int] = defaultdict(int)
        for tp in c.assignment():
            per_topic[tp.topic] += 1
        held.append(dict(per_topic))
    return held


def _settled(consumers: list[Consumer], topics: list[str], partitions: int) -> list[dict[str, int]]:
    """Poll until every member holds something, the members together hold every partition
    once, and nothing moved for 3 s (cooperative rebalances take a few rounds); at most 90 s."""
    held: list[dict[str, int]] = []
    previous: list[dict[str, int]] = []
    stable = 0
    for _ in range(90):
        held = _held(consumers, 1.0)
        complete = all(sum(h.get(t, 0) for h in held) == partitions for t in topics)
        stable = stable + 1 if complete and all(held) and held == previous else 0
        if stable >= 3:
            return held
        previous = held
    raise AssertionError(f"the group did not settle: {held}")


@pytest.mark.parametrize("group_protocol", ["classic", "consumer"])
def test_partitions_held_once_and_spread_per_language_with_kip848(
    kafka_bootstrap: str, group_protocol: str
) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}."
    partitions = 4
    create_prefixed_topics(kafka_bootstrap, prefix, LANGS, partitions=partitions)
    topics = [prefix + request_topic(lang) for lang in LANGS]
    group = f"spread-{uuid.uuid4().hex[:8]}"
    consumers = []
    for k in range(3):
        settings = Settings(
            bootstrap=kafka_bootstrap,
            group_id=group,
            languages=LANGS,
            worker_id=f"w{k}",
            session_timeout_ms=6000,
            group_protocol=group_protocol,
        )
        consumers.append(Consumer(consumer_config(settings)))
        consumers[-1].subscribe(topics)
    try:
        for members in (3, 2):
            if members == 2:
                consumers.pop().close()  # a member leaves: its partitions move to the others
            held = _settled(consumers, topics, partitions)
            print(group_protocol, members, held)
            if group_protocol == "consumer":  # range: each topic split evenly over all
                for t in topics:
                    per_member = [h.get(t, 0) for h in held]
                    assert min(per_member) >= 1 and max(per_member) - min(per_member) <= 1, held
            else:  # cooperative-sticky: the number of partitions per member is balanced
                counts = [sum(h.values()) for h in held]
                assert max(counts) - min(counts) <= 1, held
    finally:
        for c in consumers:
            c.close()
