"""A fair-share engine for the worker: `FairEngine` and `build_fair_engine`.

This is where the engine (`workers.engine`, which knows no languages' weights) and the fair-share
logic (`workers.fairness`, pure and single-threaded) are put together; neither of those two
packages imports the other beyond the engine's boundary types.

`FairEngine` wraps an `Engine` whose scheduler was given a `VTCQueue` (or the ledger-keeping
`FCFSQueue` for comparisons) and an `EngineAdmission` hook (workers.serving.admission), and is
what the worker is given (it implements `TranslationEngine`). Without touching engine.py it
adds: the submit-time precheck (a refused request resolves its handle at once), `observe` on
every finished request, the queue behind a lock with `queue_snapshot()` for readers on other
threads (workers.serving.queue_snapshot: the precheck and the worker's gauges read one frozen
copy of the ledger, never the dicts the engine thread is changing), and the rule that no
request is answered OK after its deadline: a watchdog thread cancels running requests whose
deadline passed, and a result that finishes late anyway is turned into EXPIRED before the
caller sees it. Both apply the rule of `workers.engine.deadlines` (`DeadlineWatch`,
`expire_if_late`); this module only runs the thread and holds the lock.

`Engine` is imported lazily (inside `build_fair_engine`), so importing this module does not load
torch; the CLI's `--help` stays instant.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from workers.engine.deadlines import DeadlineWatch, expire_if_late
from workers.engine.types import (
    AdmissionDecision,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    RequestHandle,
    Timings,
    TranslationRequest,
)
from workers.fairness.latency_model import LatencyModel, LatencyPrior
from workers.fairness.policy import DEFAULT_BURST_TOKENS, LanguagePolicy
from workers.fairness.vtc import FCFSQueue, VTCQueue
from workers.serving.admission import EngineAdmission
from workers.serving.pace import SloPace
from workers.serving.queue_snapshot import GuardedQueue, QueueSnapshot, snapshot_of

if TYPE_CHECKING:
    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.engine_snapshot import EngineSnapshot
    from workers.engine.loader import LoadedModel

__all__ = ["FairEngine", "build_fair_engine"]

log = logging.getLogger(__name__)


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
        # The engine thread changes the queue, the poll thread reads it (precheck, gauges):
        # every queue operation goes under one lock, readers take snapshots (queue_snapshot.py).
        # Installed here, before the engine thread starts.
        queue = engine.scheduler.queue
        if not isinstance(queue, GuardedQueue) and isinstance(queue, (VTCQueue, FCFSQueue)):
            queue = GuardedQueue(queue)
            engine.scheduler.queue = queue
            if admission is not None and admission.queue is not None:
                admission.queue = queue
        self.queue = queue
        self.model_version = engine.model_version
        self.languages = engine.languages
        self.precheck_enabled = precheck and admission is not None
        self.warm_prefix = warm_prefix
        self._prefix_len: dict[str, int] = {}
        self._deadlines = DeadlineWatch()  # running requests with a deadline (under _lock)
        self._lock = threading.Lock()
        self._watchdog_interval_s = watchdog_interval_s
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self.late_ok_converted = 0  # results that finished after their deadline -> EXPIRED
        self.cancelled_late = 0  # running requests the watchdog cancelled at their deadline

    # -- TranslationEngine ---------------------------------------------------------------------

    def submit_translation(self, request: TranslationRequest) -> RequestHandle:
        return self.submit(self.engine.generation_request(request))

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
                self._deadlines.watch(request.request_id, request.deadline)

        def done(result: GenerationResult) -> None:  # engine thread
            with self._lock:
                self._deadlines.finished(request.request_id)
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
        """The deadline rule on a finished result (`workers.engine.deadlines.expire_if_late`):
        a late OK, or a cancel at the deadline, becomes EXPIRED."""
        if request.deadline is None:
            return result
        was_ok = result.ok
        result = expire_if_late(result, request.deadline, request.arrival + result.timings.total_s)
        if was_ok and not result.ok:
            self.late_ok_converted += 1
        return result

    # -- deadline watchdog ---------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(self._watchdog_interval_s):
            with self._lock:
                due = self._deadlines.due(time.monotonic())
            for rid in due:
                self.cancelled_late += 1
                self.engine.cancel(rid)

    # -- introspection -------------------------------------------------------------------------

    def queue_snapshot(self) -> QueueSnapshot:
        """The waiting queue's ledger at one instant (depths, service, counters, weights), safe
        from any thread: what the precheck and the worker's fairness gauges read."""
        return snapshot_of(self.queue)

    def stats_snapshot(self) -> EngineSnapshot:
        """The engine's own statistics at one instant (KV use, prefix hits, preemptions), safe
        from any thread: what the worker's engine gauges read (workers/metrics.py)."""
        return self.engine.stats_snapshot()

    def stats(self) -> dict[str, Any]:
        adm = self.admission
        inner = self.queue.inner if isinstance(self.queue, GuardedQueue) else self.queue
        return {
            "queue": type(inner).__name__,
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
    loaded: LoadedModel | None = None,
    decode_steps: Mapping[int, float] | None = None,
) -> FairEngine:
    """An Engine wired with `VTCQueue.from_policies` (fair) or `FCFSQueue` and `EngineAdmission`.

    `loaded_or_config`: a LoadedModel (then `config` is the EngineConfig, default one) or an
    EngineConfig (the model is loaded by `Engine.from_config`). `burst_tokens`: the VTC queue's
    burst credit for a language returning from idle (0 = the paper's lift). `loaded`, with an
    EngineConfig: the model already loaded on its device (`Engine.from_config(loaded=)`).
    With `fair`, the scheduler's pace hook holds newcomers back while a running request needs
    fast steps to make its language's SLO (workers.serving.pace); `decode_steps`: a
    decode-only step's seconds by batch size (the start-up probe's; default: the latency
    prior's per-token constants, at batch 1 and at the running batch's cap).
    """
    from workers.engine.engine import Engine, EngineConfig

    queue = GuardedQueue(
        VTCQueue.from_policies(policies, burst_tokens=burst_tokens)
        if fair
        else FCFSQueue.from_policies(policies)
    )
    hook = EngineAdmission(latency_model, queue=queue) if admission else None
    if isinstance(loaded_or_config, EngineConfig):
        engine = Engine.from_config(loaded_or_config, loaded, request_queue=queue, admission=hook)
    else:
        engine = Engine(loaded_or_config, config, request_queue=queue, admission=hook)
    if fair:
        if not decode_steps:
            prior = LatencyPrior()
            decode_steps = {
                b: prior.decode_s_per_token + prior.decode_s_per_token_per_seq * b
                for b in (1, engine.config.max_num_seqs)
            }
        slo = {group: policy.slo_p99_s for group, policy in policies.items()}
        engine.scheduler.pace = SloPace(slo, decode_steps)
    return FairEngine(engine, hook, precheck=precheck)
