"""Bounded retries of engine runs that failed: `EngineRetries`.

When a step of the real engine raises, `Engine.results.fail_all` finishes *every* request in the
engine with ERROR and the exception's text, the one that caused it (a "poison" request) and
every bystander alike. So the worker does not answer an engine ERROR at once: it submits the
request again, up to `Settings.max_attempts` runs in all; a request whose last run fails too is
dead-lettered with reason "poison" and the engine's error text, and its client gets an ERROR
reply saying so (its offset is done once both are delivered, so its partition's commit point
waits only for that).

Runs before the last go back to the engine at once: after a transient failure (one bad step)
they simply work. The last run is *isolated*: at most one request on its last run is in the
engine at a time, the others wait here in arrival order. A poison request therefore fails its
last run without taking the last run of a bystander with it (bystanders that were in its
batches before get their last run alone, or next to fresh requests, which in turn have runs
left). The price is that after a poison request the bystanders' last runs go one by one; a
deadline that passes meanwhile ends them as EXPIRED, as usual. `max_attempts=1` turns retries
off (every failed run is dead-lettered).

Pure bookkeeping on the worker's poll thread; the worker submits, counts and dead-letters.
"""

from __future__ import annotations

from collections import deque
from typing import Literal

from workers.engine.types import FinishReason, GenerationResult

__all__ = ["EngineRetries", "RetryPlan", "is_failed_run"]

RetryPlan = Literal["retry", "last", "give_up"]


def is_failed_run(result: GenerationResult) -> bool:
    """An engine run that failed (its step raised), as opposed to a request the engine refused
    or cut (REJECTED, EXPIRED, CANCELLED) or finished."""
    return result.finish_reason is FinishReason.ERROR and bool(result.error)


class EngineRetries:
    """Which run comes next for a failed request, and the queue of isolated last runs."""

    def __init__(self, max_attempts: int) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts!r}")
        self.max_attempts = max_attempts
        self._last_waiting: deque[str] = deque()  # request ids waiting for their last run
        self._last_running: str | None = None  # the request id on its last run, if any

    def plan(self, attempts: int) -> RetryPlan:
        """After `attempts` failed runs: run again now, queue the last run, or give up."""
        if attempts >= self.max_attempts:
            return "give_up"
        return "last" if attempts + 1 == self.max_attempts else "retry"

    def queue_last(self, request_id: str) -> None:
        self._last_waiting.append(request_id)

    def finished(self, request_id: str) -> None:
        """A run of `request_id` came back (or it left the worker): free the last-run slot."""
        if self._last_running == request_id:
            self._last_running = None

    def forget(self, request_id: str) -> None:
        """`request_id` is no longer in flight (answered, dropped, abandoned)."""
        self.finished(request_id)
        if request_id in self._last_waiting:
            self._last_waiting.remove(request_id)

    def take_last(self) -> str | None:
        """The next request id to start its last run, when the slot is free."""
        if self._last_running is not None or not self._last_waiting:
            return None
        self._last_running = self._last_waiting.popleft()
        return self._last_running

    def waiting(self) -> int:
        return len(self._last_waiting)
