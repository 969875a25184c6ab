"""The cache's Redis (L2) killed under load and started again: every request answered.

A private redis-server (port 36380 or the next free one; never the shared 6379) holds both the
L2 cache and the result store; the worker runs on the in-memory Kafka of tests/workers/fakes.py
with the fake engine behind a `CachingEngine` whose L1 is tiny (one entry per language), so
most repeats are L2 hits while Redis is up. A sender thread keeps requests coming (repeated
texts, five languages) while Redis is killed and, seconds later, started again on the same port
(empty: no persistence). Checked: every request gets exactly one OK reply with the right text,
no dead letter, every offset committed; the outage shows in `tolk_cache_l2_degraded_total` and
`tolk_cache_l2_up`; after the restart the cache writes to and hits in Redis again by itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from tests.workers.fakes import FakeEngine, fake_translation
from tests.workers.polling import wait_for
from tests.workers.test_store_outage import PrivateRedis, _free_port
from tests.workers.test_worker_fake_engine import make_rig, request_bytes
from workers.cache_ttl import parse_ttl_tiers
from workers.stages.cache.redis_l2 import RedisTranslationCache
from workers.stages.cache.stage import CachingEngine
from workers.store.results import RedisResultStore

pytestmark = pytest.mark.redis

CACHE_REDIS_PORT = 36380
LANGS = ("en", "de", "fr", "es", "it")


class CacheRedis(PrivateRedis):
    def __init__(self) -> None:
        super().__init__()
        self.port = _free_port(CACHE_REDIS_PORT)
        self.url = f"redis://127.0.0.1:{self.port}/0"


@pytest.fixture
def cache_redis() -> Iterator[CacheRedis]:
    server = CacheRedis()
    server.start()
    try:
        yield server
    finally:
        server.kill()


def text_of(i: int) -> str:
    return f"Frage Nummer {i % 40}"  # 40 texts per language, repeated


def test_redis_killed_under_load_and_restarted_loses_no_request(cache_redis: CacheRedis) -> None:
    l2 = RedisTranslationCache(cache_redis.url, parse_ttl_tiers("*:600"), socket_timeout_s=0.3)
    engine = CachingEngine(
        FakeEngine(delay_s=0.002),
        l1_capacity=5,  # one entry per language: repeats are L2 hits while Redis is up
        l1_shares={lang: 1.0 for lang in LANGS},
        l2=l2,
        prompt_set_version="outage-test",
    )
    store = RedisResultStore(cache_redis.url, ttl_s=600, socket_timeout_s=0.3)
    rig = make_rig(engine=engine, store=store)
    sent: list[tuple[str, str, str]] = []  # (request id, language, text)
    stop_sending = threading.Event()

    def sender() -> None:
        i = 0
        while not stop_sending.is_set():
            lang = LANGS[i % len(LANGS)]
            rid, text = f"q{i}", text_of(i // len(LANGS))
            src = "de" if lang == "en" else "en"
            rig.send(request_bytes(rid, text=text, target=lang, src=src), lang, rid.encode())
            sent.append((rid, lang, text))
            i += 1
            time.sleep(0.004)  # ~250 requests per second

    thread = threading.Thread(target=sender, name="load", daemon=True)
    try:
        thread.start()
        time.sleep(2.0)
        wait_for(
            lambda: rig.metric("tolk_cache_hits_total", lang="de", tier="l2") > 0,
            what="L2 hits before the outage",
        )
        cache_redis.kill()
        time.sleep(2.0)  # under load with Redis down
        down_answered = rig.reply_count()
        cache_redis.start()
        time.sleep(2.5)  # the breakers retry once a second
        stop_sending.set()
        thread.join(5)

        n = len(sent)
        wait_for(lambda: rig.reply_count() >= n, timeout=20, what=f"{n} replies")
        replies = rig.replies()
        assert rig.reply_count() == n == len(replies)  # one reply each, none lost
        for rid, lang, text in sent:
            assert replies[rid]["status"] == "OK", replies[rid]
            assert replies[rid]["text"] == fake_translation(text, lang)
        assert rig.dead_letters() == []
        wait_for(lambda: rig.committed() == n, what="every offset committed")
        assert down_answered > 0

        assert rig.metric("tolk_cache_l2_degraded_total", op="get") > 0
        assert rig.metric("tolk_cache_l2_up") == 1  # came back by itself
        assert engine.l2 is not None and not engine.l2.degraded
        hits_before = rig.metric("tolk_cache_hits_total", lang="fr", tier="l2")
        # after the restart Redis is empty: new translations go in and are hit again
        rig.send(request_bytes("after-1", text="Neu nach dem Neustart", target="fr"), "fr")
        wait_for(lambda: "after-1" in rig.replies(), what="a reply after the restart")
        assert engine.flush_l2_writes()
        engine.l1.put("fr", object(), "")  # push the entry out of the one-entry L1
        rig.send(request_bytes("after-2", text="Neu nach dem Neustart", target="fr"), "fr")
        wait_for(lambda: "after-2" in rig.replies(), what="the repeat after the restart")
        assert rig.replies()["after-2"]["metadata"]["tolk.cache"] == "l2"
        assert rig.metric("tolk_cache_hits_total", lang="fr", tier="l2") == hits_before + 1
    finally:
        stop_sending.set()
        rig.worker.stop()
        rig.thread.join(10)
