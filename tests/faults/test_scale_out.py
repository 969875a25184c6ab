"""Scale-out under load: three real-model workers in one group, one SIGKILLed, one added, one
stopped with SIGTERM, while requests keep coming; nothing is lost.

Workers of one consumer group share the language topics' partitions (cooperative-sticky,
`workers/kafka/config.py`). Here three `tests/faults/worker_main.py` processes run the real
engine (SmolLM2 135M, 8 output tokens, float32 on CPU) over three languages of 4 partitions
each, under an open-loop load. Mid-run: worker `w1` gets SIGKILL (its partitions move after its
6 s session timeout; what it had answered but not committed is answered again), a new worker
`w3` joins (the group rebalances incrementally: the others keep their partitions), and `w2`
gets SIGTERM (it drains, commits and leaves the group, exit 0). `w3`'s process starts with the
others and holds, its engine warm, until it is told to join (`hold_until`): what is tested is
the group's rebalance under load, not a model's load beside three busy workers, which took
about a minute and tripled the requests the test waits for.

Asserted: every request answered, none lost; duplicates counted and equal in text (greedy
model, and the result store resends stored bytes); every answer OK; the added worker answered
requests (it got partitions); the SIGTERMed worker exited 0. The ledger line (`FAULTS {...}`)
has the per-worker counts.
"""

from __future__ import annotations

import os
import random
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

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
RATE = 4.0  # requests per second, all languages together (three workers of a 135M model)


def test_three_workers_one_killed_one_added_one_stopped_lose_nothing(
    stack_up: PrivateStack, spawn_worker: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    stack = stack_up
    seed = int(os.environ.get("TOLK_FAULTS_SEED", random.randrange(1 << 30)))
    prefix = new_prefix("scale")
    create_prefixed_topics(stack.bootstrap, prefix, LANGS, partitions=4)
    group = f"g-{uuid.uuid4().hex[:8]}"

    join_w3 = tmp_path / "join-w3"

    def start(name: str, **extra: str) -> WorkerProcess:
        return spawn_worker(
            group=group,
            languages=list(LANGS),
            prefix=prefix,
            worker_id=name,
            model="smollm2-135m",
            max_new_tokens=8,
            pack_weights=False,  # no GEMM probe: four workers start at once on two cores
            **extra,
        )

    replies = TopicTail(stack.bootstrap, prefix + REPLIES, decode_result)
    workers = {name: start(name) for name in ("w0", "w1", "w2")}
    workers["w3"] = start("w3", hold_until=str(join_w3))
    for name in ("w0", "w1", "w2"):
        workers[name].wait_assigned(600)
    workers["w3"].wait_ready(600)
    assert not workers["w3"].assigned.is_set()
    load = LoadGenerator(stack.bootstrap, prefix, LANGS, rate=RATE, seed=seed).start()
    try:
        time.sleep(8)
        workers["w1"].kill()
        assert workers["w1"].proc.returncode == -signal.SIGKILL
        time.sleep(8)
        join_w3.touch()  # w3 joins the group now, under load
        workers["w3"].wait_assigned(60)
        time.sleep(8)
        assert workers["w2"].terminate(timeout=60) == 0  # drains, commits, leaves the group
        time.sleep(6)
        load.stop()
        sent = load.rids()
        wait_until(lambda: sent <= set(replies.by_request_id()), 300, "a reply to every request")
        time.sleep(2)
        by_worker = Counter(str(s.decoded.get("worker_id")) for s in replies.snapshot())
        report = ledger_report(
            "scale_out", sent, replies, seed=seed, replies_by_worker=dict(sorted(by_worker.items()))
        )
    finally:
        replies.close()
    assert report["lost"] == 0, f"seed {seed}"
    assert report["duplicates_different_text"] == 0, f"seed {seed}"
    assert report["statuses"] == {"OK": len(sent)}
    assert by_worker["w3"] > 0, "the added worker got no partitions"
    assert by_worker["w0"] > 0 and workers["w0"].alive() and workers["w3"].alive()
