"""A circuit breaker for an optional dependency (Redis): fail fast while it is known to be down.

tolk calls Redis inline from the worker's poll loop (the results store, the L2 translation
cache). Redis is an optimisation there, never a dependency, so an outage must cost at most one
socket timeout per `retry_after_s`, not one per record:

* closed (the normal state): every call goes through;
* a call raises `failure` (the store's own "unreachable" exception): the breaker opens for
  `retry_after_s`; every call meanwhile is skipped at once with `unavailable(last error)`;
* after `retry_after_s`, one call (only one, also across threads) tries the store again: success
  closes the breaker, a failure opens it for another `retry_after_s`.

Every failed or skipped call is reported to `on_degraded(op)` (the caller's counter), a change of
state to `on_state(up)` (a gauge). With a `name`, the outage is logged once when it starts, at most
once per `log_every_s` while it lasts, and once when it ends.

Thread-safe (the cache's gets run on the poll thread, its puts on a writer thread); the call
itself runs outside the lock. Users: `workers.results_store.CircuitBreakerStore` and
`workers.tm.redis_cache.CacheBreaker`, thin typed adapters over this class.
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
    ) -> None:
        """`failure`: the exception type that means "the store is unreachable" (others pass
        through untouched and do not open the breaker); `unavailable(last_error)` builds the
        exception a skipped call raises (its text should say "skipped"). `name` (e.g. "L2
        translation cache"): log the outage under it ("" = no logging)."""
        self.failure = failure
        self.unavailable = unavailable
        self.on_degraded = on_degraded
        self.on_state = on_state
        self.retry_after_s = retry_after_s
        self.name = name
        self.log_every_s = log_every_s
        self._log = logger
        self._clock = clock
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
        with self._lock:
            now = self._clock()
            skip = self._open_until is not None and (now < self._open_until or self._trying)
            if skip:
                self.skipped += 1
            else:
                self._trying = self._open_until is not None
        if skip:
            self.on_degraded(op)
            raise self.unavailable(self.last_error)
        try:
            out = fn()
        except self.failure as exc:
            self._failed(op, exc)
            raise
        except BaseException:
            with self._lock:
                self._trying = False  # not an outage: let the next call probe
            raise
        self._succeeded()
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
