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

Queue-wait estimate for a language `g` (an approximation, documented here because it is one):
the scheduler admits a backlogged VTC group at a rate proportional to its weight, so

    wait_g ~ depth_g / rate_g,   rate_g = max(measured admissions/s of g over the last
                                                `rate_window_s`,
                                            total admissions/s * w_g / sum of backlogged w)

The measured rate covers a group that is served more than its share (others idle); the share
term covers a group that only just became backlogged (its measured rate is still low). It
ignores that requests of different size cost different service, and that EDF inside a group may
put a request ahead of older ones (it then waits less: the estimate errs towards rejecting). An
empty group waits for the next free batch slot only (taken as 0). With an FCFS queue (no
weights) the whole queue is ahead: wait ~ len(queue) / total admissions/s. The expected output
length is a per-language running mean of observed outputs (capped by the request's max), since
`expected_output_tokens` from the engine is the cap itself for short texts.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from workers.engine.types import (
    AdmissionDecision,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    RequestQueue,
)
from workers.fairness.latency_model import DeadlineAdmission, LatencyModel, Verdict
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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = model or LatencyModel()
        self.deadlines = DeadlineAdmission(self.model, margin_s, margin_ratio)
        self.queue = queue
        self.rate_window_s = rate_window_s
        self.clock = clock
        self._lock = threading.Lock()
        self._admits: deque[tuple[float, str]] = deque()  # (when, group), last rate_window_s
        self._admitted: dict[str, _Admitted] = {}  # request id -> what the hook saw
        self._out_mean: dict[str, float] = {}  # group -> running mean of output tokens
        self._out_n: dict[str, int] = {}
        self.counts: dict[str, int] = {"admitted": 0, "rejected": 0, "expired": 0, "prechecked": 0}

    # -- the scheduler's hook (engine thread) -------------------------------------------------

    def __call__(
        self, request: GenerationRequest, now: float, running_batch_size: int, cached: int
    ) -> AdmissionDecision:
        batch = running_batch_size + 1
        d = self.deadlines.decide(
            now=now,
            deadline=request.deadline,
            prompt_tokens_uncached=max(0, len(request.prompt_ids) - cached),
            expected_output_tokens=self.expected_output(request),
            batch_size=batch,
            cached_tokens=cached,
            queue_wait_s=0.0,  # admission is now: the wait is over
        )
        with self._lock:
            if d.verdict is Verdict.ADMIT:
                self.counts["admitted"] += 1
                self._admits.append((now, request.group))
                self._trim(now)
                self._admitted[request.request_id] = _Admitted(batch, cached)
                if len(self._admitted) > _MAX_REMEMBERED:  # nobody calls observe(): stay bounded
                    del self._admitted[next(iter(self._admitted))]
            else:
                self.counts[d.verdict.value] += 1
        return _to_scheduler(d.verdict, d.reason)

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
        wait = self.queue_wait_estimate(request.group, now)
        d = self.deadlines.decide(
            now=now,
            deadline=request.deadline,
            prompt_tokens_uncached=max(0, len(request.prompt_ids) - cached),
            expected_output_tokens=self.expected_output(request),
            batch_size=self._typical_batch(),
            cached_tokens=cached,
            queue_wait_s=wait,
        )
        if d.verdict is not Verdict.ADMIT:
            with self._lock:
                self.counts["prechecked"] += 1
                self.counts[d.verdict.value] += 1
        return _to_scheduler(d.verdict, d.reason)

    def queue_wait_estimate(self, group: str, now: float | None = None) -> float:
        """Seconds a request of `group` pushed now would wait before admission (see notes)."""
        q = self.queue
        if q is None:
            return 0.0
        now = self.clock() if now is None else now
        with self._lock:
            self._trim(now)
            total_rate = group_rate = 0.0
            if self._admits:
                span = max(1e-3, min(self.rate_window_s, now - self._admits[0][0]))
                total_rate = len(self._admits) / span
                group_rate = sum(1 for _, g in self._admits if g == group) / span
        snap = snapshot_of(q)  # one instant of the queue, copied under the engine's lock
        if snap.fair:
            depths = snap.depths()
            ahead = depths.get(group, 0)
            if ahead == 0:
                return 0.0
            backlogged = [g for g, n in depths.items() if n > 0]
            wsum = sum(snap.weight(g) for g in backlogged) or snap.weight(group)
            share_rate = total_rate * snap.weight(group) / wsum
            rate = max(group_rate, share_rate)
        else:
            ahead = len(snap)
            if ahead == 0:
                return 0.0
            rate = total_rate
        if rate <= 0:
            return 0.0  # no admission seen yet: unknown, let the admission-time check decide
        return ahead / rate

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

    def _trim(self, now: float) -> None:
        cut = now - self.rate_window_s
        while self._admits and self._admits[0][0] < cut:
            self._admits.popleft()

    def _typical_batch(self) -> int:
        with self._lock:
            live = len(self._admitted)  # admitted, not yet observed: about the running batch
        return max(1, live + 1)


def _to_scheduler(verdict: Verdict, reason: str) -> AdmissionDecision:
    if verdict is Verdict.ADMIT:
        return AdmissionDecision(True, None, reason)
    fr = FinishReason.EXPIRED if verdict is Verdict.EXPIRED else FinishReason.REJECTED
    return AdmissionDecision(False, fr, reason)
