"""Result-store writes that failed, kept and tried again until they are stored.

The results store's guarantee (workers/store/results.py): a delivered reply is stored under its
request id, so that a redelivery after a crash is answered with the same bytes instead of a
second, different translation. A write that fails (Redis down, or still timing out after the
breaker's patience) used to be dropped with a log line: that request would get a duplicate
reply if its record were ever redelivered. `UnstoredResults` keeps such writes instead:

* `add(request_id, value)`: a delivered reply whose write failed (the offset is marked done
  anyway: Redis is an optimisation, so its outage must not hold the commits back);
* `retry_due(now)`, called by the worker's loop each iteration: when the queue's back-off has
  passed, writes the kept results oldest first; on the first failure it stops and doubles the
  back-off (`first_delay_s` 0.5 s .. `max_delay_s` 10 s), so a Redis outage costs one call per
  back-off, which the circuit breaker turns into a skip while it is open;
* `flush()` on shutdown: one more try of everything still kept;
* bounded: past `capacity` (10,000 results) the oldest is dropped, counted as lost.

Outcomes are reported to `on_stored(n)` / `on_dropped(n)` (the worker's
`tolk_store_late_writes_total{outcome}`) and the size to `on_size(n)`
(`tolk_store_unstored`). Not thread-safe: everything runs on the worker's poll thread.
A duplicate of a kept request read by this worker meanwhile is answered with the kept bytes
(`get`, through `ReplyPublisher.pending_reply`). What stays open: a crash while results are
kept here loses them (they were never stored), and another worker that reads a redelivery
before the late write translates it again: duplicates as before, now only for the time Redis
is really unreachable.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from workers.store.results import ResultStoreError

__all__ = ["UnstoredResults"]

log = logging.getLogger(__name__)


class UnstoredResults:
    """Failed result writes, retried with a back-off (module notes)."""

    def __init__(
        self,
        put: Callable[[str, bytes], None],
        *,
        capacity: int = 10_000,
        first_delay_s: float = 0.5,
        max_delay_s: float = 10.0,
        on_stored: Callable[[int], None] = lambda n: None,
        on_dropped: Callable[[int], None] = lambda n: None,
        on_size: Callable[[int], None] = lambda n: None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        self._put = put
        self.capacity = capacity
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s
        self._on_stored = on_stored
        self._on_dropped = on_dropped
        self._on_size = on_size
        self._kept: OrderedDict[str, bytes] = OrderedDict()
        self._delay = first_delay_s
        self._due: float | None = None  # monotonic time of the next try; None: nothing kept
        self.stored = 0  # written on a later try
        self.dropped = 0  # given up (full, or still kept at shutdown)

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, request_id: str) -> bytes | None:
        """The kept result of `request_id`, if any (a duplicate read meanwhile gets it)."""
        return self._kept.get(request_id)

    def add(self, request_id: str, value: bytes, now: float) -> None:
        """Keep a result whose write failed; it is tried again `first_delay_s` from `now` at
        the earliest (or with the queue's current back-off)."""
        self._kept[request_id] = value
        self._kept.move_to_end(request_id)
        if len(self._kept) > self.capacity:
            self._kept.popitem(last=False)
            self._drop(1)
        if self._due is None:
            self._due = now + self._delay
        self._on_size(len(self._kept))

    def retry_due(self, now: float) -> int:
        """Write the kept results if their back-off has passed; returns how many were stored."""
        if self._due is None or now < self._due:
            return 0
        stored = self._write_all()
        if self._kept:
            self._delay = min(2 * self._delay, self.max_delay_s)
            self._due = now + self._delay
        else:
            self._delay, self._due = self.first_delay_s, None
        return stored

    def flush(self) -> int:
        """One more try of everything kept (shutdown); what still fails is dropped."""
        stored = self._write_all()
        if self._kept:
            left = len(self._kept)
            log.warning("%d result(s) not stored at shutdown: redis unreachable", left)
            self._kept.clear()
            self._drop(left)
        self._due = None
        self._on_size(0)
        return stored

    def _write_all(self) -> int:
        stored = 0
        while self._kept:
            request_id, value = next(iter(self._kept.items()))
            try:
                self._put(request_id, value)
            except ResultStoreError as exc:
                log.debug("kept result %s still not stored: %s", request_id, exc)
                break
            del self._kept[request_id]
            stored += 1
        if stored:
            self.stored += stored
            self._on_stored(stored)
            log.info("%d result(s) stored on retry, %d still kept", stored, len(self._kept))
        self._on_size(len(self._kept))
        return stored

    def _drop(self, n: int) -> None:
        self.dropped += n
        self._on_dropped(n)
