"""Result records per request id, so a redelivered request is answered without recompute.

Kafka delivers at least once: a worker that replied but died before committing has its records
read again by the next owner of the partition. The reply it produced is kept here under
`tolk:result:<request_id>` (the encoded TranslationResult bytes, exactly what went to the reply
topic) with a TTL; the next owner finds it and re-produces the same bytes.

`RedisResultStore` is the real one; `InMemoryResultStore` has the same interface for unit tests.
Both take explicit arguments (settings are read by the caller).

The store is an optimisation, never a dependency: when redis is down the worker keeps
translating and only loses the dedupe of redeliveries ("degraded"). Two things keep an outage
from stalling the worker's poll loop, which calls the store inline (a look-up per consumed
batch, a put per delivered reply):

* `RedisResultStore` uses short socket connect/read timeouts (`Settings.store_timeout_s`,
  0.3 s) and no client-side retries (redis-py 6 retries 3 times with backoff by default);
  redis-py drops a broken connection and opens a new one on the next command, so the store
  recovers by itself once redis is back.
* `CircuitBreakerStore` (what the worker wraps any store in) fails fast while the store is
  known to be down: after a failure every call raises `ResultStoreError` at once for
  `retry_after_s` (1 s), then one call tries redis again (success closes the breaker). So an
  outage costs at most one timeout per second instead of one per record. Every failed or
  skipped call is reported to `on_degraded(op)` (the worker counts it in
  `tolk_store_degraded_total{op="get"|"put"}`).
* A timeout is not an outage by itself: a call that times out (`ResultStoreTimeout`) while
  the breaker is closed is tried again after a short back-off until `patience_s`
  (`Settings.store_patience_s`, 2 s) after its first attempt (workers/breaker.py says why:
  a healthy redis on a CPU-starved host answers late, not never). A refused connection fails
  at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from workers.breaker import CircuitBreaker
from workers.redaction import mask_url

__all__ = [
    "KEY_PREFIX",
    "CircuitBreakerStore",
    "InMemoryResultStore",
    "RedisResultStore",
    "ResultStore",
    "ResultStoreError",
    "ResultStoreTimeout",
    "result_key",
]

KEY_PREFIX = "tolk:result:"


def result_key(request_id: str, prefix: str = KEY_PREFIX) -> str:
    return f"{prefix}{request_id}"


class ResultStoreError(RuntimeError):
    """The store could not be reached or answered with an error."""


class ResultStoreTimeout(ResultStoreError):
    """The store did not answer within the socket timeout (slow or starved, maybe not down)."""


class ResultStore(Protocol):
    def get(self, request_id: str) -> bytes | None: ...

    def get_many(self, request_ids: Sequence[str]) -> list[bytes | None]: ...

    def put(self, request_id: str, value: bytes) -> None: ...

    def close(self) -> None: ...


class RedisResultStore:
    """`tolk:result:<request_id>` -> reply bytes, with a TTL (SET EX)."""

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        ttl_s: int = 24 * 3600,
        key_prefix: str = KEY_PREFIX,
        socket_timeout_s: float = 0.3,
    ) -> None:
        import redis  # heavy-ish, and only the worker needs it
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        if ttl_s < 1:
            raise ValueError(f"ttl_s must be >= 1, got {ttl_s!r}")
        if not socket_timeout_s > 0:
            raise ValueError(f"socket_timeout_s must be > 0, got {socket_timeout_s!r}")
        self._redis_error: type[Exception] = redis.RedisError
        self._timeout: type[Exception] = redis.TimeoutError
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),  # fail fast; CircuitBreakerStore paces the retries
        )
        self.ttl_s = ttl_s
        self.key_prefix = key_prefix
        self.url = mask_url(url)  # for reprs and logs: the password masked

    def __repr__(self) -> str:
        return f"RedisResultStore(url={self.url!r}, ttl_s={self.ttl_s})"

    def get(self, request_id: str) -> bytes | None:
        try:
            value = self._client.get(result_key(request_id, self.key_prefix))
        except self._redis_error as exc:
            raise self._error("GET", exc) from exc
        return None if value is None else bytes(value)  # type: ignore[arg-type]

    def get_many(self, request_ids: Sequence[str]) -> list[bytes | None]:
        if not request_ids:
            return []
        keys = [result_key(rid, self.key_prefix) for rid in request_ids]
        try:
            values = self._client.mget(keys)
        except self._redis_error as exc:
            raise self._error("MGET", exc) from exc
        return [None if v is None else bytes(v) for v in values]  # type: ignore[union-attr]

    def put(self, request_id: str, value: bytes) -> None:
        try:
            self._client.set(result_key(request_id, self.key_prefix), value, ex=self.ttl_s)
        except self._redis_error as exc:
            raise self._error("SET", exc) from exc

    def _error(self, command: str, exc: Exception) -> ResultStoreError:
        kind = ResultStoreTimeout if isinstance(exc, self._timeout) else ResultStoreError
        return kind(f"redis {command} failed: {exc}")

    def ping(self) -> bool:
        try:
            return bool(self._client.ping())
        except self._redis_error:
            return False

    def delete(self, request_ids: Iterable[str]) -> None:
        keys = [result_key(rid, self.key_prefix) for rid in request_ids]
        if keys:
            self._client.delete(*keys)

    def ttl(self, request_id: str) -> int:
        """Seconds left (-2: no such key, -1: no TTL), as redis TTL answers."""
        return int(self._client.ttl(result_key(request_id, self.key_prefix)))  # type: ignore[arg-type]

    def close(self) -> None:
        self._client.close()


class InMemoryResultStore:
    """Dict-backed store with the same interface and TTL semantics (thread-safe)."""

    def __init__(self, ttl_s: int = 24 * 3600, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._data: dict[str, tuple[bytes, float]] = {}
        self._lock = threading.Lock()
        self.puts = 0  # number of put() calls, for tests

    def get(self, request_id: str) -> bytes | None:
        with self._lock:
            entry = self._data.get(request_id)
            if entry is None:
                return None
            value, expires = entry
            if self._clock() >= expires:
                del self._data[request_id]
                return None
            return value

    def get_many(self, request_ids: Sequence[str]) -> list[bytes | None]:
        return [self.get(rid) for rid in request_ids]

    def put(self, request_id: str, value: bytes) -> None:
        with self._lock:
            self._data[request_id] = (bytes(value), self._clock() + self.ttl_s)
            self.puts += 1

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)

    def close(self) -> None:
        pass


class CircuitBreakerStore:
    """Any `ResultStore`, failing fast for `retry_after_s` after each failure (module notes; the
    logic is `workers.breaker`). `on_degraded(op)` is called with "get" (for `get` /
    `get_many`) or "put" on every call that failed or was skipped. A call that times out
    (`ResultStoreTimeout`) while the store is healthy is tried again for up to `patience_s`
    before it counts (`on_retry(op)` per retry)."""

    def __init__(
        self,
        store: ResultStore,
        on_degraded: Callable[[str], None] = lambda op: None,
        retry_after_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        patience_s: float = 0.0,
        on_retry: Callable[[str], None] = lambda op: None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.store = store
        self.breaker = CircuitBreaker(
            failure=ResultStoreError,
            unavailable=lambda err: ResultStoreError(f"result store unavailable ({err}); skipped"),
            on_degraded=on_degraded,
            retry_after_s=retry_after_s,
            clock=clock,
            transient=ResultStoreTimeout,
            patience_s=patience_s,
            on_retry=on_retry,
            sleep=sleep,
        )

    @property
    def degraded(self) -> bool:
        """True from a failure until a call succeeds again."""
        return self.breaker.degraded

    @property
    def last_error(self) -> str:
        return self.breaker.last_error

    def get(self, request_id: str) -> bytes | None:
        return self.breaker.call("get", lambda: self.store.get(request_id))

    def get_many(self, request_ids: Sequence[str]) -> list[bytes | None]:
        if not request_ids:
            return []
        return self.breaker.call("get", lambda: self.store.get_many(request_ids))

    def put(self, request_id: str, value: bytes) -> None:
        self.breaker.call("put", lambda: self.store.put(request_id, value))

    def close(self) -> None:
        self.store.close()
