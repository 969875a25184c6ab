"""Result store: the in-memory one (TTL logic) and the real redis one (same behaviour)."""

from __future__ import annotations

import uuid

import pytest

from tests.kafka_fixtures import redis_url  # noqa: F401
from workers.store.results import (
    InMemoryResultStore,
    RedisResultStore,
    ResultStoreError,
    result_key,
)


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_key_format() -> None:
    assert result_key("abc") == "tolk:result:abc"


def test_in_memory_put_get_and_ttl() -> None:
    clock = FakeClock()
    store = InMemoryResultStore(ttl_s=10, clock=clock)
    assert store.get("r1") is None
    store.put("r1", b"\x00reply")
    assert store.get("r1") == b"\x00reply"
    assert store.get_many(["r1", "r2"]) == [b"\x00reply", None]
    clock.t += 9.9
    assert store.get("r1") == b"\x00reply"
    clock.t += 0.2
    assert store.get("r1") is None
    assert len(store) == 0


def test_in_memory_overwrite_refreshes_ttl() -> None:
    clock = FakeClock()
    store = InMemoryResultStore(ttl_s=10, clock=clock)
    store.put("r", b"a")
    clock.t += 8
    store.put("r", b"b")
    clock.t += 8
    assert store.get("r") == b"b"


@pytest.mark.redis
def test_redis_round_trip_with_ttl(redis_url: str) -> None:  # noqa: F811
    prefix = f"tolk:test:{uuid.uuid4().hex[:10]}:"
    store = RedisResultStore(redis_url, ttl_s=120, key_prefix=prefix)
    try:
        rid = uuid.uuid4().hex
        assert store.get(rid) is None
        value = bytes(range(256))  # arbitrary binary (Avro) bytes survive unchanged
        store.put(rid, value)
        assert store.get(rid) == value
        assert 0 < store.ttl(rid) <= 120
        other = uuid.uuid4().hex
        assert store.get_many([rid, other]) == [value, None]
        assert store.get_many([]) == []
        store.delete([rid])
        assert store.get(rid) is None
    finally:
        store.close()


@pytest.mark.redis
def test_redis_default_prefix_is_the_documented_key(redis_url: str) -> None:  # noqa: F811
    import redis

    store = RedisResultStore(redis_url, ttl_s=60)
    raw = redis.Redis.from_url(redis_url)
    rid = f"test-{uuid.uuid4().hex}"
    try:
        store.put(rid, b"v")
        assert raw.get(f"tolk:result:{rid}") == b"v"
    finally:
        raw.delete(f"tolk:result:{rid}")
        raw.close()
        store.close()


def test_redis_unreachable_raises_store_error() -> None:
    store = RedisResultStore("redis://127.0.0.1:1/0", ttl_s=60, socket_timeout_s=0.5)
    with pytest.raises(ResultStoreError):
        store.get("x")
    with pytest.raises(ResultStoreError):
        store.put("x", b"v")
    assert not store.ping()
