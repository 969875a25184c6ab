"""The fair-share queue read from two threads: the engine thread mutates it, the poll thread
reads it (the submit-time precheck and the worker's fairness gauges).

The hammer thread does what the engine thread does to the waiting queue (push, pop, charge,
remove), with ever new groups so the ledger's dicts keep changing size; the reader reads the
ledger the way the precheck and the gauges do. Before FairEngine guarded its queue, reading the
weight-normalized service raced with `charge()` and raised "dictionary changed size during
iteration" (and a precheck that raises is answered as ERROR by the worker).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from workers.engine.types import GenerationRequest, SamplingParams
from workers.fairness.latency_model import LatencyModel
from workers.fairness.vtc import FCFSQueue, VTCQueue
from workers.metrics import WorkerMetrics
from workers.serving.admission import EngineAdmission
from workers.serving.fair_engine import FairEngine

HAMMER_S = 0.6
MIN_READS = 5  # the reader goes on past HAMMER_S until it read this often


@pytest.fixture(autouse=True)
def _switch_often() -> Iterator[None]:
    """Let the two threads interleave every few bytecodes, as they may on a busy machine."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def _request(rid: str, group: str, deadline: float | None = None) -> GenerationRequest:
    return GenerationRequest(
        rid, list(range(12)), SamplingParams(max_new_tokens=8), group=group, deadline=deadline
    )


def _fair_engine(queue: VTCQueue | FCFSQueue) -> FairEngine:
    """A FairEngine over a stand-in engine: only its scheduler's queue is used here."""
    engine = SimpleNamespace(
        scheduler=SimpleNamespace(queue=queue), model_version="stub", languages=("de",)
    )
    admission = EngineAdmission(LatencyModel(), queue=queue)
    return FairEngine(engine, admission, precheck=True)  # type: ignore[arg-type]


def _hammer(engine_queue: object, stop: threading.Event, errors: list[BaseException]) -> None:
    """The engine thread's side: queue traffic over ever new groups during HAMMER_S (at least
    100), then over the groups it made (the ledger keeps every group it saw: after a minute of
    new ones a reader's pass took seconds, and the test 63 s in a loaded suite)."""
    q: object = engine_queue
    i = 0
    new_groups_until = time.monotonic() + HAMMER_S
    groups = 0
    try:
        while not stop.is_set():
            if groups < 100 or time.monotonic() < new_groups_until:
                groups += 1
            req = _request(f"r{i}", f"g{i % groups}")
            q.push(req)  # type: ignore[attr-defined]
            q.charge(req, 3, 1)  # type: ignore[attr-defined]
            if i % 3 == 0:
                q.remove(req.request_id)  # type: ignore[attr-defined]
            elif i % 3 == 1:
                q.pop()  # type: ignore[attr-defined]
            i += 1
    except BaseException as exc:  # pragma: no cover - reported by the test
        errors.append(exc)


@pytest.mark.parametrize("queue_cls", [VTCQueue, FCFSQueue])
def test_gauges_and_precheck_read_the_queue_while_the_engine_thread_changes_it(
    queue_cls: type[VTCQueue] | type[FCFSQueue],
) -> None:
    fair = _fair_engine(queue_cls({"de": 2.0}))
    metrics = WorkerMetrics(CollectorRegistry())
    stop = threading.Event()
    hammer_errors: list[BaseException] = []
    hammer = threading.Thread(
        target=_hammer, args=(fair.engine.scheduler.queue, stop, hammer_errors), daemon=True
    )
    hammer.start()
    reads = 0
    try:
        end = time.monotonic() + HAMMER_S
        while time.monotonic() < end or reads < MIN_READS:
            # the worker's gauges (Worker._update_gauges) and the submit-time precheck
            metrics.update_fairness(fair.queue)
            assert fair.admission is not None
            decision = fair.admission.precheck(_request("p", "de", deadline=time.monotonic() + 60))
            assert decision.admit
            reads += 1
    finally:
        stop.set()
        hammer.join(5)
    assert not hammer_errors, hammer_errors
    assert reads >= MIN_READS


def test_one_snapshot_is_consistent_while_the_engine_thread_changes_the_queue() -> None:
    """`FairEngine.queue_snapshot()` is one consistent copy: the per-group depths add up to
    the queue length of the same instant, and it does not change afterwards."""
    fair = _fair_engine(VTCQueue({"de": 2.0}))
    stop = threading.Event()
    errors: list[BaseException] = []
    hammer = threading.Thread(
        target=_hammer, args=(fair.engine.scheduler.queue, stop, errors), daemon=True
    )
    hammer.start()
    snapshots = 0
    try:
        end = time.monotonic() + HAMMER_S
        while time.monotonic() < end or snapshots < MIN_READS:
            snap = fair.queue_snapshot()
            assert sum(snap.depths().values()) == len(snap)
            snapshots += 1
    finally:
        stop.set()
        hammer.join(5)
    assert not errors, errors
    assert snapshots >= MIN_READS
    # the snapshot is frozen: later queue traffic does not change it
    before = fair.queue_snapshot()
    depths = dict(before.depths())
    fair.engine.scheduler.queue.push(_request("late", "de"))
    assert dict(before.depths()) == depths
    assert fair.queue_snapshot().depths()["de"] == depths.get("de", 0) + 1
