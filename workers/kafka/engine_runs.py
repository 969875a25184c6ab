"""The dispatch step: requests handed to the engine, and what becomes of their results.

`RecordIntake` decides which records go to the engine (`Submit`); this class hands them over
and turns what comes back into outcomes (`workers.kafka.record_life`), on the worker's poll thread.
The in-flight requests themselves are kept by `RecordLife` (`entered_engine`, `join`,
`left_engine`), never here:

* `submit()` builds the engine request (the deadline moved onto the engine's clock,
  `workers.engine.deadlines`); the engine's done-callback only puts the result on a queue. A
  request the engine refuses at once yields an `AnswerNow` per waiting record (REJECTED for an
  unsupported language, else ERROR).
* `drain_done()` takes the results off that queue and yields an `Answer`, unless:
  - the run failed (ERROR with the engine's error text: `Engine.results.fail_all` fails every
    request in the engine when a step raises). It is submitted again, up to
    `Settings.max_attempts` runs, the last one isolated (`workers.kafka.engine_retries`); a
    request whose last run fails too yields a `DeadLetter(reason="poison", reply_error=True)`
    per record (dead letter, then an ERROR reply with the same text). Each new run counts in
    `tolk_engine_retries_total{lang}`; the intake slot is kept meanwhile, and the partition's
    other records go on (its commit point waits only for the poison record's dead letter and
    reply).
  - the record's partition was revoked while it ran (`RecordLife.owned_records`): a record of
    a partition now owned by someone else and not committed is dropped (that owner reads and
    answers it), one of a partition assigned back here or already committed is answered.
  - anything raised while deciding: the request leaves the books and its records are
    dead-lettered as "poison".
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator

from workers.arms import arm_model_version
from workers.engine.deadlines import engine_deadline
from workers.engine.types import (
    GenerationResult,
    RequestHandle,
    TranslationEngine,
    TranslationRequest,
    UnsupportedLanguage,
)
from workers.kafka.engine_retries import EngineRetries, is_failed_run
from workers.kafka.record_life import Answer, AnswerNow, DeadLetter, Outcome, RecordLife
from workers.kafka.records import ConsumedRecord, InFlight
from workers.metrics import WorkerMetrics
from workers.settings import Settings

__all__ = ["EngineRuns"]


class EngineRuns:
    """Submits requests to the engine; yields the answers, retries or drops of their results."""

    def __init__(
        self,
        engine: TranslationEngine,
        settings: Settings,
        life: RecordLife,
        metrics: WorkerMetrics,
        clock_ms: Callable[[], int],
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.life = life
        self.metrics = metrics
        self._now_ms = clock_ms
        # (request id, result, monotonic time the engine finished it)
        self._done: queue.SimpleQueue[tuple[str, GenerationResult, float]] = queue.SimpleQueue()
        self._retries = EngineRetries(settings.max_attempts)

    # -- submission ---------------------------------------------------------------------------

    def submit(self, rec: ConsumedRecord) -> list[Outcome]:
        """Hand a checked record's request to the engine; the answers if it refused at once."""
        handle, refused = self._start_run(rec, [rec])
        if handle is not None:
            now_ns = time.time_ns()
            self.life.entered_engine(rec, handle, self._now_ms(), now_ns)
            if rec.taken_ns:
                lag_s = (now_ns - rec.taken_ns) / 1e9
                self.metrics.observe_lag("consume_to_submit", rec.lang, lag_s)
        return refused

    def _start_run(
        self, rec: ConsumedRecord, waiting: list[ConsumedRecord]
    ) -> tuple[RequestHandle | None, list[Outcome]]:
        """Hand `rec`'s request to the engine: its handle, or None and an answer for every
        record in `waiting` (REJECTED / ERROR) when the engine refused it."""
        req = rec.request
        assert req is not None, "only decoded requests are submitted (workers.kafka.intake)"
        rid = rec.request_id
        deadline = engine_deadline(
            req.deadline, now_ms=self._now_ms(), now_monotonic=time.monotonic()
        )
        policy = self.settings.policy(rec.lang)
        try:
            handle = self.engine.submit_translation(
                TranslationRequest(
                    request_id=rid,
                    text=req.text,
                    source_lang=req.source_lang,
                    target_lang=req.target_lang,
                    deadline=deadline,
                    max_new_tokens=policy.max_new_tokens if policy else None,
                    # every stage passes it on; the context stage uses it (workers/stages/context/)
                    conversation_id=req.conversation_id or None,
                )
            )
        except Exception as exc:
            unsupported = isinstance(exc, UnsupportedLanguage)
            status = "REJECTED" if unsupported else "ERROR"
            reason = "unsupported_language" if unsupported else "engine_error"
            error = str(exc) if unsupported else f"engine refused the request: {exc!r}"
            return None, [AnswerNow(r, status, reason, error) for r in waiting]
        done = self._done

        def on_done(result: GenerationResult) -> None:  # engine thread: only enqueue
            done.put((rid, result, time.monotonic()))

        handle.add_done_callback(on_done)
        return handle, []

    # -- results ------------------------------------------------------------------------------

    def drain_done(self) -> Iterator[Outcome]:
        """The outcomes of every result the engine finished since the last call (poll thread)."""
        while True:
            try:
                rid, result, finished_at = self._done.get_nowait()
            except queue.Empty:
                break
            inflight = self.life.in_engine(rid)
            if inflight is None:
                continue
            self._retries.finished(rid)
            try:
                outcomes = self._on_result(inflight, result, finished_at)
            except Exception as exc:
                outcomes = self._lost(inflight, exc)
            yield from outcomes
        yield from self._start_last_runs()

    def _on_result(
        self, inflight: InFlight, result: GenerationResult, finished_at: float | None = None
    ) -> list[Outcome]:
        """Answer, retry (a failed run: workers.kafka.engine_retries) or drop (partition gone) a
        result."""
        failed = is_failed_run(result)
        plan = self._retries.plan(inflight.attempts) if failed else "give_up"
        final = not failed or plan == "give_up"
        inflight.records = self.life.owned_records(inflight, final=final)
        if not inflight.records:
            self._finish(inflight)  # revoked meanwhile: the partition's new owner answers
            return []
        if plan == "retry":
            return self._rerun(inflight)
        if plan == "last":
            self._retries.queue_last(inflight.request_id)
            return []
        self._finish(inflight)
        if failed:
            error = f"{inflight.attempts} engine runs failed; the last: {result.error}"
            return [DeadLetter(rec, "poison", error, reply_error=True) for rec in inflight.records]
        # an arm's reply says which arm answered: "<engine version>@<arm>" (workers.arms)
        model_version = arm_model_version(self.engine.model_version, self.settings.arm)
        return [Answer(inflight, result, model_version, finished_at)]

    def _rerun(self, inflight: InFlight) -> list[Outcome]:
        """Submit a request whose run failed once more (same records, same deadline)."""
        inflight.attempts += 1
        self.metrics.engine_retries_total.labels(lang=inflight.lang).inc()
        handle, refused = self._start_run(inflight.records[0], inflight.records)
        if handle is None:
            self._finish(inflight)  # each record answered (refused)
        else:
            inflight.handle = handle
        return refused

    def _start_last_runs(self) -> Iterator[Outcome]:
        while (rid := self._retries.take_last()) is not None:
            inflight = self.life.in_engine(rid)
            if inflight is None:
                self._retries.forget(rid)
                continue
            try:
                inflight.records = self.life.owned_records(inflight, final=False)
                if inflight.records:
                    outcomes = self._rerun(inflight)
                else:
                    self._finish(inflight)
                    outcomes = []
            except Exception as exc:  # never leave the last-run slot taken by a lost request
                outcomes = self._lost(inflight, exc)
            yield from outcomes

    def _lost(self, inflight: InFlight, exc: Exception) -> list[Outcome]:
        """Deciding on `inflight` raised: out of the books, its records dead-lettered."""
        self._finish(inflight)
        return [DeadLetter(rec, "poison", exc) for rec in inflight.records]

    def _finish(self, inflight: InFlight) -> None:
        """`inflight` leaves the books (answered, dead-lettered or dropped)."""
        self.life.left_engine(inflight)
        self._retries.forget(inflight.request_id)
