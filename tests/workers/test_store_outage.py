"""Redis outages: the store fails fast, the worker keeps translating, both recover by themselves.

Each test starts its own redis-server on a free port (from 36379 up; never the shared 6379),
kills it mid-run and starts it again on the same port. Checked:

* `RedisResultStore` against a dead redis raises `ResultStoreError` within its short socket
  timeout (no stall, no client-side retry loop), and works again once redis is back without
  being rebuilt (redis-py reconnects);
* `CircuitBreakerStore` skips calls for `retry_after_s` after a failure and reports every
  failed or skipped call;
* a `Worker` (in-memory Kafka, fake engine, the real redis) answers every request while redis
  is down, counts the degraded look-ups and puts in `tolk_store_degraded_total`, and stores new
  results again once redis is back, and the results of the outage too (kept, written late:
  workers/store/unstored.py).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.workers.polling import wait_for
from tests.workers.test_worker_fake_engine import make_rig, request_bytes
from workers.store.results import CircuitBreakerStore, RedisResultStore, ResultStoreError

pytestmark = pytest.mark.redis

FIRST_PORT = 36379


def _free_port(start: int) -> int:
    for port in range(start, start + 200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {start}..{start + 199}")


class PrivateRedis:
    """A redis-server of this test only, on loopback, without persistence."""

    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.skip("redis-server is not installed")
        self.exe = exe
        self.port = _free_port(FIRST_PORT)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server on {self.port} did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    server = PrivateRedis()
    server.start()
    try:
        yield server
    finally:
        server.kill()


def test_redis_store_fails_fast_while_down_and_recovers_by_itself(
    private_redis: PrivateRedis,
) -> None:
    store = RedisResultStore(private_redis.url, ttl_s=60, socket_timeout_s=0.3)
    store.put("before", b"v1")
    assert store.get("before") == b"v1"

    private_redis.kill()
    for op in (lambda: store.get("before"), lambda: store.put("during", b"v2")):
        t0 = time.monotonic()
        with pytest.raises(ResultStoreError):
            op()
        assert time.monotonic() - t0 < 1.0  # refused or timed out fast: never stalls the loop

    private_redis.start()  # same port, empty (no persistence)
    wait_for(lambda: store.ping(), timeout=10, what="the same store object reconnected")
    store.put("after", b"v3")
    assert store.get_many(["after", "before"]) == [b"v3", None]
    store.close()


def test_circuit_breaker_skips_calls_while_open_and_reports_them(
    private_redis: PrivateRedis,
) -> None:
    now = [100.0]
    degraded: list[str] = []
    store = CircuitBreakerStore(
        RedisResultStore(private_redis.url, ttl_s=60, socket_timeout_s=0.3),
        on_degraded=degraded.append,
        retry_after_s=1.0,
        clock=lambda: now[0],
    )
    store.put("a", b"1")
    assert store.get("a") == b"1" and not store.degraded and degraded == []

    private_redis.kill()
    with pytest.raises(ResultStoreError):
        store.get_many(["a"])  # tried, failed: the breaker opens
    assert store.degraded and degraded == ["get"]
    t0 = time.monotonic()
    for _ in range(50):  # skipped at once while open: no socket work at all
        with pytest.raises(ResultStoreError, match="skipped"):
            store.put("b", b"2")
    assert time.monotonic() - t0 < 0.5
    assert degraded == ["get"] + ["put"] * 50

    private_redis.start()
    with pytest.raises(ResultStoreError, match="skipped"):
        store.get("a")  # still inside retry_after_s: not tried yet
    now[0] += 1.0
    wait_for(lambda: _put_ok(store), timeout=10, what="breaker closes once redis is back")
    assert not store.degraded
    assert store.get("c") == b"3"


def _put_ok(store: CircuitBreakerStore) -> bool:
    try:
        store.put("c", b"3")
    except ResultStoreError:
        return False
    return True


def test_worker_keeps_translating_through_a_redis_outage(private_redis: PrivateRedis) -> None:
    redis_store = RedisResultStore(private_redis.url, ttl_s=60, socket_timeout_s=0.3)
    rig = make_rig(store=redis_store)
    try:

        def send_requests(prefix: str, n: int) -> None:
            for i in range(n):
                rid = f"{prefix}{i}"
                rig.send(request_bytes(rid, text=f"outage test {i}"), "de", key=rid.encode())

        send_requests("up", 5)
        wait_for(lambda: rig.reply_count() == 5, what="answers before the outage")
        wait_for(lambda: redis_store.get("up4") is not None, what="stored before the outage")

        private_redis.kill()
        send_requests("down", 20)
        wait_for(lambda: rig.reply_count() == 25, what="answers during the outage")
        replies = rig.replies()
        assert all(replies[f"down{i}"]["status"] == "OK" for i in range(20))
        assert rig.metric("tolk_store_degraded_total", op="get") > 0
        assert rig.metric("tolk_store_degraded_total", op="put") > 0
        assert rig.thread.is_alive()
        wait_for(lambda: rig.committed() == 25, what="commits go on during the outage")

        private_redis.start()
        time.sleep(1.1)  # the breaker's retry_after_s
        send_requests("back", 5)
        wait_for(lambda: rig.reply_count() == 30, what="answers after the outage")
        wait_for(
            lambda: redis_store.get("back4") is not None, what="results stored again", timeout=10
        )
        assert not rig.worker.store.degraded
        # the results of the outage were kept, not skipped: stored once redis answers again
        wait_for(
            lambda: all(redis_store.get(f"down{i}") is not None for i in range(20)),
            what="results of the outage stored late",
            timeout=20,
        )
        assert rig.metric("tolk_store_late_writes_total", outcome="stored") == 20
        assert rig.metric("tolk_store_late_writes_total", outcome="dropped") == 0
        assert rig.metric("tolk_store_unstored") == 0
    finally:
        rig.worker.stop()
        rig.thread.join(10)
