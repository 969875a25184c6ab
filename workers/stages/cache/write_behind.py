"""`WriteBehind`: L2 cache writes on a thread of their own, so the engine's thread that lands a
translation never waits on Redis (`workers.stages.cache.stage.CachingEngine`, step 3).

A bounded queue (`capacity`, default 10,000 writes) in front of one daemon thread, started by
the first write. A write that finds the queue full is dropped and reported (`on_dropped`):
L1 still has the entry, and the next miss of that text writes it again. A write that fails is
not retried: an outage is the store's to count (the caller's `put` lets the circuit breaker of
`workers.stages.cache.redis_l2` count it), anything else is logged and the thread goes on. `stop`
lets the writes queued so far finish (up to a join timeout); `flush` waits for them (tests,
benchmarks).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from workers.stages.cache.key import CacheKey

__all__ = ["WriteBehind"]

log = logging.getLogger(__name__)

_STOP = object()


class WriteBehind:
    """Queue `put(key, text)` calls for a writer thread (module notes)."""

    def __init__(
        self,
        put: Callable[[CacheKey, str], None],
        *,
        on_dropped: Callable[[], None] = lambda: None,
        capacity: int = 10_000,
        name: str = "tolk-cache-writer",
    ) -> None:
        self._put = put
        self._on_dropped = on_dropped
        self._name = name
        self._lock = threading.Lock()
        self._writes: queue.Queue[Any] = queue.Queue(capacity)
        self._writer: threading.Thread | None = None

    def write(self, key: CacheKey, text: str) -> None:
        """Queue one write (never blocks: a full queue drops it, reported by `on_dropped`)."""
        with self._lock:
            if self._writer is None:
                self._writer = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._writer.start()
        try:
            self._writes.put_nowait((key, text))
        except queue.Full:
            self._on_dropped()

    def _loop(self) -> None:
        while True:
            item = self._writes.get()
            try:
                if item is _STOP:
                    return
                key, text = item
                self._put(key, text)
            except Exception:  # a bug in `put`: said, and the writes after it still go
                log.exception("%s: a cache write failed", self._name)
            finally:
                self._writes.task_done()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued write was sent (True) or `timeout` passed (False)."""
        end = time.monotonic() + timeout
        while self._writes.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.005)
        return not self._writes.unfinished_tasks

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the writer thread after the writes queued so far."""
        with self._lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            self._writes.put(_STOP)
            writer.join(timeout=timeout)
