"""Poison request: a request the engine fails every time is retried a bounded number of times,
then dead-lettered and answered ERROR, without blocking its partition or other languages.

The fault: a request whose text carries the fake engine's `POISON_MARKER`: the engine's step
raises whenever it is in the batch, and, as the real engine does (`Engine.results.fail_all`), every
request of that batch finishes ERROR with the exception's text. It is the first record of `de`
partition 0; valid requests follow it on that same partition and on `fr` at a steady rate, so
they share batches with the poison's attempts. The worker resubmits an ERROR result up to
`Settings.max_attempts` times, then dead-letters the record with reason "poison" and the
engine's error text, and then answers its client ERROR. The fake engine takes `DELAY_S` per
batch, so the retries take a while.

Asserted: exactly one dead letter for the poison request, with reason "poison" and the original
bytes, then one ERROR reply to it; every valid request answered OK, and valid requests of the
poison's own partition, sent after it, answered before its dead letter went out (the partition
was not blocked); the group's committed offset of that partition passes the poison at the end."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest
from confluent_kafka import Producer

from schemas.codec import decode_dead_letter, decode_request, decode_result, encode_request
from tests.faults.harness import (
    KAFKA_LOG,
    LoadGenerator,
    OffsetProbe,
    TopicTail,
    WorkerProcess,
    ledger_report,
    new_prefix,
    request_record,
    scrape_metrics,
    wait_until,
)
from tests.faults.private_stack import PrivateStack, free_port
from tests.workers.fakes import POISON_MARKER, create_prefixed_topics
from topics.catalog import DEAD_LETTERS, REPLIES, request_topic

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.redis, pytest.mark.faults]

LANGS = ("de", "fr")
MAX_ATTEMPTS = 3
DELAY_S = 0.3


def _dead_letter_with_request(value: bytes) -> dict[str, object]:
    letter = decode_dead_letter(value)
    try:
        letter["request_id"] = decode_request(letter["original"])["request_id"]
    except Exception:  # noqa: BLE001 - undecodable originals have no request id
        letter["request_id"] = ""
    return letter


def test_poison_request_is_dead_lettered_without_blocking_its_partition(
    stack_up: PrivateStack, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    stack = stack_up
    prefix = new_prefix("poison")
    create_prefixed_topics(stack.bootstrap, prefix, LANGS, partitions=2)
    group = f"g-{uuid.uuid4().hex[:8]}"
    metrics_port = free_port(19400)
    worker = spawn_worker(
        group=group,
        languages=list(LANGS),
        prefix=prefix,
        worker_id="poison",
        delay_s=DELAY_S,
        metrics_port=metrics_port,
        settings={"max_attempts": MAX_ATTEMPTS},
    )
    worker.wait_assigned(60)
    replies = TopicTail(stack.bootstrap, prefix + REPLIES, decode_result)
    letters = TopicTail(stack.bootstrap, prefix + DEAD_LETTERS, _dead_letter_with_request)
    probe = OffsetProbe(stack.bootstrap)
    poison_topic = prefix + request_topic("de")
    poison_rid = f"poison-{uuid.uuid4().hex[:8]}"
    poison_value = encode_request(
        request_record(poison_rid, "de", f"this {POISON_MARKER} fails", prefix + REPLIES)
    )
    producer = Producer({"bootstrap.servers": stack.bootstrap, "logger": KAFKA_LOG})
    producer.produce(poison_topic, value=poison_value, key=poison_rid.encode(), partition=0)
    assert producer.flush(10) == 0
    poison_sent = time.monotonic()
    # Everything on partition 0: the poison's own partition for `de`.
    load = LoadGenerator(stack.bootstrap, prefix, LANGS, rate=20, partition_of=lambda i: 0)
    load.start()
    try:
        time.sleep(4)
        load.stop()
        sent = load.rids()
        wait_until(lambda: sent <= set(replies.by_request_id()), 60, "a reply to every request")
        wait_until(
            lambda: poison_rid in letters.by_request_id(), 60, "the poison request's dead letter"
        )
        wait_until(
            lambda: poison_rid in replies.by_request_id(), 30, "the poison request's ERROR reply"
        )
        time.sleep(1)
        poison_letters = letters.by_request_id()[poison_rid]
        dead_at = poison_letters[0].arrived
        by_id = replies.by_request_id()
        same_partition_before = [
            rid
            for rid in sent
            if load.sent[rid].lang == "de" and min(s.arrived for s in by_id[rid]) < dead_at
        ]
        end = probe.high_watermarks([(poison_topic, 0)])[(poison_topic, 0)]
        committed = wait_until(
            lambda: probe.committed(group, [(poison_topic, 0)])[(poison_topic, 0)] >= end,
            30,
            "the commit to pass the poison record",
        )
        metrics = scrape_metrics(metrics_port)
        retries = sum(v for k, v in metrics.items() if k.startswith("tolk_engine_retries_total{"))
        report = ledger_report(
            "poison_request",
            sent,
            replies,
            poison_dead_letters=len(poison_letters),
            poison_reason=poison_letters[0].decoded.get("reason"),
            poison_dead_letter_after_s=round(dead_at - poison_sent, 2),
            poison_replies=len(by_id.get(poison_rid, [])),
            same_partition_answered_before_dead_letter=len(same_partition_before),
            engine_retries_metric=retries,
            commit_passed_poison_after_s=round(committed, 1),
        )
    finally:
        replies.close()
        letters.close()
        probe.close()
    assert report["lost"] == 0
    assert report["statuses"] == {"OK": len(sent)}
    assert len(poison_letters) == 1
    assert poison_letters[0].decoded["reason"] == "poison"
    assert poison_letters[0].decoded["original"] == poison_value
    # after the dead letter the client is answered ERROR once, not left to time out
    (poison_reply,) = by_id[poison_rid]
    assert poison_reply.decoded["status"] == "ERROR" and "poison" in poison_reply.decoded["error"]
    assert poison_reply.arrived >= dead_at
    assert same_partition_before, "the poison request blocked its partition"
    assert worker.alive()
