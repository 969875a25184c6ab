"""Repeated SIGKILL: 20 kills of the worker at random moments under a steady load.

The fault: SIGKILL (no `finally`, no flush, no commit, no leaving the group) after a random
1-4 s of work, each followed at once by a new worker process. At a kill, requests sit in the
fake engine, replies in the producer's queue, delivered replies with uncommitted offsets. The
successor uses the same static `group.instance.id` (KIP-345), so the coordinator hands it the
dead member's partitions at once instead of waiting out its session timeout; it reads again
from the last commit.

Asserted: 0 lost over all 20 kills; duplicates (replies delivered but not committed before a
kill, answered again from the redis result store or recomputed) are counted and carry the
same text as the first answer. The seed is in the report (`TOLK_FAULTS_SEED` replays it).
"""

from __future__ import annotations

import os
import random
import signal
import time
import uuid
from collections.abc import Callable

import pytest

from schemas.codec import decode_result
from tests.faults.harness import (
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

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.redis, pytest.mark.faults]

LANGS = ("de", "fr", "es")
KILLS = 20


def test_twenty_sigkills_under_load_lose_nothing(
    stack_up: PrivateStack, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    stack = stack_up
    seed = int(os.environ.get("TOLK_FAULTS_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    prefix = new_prefix("kill")
    create_prefixed_topics(stack.bootstrap, prefix, LANGS, partitions=2)
    group = f"g-{uuid.uuid4().hex[:8]}"

    def start(n: int) -> WorkerProcess:
        return spawn_worker(
            group=group,
            languages=list(LANGS),
            prefix=prefix,
            worker_id=f"kill-{n}",
            group_instance_id="faults-kill-worker",
            delay_s=0.1,
        )

    replies = TopicTail(stack.bootstrap, prefix + REPLIES, decode_result)
    worker = start(0)
    worker.wait_assigned(60)
    load = LoadGenerator(stack.bootstrap, prefix, LANGS, rate=20, seed=seed).start()
    reassigned_s: list[float] = []
    try:
        for n in range(1, KILLS + 1):
            time.sleep(rng.uniform(1.0, 4.0))
            worker.kill()
            assert worker.proc.returncode == -signal.SIGKILL
            t0 = time.monotonic()
            worker = start(n)
            worker.wait_assigned(60)
            reassigned_s.append(time.monotonic() - t0)
        time.sleep(3)
        load.stop()
        sent = load.rids()
        wait_until(lambda: sent <= set(replies.by_request_id()), 120, "a reply to every request")
        time.sleep(2)
        workers = {s.decoded.get("worker_id") for s in replies.snapshot()}
        report = ledger_report(
            "repeated_sigkill",
            sent,
            replies,
            seed=seed,
            kills=KILLS,
            restart_to_assigned_s_max=round(max(reassigned_s), 1),
            restart_to_assigned_s_mean=round(sum(reassigned_s) / len(reassigned_s), 1),
            answering_workers=len(workers),
        )
    finally:
        replies.close()
    assert report["lost"] == 0, f"seed {seed}"
    assert report["duplicates_different_text"] == 0, f"seed {seed}"
    assert report["statuses"] == {"OK": len(sent)}
    assert len(workers) > KILLS // 2, "the restarted workers did not take over"
    assert worker.alive()
