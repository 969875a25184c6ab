"""A slow Redis is not a down Redis (issue 26 item 3), with fakes only: the breaker's patience
(workers/breaker.py), the stores' timeout classification, and the result writes kept and
written again (workers/store/unstored.py). The real-redis tests are in test_redis_stall.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from workers.breaker import CircuitBreaker
from workers.stages.cache.key import CacheKey
from workers.stages.cache.redis_l2 import CacheBreaker, CacheTimeout, InMemoryTranslationCache
from workers.store.results import (
    CircuitBreakerStore,
    InMemoryResultStore,
    ResultStoreError,
    ResultStoreTimeout,
)
from workers.store.unstored import UnstoredResults


class Down(Exception):
    pass


class Slow(Down):
    pass


class FakeTime:
    """A clock that only moves when someone sleeps (or a stalled call takes its time)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def stalls(t: FakeTime, n: int, then: object = "ok", stall_s: float = 0.3) -> Callable[[], object]:
    """A call that times out (`Slow`, after `stall_s` of the fake clock) `n` times, then works."""
    calls = [0]

    def fn() -> object:
        calls[0] += 1
        if calls[0] <= n:
            t.now += stall_s
            raise Slow("Timeout reading from socket")
        return then

    fn.calls = calls  # type: ignore[attr-defined]
    return fn


def breaker(t: FakeTime, patience_s: float = 2.0) -> tuple[CircuitBreaker, list[str], list[str]]:
    degraded: list[str] = []
    retried: list[str] = []
    b = CircuitBreaker(
        failure=Down,
        unavailable=lambda err: Down(f"skipped ({err})"),
        on_degraded=degraded.append,
        on_retry=retried.append,
        retry_after_s=1.0,
        clock=t.clock,
        sleep=t.sleep,
        transient=Slow,
        patience_s=patience_s,
    )
    return b, degraded, retried


def test_a_call_that_times_out_within_the_patience_is_retried_and_the_breaker_stays_closed() -> (
    None
):
    t = FakeTime()
    b, degraded, retried = breaker(t)
    recovered: list[tuple[str, int]] = []
    b.on_recovered = lambda op, attempts, s: recovered.append((op, attempts))
    fn = stalls(t, 3)
    assert b.call("put", fn) == "ok"
    assert fn.calls[0] == 4  # type: ignore[attr-defined]
    assert not b.degraded and degraded == [] and retried == ["put"] * 3
    assert recovered == [("put", 4)]
    assert t.sleeps == [0.02, 0.04, 0.08]  # short, doubling back-off


def test_a_call_still_timing_out_at_the_deadline_opens_the_breaker() -> None:
    t = FakeTime()
    b, degraded, retried = breaker(t, patience_s=2.0)
    fn = stalls(t, 1000)
    with pytest.raises(Slow):
        b.call("get", fn)
    assert b.degraded and degraded == ["get"]
    assert t.now - 100.0 <= 2.0 + 0.3  # never past the deadline plus one attempt
    assert 4 <= fn.calls[0] <= 7  # type: ignore[attr-defined]
    assert len(retried) == fn.calls[0] - 1  # type: ignore[attr-defined]


def test_a_refused_connection_is_an_outage_at_once() -> None:
    t = FakeTime()
    b, degraded, retried = breaker(t)
    calls = []

    def refused() -> None:
        calls.append(1)
        raise Down("Connection refused")

    with pytest.raises(Down):
        b.call("get", refused)
    assert calls == [1] and retried == [] and b.degraded and t.sleeps == []


def test_the_probe_of_an_open_breaker_gets_one_attempt() -> None:
    t = FakeTime()
    b, _, retried = breaker(t)
    with pytest.raises(Slow):
        b.call("get", stalls(t, 1000))
    retried.clear()
    t.now += 1.0  # retry_after_s
    fn = stalls(t, 1)
    with pytest.raises(Slow):
        b.call("get", fn)
    assert fn.calls[0] == 1 and retried == []  # type: ignore[attr-defined]


def test_without_patience_a_timeout_opens_the_breaker_as_before() -> None:
    t = FakeTime()
    b, degraded, _ = breaker(t, patience_s=0.0)
    with pytest.raises(Slow):
        b.call("put", stalls(t, 1))
    assert b.degraded and degraded == ["put"]


class StallingStore(InMemoryResultStore):
    """The results store of a host whose Redis answers late: the first `n` calls time out."""

    def __init__(self, t: FakeTime, n: int) -> None:
        super().__init__()
        self.t, self.n = t, n

    def _stall(self) -> None:
        if self.n > 0:
            self.n -= 1
            self.t.now += 0.3
            raise ResultStoreTimeout("redis SET failed: Timeout reading from socket")

    def put(self, request_id: str, value: bytes) -> None:
        self._stall()
        super().put(request_id, value)

    def get_many(self, request_ids: list[str]) -> list[bytes | None]:  # type: ignore[override]
        self._stall()
        return super().get_many(request_ids)


def test_the_results_store_rides_out_a_stall_shorter_than_its_patience() -> None:
    t = FakeTime()
    inner = StallingStore(t, n=2)
    retried: list[str] = []
    store = CircuitBreakerStore(
        inner, patience_s=2.0, clock=t.clock, sleep=t.sleep, on_retry=retried.append
    )
    store.put("r1", b"reply")  # two timeouts, then stored: no error, no outage
    assert inner.get("r1") == b"reply" and not store.degraded and retried == ["put", "put"]
    inner.n = 1
    assert store.get_many(["r1"]) == [b"reply"] and not store.degraded


