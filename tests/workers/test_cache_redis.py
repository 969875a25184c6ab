"""L2 of the cache (workers/stages/cache/redis_l2.py): TTL tiers, the real Redis, the breaker."""

from __future__ import annotations

import logging
import uuid

import pytest

from tests.kafka_fixtures import redis_url  # noqa: F401
from workers.cache_ttl import TtlTiers, parse_ttl_tiers
from workers.settings import Settings
from workers.stages.cache.key import CacheKey, cache_key
from workers.stages.cache.redis_l2 import (
    CacheBreaker,
    CacheUnavailable,
    InMemoryTranslationCache,
    RedisTranslationCache,
)


def key(text: str, target: str) -> CacheKey:
    return cache_key(
        engine_fingerprint="test",
        prompt_set_version=uuid.uuid4().hex,  # fresh keys on every run
        source_lang="de" if target != "de" else "en",
        target_lang=target,
        text=text,
    )


# -- TTL tiers ----------------------------------------------------------------------------------


def test_ttl_tiers_parse_per_language_and_default() -> None:
    tiers = parse_ttl_tiers(" en:180, DE:300 ,*:60,")
    assert (tiers.ttl_s("en"), tiers.ttl_s("de"), tiers.ttl_s("fr")) == (180, 300, 60)
    assert tiers.as_dict() == {"de": 300, "en": 180, "*": 60}
    assert parse_ttl_tiers("en:10").ttl_s("it") == 86400  # no "*": one day
    assert parse_ttl_tiers("") == TtlTiers((), 86400)


@pytest.mark.parametrize(
    "spec, why",
    [
        ("en", "lang:seconds"),
        (":60", "lang:seconds"),
        ("en:soon", "integer"),
        ("en:0", ">= 1"),
        ("en:10,en:20", "twice"),
    ],
)
def test_bad_ttl_specs_are_refused_with_the_reason(spec: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_ttl_tiers(spec)


def test_settings_read_the_cache_variables_once() -> None:
    s = Settings.from_env(
        {"TOLK_CACHE_TTL": "en:180,de:300,*:60", "TOLK_CACHE": "0", "TOLK_CACHE_L1_ENTRIES": "7"}
    )
    assert not s.cache_enabled and s.cache_l1_entries == 7
    assert s.cache_ttl.ttl_s("de") == 300 and s.cache_ttl.ttl_s("es") == 60
    defaults = Settings.from_env({})
    assert defaults.cache_enabled and defaults.cache_ttl.ttl_s("en") == 86400
    with pytest.raises(ValueError, match="TOLK_CACHE_TTL"):
        Settings.from_env({"TOLK_CACHE_TTL": "en=5"})
    with pytest.raises(ValueError, match="TOLK_CACHE_L1_ENTRIES"):
        Settings.from_env({"TOLK_CACHE_L1_ENTRIES": "many"})


# -- the real Redis -----------------------------------------------------------------------------


@pytest.mark.redis
def test_ttl_tiers_read_back_from_redis(redis_url: str) -> None:  # noqa: F811
    cache = RedisTranslationCache(redis_url, parse_ttl_tiers("en:180,de:300,*:60"))
    keys = {lang: key("Vielen Dank.", lang) for lang in ("en", "de", "fr")}
    try:
        for lang, k in keys.items():
            assert cache.get(k) is None
            cache.put(k, f"thanks in {lang} — ✓")
        assert cache.get(keys["fr"]) == "thanks in fr — ✓"  # UTF-8 round trip
        assert 170 < cache.ttl_left(keys["en"]) <= 180
        assert 290 < cache.ttl_left(keys["de"]) <= 300
        assert 50 < cache.ttl_left(keys["fr"]) <= 60
        raw = __import__("redis").Redis.from_url(redis_url)
        assert raw.get(f"tolk:tm:de:{keys['de'].digest}") == "thanks in de — ✓".encode()
        raw.close()
    finally:
        cache.delete_all(keys.values())
        cache.close()


def test_a_dead_redis_fails_fast_with_cache_unavailable() -> None:
    import socket
    import time

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cache = RedisTranslationCache(f"redis://127.0.0.1:{port}/0", parse_ttl_tiers(""))
    t0 = time.monotonic()
    with pytest.raises(CacheUnavailable):
        cache.get(key("x", "en"))
    with pytest.raises(CacheUnavailable):
        cache.put(key("x", "en"), "y")
    assert time.monotonic() - t0 < 1.0


# -- the breaker --------------------------------------------------------------------------------


class FlakyStore(InMemoryTranslationCache):
    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.calls = 0

    def get(self, key: CacheKey) -> str | None:
        self.calls += 1
        if self.down:
            raise CacheUnavailable("connection refused")
        return super().get(key)

    def put(self, key: CacheKey, text: str) -> None:
        self.calls += 1
        if self.down:
            raise CacheUnavailable("connection refused")
        super().put(key, text)


def test_breaker_skips_calls_while_open_logs_once_and_recovers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    degraded: list[str] = []
    states: list[bool] = []
    store = FlakyStore()
    breaker = CacheBreaker(
        store,
        on_degraded=degraded.append,
        on_state=states.append,
        retry_after_s=1.0,
        log_every_s=60.0,
        clock=lambda: now[0],
    )
    k = key("Ja.", "en")
    breaker.put(k, "Yes.")
    assert breaker.get(k) == "Yes." and not breaker.degraded

    store.down = True
    caplog.set_level(logging.WARNING, logger="workers.stages.cache.redis_l2")
    for _ in range(30):  # 30 s of outage, one try per second, 100 calls per second
        for _ in range(100):
            with pytest.raises(CacheUnavailable):
                breaker.get(k)
        now[0] += 1.0
    assert breaker.degraded and states == [False]
    assert store.calls == 2 + 30  # one real try per second, the rest skipped
    assert len(degraded) == 3000 and set(degraded) == {"get"}
    outage_logs = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(outage_logs) == 1  # once per log_every_s (60 s), not once per call

    store.down = False
    assert breaker.get(k) == "Yes."  # the retry_after_s passed: tried, and it works
    assert not breaker.degraded and states == [False, True]
    assert any("reachable again" in r.getMessage() for r in caplog.records)
