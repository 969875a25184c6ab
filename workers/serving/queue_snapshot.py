"""The fair-share waiting queue shared between threads: `GuardedQueue` and `QueueSnapshot`.

The engine thread owns the waiting queue (`VTCQueue` or `FCFSQueue`, workers.fairness.vtc,
pure single-threaded logic): the scheduler pushes, pops, removes and charges it every step.
Two readers live on other threads: the submit-time precheck (`EngineAdmission.precheck`, on
the worker's poll thread, wants the depth per group and the weights) and the worker's fairness
gauges (`WorkerMetrics.update_fairness`, also the poll thread, wants depths, service and
counters). Reading the queue's dicts while the engine thread changes them raced: a read that
iterates a ledger dict could raise "dictionary changed size during iteration", and depths,
service and counters read one after the other could come from different instants.

So `FairEngine` hands the scheduler a `GuardedQueue`: the same queue behind one lock that every
queue operation of the engine thread takes (uncontended almost always: a few dict updates per
call), and `snapshot()`, which copies the whole ledger under that lock into one frozen
`QueueSnapshot`. Readers only ever see snapshots, so what they read is one instant and nothing
they do can disturb the engine thread. A snapshot answers the same read methods as the queues
(`depths()`, `service_by_group()`, `counters()`, `weight()`, `len()`), so the metrics code takes
either.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from workers.engine.types import GenerationRequest, RequestQueue
from workers.fairness.vtc import FCFSQueue, VTCQueue

__all__ = ["GuardedQueue", "QueueSnapshot", "snapshot_of"]


@dataclass(frozen=True, slots=True)
class QueueSnapshot:
    """The waiting queue's ledger at one instant (read-only mappings)."""

    fair: bool  # weighted fair share (VTC) or FCFS (then the whole queue is ahead of anyone)
    waiting: int  # requests waiting, all groups together
    depth_by_group: Mapping[str, int]  # waiting requests per group seen so far (zeros too)
    service: Mapping[str, float]  # weighted tokens served per group (prefill + 2 x output)
    counter_by_group: Mapping[str, float]  # VTC counters (FCFS: weight-normalized service)
    weights: Mapping[str, float]  # explicitly configured weights
    default_weight: float  # the weight of any other group
    burst_tokens: float = 0.0  # VTC burst credit of a group back from idle (VTCQueue)
    idle_floor: float = 0.0  # VTC lift floor while nothing is backlogged (VTCQueue.idle_floor)

    def weight(self, group: str) -> float:
        return self.weights.get(group, self.default_weight)

    def depths(self) -> Mapping[str, int]:
        return self.depth_by_group

    def service_by_group(self, normalized: bool = False) -> dict[str, float]:
        if normalized:
            return {g: s / self.weight(g) for g, s in self.service.items()}
        return dict(self.service)

    def counters(self) -> Mapping[str, float]:
        return self.counter_by_group

    def __len__(self) -> int:
        return self.waiting


def snapshot_of(queue: RequestQueue) -> QueueSnapshot:
    """A snapshot of `queue`: under its lock for a `GuardedQueue`; a plain VTC / FCFS queue is
    copied as is (only safe on the thread that owns it: single-threaded tests, simulations);
    any other `RequestQueue` keeps no ledger, so only its length is known."""
    if isinstance(queue, GuardedQueue):
        return queue.snapshot()
    if isinstance(queue, (VTCQueue, FCFSQueue)):
        return _copy(queue)
    empty: Mapping[str, Any] = MappingProxyType({})
    return QueueSnapshot(False, len(queue), empty, empty, empty, empty, 1.0)


def _copy(queue: VTCQueue | FCFSQueue) -> QueueSnapshot:
    vtc = queue if isinstance(queue, VTCQueue) else None
    return QueueSnapshot(
        fair=vtc is not None,
        waiting=len(queue),
        depth_by_group=MappingProxyType(queue.depths()),
        service=MappingProxyType(queue.service_by_group()),
        counter_by_group=MappingProxyType(queue.counters()),
        weights=MappingProxyType(queue.weights()),
        default_weight=queue.default_weight,
        burst_tokens=vtc.burst_tokens if vtc is not None else 0.0,
        idle_floor=vtc.idle_floor() if vtc is not None else 0.0,
    )


class GuardedQueue:
    """A `RequestQueue` around a `VTCQueue` / `FCFSQueue`: every operation under one lock, and
    `snapshot()` for readers on other threads (see the module notes)."""

    def __init__(self, inner: VTCQueue | FCFSQueue) -> None:
        self.inner = inner
        self._lock = threading.Lock()

    # -- RequestQueue (the engine thread) -----------------------------------------------------

    def push(self, request: GenerationRequest) -> None:
        with self._lock:
            self.inner.push(request)

    def peek(self) -> GenerationRequest | None:
        with self._lock:
            return self.inner.peek()

    def pop(self) -> GenerationRequest:
        with self._lock:
            return self.inner.pop()

    def remove(self, request_id: str) -> GenerationRequest | None:
        with self._lock:
            return self.inner.remove(request_id)

    def charge(self, request: GenerationRequest, prefill_tokens: int, output_tokens: int) -> None:
        with self._lock:
            self.inner.charge(request, prefill_tokens, output_tokens)

    def __len__(self) -> int:
        with self._lock:
            return len(self.inner)

    def __iter__(self) -> Iterator[GenerationRequest]:
        with self._lock:
            return iter(list(self.inner))

    def set_weight(self, group: str, weight: float) -> None:
        with self._lock:
            self.inner.set_weight(group, weight)

    # -- readers (any thread) -----------------------------------------------------------------

    def snapshot(self) -> QueueSnapshot:
        """The whole ledger at one instant, copied under the lock."""
        with self._lock:
            return _copy(self.inner)

    def depths(self) -> Mapping[str, int]:
        return self.snapshot().depths()

    def service_by_group(self, normalized: bool = False) -> dict[str, float]:
        return self.snapshot().service_by_group(normalized)

    def counters(self) -> Mapping[str, float]:
        return self.snapshot().counters()

    def weight(self, group: str) -> float:
        return self.snapshot().weight(group)
