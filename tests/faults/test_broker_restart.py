"""Broker restart under load: the Kafka process stops, and starts again ~12 s later.

The fault: SIGTERM to the private broker's JVM (its controlled shutdown), a dead broker for
`DOWN_S` seconds, then ``stack.sh up`` starts it again from the same data directory. Load runs
all along: an open-loop producer of raw Avro requests and a `TranslationClient` sending through
its own asyncio loop (the bot's path), both before, during and after the outage. librdkafka
buffers what is produced while the broker is gone and reconnects; the worker keeps polling.

Asserted: every request sent before, during and after is answered once the broker is back
(lost == 0), duplicates (a reply delivered whose offset was not yet committed) carry the same
text, the worker process is still alive at the end, and every `translate()` of the client
returned a reply (none raised, none timed out).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from schemas.codec import decode_result
from tests.faults.harness import (
    KAFKA_LOG,
    LoadGenerator,
    TopicTail,
    WorkerProcess,
    ledger_report,
    new_prefix,
    wait_until,
)
from tests.faults.private_stack import PrivateStack
from tests.workers.fakes import create_prefixed_topics
from topics.catalog import REPLIES
from workers.client import TranslationClient

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.redis, pytest.mark.faults]

LANGS = ("de", "fr", "es")
DOWN_S = 12.0  # the issue asks for 10-30 s; the low end keeps CI short


class ClientLoad:
    """A `TranslationClient` on its own event loop thread, one `translate()` every
    1/rate s until `stop()`; each outcome (reply or exception) is kept."""

    def __init__(self, bootstrap: str, prefix: str, rate: float) -> None:
        self.bootstrap, self.prefix, self.rate = bootstrap, prefix, rate
        self.replies: list[Any] = []
        self.failures: list[BaseException] = []
        self.started = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def start(self) -> ClientLoad:
        self._thread.start()
        assert self.started.wait(60), "the client did not start"
        return self

    async def _one(self, client: TranslationClient, i: int) -> None:
        try:
            reply = await client.translate(
                f"client {i} where is my order", to=LANGS[i % 3], src="en", timeout=240
            )
            self.replies.append(reply)
        except Exception as exc:  # noqa: BLE001 - every failure is counted and asserted on
            self.failures.append(exc)

    async def _main(self) -> None:
        async with TranslationClient(
            self.bootstrap, topic_prefix=self.prefix, kafka_config={"logger": KAFKA_LOG}
        ) as client:
            self.started.set()
            tasks = []
            i = 0
            while not self._stop.is_set():
                tasks.append(asyncio.create_task(self._one(client, i)))
                i += 1
                await asyncio.sleep(1 / self.rate)
            await asyncio.gather(*tasks)

    def stop(self, timeout: float = 300) -> None:
        self._stop.set()
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "client load did not finish"

    @property
    def sent(self) -> int:
        return len(self.replies) + len(self.failures)


def test_broker_restart_under_load_loses_nothing(
    stack_up: PrivateStack, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    stack = stack_up
    prefix = new_prefix("broker")
    create_prefixed_topics(stack.bootstrap, prefix, LANGS, partitions=2)
    worker = spawn_worker(
        group=f"g-{uuid.uuid4().hex[:8]}",
        languages=list(LANGS),
        prefix=prefix,
        worker_id="broker-restart",
        delay_s=0.05,
    )
    worker.wait_assigned(60)
    replies = TopicTail(stack.bootstrap, prefix + REPLIES, decode_result)
    load = LoadGenerator(stack.bootstrap, prefix, LANGS, rate=20).start()
    client = ClientLoad(stack.bootstrap, prefix, rate=2).start()
    try:
        time.sleep(5)
        before = len(load.rids())
        t_down = time.monotonic()
        stack.stop_kafka()
        time.sleep(DOWN_S)
        during = len(load.rids()) - before
        stack.start_kafka()
        back_after_s = time.monotonic() - t_down
        time.sleep(5)
        load.stop()
        client.stop()
        sent = load.rids()
        drain_s = wait_until(
            lambda: sent <= set(replies.by_request_id()), 180, "a reply to every request"
        )
        time.sleep(2)  # late duplicates would show up now
        report = ledger_report(
            "broker_restart",
            sent,
            replies,
            sent_before_outage=before,
            sent_during_outage=during,
            broker_back_after_s=round(back_after_s, 1),
            drain_after_load_s=round(drain_s, 1),
            client_sent=client.sent,
            client_ok=sum(1 for r in client.replies if r.ok),
            client_failed=len(client.failures),
            worker_alive=worker.alive(),
        )
    finally:
        replies.close()
    assert report["lost"] == 0
    assert report["duplicates_different_text"] == 0
    assert report["statuses"] == {"OK": len(sent)}
    assert during > 0, "no request was sent while the broker was down"
    assert worker.alive(), "the worker exited during the broker outage"
    assert not client.failures, f"client translate() failed: {client.failures[:3]!r}"
    assert client.sent > 0 and all(r.ok for r in client.replies)
