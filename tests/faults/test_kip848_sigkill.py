"""SIGKILL under the KIP-848 group protocol (`TOLK_GROUP_PROTOCOL=consumer`): nothing lost.

With `group.protocol=consumer` the broker, not the client, decides when a member is gone: its
session timeout is the broker's `group.consumer.session.timeout.ms` (45 s by default, and no
client can ask for less), so the client's `session.timeout.ms` (6 s in these tests) no longer
applies. Two workers of one group share 2 languages x 2 partitions under a steady load (fake
engine), then:

1. the static member (`group.instance.id`) is SIGKILLed and restarted at once with the same
   instance id, by a supervisor loop (what Kubernetes does). Unlike the classic protocol, where
   the successor takes the dead member's place at once (tests/faults/test_repeated_sigkill.py),
   the KIP-848 coordinator refuses it with a fatal error ("The instance ID is still used by
   another member") until the dead member's session expires. The worker must exit on that
   error (it used to stay up, alive and without partitions, for good); the supervisor's next
   start after the session timeout gets the partitions back;
2. the dynamic member is SIGKILLed and not replaced: its partitions wait for the broker's
   session timeout, then move to the surviving worker.

Asserted: every request answered, none lost, duplicates equal in text, all OK; every refused
start exited non-zero, saying why; the stall of the requests sent just after each kill (send ->
first reply) is bounded by the broker's session timeout. The ledger line (`FAULTS {...}`) has
both stalls and the refused starts: the figures docs/OPERATIONS.md quotes for KIP-848.
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

LANGS = ("de", "fr")
RATE = 10.0
BROKER_SESSION_TIMEOUT_S = 45.0  # Kafka 4's group.consumer.session.timeout.ms default


def _stall_after(load: LoadGenerator, replies: TopicTail, t_kill: float, window_s: float) -> float:
    """The longest send -> first reply of the requests due in `window_s` after `t_kill`."""
    by_id = replies.by_request_id()
    stalls = [
        min(s.arrived for s in by_id[rid]) - sent.scheduled
        for rid, sent in list(load.sent.items())
        if t_kill <= sent.scheduled < t_kill + window_s and rid in by_id
    ]
    assert stalls, "no request was due right after the kill"
    return max(stalls)


def supervise(start: Callable[[int], WorkerProcess], timeout_s: float) -> tuple[WorkerProcess, int]:
    """Start a worker again and again (2 s apart) until one is assigned, as a supervisor
    would; returns it and how many starts were refused (each must exit non-zero, saying why)."""
    end = time.monotonic() + timeout_s
    refused = 0
    while time.monotonic() < end:
        worker = start(refused + 1)
        while not worker.assigned.is_set() and worker.proc.poll() is None:
            assert time.monotonic() < end, "no start of the successor got the partitions"
            time.sleep(0.2)
        if worker.assigned.is_set():
            return worker, refused
        assert worker.proc.returncode not in (0, None), "a refused start must exit non-zero"
        assert "fatal Kafka error" in worker.log_text(), worker.log_text()[-2000:]
        refused += 1
        time.sleep(2.0)
    raise AssertionError(f"no successor assigned within {timeout_s:.0f} s ({refused} refused)")


def test_kip848_static_restart_and_dynamic_kill_lose_nothing(
    stack_up: PrivateStack, spawn_worker: Callable[..., WorkerProcess]
) -> None:
    stack = stack_up
    seed = int(os.environ.get("TOLK_FAULTS_SEED", random.randrange(1 << 30)))
    prefix = new_prefix("kip848")
    create_prefixed_topics(stack.bootstrap, prefix, LANGS, partitions=2)
    group = f"g-{uuid.uuid4().hex[:8]}"
    instance = f"kip848-{uuid.uuid4().hex[:6]}"

    def start(name: str, instance_id: str | None) -> WorkerProcess:
        return spawn_worker(
            group=group,
            languages=list(LANGS),
            prefix=prefix,
            worker_id=name,
            group_instance_id=instance_id,
            delay_s=0.05,
            settings={"group_protocol": "consumer"},
        )

    replies = TopicTail(stack.bootstrap, prefix + REPLIES, decode_result)
    static, dynamic = start("static-0", instance), start("dynamic", None)
    static.wait_assigned(60)
    dynamic.wait_assigned(60)
    load = LoadGenerator(stack.bootstrap, prefix, LANGS, rate=RATE, seed=seed).start()
    try:
        wait_until(
            lambda: {"static-0", "dynamic"}
            <= {str(s.decoded.get("worker_id")) for s in replies.snapshot()},
            60,
            "both workers answering (the group spread the partitions)",
        )
        static.kill()
        assert static.proc.returncode == -signal.SIGKILL
        t_static = time.monotonic()
        static, refused = supervise(lambda n: start(f"static-{n}", instance), 120)
        time.sleep(6)
        dynamic.kill()
        t_dynamic = time.monotonic()
        time.sleep(BROKER_SESSION_TIMEOUT_S + 10)
        load.stop()
        sent = load.rids()
        wait_until(lambda: sent <= set(replies.by_request_id()), 120, "a reply to every request")
        time.sleep(2)
        static_stall = _stall_after(load, replies, t_static, 2.0)
        dynamic_stall = _stall_after(load, replies, t_dynamic, 2.0)
        late = {
            str(replies.by_request_id()[rid][0].decoded.get("worker_id"))
            for rid, s in list(load.sent.items())
            if s.scheduled > t_dynamic + BROKER_SESSION_TIMEOUT_S + 5
        }
        report = ledger_report(
            "kip848_sigkill",
            sent,
            replies,
            seed=seed,
            static_restart_stall_s=round(static_stall, 1),
            dynamic_kill_stall_s=round(dynamic_stall, 1),
            refused_starts=refused,
            answering_at_the_end=sorted(late),
        )
    finally:
        replies.close()
    assert report["lost"] == 0, f"seed {seed}"
    assert report["duplicates_different_text"] == 0, f"seed {seed}"
    assert report["statuses"] == {"OK": len(sent)}
    assert static_stall < BROKER_SESSION_TIMEOUT_S + 30, f"static restart: {static_stall:.1f} s"
    assert dynamic_stall < BROKER_SESSION_TIMEOUT_S + 20, (
        f"dynamic kill stalled {dynamic_stall:.1f} s"
    )
    assert late == {f"static-{refused + 1}"}, (
        "the survivor did not take the killed member's partitions"
    )
    assert static.alive()
