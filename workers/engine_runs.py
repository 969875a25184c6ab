"""The requests a worker has in the engine: `EngineRuns`.

`Worker` decides which records go to the engine (intake, validation, duplicates); this class
hands them over and deals with what comes back, on the worker's poll thread:

* `submit()` builds the engine request (the deadline moved onto the engine's clock,
  `workers.deadlines`) and keeps an `InFlight` per request id (the worker's `_inflight` is the
  same dict: redeliveries join it); the engine's done-callback only puts the result on a queue.
* `drain_done()` takes the results off that queue. A result is answered through the
  `ReplyPublisher`, unless:
  - the run failed (ERROR with the engine's error text: `Engine._fail_all` fails every request
    in the engine when a step raises). It is submitted again, up to `Settings.max_attempts`
    runs, the last one isolated (`workers.retries`); a request whose last run fails too is
    dead-lettered with reason "poison" and the error text, then answered ERROR with the same
    text (`ReplyPublisher.dead_letter_and_reply_error`). Each new run counts in
    `tolk_engine_retries_total{lang}`; the intake slot is kept meanwhile, and the partition's
    other records go on (its commit point waits only for the poison record's dead letter and reply).
  - the record's partition was revoked while it ran (`PartitionState.ownership`): a record of
    a partition now owned by someone else and not committed is dropped (that owner reads and
    answers it), one of a partition assigned back here (a new assignment generation) or
    already committed is answered; both counted in `tolk_revoked_answers_total{outcome}`.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable

from workers.arms import arm_model_version
from workers.deadlines import engine_deadline
from workers.engine.types import (
    GenerationResult,
    RequestHandle,
    TranslationEngine,
    TranslationRequest,
    UnsupportedLanguage,
)
from workers.fairness.intake import IntakeController
from workers.metrics import WorkerMetrics
from workers.partitions import PartitionState
from workers.records import ConsumedRecord, InFlight
from workers.reply_publisher import ReplyPublisher
from workers.retries import EngineRetries, is_failed_run
from workers.settings import Settings

__all__ = ["EngineRuns"]


class EngineRuns:
    """Submits requests to the engine and answers, retries or drops their results."""

    def __init__(
        self,
        engine: TranslationEngine,
        settings: Settings,
        publisher: ReplyPublisher,
        partitions: PartitionState,
        intake: IntakeController,
        metrics: WorkerMetrics,
        clock_ms: Callable[[], int],
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.publisher = publisher
        self.partitions = partitions
        self.intake = intake
        self.metrics = metrics
        self._now_ms = clock_ms
        self.inflight: dict[str, InFlight] = {}  # request id -> the request in the engine
        # (request id, result, monotonic time the engine finished it)
        self._done: queue.SimpleQueue[tuple[str, GenerationResult, float]] = queue.SimpleQueue()
        self._retries = EngineRetries(settings.max_attempts)

    # -- submission ---------------------------------------------------------------------------

    def submit(self, rec: ConsumedRecord) -> None:
        """Hand a checked record's request to the engine (answered at once if refused)."""
        handle = self._start_run(rec, [rec])
        if handle is not None:
            now_ns = time.time_ns()
            self.inflight[rec.request_id] = InFlight(
                rec.request_id, rec.lang, handle, [rec], self._now_ms(), submitted_ns=now_ns
            )
            self.intake.on_enqueued(rec.lang)
            if rec.taken_ns:
                lag_s = (now_ns - rec.taken_ns) / 1e9
                self.metrics.observe_lag("consume_to_submit", rec.lang, lag_s)

    def _start_run(
        self, rec: ConsumedRecord, waiting: list[ConsumedRecord]
    ) -> RequestHandle | None:
        """Hand `rec`'s request to the engine. None when the engine refused it: then every
        record in `waiting` is answered (REJECTED / ERROR)."""
        req = rec.request
        rid = rec.request_id
        deadline = engine_deadline(
            req.get("deadline"), now_ms=self._now_ms(), now_monotonic=time.monotonic()
        )
        policy = self.settings.policy(rec.lang)
        try:
            handle = self.engine.submit_translation(
                TranslationRequest(
                    request_id=rid,
                    text=str(req["text"]),
                    source_lang=str(req.get("source_lang", "")),
                    target_lang=str(req["target_lang"]),
                    deadline=deadline,
                    max_new_tokens=policy.max_new_tokens if policy else None,
                    # every stage passes it on; the context stage uses it (context_engine.py)
                    conversation_id=req.get("conversation_id") or None,
                )
            )
        except Exception as exc:
            unsupported = isinstance(exc, UnsupportedLanguage)
            for r in waiting:
                self.publisher.answer_without_engine(
                    r,
                    "REJECTED" if unsupported else "ERROR",
                    "unsupported_language" if unsupported else "engine_error",
                    str(exc) if unsupported else f"engine refused the request: {exc!r}",
                )
            return None
        done = self._done

        def on_done(result: GenerationResult) -> None:  # engine thread: only enqueue
            done.put((rid, result, time.monotonic()))

        handle.add_done_callback(on_done)
        return handle

    # -- results ------------------------------------------------------------------------------

    def drain_done(self) -> None:
        """Handle every result the engine finished since the last call (poll thread)."""
        while True:
            try:
                rid, result, finished_at = self._done.get_nowait()
            except queue.Empty:
                break
            inflight = self.inflight.get(rid)
            if inflight is None:
                continue
            self._retries.finished(rid)
            try:
                self._on_result(inflight, result, finished_at)
            except Exception as exc:
                self._finish(inflight)
                for rec in inflight.records:
                    self.publisher.dead_letter(rec, "poison", exc)
        self._start_last_runs()

    def _on_result(
        self, inflight: InFlight, result: GenerationResult, finished_at: float | None = None
    ) -> None:
        """Answer, retry (a failed run: workers.retries) or drop (partition gone) a result."""
        failed = is_failed_run(result)
        plan = self._retries.plan(inflight.attempts) if failed else "give_up"
        final = not failed or plan == "give_up"
        inflight.records = self._owned_records(inflight, final=final)
        if not inflight.records:
            self._finish(inflight)  # revoked meanwhile: the partition's new owner answers
        elif plan == "retry":
            self._rerun(inflight)
        elif plan == "last":
            self._retries.queue_last(inflight.request_id)
        elif failed:
            self._finish(inflight)
            error = f"{inflight.attempts} engine runs failed; the last: {result.error}"
            for rec in inflight.records:
                self.publisher.dead_letter_and_reply_error(rec, "poison", error)
        else:
            self._finish(inflight)
            # an arm's reply says which arm answered: "<engine version>@<arm>" (workers.arms)
            model_version = arm_model_version(self.engine.model_version, self.settings.arm)
            self.publisher.answer_from_engine(
                inflight, result, model_version=model_version, finished_at=finished_at
            )

    def _owned_records(self, inflight: InFlight, *, final: bool) -> list[ConsumedRecord]:
        """The records this worker still answers; those of a partition revoked meanwhile and
        not committed are dropped (counted), the others answered (counted when `final`)."""
        kept = []
        for rec in inflight.records:
            owner = self.partitions.ownership(rec.tp, rec.generation, rec.offset)
            if owner == "gone":
                self.metrics.revoked_answers_total.labels(outcome="dropped").inc()
                continue
            if owner != "owned" and final:
                self.metrics.revoked_answers_total.labels(outcome="answered").inc()
            kept.append(rec)
        return kept

    def _rerun(self, inflight: InFlight) -> None:
        """Submit a request whose run failed once more (same records, same deadline)."""
        inflight.attempts += 1
        self.metrics.engine_retries_total.labels(lang=inflight.lang).inc()
        handle = self._start_run(inflight.records[0], inflight.records)
        if handle is None:
            self._finish(inflight)  # answered by _start_run
        else:
            inflight.handle = handle

    def _start_last_runs(self) -> None:
        while (rid := self._retries.take_last()) is not None:
            inflight = self.inflight.get(rid)
            if inflight is None:
                self._retries.forget(rid)
                continue
            try:
                inflight.records = self._owned_records(inflight, final=False)
                if inflight.records:
                    self._rerun(inflight)
                else:
                    self._finish(inflight)
            except Exception as exc:  # never leave the last-run slot taken by a lost request
                self._finish(inflight)
                for rec in inflight.records:
                    self.publisher.dead_letter(rec, "poison", exc)

    def _finish(self, inflight: InFlight) -> None:
        """`inflight` leaves the worker's books (answered, dead-lettered or dropped)."""
        if self.inflight.pop(inflight.request_id, None) is not None:
            self.intake.on_done(inflight.lang)
        self._retries.forget(inflight.request_id)
