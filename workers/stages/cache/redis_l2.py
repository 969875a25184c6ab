"""L2 of the exact-match cache: Redis, shared by every worker, with a TTL per language tier.

* Entries: `tolk:tm:<target lang>:<digest>` (`CacheKey.redis_key`) -> the translation's UTF-8
  text, written with `SET ... EX <ttl>`. The TTL depends on the target language:
  `TOLK_CACHE_TTL` = `en:180,de:300,*:60` (seconds; "*" for every other language), parsed once
  by `workers.settings` with `workers.cache_ttl.parse_ttl_tiers`. Redis itself bounds the
  memory: the stack
  starts it with `maxmemory` and `allkeys-lru` (`compose/stack.sh`), so an L2 that fills up
  drops its least recently used entries instead of refusing writes.
* Outages: the cache is an optimisation, never a dependency. `RedisTranslationCache` uses
  short socket timeouts and no client-side retries (as `workers.store.results` does);
  `CacheBreaker` wraps it and, after a failure, skips every call for `retry_after_s` (1 s), then
  lets one call try again; success closes it. So an outage costs at most one timeout per
  second, the worker translates on with L1 and the engine, and the cache recovers by itself
  when Redis is back (redis-py reconnects on the next command). A call that merely timed out
  while L2 was healthy is tried again for up to `patience_s` (`Settings.store_patience_s`)
  first: a loaded host makes a healthy Redis answer late (workers/breaker.py). The breaker
  logs the outage once when it starts, at most once per `log_every_s` (60 s) while it lasts,
  and once when it ends; every failed or skipped call is reported to `on_degraded(op)` ("get" /
  "put") and the state to `on_state(up)` (the worker's `tolk_cache_l2_degraded_total` and
  `tolk_cache_l2_up`).

`CacheBreaker` is thread-safe: gets run on the worker's poll thread, puts on the cache's
writer thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from workers.breaker import CircuitBreaker
from workers.cache_ttl import TtlTiers
from workers.redaction import mask_url
from workers.stages.cache.key import CacheKey

__all__ = [
    "KEY_PREFIX",
    "CacheBreaker",
    "CacheTimeout",
    "CacheUnavailable",
    "InMemoryTranslationCache",
    "RedisTranslationCache",
    "TranslationStore",
]

log = logging.getLogger(__name__)

KEY_PREFIX = "tolk:tm:"


class CacheUnavailable(RuntimeError):
    """L2 could not be reached or answered with an error (or the breaker skipped the call)."""


class CacheTimeout(CacheUnavailable):
    """L2 did not answer within the socket timeout (slow or starved, maybe not down)."""


class TranslationStore(Protocol):
    def get(self, key: CacheKey) -> str | None: ...

    def put(self, key: CacheKey, text: str) -> None: ...

    def close(self) -> None: ...


class RedisTranslationCache:
    """`CacheKey` -> translation text in Redis, TTL by the key's target language."""

    def __init__(
        self,
        url: str,
        ttl: TtlTiers,
        *,
        socket_timeout_s: float = 0.3,
        key_prefix: str = KEY_PREFIX,
    ) -> None:
        import redis  # only the worker needs it
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        if not socket_timeout_s > 0:
            raise ValueError(f"socket_timeout_s must be > 0, got {socket_timeout_s!r}")
        self._redis_error: type[Exception] = redis.RedisError
        self._timeout: type[Exception] = redis.TimeoutError
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),  # fail fast; CacheBreaker paces the retries
        )
        self.ttl = ttl
        self.key_prefix = key_prefix
        self.url = mask_url(url)

    def __repr__(self) -> str:
        return f"RedisTranslationCache(url={self.url!r}, ttl={self.ttl.as_dict()})"

    def get(self, key: CacheKey) -> str | None:
        try:
            value = self._client.get(key.redis_key(self.key_prefix))
        except self._redis_error as exc:
            raise self._error("GET", exc) from exc
        return None if value is None else bytes(value).decode("utf-8")  # type: ignore[arg-type]

    def put(self, key: CacheKey, text: str) -> None:
        try:
            self._client.set(
                key.redis_key(self.key_prefix),
                text.encode("utf-8"),
                ex=self.ttl.ttl_s(key.target_lang),
            )
        except self._redis_error as exc:
            raise self._error("SET", exc) from exc

    def _error(self, command: str, exc: Exception) -> CacheUnavailable:
        kind = CacheTimeout if isinstance(exc, self._timeout) else CacheUnavailable
        return kind(f"redis {command} failed: {exc}")

    def ttl_left(self, key: CacheKey) -> int:
        """Seconds the entry has left (-2: none, -1: no TTL), as Redis's TTL answers."""
        return int(self._client.ttl(key.redis_key(self.key_prefix)))  # type: ignore[arg-type]

    def delete_all(self, keys: Iterable[CacheKey]) -> None:
        names = [k.redis_key(self.key_prefix) for k in keys]
        if names:
            self._client.delete(*names)

    def close(self) -> None:
        self._client.close()


class InMemoryTranslationCache:
    """Dict-backed L2 with the same interface, for unit tests (no TTL)."""

    def __init__(self) -> None:
        self.data: dict[CacheKey, str] = {}
        self._lock = threading.Lock()

    def get(self, key: CacheKey) -> str | None:
        with self._lock:
            return self.data.get(key)

    def put(self, key: CacheKey, text: str) -> None:
        with self._lock:
            self.data[key] = text

    def close(self) -> None:
        pass


class CacheBreaker:
    """A `TranslationStore` that fails fast for `retry_after_s` after each failure and logs the
    outage at most once per `log_every_s` (module notes; the logic is `workers.breaker`). A
    call that times out (`CacheTimeout`) while L2 is healthy is tried again for up to
    `patience_s` before it counts (`on_retry(op)` per retry)."""

    def __init__(
        self,
        store: TranslationStore,
        *,
        on_degraded: Callable[[str], None] = lambda op: None,
        on_state: Callable[[bool], None] = lambda up: None,
        retry_after_s: float = 1.0,
        log_every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        patience_s: float = 0.0,
        on_retry: Callable[[str], None] = lambda op: None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.store = store
        self.breaker = CircuitBreaker(
            failure=CacheUnavailable,
            unavailable=lambda err: CacheUnavailable(f"L2 cache unavailable ({err}); skipped"),
            on_degraded=on_degraded,
            on_state=on_state,
            retry_after_s=retry_after_s,
            name="L2 translation cache",
            log_every_s=log_every_s,
            logger=log,
            clock=clock,
            transient=CacheTimeout,
            patience_s=patience_s,
            on_retry=on_retry,
            sleep=sleep,
        )

    @property
    def degraded(self) -> bool:
        """True from a failure until a call succeeds again."""
        return self.breaker.degraded

    @property
    def skipped(self) -> int:
        """Calls not tried because the breaker was open."""
        return self.breaker.skipped

    def get(self, key: CacheKey) -> str | None:
        return self.breaker.call("get", lambda: self.store.get(key))

    def put(self, key: CacheKey, text: str) -> None:
        self.breaker.call("put", lambda: self.store.put(key, text))

    def close(self) -> None:
        self.store.close()