def test_the_l2_breaker_rides_out_a_stall_and_counts_it_as_a_retry() -> None:
    t = FakeTime()

    class StallingCache(InMemoryTranslationCache):
        stalls = 2

        def get(self, key: CacheKey) -> str | None:
            if self.stalls:
                self.stalls -= 1
                t.now += 0.3
                raise CacheTimeout("redis GET failed: Timeout reading from socket")
            return super().get(key)

    inner = StallingCache()
    key = CacheKey("de", "0" * 32)
    inner.put(key, "hallo")
    retried: list[str] = []
    states: list[bool] = []
    l2 = CacheBreaker(
        inner,
        patience_s=2.0,
        clock=t.clock,
        sleep=t.sleep,
        on_retry=retried.append,
        on_state=states.append,
    )
    assert l2.get(key) == "hallo"
    assert retried == ["get", "get"] and states == [] and not l2.degraded


# -- result writes kept and written again (workers/store/unstored.py)
# -------------------------------


class FlakyPut:
    def __init__(self, fails: int) -> None:
        self.fails = fails
        self.stored: dict[str, bytes] = {}

    def __call__(self, rid: str, value: bytes) -> None:
        if self.fails > 0:
            self.fails -= 1
            raise ResultStoreError("redis SET failed: Connection refused")
        self.stored[rid] = value


def test_a_failed_result_write_is_kept_and_stored_on_a_later_try() -> None:
    put = FlakyPut(fails=2)
    counts = {"stored": 0, "dropped": 0}
    sizes: list[int] = []
    kept = UnstoredResults(
        put,
        on_stored=lambda n: counts.__setitem__("stored", counts["stored"] + n),
        on_dropped=lambda n: counts.__setitem__("dropped", counts["dropped"] + n),
        on_size=sizes.append,
    )
    kept.add("a", b"A", now=0.0)
    kept.add("b", b"B", now=0.1)
    assert len(kept) == 2 and sizes[-1] == 2
    assert kept.get("a") == b"A" and kept.get("zz") is None  # a duplicate read meanwhile
    assert kept.retry_due(0.4) == 0 and put.fails == 2  # not due yet (0.5 s back-off)
    assert kept.retry_due(0.5) == 0 and put.fails == 1  # one try, failed: stop, back off
    assert kept.retry_due(1.4) == 0 and put.fails == 1  # back-off doubled: due at 1.5
    assert kept.retry_due(1.5) == 0 and put.fails == 0
    assert kept.retry_due(3.5) == 2  # 1.5 + 2.0: both written, oldest first
    assert put.stored == {"a": b"A", "b": b"B"} and len(kept) == 0 and sizes[-1] == 0
    assert kept.get("a") is None
    assert counts == {"stored": 2, "dropped": 0}
    kept.add("c", b"C", now=10.0)  # the back-off starts again from the first delay
    assert kept.retry_due(10.5) == 1 and put.stored["c"] == b"C"


def test_kept_results_are_bounded_and_what_is_left_at_shutdown_is_counted_as_dropped() -> None:
    put = FlakyPut(fails=10**6)
    kept = UnstoredResults(put, capacity=3)
    for i in range(5):
        kept.add(f"r{i}", b"x", now=0.0)
    assert len(kept) == 3 and kept.dropped == 2  # the two oldest
    assert kept.flush() == 0 and kept.dropped == 5 and len(kept) == 0
    put.fails = 0
    kept.add("late", b"y", now=1.0)
    assert kept.flush() == 1 and put.stored == {"late": b"y"} and kept.stored == 1


def test_the_patience_setting_defaults_to_two_seconds_and_reads_tolk_store_patience_s() -> None:
    from workers.settings import Settings

    assert Settings().store_patience_s == 2.0
    assert Settings.from_env({"TOLK_STORE_PATIENCE_S": "0.5"}).store_patience_s == 0.5
    assert Settings.from_env({"TOLK_STORE_PATIENCE_S": "0"}).store_patience_s == 0.0
    with pytest.raises(ValueError, match="TOLK_STORE_PATIENCE_S"):
        Settings.from_env({"TOLK_STORE_PATIENCE_S": "later"})
    with pytest.raises(ValueError, match="store_patience_s"):
        Settings(store_patience_s=-1.0)


def test_a_duplicate_read_while_its_result_waits_for_a_late_write_gets_the_same_bytes() -> None:
    from tests.workers.polling import wait_for
    from tests.workers.test_worker_fake_engine import make_rig, request_bytes
    from topics.catalog import REPLIES

    class DownForWrites(InMemoryResultStore):
        def __bool__(self) -> bool:  # empty, but a store (make_rig tests `store or default`)
            return True

        def put(self, request_id: str, value: bytes) -> None:
            raise ResultStoreError("redis SET failed: Connection refused")

    rig = make_rig(store=DownForWrites())
    try:
        rig.send(request_bytes("dup", text="hello"), "de", key=b"dup")
        wait_for(lambda: rig.reply_count() == 1, what="the first answer")
        wait_for(lambda: rig.metric("tolk_store_unstored") == 1, what="its result kept")
        rig.send(request_bytes("dup", text="hello"), "de", key=b"dup")  # a redelivery
        wait_for(lambda: rig.reply_count() == 2, what="the duplicate answered")
        first, second = (v for _k, v in rig.broker.records(REPLIES))
        assert first == second  # byte for byte, not translated again
        assert rig.engine.submitted.count("dup") == 1
        assert rig.metric("tolk_worker_duplicates_total") == 1
    finally:
        rig.worker.stop()
        rig.thread.join(10)
    assert rig.metric("tolk_store_late_writes_total", outcome="dropped") == 1  # at shutdown
