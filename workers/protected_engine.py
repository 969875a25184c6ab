"""`ProtectedSpansEngine`: a `TranslationEngine` that masks protected spans before translation
and restores them in the result (the "protected spans" arm option of docs/REPLAY.md).

Flow of one request whose text has spans (`workers.protected_spans.find_spans`):

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
masked request says what happened in `GenerationResult.notes`, which `workers.replies` copies
into the reply's `metadata`: `tolk.protected_spans` = the outcome, plus
`tolk.protected_spans.spans` (how many), `.restore_error` (why restore failed) and
`.preserved` (`found/total` of the answer) where they apply. Each outcome is counted in
`tolk_protected_spans_total{lang, outcome}` once the worker binds its metrics
(`bind_metrics`, called by `Worker`), and always in `ProtectedSpansEngine.outcomes`.

A failed masked run (ERROR, EXPIRED, CANCELLED) is passed on as it is: the worker's own retry
and deadline rules apply to it as to any engine result. The result of a retry carries the
work of both runs: summed tokens and prefill/decode/total times.

Callbacks run on the inner engine's thread: they do a few regex passes and, at most, queue one
more request, so they stay quick. `protect_spans(engine)` is what the CLI calls for
`tolk worker --protect-spans`.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

from workers.engine.types import (
    FinishReason,
    GenerationResult,
    RequestHandle,
    TranslationEngine,
)
from workers.engine_wrapper import EngineWrapper, merged_runs
from workers.protected_spans import (
    MaskConflict,
    Masked,
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
    "protect_spans",
]

NOTE_KEY = "tolk.protected_spans"  # metadata key of the outcome on the reply
OUTCOMES = ("restored", "retried_unmasked", "flagged", "skipped")
RETRY_SUFFIX = "~unmasked"  # inner request id of the unmasked retry


class _SpanMetrics(Protocol):
    protected_spans_total: Any  # a prometheus Counter labelled (lang, outcome)


@dataclass
class _Job:
    """One masked request in flight."""

    request_id: str
    text: str  # the original text
    source_lang: str
    target_lang: str
    deadline: float | None
    max_new_tokens: int | None
    masked: Masked
    handle: RequestHandle  # what the caller holds
    conversation_id: str | None = None
    inner: RequestHandle | None = None  # the inner run now in flight
    cancelled: bool = False


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
        self._jobs: dict[str, _Job] = {}
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (lang, outcome) -> count

    # -- TranslationEngine -------------------------------------------------------------------

    def bind_metrics(self, metrics: _SpanMetrics) -> None:
        """Count outcomes in the worker's `tolk_protected_spans_total` from now on."""
        self._metrics = metrics
        super().bind_metrics(metrics)

    def submit_translation(
        self,
        *,
        request_id: str,
        text: str,
        source_lang: str,
        target_lang: str,
        deadline: float | None = None,
        max_new_tokens: int | None = None,
        conversation_id: str | None = None,
    ) -> RequestHandle:
        """Queue one translation, masked when its text has protected spans."""
        spans = find_spans(text)

        def submit(inner_text: str) -> RequestHandle:
            return self.inner.submit_translation(
                request_id=request_id,
                text=inner_text,
                source_lang=source_lang,
                target_lang=target_lang,
                deadline=deadline,
                max_new_tokens=max_new_tokens,
                conversation_id=conversation_id,
            )

        if not spans:
            return submit(text)
        try:
            masked = mask(text, spans, self.style)
        except MaskConflict:
            return self._skipped(submit(text), target_lang, len(spans))
        handle = RequestHandle(request_id, self._cancel)
        job = _Job(
            request_id,
            text,
            source_lang,
            target_lang,
            deadline,
            max_new_tokens,
            masked,
            handle,
            conversation_id=conversation_id,
        )
        with self._lock:
            self._jobs[request_id] = job
        try:
            job.inner = submit(masked.text)
        except Exception:
            with self._lock:
                self._jobs.pop(request_id, None)
            raise
        job.inner.add_done_callback(lambda result: self._on_masked(job, result))
        return handle

    # -- the two runs ---------------------------------------------------------------------------

    def _on_masked(self, job: _Job, result: GenerationResult) -> None:
        if not result.ok:
            self._resolve(job, result)  # the worker's retry / deadline rules apply
            return
        try:
            text = restore(job.masked, result.text)
        except RestoreError as exc:
            self._retry_unmasked(job, result, exc)
            return
        notes = self._notes(job, "restored")
        self._answer(job, "restored", dataclasses.replace(result, text=text, notes=notes))

    def _retry_unmasked(
        self, job: _Job, masked_result: GenerationResult, exc: RestoreError
    ) -> None:
        with self._lock:
            cancelled = job.cancelled
        if not cancelled:
            try:
                job.inner = self.inner.submit_translation(
                    request_id=job.request_id + RETRY_SUFFIX,
                    text=job.text,
                    source_lang=job.source_lang,
                    target_lang=job.target_lang,
                    deadline=job.deadline,
                    max_new_tokens=job.max_new_tokens,
                    # the same turn of the same conversation, asked again unmasked
                    conversation_id=job.conversation_id,
                )
            except Exception as submit_exc:  # the engine is stopping: answer what we have
                why = f"unmasked retry not submitted: {type(submit_exc).__name__}: {submit_exc}"
                self._flag_masked(job, masked_result, exc, why)
                return
            job.inner.add_done_callback(
                lambda result: self._on_unmasked(job, masked_result, exc, result)
            )
            with self._lock:
                cancel_now = job.cancelled  # cancel() raced with the submit above
            if cancel_now:
                job.inner.cancel()
            return
        self._resolve(job, _cancelled(masked_result, job.request_id))

    def _on_unmasked(
        self,
        job: _Job,
        masked_result: GenerationResult,
        exc: RestoreError,
        result: GenerationResult,
    ) -> None:
        if result.finish_reason is FinishReason.CANCELLED:
            self._resolve(job, merged_runs(masked_result, result, job.request_id))
            return
        if not result.ok:
            why = f"unmasked retry finished {result.finish_reason.value}: {result.error}"
            self._flag_masked(job, masked_result, exc, why)
            return
        found, total = preservation(job.text, result.text)
        outcome = "retried_unmasked" if found == total else "flagged"
        notes = self._notes(job, outcome, restore_error=exc.summary(), preserved=f"{found}/{total}")
        merged = merged_runs(masked_result, result, job.request_id)
        self._answer(job, outcome, dataclasses.replace(merged, notes=notes))

    def _flag_masked(
        self, job: _Job, masked_result: GenerationResult, exc: RestoreError, why: str
    ) -> None:
        """The answer of last resort: the masked translation restored as far as it goes."""
        text = restore(job.masked, masked_result.text, strict=False)
        found, total = preservation(job.text, text)
        notes = self._notes(
            job, "flagged", restore_error=exc.summary(), preserved=f"{found}/{total}", retry=why
        )
        self._answer(job, "flagged", dataclasses.replace(masked_result, text=text, notes=notes))

    # -- bookkeeping ----------------------------------------------------------------------------

    def _notes(self, job: _Job, outcome: str, **extra: str) -> dict[str, str]:
        notes = {NOTE_KEY: outcome, f"{NOTE_KEY}.spans": str(len(job.masked.spans))}
        notes.update({f"{NOTE_KEY}.{k}": v for k, v in extra.items()})
        return notes

    def _count(self, lang: str, outcome: str) -> None:
        with self._lock:
            self.outcomes[(lang, outcome)] += 1
        if self._metrics is not None:
            self._metrics.protected_spans_total.labels(lang=lang, outcome=outcome).inc()

    def _answer(self, job: _Job, outcome: str, result: GenerationResult) -> None:
        self._count(job.target_lang, outcome)
        self._resolve(job, result)

    def _resolve(self, job: _Job, result: GenerationResult) -> None:
        with self._lock:
            self._jobs.pop(job.request_id, None)
        job.handle.set_result(dataclasses.replace(result, request_id=job.request_id))

    def _skipped(self, inner: RequestHandle, lang: str, n_spans: int) -> RequestHandle:
        """The caller's handle for a text translated unmasked because it held mask-like
        tokens: the inner result with a note, counted as `skipped`."""
        handle = RequestHandle(inner.request_id, lambda _rid: inner.cancel())

        def done(result: GenerationResult) -> None:
            if result.ok:
                self._count(lang, "skipped")
                notes = {NOTE_KEY: "skipped", f"{NOTE_KEY}.spans": str(n_spans)}
                result = dataclasses.replace(result, notes=notes)
            handle.set_result(result)

        inner.add_done_callback(done)
        return handle

    def _cancel(self, request_id: str) -> None:
        with self._lock:
            job = self._jobs.get(request_id)
            if job is None:
                return
            job.cancelled = True
            inner = job.inner
        if inner is not None:
            inner.cancel()


def _cancelled(result: GenerationResult, request_id: str) -> GenerationResult:
    return dataclasses.replace(
        result,
        request_id=request_id,
        text="",
        finish_reason=FinishReason.CANCELLED,
        error="cancelled",
    )


def protect_spans(
    engine: TranslationEngine, *, style: MaskStyle | None = None
) -> ProtectedSpansEngine:
    """`engine` with protected spans masked and restored (`tolk worker --protect-spans`)."""
    return ProtectedSpansEngine(engine, style=style)
