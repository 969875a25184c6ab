"""Deadline admission wired into the engine's scheduler: `EngineAdmission`.

`EngineAdmission` adapts `DeadlineAdmission` + `LatencyModel` (workers.fairness.latency_model)
to the scheduler's `AdmissionHook` (workers.engine.types) and keeps the model honest with the
engine's own timings. It lives in the serving package, not in `workers.fairness`, because it is
shared between threads (one lock) and that package is pure, single-threaded logic. Deadlines
are checked twice, so a request that cannot make it is refused *early* and never costs prefill:

1. at submission (`precheck`, on the submitting thread): now + estimated queue wait + predicted
   service (+ margins) past the deadline -> REJECTED at once, before it ever waits;
2. at admission (`__call__`, the scheduler's hook, on the engine thread): the wait is over, so
   only the predicted service counts; a request whose deadline passed is EXPIRED by the
   scheduler itself before the hook runs.

What the latency model learns (`observe`). Features: uncached prompt tokens (tokens_in -
cached_tokens), output tokens actually generated, the running batch size when the request was
admitted (itself included; remembered by the hook, per request id) and the cached prompt
tokens. Target: *service* latency, `timings.total_s - timings.queue_s` (admission -> finish).
The queue wait is left out on purpose: it depends on the backlog, not on the request, and is
estimated separately below; a model fitted on total latency would learn the backlog of the
past minute and reject everything once a flood is over.

Queue-wait estimate (`wait_estimate`): the wait *in VTC order*, workers.fairness.vtc_wait.
The queue is read as one `QueueSnapshot` (depths, virtual counters, weights, burst credit, the
lift floor); each language's request cost (uncached prompt + 2 x expected output, what the queue
charges) is the mean over its admissions in the last `rate_window_s`, and the service rate is
the cost admitted per second over the same window. The request waits behind its own language's
backlog, plus, of each other language, the requests whose counters come before its own pick
(given the weights and the burst credit), plus one service slot for the full batch to make room;
so a light language below its share waits about one slot however deep a heavy one's backlog is,
while the heavy language waits behind its own backlog at its share. With an FCFS queue the whole
queue is ahead. Nothing measured yet: 0 (the admission-time check decides). The measured rate
is the admitted cost over the window since the first admission in it: after an idle spell it is
low (the estimate errs towards rejecting, at the start of a burst only).

An idle engine tries (`explore`): with nothing running and nothing waiting, a request the
fitted model says would miss its deadline is admitted anyway when the model's prior (the
per-token constants it started from) says it fits alone; one that not even the prior fits is
refused. The model's coefficients are fitted on what it admitted; after a flood they describe a
full batch only (output length and output x batch are collinear when the batch is always
~full), and their extrapolation to a small batch can predict seconds for a request that takes a
fraction of one. Refusing on it stopped all learning for good: the simulator's overload at a
batch cap of 16 ended with every request of both languages REJECTED. Served alone, the
request's result is the sample the model lacked.

The expected output length is a per-language running mean of observed outputs (capped by the
request's max), since `expected_output_tokens` from the engine is the cap itself for short texts.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from workers.engine.deadlines import would_miss
from workers.engine.types import (
    AdmissionDecision,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    RequestQueue,
)
from workers.fairness.latency_model import DeadlineAdmission, LatencyModel, Verdict
from workers.fairness.vtc import service_cost
from workers.fairness.vtc_wait import GroupState, QueueState, WaitEstimate, fcfs_wait, vtc_wait
from workers.serving.queue_snapshot import snapshot_of

__all__ = ["EngineAdmission"]

_EMA_ALPHA = 0.05  # per-language output-length mean: ~20 recent requests
_EMA_MIN_SAMPLES = 8  # before this many, the request's own expected_output_tokens is used
_MAX_REMEMBERED = 8192  # admitted requests awaiting observe()


@dataclass(slots=True)
class _Admitted:
    batch_size: int  # running sequences when admitted, itself included
    cached: int  # cached prompt tokens at admission


class EngineAdmission:
    """The scheduler's admission hook with a learning latency model (see the module notes).

    Thread-safety: `__call__` and `observe` run on the engine thread, `precheck` on whichever
    thread submits; the small shared state is guarded by one lock. The queue the engine thread
    changes is read only through one `QueueSnapshot` per estimate (a `GuardedQueue`, as
    `FairEngine` installs it, copies it under the lock its engine thread takes; a plain queue
    is only safe single-threaded).
    """

    def __init__(
        self,
        model: LatencyModel | None = None,
        *,
        queue: RequestQueue | None = None,
        margin_s: float = 0.05,
        margin_ratio: float = 0.1,
        rate_window_s: float = 30.0,
        explore: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = model or LatencyModel()
        self.deadlines = DeadlineAdmission(self.model, margin_s, margin_ratio)
        self.queue = queue
        self.rate_window_s = rate_window_s
        self.explore = explore
        self.clock = clock
        self._lock = threading.Lock()
        # (when, group, weighted cost) of each admission in the last rate_window_s
        self._admits: deque[tuple[float, str, float]] = deque()
        self._window: dict[str, list[float]] = {}  # group -> [cost sum, count] of _admits
        self._admitted: dict[str, _Admitted] = {}  # request id -> what the hook saw
        self._out_mean: dict[str, float] = {}  # group -> running mean of output tokens
        self._out_n: dict[str, int] = {}
        self.counts: dict[str, int] = {
            "admitted": 0,
            "rejected": 0,
            "expired": 0,
            "prechecked": 0,
            "explored": 0,
        }

    # -- the scheduler's hook (engine thread) -------------------------------------------------

    def __call__(
        self, request: GenerationRequest, now: float, running_batch_size: int, cached: int
    ) -> AdmissionDecision:
        batch = running_batch_size + 1
        uncached = max(0, len(request.prompt_ids) - cached)
        out = self.expected_output(request)
        d = self.deadlines.decide(
            now=now,
            deadline=request.deadline,
            prompt_tokens_uncached=uncached,
            expected_output_tokens=out,
            batch_size=batch,
            cached_tokens=cached,
            queue_wait_s=0.0,  # admission is now: the wait is over
        )
        verdict, reason = d.verdict, d.reason
        idle = running_batch_size == 0
        if verdict is Verdict.REJECTED and idle and self._explores(request, now, uncached, out):
            verdict, reason = Verdict.ADMIT, f"idle engine, admitted to learn ({reason})"
        with self._lock:
            if verdict is Verdict.ADMIT:
                self.counts["admitted"] += 1
                if reason.startswith("idle engine"):
                    self.counts["explored"] += 1
                cost = service_cost(uncached, out)
                self._admits.append((now, request.group, cost))
                acc = self._window.setdefault(request.group, [0.0, 0.0])
                acc[0] += cost
                acc[1] += 1
                self._trim(now)
                self._admitted[request.request_id] = _Admitted(batch, cached)
                if len(self._admitted) > _MAX_REMEMBERED:  # nobody calls observe(): stay bounded
                    del self._admitted[next(iter(self._admitted))]
            else:
                self.counts[verdict.value] += 1
        return _to_scheduler(verdict, reason)

    # -- submit-time check (any thread) -------------------------------------------------------

    def precheck(
        self, request: GenerationRequest, now: float | None = None, cached: int = 0
    ) -> AdmissionDecision:
        """Refuse at submission what would miss its deadline after the estimated queue wait.

        `cached` is the caller's guess of the cached prefix (the language's template when it is
        warm); the batch size is taken as full when others wait, else the current one + 1.
        """
        if request.deadline is None:
            return AdmissionDecision(True)
        now = self.clock() if now is None else now
        uncached = max(0, len(request.prompt_ids) - cached)
        out = self.expected_output(request)
        est = self.wait_estimate(request.group, now, service_cost(uncached, out))
        batch = self._typical_batch()
        d = self.deadlines.decide(
            now=now,
            deadline=request.deadline,
            prompt_tokens_uncached=uncached,
            expected_output_tokens=out,
            batch_size=batch,
            cached_tokens=cached,
            queue_wait_s=est.wait_s,
        )
        idle = batch == 1 and not est.queued
        if d.verdict is Verdict.REJECTED and idle and self._explores(request, now, uncached, out):
            return AdmissionDecision(True, None, f"idle engine, admitted to learn ({d.reason})")
        if d.verdict is not Verdict.ADMIT:
            with self._lock:
                self.counts["prechecked"] += 1
                self.counts[d.verdict.value] += 1
        return _to_scheduler(d.verdict, d.reason)

    def queue_wait_estimate(
        self, group: str, now: float | None = None, cost: float | None = None
    ) -> float:
        """Seconds a request of `group` pushed now would wait before admission (see notes)."""
        return self.wait_estimate(group, now, cost).wait_s

    def wait_estimate(
        self, group: str, now: float | None = None, cost: float | None = None
    ) -> WaitEstimate:
        """The wait of a request of `group` (weighted cost `cost`, default: its language's
        mean) pushed now, in the queue's serving order, with what is ahead of it."""
        q = self.queue
        if q is None:
            return WaitEstimate(0.0, 0.0)
        now = self.clock() if now is None else now
        with self._lock:
            self._trim(now)
            rate = slot = 0.0
            sums = {g: (c, n) for g, (c, n) in self._window.items() if n > 0}
            if self._admits:
                span = max(1e-3, min(self.rate_window_s, now - self._admits[0][0]))
                total = sum(c for c, _ in sums.values())
                rate = total / span
                slot = total / len(self._admits)
        means = {g: c / n for g, (c, n) in sums.items()}
        fallback = cost if cost is not None else (means.get(group) or slot or 1.0)
        snap = snapshot_of(q)  # one instant of the queue, copied under the engine's lock
        counters = snap.counters()
        depths = dict(snap.depths())
        if not depths and len(snap):  # a queue without a ledger: only its length is known
            depths = {"": len(snap)}
        groups = {
            g: GroupState(n, counters.get(g, 0.0), snap.weight(g), means.get(g, fallback))
            for g, n in depths.items()
        }
        state = QueueState(groups, snap.idle_floor, snap.burst_tokens, rate, slot or fallback)
        if not snap.fair:
            return fcfs_wait(state)
        own = GroupState(0, 0.0, snap.weight(group), means.get(group, fallback))
        return vtc_wait(state, group, own)

    # -- learning (engine thread) --------------------------------------------------------------

    def observe(
        self, result: GenerationResult, batch_size: int | None = None, group: str = ""
    ) -> None:
        """Refit from one finished request (only served ones: OK, or cut by a cancel after
        prefill). `batch_size` defaults to what the hook saw when it admitted the request."""
        with self._lock:
            seen = self._admitted.pop(result.request_id, None)
        if not result.ok or result.tokens_out == 0:
            return
        batch = batch_size if batch_size is not None else (seen.batch_size if seen else 1)
        service_s = max(0.0, result.timings.total_s - result.timings.queue_s)
        self.model.observe(
            max(0, result.tokens_in - result.cached_tokens),
            result.tokens_out,
            batch,
            result.cached_tokens,
            service_s,
        )
        if group:
            with self._lock:
                n = self._out_n.get(group, 0) + 1
                self._out_n[group] = n
                prev = self._out_mean.get(group, float(result.tokens_out))
                alpha = max(_EMA_ALPHA, 1.0 / n)
                self._out_mean[group] = prev + alpha * (result.tokens_out - prev)

    def forget(self, request_id: str) -> None:
        """Drop what the hook remembered of a request that will not be observed."""
        with self._lock:
            self._admitted.pop(request_id, None)

    def expected_output(self, request: GenerationRequest) -> int:
        cap = request.params.max_new_tokens
        own = request.expected_output_tokens or cap
        with self._lock:
            n = self._out_n.get(request.group, 0)
            mean = self._out_mean.get(request.group)
        if mean is None or n < _EMA_MIN_SAMPLES:
            return own
        return max(1, min(cap, math.ceil(mean)))

    # -- internals -----------------------------------------------------------------------------

    def _explores(self, request: GenerationRequest, now: float, uncached: int, out: int) -> bool:
        """An idle engine admits a request the fitted model refuses when the prior says it
        fits alone (see the module notes); one no engine could serve in time is still refused.
        """
        if not self.explore or request.deadline is None:
            return False
        return not would_miss(request.deadline, now, self.model.predict_prior(uncached, out, 1))

    def _trim(self, now: float) -> None:
        cut = now - self.rate_window_s
        while self._admits and self._admits[0][0] < cut:
            _, group, cost = self._admits.popleft()
            acc = self._window[group]
            acc[0] -= cost
            acc[1] -= 1
        if not self._admits:
            self._window.clear()  # no drift left over from the running sums

    def _typical_batch(self) -> int:
        with self._lock:
            live = len(self._admitted)  # admitted, not yet observed: about the running batch
        return max(1, live + 1)


def _to_scheduler(verdict: Verdict, reason: str) -> AdmissionDecision:
    if verdict is Verdict.ADMIT:
        return AdmissionDecision(True, None, reason)
    fr = FinishReason.EXPIRED if verdict is Verdict.EXPIRED else FinishReason.REJECTED
    return AdmissionDecision(False, fr, reason)
