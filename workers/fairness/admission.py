"""Deadline admission wired into the engine, and a fair-share engine for the worker.

`EngineAdmission` adapts `DeadlineAdmission` + `LatencyModel` (workers.fairness.latency_model)
to the scheduler's `AdmissionHook` and keeps the model honest with the engine's own timings.
Deadlines are checked twice, so a request that cannot make it is refused *early* and never
costs prefill:

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

`FairEngine` wraps an `Engine` with a `VTCQueue` (or `FCFSQueue`) and this admission, and is
what the worker is given (it implements `TranslationEngine`). Without touching engine.py it
adds: the submit-time precheck (a refused request resolves its handle at once), `observe` on
every finished request, and the rule that no request is answered OK after its deadline: a
watchdog cancels running requests whose deadline passed, and a result that finishes late anyway
is turned into EXPIRED before the caller sees it.
"""

from __future__ import annotations

import heapq
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from workers.engine.scheduler import AdmissionDecision
from workers.engine.types import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    RequestHandle,
    RequestQueue,
    Timings,
)
from workers.fairness.latency_model import DeadlineAdmission, LatencyModel, LatencyPrior, Verdict
from workers.fairness.policy import DEFAULT_BURST_TOKENS, LanguagePolicy
from workers.fairness.vtc import FCFSQueue, VTCQueue

if TYPE_CHECKING:
    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.loader import LoadedModel

__all__ = ["EngineAdmission", "FairEngine", "build_fair_engine", "prior_from_step_costs"]

log = logging.getLogger(__name__)

_EMA_ALPHA = 0.05  # per-language output-length mean: ~20 recent requests
_EMA_MIN_SAMPLES = 8  # before this many, the request's own expected_output_tokens is used
_MAX_REMEMBERED = 8192  # admitted requests awaiting observe()


def prior_from_step_costs(
    step_base_s: float, prefill_s_per_token: float, batch_s_per_seq: float
) -> LatencyPrior:
    """A latency prior from measured step costs (step = a + b * prefill + c * batch, the
    simulator's `CostModel`): a request decoding `out` tokens in a batch of B spends `out` steps
    of a + c * B, plus b per uncached prompt token for its prefill. Far closer than the generic
    CPU prior on another machine, so the model predicts well before its first refit."""
    return LatencyPrior(
        base_s=step_base_s,  # the prefill step itself
        prefill_s_per_token=prefill_s_per_token,
        cached_s_per_token=0.0,
        decode_s_per_token=step_base_s,
        batch_s=0.0,
        decode_s_per_token_per_seq=batch_s_per_seq,
    )


@dataclass(slots=True)
class _Admitted:
    batch_size: int  # running sequences when admitted, itself included
    cached: int  # cached prompt tokens at admission


