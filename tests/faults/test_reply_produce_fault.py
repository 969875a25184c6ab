"""Slow, failing reply produce: a producer quota throttles the worker's replies; commits wait.

The fault: a `producer_byte_rate` client quota of `QUOTA_BYTES_S` bytes a second on the
worker's client id (an AlterClientQuotas request to the real broker,
`harness.set_producer_quota`) for `FAULT_S` seconds, a few percent of what the load's replies
need; then it is removed. The broker delays its produce responses and mutes the worker's
connection, so replies pile up in the producer and, with the short delivery timeout the worker
runs with (`Settings.delivery_timeout_ms`), time out and are produced again with backoff
(`Settings.reply_attempts` of them before a dead letter; `workers.kafka.reply_publisher`). (Raising
the reply topic's `min.insync.replicas` does not work here: Kafka 4.x caps the effective
minimum ISR at the replication factor, so a single-broker topic keeps taking `acks=all`
writes.)

Asserted, from samples taken every 0.25 s during and after the fault: the consumer group's
committed offset never passes a request whose reply was not yet written. A sample reads the
committed offsets (a Consumer's committed() with its group id) and then the reply topic's high
watermarks; a request below a sampled commit must have a reply below the watermark sampled
right after it. Also: the fault took effect (in most samples of its middle no reply was
written, and the worker's `tolk_reply_retries_total` counted re-produced
replies), nothing was dead-lettered, and every request is answered once it clears; duplicates
(a timed-out reply that had been written after all) carry the same text.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest

from schemas.codec import decode_result
from tests.faults.harness import (
    LoadGenerator,
    OffsetProbe,
    TopicTail,
    WorkerProcess,
    ledger_report,
    new_prefix,
    scrape_metrics,
    wait_until,
)
from tests.faults.private_stack import PrivateStack, free_port, set_producer_quota
from tests.workers.fakes import create_prefixed_topics
from topics.catalog import DEAD_LETTERS, REPLIES, request_topic

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.redis, pytest.mark.faults]

LANGS = ("de", "fr")
PARTITIONS = 2
FAULT_S = 10.0
QUOTA_BYTES_S = 200.0  # the load's replies need ~6 KB/s
WORKER_ID = "reply-fault"  # the client id the quota is set on
SAMPLE_EVERY_S = 0.25


def test_commits_wait_for_replies_while_reply_produce_is_throttled(
    stack_up: PrivateStack, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    stack = stack_up
    prefix = new_prefix("reply")
    create_prefixed_topics(stack.bootstrap, prefix, LANGS, partitions=PARTITIONS)
    group = f"g-{uuid.uuid4().hex[:8]}"
    metrics_port = free_port(19400)
    worker = spawn_worker(
        group=group,
        languages=list(LANGS),
        prefix=prefix,
        worker_id=WORKER_ID,
        metrics_port=metrics_port,
        settings={"delivery_timeout_ms": 3000, "reply_attempts": 10},
    )
    worker.wait_assigned(60)
    reply_topic = prefix + REPLIES
    request_tps = [(prefix + request_topic(lang), p) for lang in LANGS for p in range(PARTITIONS)]
    reply_tps = [(reply_topic, p) for p in range(PARTITIONS)]
    replies = TopicTail(stack.bootstrap, reply_topic, decode_result)
    letters = TopicTail(stack.bootstrap, prefix + DEAD_LETTERS, lambda v: {})
    probe = OffsetProbe(stack.bootstrap)
    load = LoadGenerator(stack.bootstrap, prefix, LANGS, rate=20).start()
    # (seconds since the fault began, committed offsets, reply watermarks read after them)
    samples: list[tuple[float, dict[tuple[str, int], int], dict[tuple[str, int], int]]] = []
    try:
        time.sleep(3)
        set_producer_quota(stack.bootstrap, WORKER_ID, QUOTA_BYTES_S)
        fault_at = time.monotonic()
        while time.monotonic() - fault_at < FAULT_S:
            samples.append(
                (
                    time.monotonic() - fault_at,
                    probe.committed(group, request_tps),
                    probe.high_watermarks(reply_tps),
                )
            )
            time.sleep(SAMPLE_EVERY_S)
        set_producer_quota(stack.bootstrap, WORKER_ID, None)
        cleared_at = time.monotonic()
        while time.monotonic() - cleared_at < 5:
            samples.append(
                (
                    time.monotonic() - fault_at,
                    probe.committed(group, request_tps),
                    probe.high_watermarks(reply_tps),
                )
            )
            time.sleep(SAMPLE_EVERY_S)
        load.stop()
        sent = load.rids()
        drain_s = wait_until(
            lambda: sent <= set(replies.by_request_id()), 120, "a reply to every request"
        )
        time.sleep(1)
        by_id = replies.by_request_id()
        first_reply = {
            rid: min((s.partition, s.offset) for s in seen) for rid, seen in by_id.items()
        }
        # Per request partition: offset -> request id.
        at_offset: dict[tuple[str, int], dict[int, str]] = {tp: {} for tp in request_tps}
        for rid, info in load.sent.items():
            at_offset[(prefix + request_topic(info.lang), info.partition)][info.offset] = rid
        violations: list[str] = []
        for when, committed, watermarks in samples:
            for tp, upto in committed.items():
                for offset in range(max(0, upto)):
                    request_id = at_offset[tp].get(offset)
                    reply = first_reply.get(request_id) if request_id else None
                    if reply is None or reply[1] >= watermarks[(reply_topic, reply[0])]:
                        violations.append(f"{tp}@{offset} committed at +{when:.2f}s, no reply")
        in_fault = [s for s in samples if 1.5 <= s[0] <= FAULT_S - 0.5]
        written = [  # replies written between one in-fault sample and the next
            sum(b[2].values()) - sum(a[2].values())
            for a, b in zip(in_fault, in_fault[1:], strict=False)
        ]
        stalled = sum(1 for n in written if n == 0)
        metrics = scrape_metrics(metrics_port)
        reply_retries = sum(
            v for k, v in metrics.items() if k.startswith("tolk_reply_retries_total{")
        )
        report = ledger_report(
            "reply_produce_fault",
            sent,
            replies,
            fault_s=FAULT_S,
            samples=len(samples),
            commit_violations=len(violations),
            quota_bytes_s=QUOTA_BYTES_S,
            mid_fault_samples=len(written),
            mid_fault_samples_without_a_reply_written=stalled,
            dead_letters=len(letters),
            reply_retries_metric=reply_retries,
            replies_written_per_sample=[
                sum(b[2].values()) - sum(a[2].values())
                for a, b in zip(samples, samples[1:], strict=False)
            ],
            drain_after_load_s=round(drain_s, 1),
        )
    finally:
        set_producer_quota(stack.bootstrap, WORKER_ID, None)
        replies.close()
        letters.close()
        probe.close()
    assert not violations, violations[:5]
    # Throttled, replies go out in bursts between long stalls (steady load: ~5 per sample).
    assert stalled >= len(written) // 2, "replies kept flowing: the quota did not hold"
    assert reply_retries > 0, "no reply produce failed and was retried: the fault was idle"
    assert report["lost"] == 0
    assert report["statuses"] == {"OK": len(sent)}
    assert len(letters) == 0, "replies were dead-lettered instead of retried"
    assert worker.alive()
