"""Weighted fair-share waiting queues: the Virtual Token Counter (VTC) and an FCFS baseline.

VTC (Sheng et al., OSDI 2024, "Fairness in Serving Large Language Models") keeps a counter per
client of the weighted service it received; the next request admitted comes from the
*backlogged* client with the smallest counter. Here a client is a fair-share group, the target
language (`GenerationRequest.group`).

Design notes:

- Service cost is `prefill_tokens + 2 * output_tokens` (an output token costs about twice a
  prompt token), and a group's counter advances by cost / weight, so backlogged groups receive
  service in proportion to their weights. The engine charges only *uncached* prefill tokens:
  a language whose prompt prefix (the translation template) sits in the prefix cache is not
  charged for it, since it costs the model nothing.
- Counter lift: when a group goes from empty to backlogged, its counter is raised to the
  smallest counter among the currently backlogged groups (never lowered), so an idle group
  cannot bank credit and then starve the others. When no group is backlogged, it is raised to
  the counter of the group that left the backlog last (the paper's rule for an empty queue).
- Burst credit (`burst_tokens`, 0 = the paper's rule): the lift stops `burst_tokens / weight`
  *below* that floor, so a group returning from idle may take up to `burst_tokens` of weighted
  service ahead of the backlogged groups. Without it a light language pays a full VTC round
  for each request of a burst (its counter jumps by cost / weight per request, and a weight-1
  language waits for the others to catch up, ~1.8 s per request in the CPU benchmark) although
  it is far under its share. The bound on the service gap between two groups grows by at most
  `burst_tokens`; groups that stay backlogged never get the credit, so the split among them is
  unchanged.
- Inside a group requests go earliest deadline first; requests without a deadline come after
  those with one; ties by arrival time, then by push order. One binary heap per group, with
  lazy deletion for `remove()`, so push/pop/remove are O(log n) and `peek()` is O(#groups)
  (a handful of languages). Nothing sorts the backlog per step (a per-step sort of
  the waiting queue is what made SGLang's scheduler slow under a deep backlog).
- Not thread-safe: the engine's scheduler thread owns it. Readers on other threads go through
  `workers.serving.queue_snapshot.GuardedQueue` (one lock, frozen snapshots of the ledger).

`FCFSQueue` is the baseline: the engine's `FCFSRequestQueue` in push order; `charge()` only
records service, so the benchmarks can report the same per-group numbers for both.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from workers.engine.fcfs import FCFSRequestQueue
from workers.engine.types import GenerationRequest
from workers.fairness.policy import LanguagePolicy

__all__ = ["OUTPUT_TOKEN_COST", "FCFSQueue", "VTCQueue", "jain_index", "service_cost"]

OUTPUT_TOKEN_COST = 2.0  # an output token costs this many prompt tokens of service

_NO_DEADLINE = math.inf


def service_cost(prefill_tokens: int, output_tokens: int) -> float:
    """Weighted tokens of service: prefill + 2 * output."""
    if prefill_tokens < 0 or output_tokens < 0:
        raise ValueError(f"negative charge: prefill={prefill_tokens} output={output_tokens}")
    return prefill_tokens + OUTPUT_TOKEN_COST * output_tokens


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1 = equal, 1/n = one takes all.

    An empty sequence or all zeros counts as perfectly fair (1.0).
    """
    n = len(values)
    if n == 0:
        return 1.0
    if any(v < 0 for v in values):
        raise ValueError("jain_index needs non-negative values")
    sq = sum(v * v for v in values)
    if sq == 0:
        return 1.0
    total = sum(values)
    return total * total / (n * sq)


@dataclass(slots=True)
class _Entry:
    request: GenerationRequest
    group: str
    alive: bool = True  # False once popped or removed (lazy deletion in the heap)


