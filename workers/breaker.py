"""A circuit breaker for an optional dependency (Redis): fail fast while it is known to be down.

tolk calls Redis inline from the worker's poll loop (the results store, the L2 translation
cache). Redis is an optimisation there, never a dependency, so an outage must cost at most one
socket timeout per `retry_after_s`, not one per record:

* closed (the normal state): every call goes through;
* a call raises `failure` (the store's own "unreachable" exception): the breaker opens for
  `retry_after_s`; every call meanwhile is skipped at once with `unavailable(last error)`;
* after `retry_after_s`, one call (only one, also across threads) tries the store again: success
  closes the breaker, a failure opens it for another `retry_after_s`.

A slow answer is not an outage. With `transient` (the store's "timed out" exception, a subclass
of `failure`) and `patience_s` > 0, a call made while the breaker is closed that times out is
tried again after a short back-off (`backoff_s`, doubling, at most 0.2 s), as long as the
deadline `patience_s` from its first attempt has not passed; only a call still failing then
opens the breaker. Each retry is reported to `on_retry(op)`, a call that succeeded after
retries to `on_recovered(op, attempts, seconds)`. Why (docs/BENCHMARKS.md, "Redis calls under
CPU load"): on a machine whose CPUs are oversubscribed (two workers' torch threads on two
cores, and more), a healthy local Redis sometimes answers after more than the 0.3 s socket
timeout: redis-server is off the CPU that long (every client process times out in the same
second, while the calling thread's own run-queue and GIL waits stay around a millisecond);
treating each such call as an outage skipped the next second of calls (result writes lost,
the L2 flapping). A
refused connection (nothing listens) is not `transient`: it opens the breaker at once. The
probe of an open breaker gets one attempt only, so a real outage still costs one socket
timeout per `retry_after_s`, plus at most `patience_s` (and one timeout) when it begins.

Every failed or skipped call is reported to `on_degraded(op)` (the caller's counter), a change of
state to `on_state(up)` (a gauge). With a `name`, the outage is logged once when it starts, at most
once per `log_every_s` while it lasts, and once when it ends.

Thread-safe (the cache's gets run on the poll thread, its puts on a writer thread); the call
itself runs outside the lock. Users: `workers.store.results.CircuitBreakerStore` and
`workers.stages.cache.redis_l2.CacheBreaker`, thin typed adapters over this class.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["CircuitBreaker"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class CircuitBreaker:
    def __init__(
        self,
        *,
        failure: type[Exception],
        unavailable: Callable[[str], Exception],
        on_degraded: Callable[[str], None] = lambda op: None,
        on_state: Callable[[bool], None] = lambda up: None,
        retry_after_s: float = 1.0,
        name: str = "",
        log_every_s: float = 60.0,
        logger: logging.Logger = log,
        clock: Callable[[], float] = time.monotonic,
        transient: type[Exception] | None = None,
        patience_s: float = 0.0,
        backoff_s: float = 0.02,
        on_retry: Callable[[str], None] = lambda op: None,
        on_recovered: Callable[[str, int, float], None] = lambda op, attempts, seconds: None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """`failure`: the exception type that means "the store is unreachable" (others pass
        through untouched and do not open the breaker); `unavailable(last_error)` builds the
        exception a skipped call raises (its text should say "skipped"). `name` (e.g. "L2
        translation cache"): log the outage under it ("" = no logging). `transient`,
        `patience_s`, `backoff_s`: retry a timed-out call (module notes)."""
        if patience_s < 0 or backoff_s < 0:
            raise ValueError(
                f"patience_s and backoff_s must be >= 0: {patience_s!r}, {backoff_s!r}"
            )
        self.failure = failure
        self.unavailable = unavailable
        self.on_degraded = on_degraded
        self.on_state = on_state
        self.retry_after_s = retry_after_s
        self.name = name
        self.log_every_s = log_every_s
        self._log = logger
        self._clock = clock
        self.transient = transient
        self.patience_s = patience_s
        self.backoff_s = backoff_s
        self.on_retry = on_retry
        self.on_recovered = on_recovered
        self._sleep = sleep
        self._lock = threading.Lock()
        self._open_until: float | None = None  # None: closed, calls go through
        self._trying = False  # one call is probing the down store now
        self._last_log: float | None = None
        self.last_error = ""
        self.skipped = 0  # calls not tried because the breaker was open

    @property
    def degraded(self) -> bool:
        """True from a failure until a call succeeds again."""
        with self._lock:
            return self._open_until is not None

    def call(self, op: str, fn: Callable[[], _T]) -> _T:
        """Run `fn` unless the breaker is open; `op` ("get", "put") names it in `on_degraded`."""
        probing = False
        with self._lock:
            now = self._clock()
            skip = self._open_until is not None and (now < self._open_until or self._trying)
            if skip:
                self.skipped += 1
            else:
                probing = self._trying = self._open_until is not None
        if skip:
            self.on_degraded(op)
            raise self.unavailable(self.last_error)
        try:
            out = fn() if probing else self._patiently(op, fn)
        except self.failure as exc:
            self._failed(op, exc)
            raise
        except BaseException:
            with self._lock:
                self._trying = False  # not an outage: let the next call probe
            raise
        self._succeeded()
        return out

    def _patiently(self, op: str, fn: Callable[[], _T]) -> _T:
        """`fn()`, tried again after a back-off while it times out and the deadline allows."""
        if self.transient is None or self.patience_s <= 0:
            return fn()
        start = self._clock()
        deadline = start + self.patience_s
        backoff = self.backoff_s
        attempts = 1
        while True:
            try:
                out = fn()
            except self.transient:
                if self._clock() + backoff >= deadline:
                    raise
                self.on_retry(op)
                self._sleep(backoff)
                backoff = min(2 * backoff, 0.2) if backoff > 0 else 0.0
                attempts += 1
                continue
            if attempts > 1:
                self.on_recovered(op, attempts, self._clock() - start)
            return out

    def _failed(self, op: str, exc: Exception) -> None:
        with self._lock:
            now = self._clock()
            was_up = self._open_until is None
            self._open_until = now + self.retry_after_s
            self._trying = False
            self.last_error = str(exc)
            log_now = bool(self.name) and (
                self._last_log is None or now - self._last_log >= self.log_every_s
            )
            if log_now:
                self._last_log = now
        self.on_degraded(op)
        if was_up:
            self.on_state(False)
        if log_now:
            self._log.warning(
                "%s unreachable (%s): carrying on without it, retrying every %.1f s",
                self.name,
                exc,
                self.retry_after_s,
            )

    def _succeeded(self) -> None:
        with self._lock:
            was_down = self._open_until is not None
            self._open_until = None
            self._trying = False
            if was_down:
                self._last_log = None  # the next outage is logged at once
        if was_down:
            self.on_state(True)
            if self.name:
                self._log.warning("%s reachable again", self.name)
