"""A real redis-server that stalls shorter than the patience is not an outage (issue 26 item 3).

Each test starts its own redis-server (test_store_outage.PrivateRedis: a free port from 36379
up, never the shared 6379, which other tests use) and stalls it with `CLIENT PAUSE`: commands
of every client wait until the pause ends (`WRITE`: only writes wait), the server stays
healthy. That is what a CPU-starved host does to a local Redis: it answers, late. With the
default settings (0.3 s socket timeout, 2 s patience) a 1.2 s stall must cost nothing: the
result is stored, the breaker stays closed, no degraded call is counted. On the code before
the patience (a timeout opened the breaker at once) the write was skipped and counted.
"""

from __future__ import annotations

import time

import pytest
import redis

from tests.workers.polling import wait_for
from tests.workers.test_store_outage import PrivateRedis, private_redis  # noqa: F401
from tests.workers.test_worker_fake_engine import make_rig, request_bytes
from workers.cache_ttl import parse_ttl_tiers
from workers.settings import Settings
from workers.stages.cache.key import CacheKey
from workers.stages.cache.redis_l2 import CacheBreaker, RedisTranslationCache

pytestmark = pytest.mark.redis

STALL_MS = 1200  # four socket timeouts, well inside the default patience (2 s)


def _pause(url: str, ms: int, mode: str = "ALL") -> None:
    client = redis.Redis.from_url(url)
    assert client.execute_command("CLIENT", "PAUSE", ms, mode)
    client.close()


def test_a_worker_stores_every_result_through_a_stall_and_its_breaker_stays_closed(
    private_redis: PrivateRedis,  # noqa: F811
) -> None:
    from workers.store.results import RedisResultStore

    settings = Settings(languages=("de",))  # the defaults: 0.3 s timeout, 2 s patience
    store = RedisResultStore(private_redis.url, ttl_s=60, socket_timeout_s=settings.store_timeout_s)
    rig = make_rig(store=store)
    try:
        rig.send(request_bytes("warm", text="before the stall"), "de", key=b"warm")
        wait_for(lambda: store.get("warm") is not None, what="stored before the stall")

        _pause(private_redis.url, STALL_MS, "WRITE")  # look-ups pass, the SET of the reply waits
        t0 = time.monotonic()
        for i in range(3):
            rid = f"stall{i}"
            rig.send(request_bytes(rid, text=f"during the stall {i}"), "de", key=rid.encode())
        wait_for(lambda: rig.reply_count() == 4, what="every request answered")
        wait_for(
            lambda: all(store.get(f"stall{i}") is not None for i in range(3)),
            timeout=10,
            what="every result stored",
        )
        assert time.monotonic() - t0 >= STALL_MS / 1000 * 0.8  # the writes did wait the stall
        assert rig.metric("tolk_redis_retries_total", store="results", op="put") > 0
        assert rig.metric("tolk_store_degraded_total", op="put") == 0
        assert rig.metric("tolk_store_degraded_total", op="get") == 0
        assert rig.metric("tolk_store_late_writes_total", outcome="stored") == 0  # not needed
        assert not rig.worker.store.degraded
    finally:
        rig.worker.stop()
        rig.thread.join(10)
        store.close()


def test_the_l2_cache_answers_through_a_stall_without_flapping(
    private_redis: PrivateRedis,  # noqa: F811
) -> None:
    l2 = RedisTranslationCache(private_redis.url, parse_ttl_tiers("*:60"), socket_timeout_s=0.3)
    states: list[bool] = []
    retried: list[str] = []
    cache = CacheBreaker(l2, patience_s=2.0, on_state=states.append, on_retry=retried.append)
    key = CacheKey("de", "0" * 32)
    cache.put(key, "hallo")

    _pause(private_redis.url, STALL_MS)
    t0 = time.monotonic()
    assert cache.get(key) == "hallo"
    assert time.monotonic() - t0 >= STALL_MS / 1000 * 0.8
    assert retried and states == [] and not cache.degraded
    cache.close()


def test_a_stall_longer_than_the_patience_is_still_an_outage(
    private_redis: PrivateRedis,  # noqa: F811
) -> None:
    l2 = RedisTranslationCache(private_redis.url, parse_ttl_tiers("*:60"), socket_timeout_s=0.3)
    states: list[bool] = []
    cache = CacheBreaker(l2, patience_s=0.5, on_state=states.append)
    key = CacheKey("de", "1" * 32)
    _pause(private_redis.url, 3000)
    t0 = time.monotonic()
    with pytest.raises(Exception, match="Timeout"):
        cache.get(key)
    assert time.monotonic() - t0 < 0.5 + 0.3 + 0.25  # the deadline, one attempt, slack
    assert states == [False] and cache.degraded
    cache.close()