class _Ledger:
    """Weights and served-service bookkeeping shared by both queues."""

    def __init__(self, weights: Mapping[str, float] | None, default_weight: float) -> None:
        if not (math.isfinite(default_weight) and default_weight > 0):
            raise ValueError(f"default_weight must be > 0, got {default_weight!r}")
        self._default_weight = default_weight
        self._weights: dict[str, float] = {}
        for group, w in (weights or {}).items():
            self.set_weight(group, w)
        self._service: dict[str, float] = {}  # raw weighted tokens served per group
        self._depth: dict[str, int] = {}  # live waiting requests per group

    def weight(self, group: str) -> float:
        return self._weights.get(group, self._default_weight)

    @property
    def default_weight(self) -> float:
        return self._default_weight

    def weights(self) -> dict[str, float]:
        """The explicitly set weights (other groups weigh `default_weight`)."""
        return dict(self._weights)

    def set_weight(self, group: str, weight: float) -> None:
        """Change a group's weight; affects charges from now on."""
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"weight of {group!r} must be > 0, got {weight!r}")
        self._weights[group] = float(weight)

    def _record(self, group: str, cost: float) -> None:
        self._service[group] = self._service.get(group, 0.0) + cost

    def service_by_group(self, normalized: bool = False) -> dict[str, float]:
        """Weighted tokens served per group (prefill + 2*output); `normalized` divides by weight."""
        if normalized:
            return {g: s / self.weight(g) for g, s in self._service.items()}
        return dict(self._service)

    def depths(self) -> dict[str, int]:
        """Waiting requests per group (groups seen so far, zeros included)."""
        return dict(self._depth)


class VTCQueue(_Ledger):
    """Weighted fair-share waiting queue (VTC); implements `RequestQueue`."""

    def __init__(
        self,
        weights: Mapping[str, float] | None = None,
        default_weight: float = 1.0,
        burst_tokens: float = 0.0,
    ) -> None:
        super().__init__(weights, default_weight)
        if not (math.isfinite(burst_tokens) and burst_tokens >= 0):
            raise ValueError(f"burst_tokens must be >= 0, got {burst_tokens!r}")
        self.burst_tokens = float(burst_tokens)
        # per group: heap of (deadline or inf, arrival, seq, entry); seq is unique so the
        # comparison never reaches the entry
        self._heaps: dict[str, list[tuple[float, float, int, _Entry]]] = {}
        self._garbage: dict[str, int] = {}  # dead entries still inside each heap
        self._counters: dict[str, float] = {}
        self._backlogged: set[str] = set()  # groups with depth > 0
        self._live: dict[str, _Entry] = {}  # request_id -> entry
        self._last_left: str | None = None  # group that left the backlog most recently
        self._seq = 0

    @classmethod
    def from_policies(
        cls,
        policies: Mapping[str, LanguagePolicy],
        default_weight: float = 1.0,
        burst_tokens: float = 0.0,
    ) -> VTCQueue:
        return cls({lang: p.weight for lang, p in policies.items()}, default_weight, burst_tokens)

    # -- RequestQueue -------------------------------------------------------------------------

    def push(self, request: GenerationRequest) -> None:
        rid = request.request_id
        if rid in self._live:
            raise ValueError(f"request {rid!r} is already queued")
        group = request.group
        if self._depth.get(group, 0) == 0:
            self._lift(group)
            self._backlogged.add(group)
        entry = _Entry(request, group)
        deadline = _NO_DEADLINE if request.deadline is None else request.deadline
        heapq.heappush(
            self._heaps.setdefault(group, []), (deadline, request.arrival, self._seq, entry)
        )
        self._seq += 1
        self._live[rid] = entry
        self._depth[group] = self._depth.get(group, 0) + 1

    def peek(self) -> GenerationRequest | None:
        group = self._next_group()
        if group is None:
            return None
        return self._head(group).request

    def pop(self) -> GenerationRequest:
        group = self._next_group()
        if group is None:
            raise IndexError("pop from an empty VTCQueue")
        heap = self._heaps[group]
        self._head(group)  # drops dead entries above the live head
        entry = heapq.heappop(heap)[3]
        entry.alive = False
        del self._live[entry.request.request_id]
        self._dec(group)
        return entry.request

    def remove(self, request_id: str) -> GenerationRequest | None:
        entry = self._live.pop(request_id, None)
        if entry is None:
            return None
        entry.alive = False
        group = entry.group
        self._garbage[group] = self._garbage.get(group, 0) + 1
        self._dec(group)
        self._maybe_compact(group)
        return entry.request

    def charge(self, request: GenerationRequest, prefill_tokens: int, output_tokens: int) -> None:
        cost = service_cost(prefill_tokens, output_tokens)
        group = request.group
        self._record(group, cost)
        self._counters[group] = self._counters.get(group, 0.0) + cost / self.weight(group)

    def __len__(self) -> int:
        return len(self._live)

    # -- introspection ------------------------------------------------------------------------

    def counters(self) -> dict[str, float]:
        """Virtual counters (weight-normalized service plus lifts) per group seen so far."""
        return dict(self._counters)

    def backlogged(self) -> frozenset[str]:
        return frozenset(self._backlogged)

    def idle_floor(self) -> float:
        """The lift floor while nothing is backlogged: the counter of the group that left the
        backlog last (0 before any did)."""
        if self._last_left is None:
            return 0.0
        return self._counters.get(self._last_left, 0.0)

    def __iter__(self) -> Iterator[GenerationRequest]:
        """Waiting requests, in no particular order (for metrics and shutdown)."""
        return iter([e.request for e in self._live.values()])

    # -- internals ----------------------------------------------------------------------------

    def _next_group(self) -> str | None:
        best: str | None = None
        best_counter = math.inf
        for group in self._backlogged:
            c = self._counters.get(group, 0.0)
            if c < best_counter or (c == best_counter and best is not None and group < best):
                best, best_counter = group, c
        return best

    def _head(self, group: str) -> _Entry:
        heap = self._heaps[group]
        while not heap[0][3].alive:
            heapq.heappop(heap)
            self._garbage[group] -= 1
        return heap[0][3]

    def _lift(self, group: str) -> None:
        if self._backlogged:
            floor = min(self._counters.get(g, 0.0) for g in self._backlogged)
        else:
            floor = self.idle_floor()
        floor -= self.burst_tokens / self.weight(group)
        self._counters[group] = max(self._counters.get(group, 0.0), floor)

    def _dec(self, group: str) -> None:
        depth = self._depth[group] - 1
        self._depth[group] = depth
        if depth == 0:
            self._backlogged.discard(group)
            self._last_left = group
            # every entry left in the heap is dead: drop them all at once
            self._heaps[group].clear()
            self._garbage[group] = 0

    def _maybe_compact(self, group: str) -> None:
        garbage = self._garbage.get(group, 0)
        if garbage > 64 and garbage > self._depth[group]:
            heap = [item for item in self._heaps[group] if item[3].alive]
            heapq.heapify(heap)
            self._heaps[group] = heap
            self._garbage[group] = 0


