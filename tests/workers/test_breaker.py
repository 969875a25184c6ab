"""workers.breaker.CircuitBreaker: the logic behind the results store's and the L2 cache's
breakers (their real-Redis outage tests: test_store_outage.py, test_cache_redis.py)."""

from __future__ import annotations

import threading

import pytest

from workers.breaker import CircuitBreaker


class Down(Exception):
    pass


class Skipped(Exception):
    pass


def make(now: list[float], **kw: object) -> tuple[CircuitBreaker, list[str], list[bool]]:
    degraded: list[str] = []
    states: list[bool] = []
    breaker = CircuitBreaker(
        failure=Down,
        unavailable=lambda err: Skipped(f"down ({err}); skipped"),
        on_degraded=degraded.append,
        on_state=states.append,
        retry_after_s=1.0,
        clock=lambda: now[0],
        **kw,  # type: ignore[arg-type]
    )
    return breaker, degraded, states


def fail() -> None:
    raise Down("connection refused")


def test_opens_on_failure_skips_until_retry_after_then_probes_and_closes() -> None:
    now = [0.0]
    breaker, degraded, states = make(now)
    assert breaker.call("get", lambda: 1) == 1 and not breaker.degraded

    with pytest.raises(Down):
        breaker.call("get", fail)
    assert breaker.degraded and states == [False] and breaker.last_error == "connection refused"
    calls = []
    for _ in range(5):
        with pytest.raises(Skipped, match=r"down \(connection refused\); skipped"):
            breaker.call("put", lambda: calls.append(1))
    assert calls == [] and breaker.skipped == 5
    assert degraded == ["get"] + ["put"] * 5

    now[0] = 1.0  # retry_after_s passed: one call probes, and it fails again
    with pytest.raises(Down):
        breaker.call("get", fail)
    assert states == [False]  # still down: no second "down" event
    with pytest.raises(Skipped):
        breaker.call("get", lambda: 2)

    now[0] = 2.5
    assert breaker.call("get", lambda: 3) == 3
    assert not breaker.degraded and states == [False, True]


def test_an_exception_that_is_not_an_outage_passes_through_and_does_not_wedge_the_probe() -> None:
    now = [0.0]
    breaker, degraded, states = make(now)
    with pytest.raises(ValueError):
        breaker.call("get", lambda: int("x"))
    assert not breaker.degraded and degraded == [] and states == []

    with pytest.raises(Down):
        breaker.call("get", fail)
    now[0] = 1.0
    with pytest.raises(ValueError):  # the probe raised something else ...
        breaker.call("get", lambda: int("x"))
    assert breaker.call("get", lambda: 4) == 4  # ... and the next call may probe again


def test_only_one_caller_probes_a_down_store_at_a_time() -> None:
    now = [0.0]
    breaker, _, _ = make(now)
    with pytest.raises(Down):
        breaker.call("get", fail)
    now[0] = 1.0
    inside, release = threading.Event(), threading.Event()

    def slow_probe() -> str:
        inside.set()
        release.wait(5)
        return "ok"

    result: list[str] = []
    prober = threading.Thread(target=lambda: result.append(breaker.call("get", slow_probe)))
    prober.start()
    assert inside.wait(5)
    with pytest.raises(Skipped):  # another thread meanwhile is skipped, not a second probe
        breaker.call("put", lambda: "second")
    release.set()
    prober.join(5)
    assert result == ["ok"] and not breaker.degraded


def test_logs_the_outage_once_per_interval_and_its_end(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    breaker, _, _ = make(now, name="test store", log_every_s=10.0)
    caplog.set_level("WARNING", logger="workers.breaker")
    for t in range(25):  # 25 s down, one probe per second
        now[0] = float(t)
        with pytest.raises(Down):
            breaker.call("get", fail)
    down = [r for r in caplog.records if "test store unreachable" in r.getMessage()]
    assert len(down) == 3  # at 0, 10 and 20 s
    now[0] = 30.0
    breaker.call("get", lambda: None)
    assert any(r.getMessage() == "test store reachable again" for r in caplog.records)
