"""A worker process killed with SIGKILL under load, then restarted: nothing is lost.

The worker runs as a real subprocess with the real engine (SmolLM2, 8 output tokens, float32
on CPU; startup is a few seconds from the weight cache), so the kill is a real one: no
`finally`, no flush, no commit, no leaving the group. ~150 requests are produced; once a random
number of replies has come back (the worker is mid-batch then: requests in the engine, replies
in the producer's queue, offsets done but not committed) the process gets SIGKILL. A second
process in the same group takes the partitions over once the session times out and must answer
everything the first one did not.

At-least-once means a request may be answered twice: its reply was delivered but its offset
not yet committed. The successor then finds the stored result in redis and resends the same
bytes (or, if the kill fell between delivery and the redis write, translates again with the same
greedy model). Duplicates are counted and must carry the same text.
"""

from __future__ import annotations

import os
import random
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from schemas.codec import decode_result, encode_request
from tests.faults.harness import WorkerProcess
from tests.workers.fakes import TopicReader, create_prefixed_topics
from tests.workers.polling import wait_for
from topics.catalog import REPLIES, request_topic

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.redis]

LANGS = ("de", "fr", "es", "it")
N_REQUESTS = 150


@pytest.fixture
def procs() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for p in started:
        p.terminate()


def test_sigkill_under_load_then_restart_loses_nothing(
    kafka_bootstrap: str, redis_url: str, procs: list[WorkerProcess], tmp_path: Path
) -> None:
    from replay.datasets import tatoeba_pairs

    seed = int(os.environ.get("TOLK_SIGKILL_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    prefix = f"t{uuid.uuid4().hex[:10]}."
    create_prefixed_topics(kafka_bootstrap, prefix, LANGS, partitions=2)
    args: dict[str, Any] = {
        "bootstrap": kafka_bootstrap,
        "redis": redis_url,
        "group": f"tolk-test-{uuid.uuid4().hex[:10]}",
        "languages": list(LANGS),
        "prefix": prefix,
        "model": "smollm2-135m",
        "max_new_tokens": 8,
        "session_timeout_ms": 6000,
    }
    replies = TopicReader(kafka_bootstrap, prefix + REPLIES)
    try:
        first = WorkerProcess({**args, "worker_id": "first"}, tmp_path / "first.log")
        procs.append(first)
        first.wait_assigned(180)

        producer = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 5})
        run = uuid.uuid4().hex[:8]
        rids: list[str] = []
        texts = {lang: [en for en, _ in tatoeba_pairs(lang) if len(en) <= 60] for lang in LANGS}
        for i in range(N_REQUESTS):
            lang = LANGS[i % len(LANGS)]
            rid = f"{run}-{i}"
            rids.append(rid)
            record: dict[str, Any] = {
                "request_id": rid,
                "conversation_id": None,
                "source_lang": "en",
                "target_lang": lang,
                "text": texts[lang][i // len(LANGS)],
                "created_at": int(time.time() * 1000),
                "deadline": None,
                "reply_topic": prefix + REPLIES,
                "metadata": {},
            }
            producer.produce(
                prefix + request_topic(lang), value=encode_request(record), key=rid.encode()
            )
        assert producer.flush(30) == 0

        kill_after = rng.randint(5, N_REQUESTS - 30)  # replies seen before the kill
        wait_for(lambda: len(replies) >= kill_after, 600, f"{kill_after} replies before kill")
        first.kill()
        seen_at_kill = len(replies)
        assert first.proc.returncode == -signal.SIGKILL

        second = WorkerProcess({**args, "worker_id": "second"}, tmp_path / "second.log")
        procs.append(second)
        second.wait_assigned(180)  # after the dead member's session timeout (6 s)

        def answered() -> set[str]:
            return {decode_result(v)["request_id"] for v in replies.values()}

        wait_for(lambda: answered() >= set(rids), 900, "a reply to every request")
        time.sleep(3.0)  # late duplicates would show up now
        assert second.terminate() == 0  # SIGTERM: drains, commits, exits 0
    finally:
        replies.close()

    by_id: dict[str, list[dict[str, Any]]] = {}
    for v in replies.values():
        r = decode_result(v)
        by_id.setdefault(r["request_id"], []).append(r)
    assert set(by_id) == set(rids), f"seed {seed}: lost {sorted(set(rids) - set(by_id))[:5]}"
    duplicates = {rid: rs for rid, rs in by_id.items() if len(rs) > 1}
    different = {
        rid: [r["text"] for r in rs]
        for rid, rs in duplicates.items()
        if len({r["text"] for r in rs}) > 1
    }
    workers = {r["worker_id"] for rs in by_id.values() for r in rs}
    print(
        f"seed {seed}: killed after {seen_at_kill} replies; {len(rids)} answered; "
        f"{sum(len(rs) - 1 for rs in duplicates.values())} duplicate replies for "
        f"{len(duplicates)} ids; answered by {sorted(workers)}"
    )
    assert not different, f"seed {seed}: duplicates with different text: {different}"
    assert all(r["status"] == "OK" for rs in by_id.values() for r in rs)
    assert "second" in workers  # the successor answered what the first one left