class FCFSQueue(_Ledger):
    """First come, first served in push order (the engine's own `FCFSRequestQueue`) plus the
    per-language service ledger, so the fairness metrics compare it with `VTCQueue`;
    implements `RequestQueue`. `charge()` schedules nothing; it only records the service.
    """

    def __init__(
        self, weights: Mapping[str, float] | None = None, default_weight: float = 1.0
    ) -> None:
        super().__init__(weights, default_weight)
        self._queue = FCFSRequestQueue()

    @classmethod
    def from_policies(
        cls, policies: Mapping[str, LanguagePolicy], default_weight: float = 1.0
    ) -> FCFSQueue:
        return cls({lang: p.weight for lang, p in policies.items()}, default_weight)

    def push(self, request: GenerationRequest) -> None:
        self._queue.push(request)
        self._depth[request.group] = self._depth.get(request.group, 0) + 1

    def peek(self) -> GenerationRequest | None:
        return self._queue.peek()

    def pop(self) -> GenerationRequest:
        request = self._queue.pop()
        self._depth[request.group] -= 1
        return request

    def remove(self, request_id: str) -> GenerationRequest | None:
        request = self._queue.remove(request_id)
        if request is not None:
            self._depth[request.group] -= 1
        return request

    def charge(self, request: GenerationRequest, prefill_tokens: int, output_tokens: int) -> None:
        self._record(request.group, service_cost(prefill_tokens, output_tokens))

    def __len__(self) -> int:
        return len(self._queue)

    def counters(self) -> dict[str, float]:
        """FCFS keeps no counters; this is the weight-normalized service, VTC's counter minus
        its lifts, so dashboards show the same series for both queues."""
        return self.service_by_group(normalized=True)

    def __iter__(self) -> Iterator[GenerationRequest]:
        return iter(self._queue)