class EngineAdmission:
    """The scheduler's admission hook with a learning latency model (see the module notes).

    Thread-safety: `__call__` and `observe` run on the engine thread, `precheck` on whichever
    thread submits; the small shared state is guarded by one lock.
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
        if isinstance(q, VTCQueue):
            depths = q.depths()
            ahead = depths.get(group, 0)
            if ahead == 0:
                return 0.0
            backlogged = [g for g, n in depths.items() if n > 0]
            wsum = sum(q.weight(g) for g in backlogged) or q.weight(group)
            share_rate = total_rate * q.weight(group) / wsum
            rate = max(group_rate, share_rate)
        else:
            ahead = len(q)
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


class FairEngine:
    """An `Engine` with a fair-share queue and deadline admission; a `TranslationEngine`.

    `submit()` / `submit_translation()` return a handle of their own that resolves with the
    engine's result after `observe()` and the deadline rule ran (see the module notes).
    """

    def __init__(
        self,
        engine: Engine,
        admission: EngineAdmission | None,
        *,
        precheck: bool = True,
        warm_prefix: bool = True,
        watchdog_interval_s: float = 0.02,
    ) -> None:
        self.engine = engine
        self.admission = admission
        self.queue = engine.scheduler.queue
        self.model_version = engine.model_version
        self.languages = engine.languages
        self.precheck_enabled = precheck and admission is not None
        self.warm_prefix = warm_prefix
        self._prefix_len: dict[str, int] = {}
        self._deadlines: list[tuple[float, str]] = []  # heap of (deadline, request id)
        self._live: set[str] = set()
        self._lock = threading.Lock()
        self._watchdog_interval_s = watchdog_interval_s
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self.late_ok_converted = 0  # results that finished after their deadline -> EXPIRED
        self.cancelled_late = 0  # running requests the watchdog cancelled at their deadline

    # -- TranslationEngine ---------------------------------------------------------------------

    def submit_translation(
        self,
        *,
        request_id: str,
        text: str,
        source_lang: str,
        target_lang: str,
        deadline: float | None = None,
        max_new_tokens: int | None = None,
    ) -> RequestHandle:
        request = self.engine.translation_request(
            text,
            source_lang,
            target_lang,
            request_id=request_id,
            deadline=deadline,
            max_new_tokens=max_new_tokens,
        )
        return self.submit(request)

    def count_tokens(self, text: str) -> int:
        return self.engine.count_tokens(text)

    def start(self) -> None:
        self.engine.start()
        if self._watchdog is None:
            self._stop.clear()
            self._watchdog = threading.Thread(
                target=self._watch, name="tolk-deadline-watchdog", daemon=True
            )
            self._watchdog.start()

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        self.engine.stop(drain=drain, timeout=timeout)
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout=2)
            self._watchdog = None

    # -- submission ----------------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> RequestHandle:
        outer = RequestHandle(request.request_id, self.engine.cancel)
        if self.precheck_enabled and self.admission is not None and request.deadline is not None:
            verdict = self.admission.precheck(request, cached=self._cached_guess(request))
            if not verdict.admit:
                outer.set_result(_refused(request, verdict))
                return outer
        inner = self.engine.submit(request)
        if request.deadline is not None:
            with self._lock:
                heapq.heappush(self._deadlines, (request.deadline, request.request_id))
                self._live.add(request.request_id)

        def done(result: GenerationResult) -> None:  # engine thread
            with self._lock:
                self._live.discard(request.request_id)
            if self.admission is not None:
                try:
                    self.admission.observe(result, group=request.group)
                except Exception:  # a bad sample must never lose the answer
                    log.exception("latency model observe failed")
            outer.set_result(self._enforce_deadline(request, result))

        inner.add_done_callback(done)
        return outer

    def _cached_guess(self, request: GenerationRequest) -> int:
        if not self.warm_prefix:
            return 0
        n = self._prefix_len.get(request.group)
        if n is None:
            try:
                n = len(self.engine.prompts.prefix_ids(request.group))
            except Exception:
                n = 0
            self._prefix_len[request.group] = n
        bs = self.engine.config.block_size
        return min(len(request.prompt_ids) - 1, (n // bs) * bs)  # only full blocks are shared

    def _enforce_deadline(
        self, request: GenerationRequest, result: GenerationResult
    ) -> GenerationResult:
        if request.deadline is None:
            return result
        finished_at = request.arrival + result.timings.total_s
        late = finished_at - request.deadline
        if result.ok and late > 0:
            self.late_ok_converted += 1
            result.finish_reason = FinishReason.EXPIRED
            result.error = f"finished {late * 1e3:.0f} ms after its deadline"
            result.text = ""
        elif result.finish_reason is FinishReason.CANCELLED and late >= 0:
            result.finish_reason = FinishReason.EXPIRED
            result.error = (
                f"deadline passed while running; stopped after {result.tokens_out} tokens"
            )
            result.text = ""
        return result

    # -- deadline watchdog ---------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(self._watchdog_interval_s):
            now = time.monotonic()
            due: list[str] = []
            with self._lock:
                while self._deadlines and self._deadlines[0][0] <= now:
                    _, rid = heapq.heappop(self._deadlines)
                    if rid in self._live:
                        self._live.discard(rid)
                        due.append(rid)
            for rid in due:
                self.cancelled_late += 1
                self.engine.cancel(rid)

    # -- introspection -------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        adm = self.admission
        return {
            "queue": type(self.queue).__name__,
            "admission": dict(adm.counts) if adm else {},
            "latency_model_mae_s": adm.model.median_abs_error() if adm else math.nan,
            "latency_model_observations": adm.model.observations if adm else 0,
            "late_ok_converted": self.late_ok_converted,
            "cancelled_late": self.cancelled_late,
        }


def _refused(request: GenerationRequest, verdict: AdmissionDecision) -> GenerationResult:
    return GenerationResult(
        request_id=request.request_id,
        token_ids=[],
        text="",
        finish_reason=verdict.finish_reason or FinishReason.REJECTED,
        tokens_in=len(request.prompt_ids),
        timings=Timings(),
        error=verdict.reason,
    )


def build_fair_engine(
    loaded_or_config: LoadedModel | EngineConfig,
    policies: Mapping[str, LanguagePolicy],
    fair: bool = True,
    *,
    config: EngineConfig | None = None,
    admission: bool = True,
    latency_model: LatencyModel | None = None,
    precheck: bool = True,
    burst_tokens: float = DEFAULT_BURST_TOKENS,
) -> FairEngine:
    """An Engine wired with `VTCQueue.from_policies` (fair) or `FCFSQueue` and `EngineAdmission`.

    `loaded_or_config`: a LoadedModel (then `config` is the EngineConfig, default one) or an
    EngineConfig (the model is loaded by `Engine.from_config`). `burst_tokens`: the VTC queue's
    burst credit for a language returning from idle (0 = the paper's lift).
    """
    from workers.engine.engine import Engine, EngineConfig

    queue: VTCQueue | FCFSQueue = (
        VTCQueue.from_policies(policies, burst_tokens=burst_tokens)
        if fair
        else FCFSQueue.from_policies(policies)
    )
    hook = EngineAdmission(latency_model, queue=queue) if admission else None
    if isinstance(loaded_or_config, EngineConfig):
        engine = Engine.from_config(loaded_or_config, request_queue=queue, admission=hook)
    else:
        engine = Engine(loaded_or_config, config, request_queue=queue, admission=hook)
    return FairEngine(engine, hook, precheck=precheck)
