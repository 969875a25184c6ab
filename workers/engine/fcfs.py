"""The engine's default waiting queue: first come, first served.

An `Engine` built without a queue admits requests in arrival order through this one, so the
engine package needs nothing of `workers.fairness` (whose `VTCQueue` is what the worker plugs in,
and whose `FCFSQueue` wraps this one with a per-language service ledger for comparisons). This
queue keeps no ledger: `charge()` is a no-op.

One deque in push order; `remove()` (a cancel) marks the entry dead and it is dropped when it
reaches the head, so every operation is O(1) amortized. Not thread-safe: the engine's loop
thread owns it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from workers.engine.types import GenerationRequest

__all__ = ["FCFSRequestQueue"]


class _Entry:
    __slots__ = ("alive", "request")

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self.alive = True  # False once popped or removed (lazy deletion from the deque)


class FCFSRequestQueue:
    """First come, first served in push order; implements `RequestQueue`."""

    def __init__(self) -> None:
        self._fifo: deque[_Entry] = deque()  # push order; may hold dead entries
        self._live: dict[str, _Entry] = {}  # request id -> its live entry

    def push(self, request: GenerationRequest) -> None:
        rid = request.request_id
        if rid in self._live:
            raise ValueError(f"request {rid!r} is already queued")
        entry = _Entry(request)
        self._fifo.append(entry)
        self._live[rid] = entry

    def peek(self) -> GenerationRequest | None:
        fifo = self._fifo
        while fifo and not fifo[0].alive:
            fifo.popleft()  # removed while waiting
        return fifo[0].request if fifo else None

    def pop(self) -> GenerationRequest:
        if self.peek() is None:
            raise IndexError("pop from an empty FCFSRequestQueue")
        entry = self._fifo.popleft()
        entry.alive = False
        del self._live[entry.request.request_id]
        return entry.request

    def remove(self, request_id: str) -> GenerationRequest | None:
        entry = self._live.pop(request_id, None)
        if entry is None:
            return None
        entry.alive = False
        if len(self._fifo) > 64 and len(self._fifo) > 2 * len(self._live):
            self._fifo = deque(e for e in self._fifo if e.alive)
        return entry.request

    def charge(self, request: GenerationRequest, prefill_tokens: int, output_tokens: int) -> None:
        """No ledger: the engine's own queue does not track service."""

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[GenerationRequest]:
        """Waiting requests in admission order."""
        return iter([e.request for e in self._fifo if e.alive])
