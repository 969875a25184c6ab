"""`ProtectedSpansEngine`: a `TranslationEngine` that masks protected spans before translation
and restores them in the result (the "protected spans" arm option of docs/REPLAY.md).

Flow of one request whose text has spans (`workers.text.spans.find_spans`):

1. The masked text (`Order <x1> arrives at <x2>`) goes to the inner engine under the request's
   own id.
2. Its result is restored with verification (`restore`, strict). Success: the reply carries
   the restored text; outcome `restored`.
3. Restore failed (a token missing, duplicated, unknown or mangled): the original text goes to
   the inner engine once more, unmasked, under `<id>~unmasked`, with the same deadline. Its
   translation is the answer. If it carries every source span exactly (`preservation`), the
   outcome is `retried_unmasked`; if not, or if the retry could not run or failed (deadline,
   engine error), the reply is still sent but flagged: outcome `flagged`, the best text we
   have (the unmasked one, else the masked one restored as far as it goes).

A text without spans passes straight through (no wrapper handle, no notes, no count). A text
that already contains mask-like tokens is translated unmasked (`skipped`). Every reply of a
masked request says what happened in `GenerationResult.notes`, which `workers.kafka.replies` copies
into the reply's `metadata`: `tolk.protected_spans` = the outcome, plus
`tolk.protected_spans.spans` (how many), `.restore_error` (why restore failed) and
`.preserved` (`found/total` of the answer) where they apply. Each outcome is counted in
`tolk_protected_spans_total{lang, outcome}` once the worker binds its metrics
(`bind_metrics`, called by `Worker`), and always in `ProtectedSpansEngine.outcomes`.

A failed masked run (ERROR, EXPIRED, CANCELLED) is passed on as it is: the worker's own retry
and deadline rules apply to it as to any engine result. The result of a retry carries the
work of both runs: summed tokens and prefill/decode/total times.

Callbacks run on the inner engine's thread: they do a few regex passes and, at most, queue one
more request (a `workers.stages.retry.RetryJob` rerun), so they stay quick. `tolk worker
--protect-spans` turns it on; its place in the pipeline is workers/serving/pipeline.py's.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from typing import Any, Protocol

from workers import reply_metadata as meta
from workers.engine.types import (
    FinishReason,
    GenerationResult,
    RequestHandle,
    TranslationEngine,
    TranslationRequest,
)
from workers.stages.retry import RetryJob
from workers.stages.wrapper import EngineWrapper, merged_runs
from workers.text.spans import (
    MaskConflict,
    MaskStyle,
    RestoreError,
    find_spans,
    mask,
    preservation,
    restore,
    style_for_model,
)

__all__ = [
    "NOTE_KEY",
    "OUTCOMES",
    "ProtectedSpansEngine",
]

NOTE_KEY = meta.SPANS  # the outcome's reply metadata key (workers/reply_metadata.py)
OUTCOMES = ("restored", "retried_unmasked", "flagged", "skipped")
RETRY_SUFFIX = "~unmasked"  # inner request id of the unmasked retry


class _SpanMetrics(Protocol):
    protected_spans_total: Any  # a prometheus Counter labelled (lang, outcome)


class ProtectedSpansEngine(EngineWrapper):
    """Wraps a `TranslationEngine`; masks spans before `submit_translation`, restores after."""

    def __init__(
        self,
        inner: TranslationEngine,
        *,
        style: MaskStyle | None = None,
        metrics: _SpanMetrics | None = None,
    ) -> None:
        self.inner = inner
        # None: the form the inner engine's model copied best (measured, docs/REPLAY.md)
        self.style = style if style is not None else style_for_model(inner.model_version)
        self._metrics = metrics
        self._lock = threading.Lock()
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (lang, outcome) -> count

    # -- TranslationEngine -------------------------------------------------------------------

    def bind_metrics(self, metrics: _SpanMetrics) -> None:
        """Count outcomes in the worker's `tolk_protected_spans_total` from now on."""
        self._metrics = metrics

    def submit_translation(self, request: TranslationRequest) -> RequestHandle:
        """Queue one translation, masked when its text has protected spans."""
        spans = find_spans(request.text)
        if not spans:
            return self.inner.submit_translation(request)
        try:
            masked = mask(request.text, spans, self.style)
        except MaskConflict:
            inner = self.inner.submit_translation(request)
            return self._skipped(inner, request.target_lang, len(spans))
        job = RetryJob(request, masked)  # the masked text under the request's own id
        job.run(
            self.inner,
            lambda result: self._on_masked(job, result),
            dataclasses.replace(request, text=masked.text),
        )
        return job.handle

    # -- the two runs ---------------------------------------------------------------------------

    def _on_masked(self, job: RetryJob, result: GenerationResult) -> None:
        if not result.ok:
            job.resolve(result)  # the worker's retry / deadline rules apply
            return
        try:
            text = restore(job.state, result.text)
        except RestoreError as exc:
            self._retry_unmasked(job, result, exc)
            return
        notes = self._notes(job, "restored")
        answer = dataclasses.replace(result, text=text, notes=notes, spans="restored")
        self._answer(job, "restored", answer)

    def _retry_unmasked(
        self, job: RetryJob, masked_result: GenerationResult, exc: RestoreError
    ) -> None:
        if job.cancelled:
            job.resolve(_cancelled(masked_result, job.request.request_id))
            return
        try:  # the same turn of the same conversation, asked again unmasked
            job.rerun(
                self.inner,
                RETRY_SUFFIX,
                lambda result: self._on_unmasked(job, masked_result, exc, result),
            )
        except Exception as submit_exc:  # the engine is stopping: answer what we have
            why = f"unmasked retry not submitted: {type(submit_exc).__name__}: {submit_exc}"
            self._flag_masked(job, masked_result, exc, why)

    def _on_unmasked(
        self,
        job: RetryJob,
        masked_result: GenerationResult,
        exc: RestoreError,
        result: GenerationResult,
    ) -> None:
        def failed(ran: GenerationResult, why: str) -> None:
            self._flag_masked(job, ran, exc, f"unmasked retry {why}")

        if job.rerun_ended(masked_result, result, failed):
            return
        found, total = preservation(job.request.text, result.text)
        outcome = "retried_unmasked" if found == total else "flagged"
        notes = self._notes(job, outcome, restore_error=exc.summary(), preserved=f"{found}/{total}")
        merged = merged_runs(masked_result, result, job.request.request_id)
        answer = dataclasses.replace(
            merged,
            notes=notes,
            spans=outcome,
            retries=merged.retries + 1,
            flagged=outcome == "flagged",
        )
        self._answer(job, outcome, answer)

    def _flag_masked(
        self, job: RetryJob, masked_result: GenerationResult, exc: RestoreError, why: str
    ) -> None:
        """The answer of last resort: the masked translation restored as far as it goes."""
        text = restore(job.state, masked_result.text, strict=False)
        found, total = preservation(job.request.text, text)
        notes = self._notes(
            job, "flagged", restore_error=exc.summary(), preserved=f"{found}/{total}", retry=why
        )
        answer = dataclasses.replace(
            masked_result, text=text, notes=notes, spans="flagged", flagged=True
        )
        self._answer(job, "flagged", answer)

    # -- bookkeeping ----------------------------------------------------------------------------

    def _notes(
        self,
        job: RetryJob,
        outcome: str,
        *,
        restore_error: str | None = None,
        preserved: str | None = None,
        retry: str | None = None,
    ) -> dict[str, str]:
        notes = {NOTE_KEY: outcome, meta.SPANS_COUNT: str(len(job.state.spans))}
        for key, value in (
            (meta.SPANS_RESTORE_ERROR, restore_error),
            (meta.SPANS_PRESERVED, preserved),
            (meta.SPANS_RETRY, retry),
        ):
            if value is not None:
                notes[key] = value
        return notes

    def _count(self, lang: str, outcome: str) -> None:
        with self._lock:
            self.outcomes[(lang, outcome)] += 1
        if self._metrics is not None:
            self._metrics.protected_spans_total.labels(lang=lang, outcome=outcome).inc()

    def _answer(self, job: RetryJob, outcome: str, result: GenerationResult) -> None:
        self._count(job.request.target_lang, outcome)
        job.resolve(result)

    def _skipped(self, inner: RequestHandle, lang: str, n_spans: int) -> RequestHandle:
        """The caller's handle for a text translated unmasked because it held mask-like
        tokens: the inner result with a note, counted as `skipped`."""
        handle = RequestHandle(inner.request_id, lambda _rid: inner.cancel())

        def done(result: GenerationResult) -> None:
            if result.ok:
                self._count(lang, "skipped")
                notes = {NOTE_KEY: "skipped", meta.SPANS_COUNT: str(n_spans)}
                result = dataclasses.replace(result, notes=notes, spans="skipped")
            handle.set_result(result)

        inner.add_done_callback(done)
        return handle


def _cancelled(result: GenerationResult, request_id: str) -> GenerationResult:
    return dataclasses.replace(
        result,
        request_id=request_id,
        text="",
        finish_reason=FinishReason.CANCELLED,
        error="cancelled",
    )
