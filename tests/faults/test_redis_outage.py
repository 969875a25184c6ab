"""Redis outage under load: redis-server stops, and starts again ~8 s later.

The fault: SIGTERM to the private redis-server (it runs with `--save ""`, so it comes back
empty, as a redis without persistence would), a dead result store for `DOWN_S` seconds, then
``stack.sh up`` starts it again. The worker uses redis only to answer redelivered requests
from stored results (dedupe); without it, it must keep translating (dedupe degraded) and not
stall or exit.

Asserted: translations keep flowing during the outage (requests sent while redis was down are
answered before it is back), nothing is lost, the worker counts the outage in its degraded-store
metric (`tolk_store_degraded_total`: failed or skipped store calls), and once redis is back the
results of new requests are stored in it again (redis-py reconnects by itself).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import cast

import pytest
import redis

from schemas.codec import decode_result
from tests.faults.harness import (
    LoadGenerator,
    TopicTail,
    WorkerProcess,
    ledger_report,
    new_prefix,
    scrape_metrics,
    wait_until,
)
from tests.faults.private_stack import PrivateStack, free_port
from tests.workers.fakes import create_prefixed_topics
from topics.catalog import REPLIES
from workers.store.results import result_key

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.redis, pytest.mark.faults]

LANGS = ("de", "fr")
DOWN_S = 8.0


def degraded_count(metrics: dict[str, float]) -> tuple[str, float]:
    """(the metric's name, its total over `op`): failed or skipped result-store calls."""
    name = "tolk_store_degraded_total"
    return name, sum(v for k, v in metrics.items() if k.startswith(name + "{"))


def test_redis_outage_under_load_keeps_translating(
    stack_up: PrivateStack, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    stack = stack_up
    prefix = new_prefix("redis")
    create_prefixed_topics(stack.bootstrap, prefix, LANGS, partitions=2)
    metrics_port = free_port(19400)
    worker = spawn_worker(
        group=f"g-{uuid.uuid4().hex[:8]}",
        languages=list(LANGS),
        prefix=prefix,
        worker_id="redis-outage",
        metrics_port=metrics_port,
    )
    worker.wait_assigned(60)
    replies = TopicTail(stack.bootstrap, prefix + REPLIES, decode_result)
    load = LoadGenerator(stack.bootstrap, prefix, LANGS, rate=20).start()
    store = redis.Redis.from_url(stack.redis_url, socket_timeout=2)
    try:
        time.sleep(4)
        stack.stop_redis()
        down_at = time.monotonic()
        sent_down_start = load.rids()
        time.sleep(DOWN_S)
        sent_during = load.rids() - sent_down_start
        answered_during = sent_during & set(replies.by_request_id())
        degraded_metric, degraded_during = degraded_count(scrape_metrics(metrics_port))
        stack.start_redis()
        back_at = time.monotonic()
        time.sleep(5)
        load.stop()
        sent = load.rids()
        wait_until(lambda: sent <= set(replies.by_request_id()), 120, "a reply to every request")
        time.sleep(1)
        # Requests sent a second after redis answered again: their results must be stored.
        after = sorted(rid for rid in sent if load.sent[rid].scheduled > back_at + 1.0)
        stored = cast(list[bytes | None], store.mget([result_key(rid) for rid in after]))
        stored_after = sum(1 for v in stored if v is not None)
        report = ledger_report(
            "redis_outage",
            sent,
            replies,
            outage_s=round(back_at - down_at, 1),
            sent_during_outage=len(sent_during),
            answered_during_outage=len(answered_during),
            degraded_metric=degraded_metric,
            degraded_count=degraded_during,
            sent_after_recovery=len(after),
            stored_after_recovery=stored_after,
            worker_alive=worker.alive(),
        )
    finally:
        replies.close()
        store.close()
    assert report["lost"] == 0
    assert report["duplicates_different_text"] == 0
    assert report["statuses"] == {"OK": len(sent)}
    assert sent_during and len(answered_during) >= len(sent_during) // 2, (
        "translations stalled while redis was down"
    )
    assert degraded_during > 0, f"{degraded_metric} did not count the outage"
    assert after and stored_after == len(after), "results not stored again after redis came back"
    assert worker.alive()
