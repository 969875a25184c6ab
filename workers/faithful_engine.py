"""`FaithfulEngine`: a `TranslationEngine` that caps each translation's length by its source and
checks every answer for leaked examples, length outliers and loops (issue #18).

Flow of one request:

1. The length guard: the source's tokens (`count_tokens`) give the pair's cap
   (`workers.faithful.LengthCaps`, fitted on data/ per tokenizer); the inner engine runs with
   `max_new_tokens` = the tighter of that cap and the language's own.
2. The answer is checked (`workers.faithful.check`): a copied few-shot example, a length ratio
   outside [0.3, 3], an n-gram loop, or a stop at the guard's cap (the guard was tighter than
   `max_new_tokens` and generation reached it). Nothing found: the answer goes out unchanged.
3. Something found: the text is translated once more under `<id>~faithful`, same deadline and
   cap, with the template's retry form (`prompts.json` `retry_form`, `short_mix8` for both
   templates: for Gemma 3 another example set, so not the same example to copy; for SmolLM2
   the same examples without the per-turn instruction of its default; zero-shot made the base
   model copy or answer the source, docs/PROMPTS.md), if the inner engine takes `prompt_form`.
   A clean retry is the answer (outcome `retried`); otherwise the better of the two (fewer and
   milder problems; a leak is the worst) is what the policy handles. Without retries
   (`retry=False`) a suspect answer goes to the policy at once.
4. The policy for an answer still suspect (`policy`, `tolk worker --faithful-policy`):
   - `withhold` (the default): no translation goes out. The result finishes `WITHHELD` (the
     reply's status ERROR, its error "unfaithful translation withheld: ratio (retry: suspect
     too)"), the candidate text in the notes (`tolk.faithful.candidate`), outcome `withheld`.
     A support bot that shows a customer a promise nobody made is worse than no translation
     (issue #18): the client gets the reason and decides (show the source, ask a human, or
     show the candidate marked as unchecked). Measured: with Gemma 3 270M 2 of 800 benchmark
     answers are still suspect after the retry; with SmolLM2-135M 57 of 800 (12-13 % of the
     chat turns; docs/BENCHMARKS.md, "Third round").
   - `flag`: the candidate goes out as the translation, flagged (outcome `flagged`).

Every suspect answer's reply says so in `GenerationResult.notes` (-> the reply's `metadata`):
`tolk.faithful` = the outcome, `tolk.faithful.first` = what the first run's checks found
(`leak,ratio`), `tolk.faithful.problems` = what the answer still has (flagged / withheld),
`tolk.faithful.candidate` = the withheld text, and
`tolk.finish_reason` = `length_guard` when the answer stopped at the guard's cap (the reply
builder keeps that finer reason over its plain `length`). Counted per language once the worker
binds its metrics: `tolk_faithful_checks_total{lang, check}` (each detector firing on a first
run) and `tolk_faithful_outcomes_total{lang, outcome}`; always in `FaithfulEngine.checks` and
`.outcomes`.

Compose it innermost, right around the engine (`faithful(engine)` in `tolk worker`, before
`--protect-spans` wraps it): its retry asks the inner engine for another prompt form, which only
the engine itself offers. A failed run (ERROR, EXPIRED, CANCELLED) passes through unchanged.
Callbacks run on the inner engine's thread: a few string comparisons and at most one submit.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from workers.engine.prompts import prompt_examples
from workers.engine.types import (
    FinishReason,
    GenerationResult,
    RequestHandle,
    TranslationEngine,
)
from workers.engine_wrapper import EngineWrapper, merged_runs
from workers.faithful import Check, LengthCaps, check

__all__ = [
    "CANDIDATE_KEY",
    "CHECKS",
    "GUARD_REASON",
    "NOTE_KEY",
    "OUTCOMES",
    "POLICIES",
    "FaithfulEngine",
    "faithful",
]

NOTE_KEY = "tolk.faithful"  # metadata key of the outcome on a suspect answer's reply
FINISH_REASON_KEY = "tolk.finish_reason"  # = workers.replies.FINISH_REASON_KEY
GUARD_REASON = "length_guard"  # its value on an answer stopped at the guard's cap
CHECKS = ("leak", "ratio", "loop", "length_guard")
OUTCOMES = ("retried", "flagged", "withheld")
POLICIES = ("withhold", "flag")  # what happens to an answer still suspect after the retry
CANDIDATE_KEY = "tolk.faithful.candidate"  # metadata key of a withheld answer's text
RETRY_SUFFIX = "~faithful"  # inner request id of the retry
DEFAULT_MAX_NEW_TOKENS = 256  # the engine's default cap when a request names none
_SEVERITY = {"leak": 4, "loop": 2, "length_guard": 2, "ratio": 1}


class _FaithfulMetrics(Protocol):
    faithful_checks_total: Any  # a prometheus Counter labelled (lang, check)
    faithful_outcomes_total: Any  # a prometheus Counter labelled (lang, outcome)


@dataclass
class _Job:
    """One request in flight."""

    request_id: str
    text: str
    source_lang: str
    target_lang: str
    deadline: float | None
    cap: int  # max_new_tokens the inner engine runs with
    guard_binding: bool  # the length guard's cap is tighter than the language's max_new_tokens
    handle: RequestHandle  # what the caller holds
    conversation_id: str | None = None
    inner: RequestHandle | None = None  # the inner run now in flight
    cancelled: bool = False


class FaithfulEngine(EngineWrapper):
    """Wraps a `TranslationEngine` with the length guard and the faithfulness checks."""

    def __init__(
        self,
        inner: TranslationEngine,
        *,
        caps: LengthCaps | None = None,
        examples: Sequence[Mapping[str, str]] | None = None,
        retry: bool = True,
        retry_form: str | None = None,
        policy: str = "withhold",
        default_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        metrics: _FaithfulMetrics | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.inner = inner
        self.caps = caps if caps is not None else LengthCaps.packaged()
        self.tokenizer_key = self.caps.for_model(inner.model_version)
        self.examples = list(examples) if examples is not None else prompt_examples()
        params = inspect.signature(inner.submit_translation).parameters
        self.retry_form = retry_form or _retry_form_of(inner)
        # a retry needs another prompt form, which only an engine taking `prompt_form` gives
        self.retry = retry and "prompt_form" in params and self.retry_form is not None
        self.default_max_new_tokens = default_max_new_tokens
        self._metrics = metrics
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}
        self.checks: Counter[tuple[str, str]] = Counter()  # (lang, check) -> count
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (lang, outcome) -> count

    # -- TranslationEngine -------------------------------------------------------------------

    def bind_metrics(self, metrics: _FaithfulMetrics) -> None:
        """Count in the worker's `tolk_faithful_*` counters from now on (and pass the metrics
        on to an inner wrapper that counts too)."""
        self._metrics = metrics
        super().bind_metrics(metrics)

    def length_cap(self, text: str, source_lang: str, target_lang: str) -> int:
        """The length guard's cap of output tokens for this source."""
        cap = self.caps.cap(self.tokenizer_key, source_lang, target_lang)
        return cap.tokens(self.inner.count_tokens(text))

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
        """Queue one translation under the length guard; its answer is checked when done."""
        requested = max_new_tokens or self.default_max_new_tokens
        guard = self.length_cap(text, source_lang, target_lang)
        job = _Job(
            request_id,
            text,
            source_lang,
            target_lang,
            deadline,
            cap=min(guard, requested),
            guard_binding=guard < requested,
            handle=RequestHandle(request_id, self._cancel),
            conversation_id=conversation_id,
        )
        with self._lock:
            self._jobs[request_id] = job
        try:
            job.inner = self.inner.submit_translation(
                request_id=request_id,
                text=text,
                source_lang=source_lang,
                target_lang=target_lang,
                deadline=deadline,
                max_new_tokens=job.cap,
                conversation_id=conversation_id,
            )
        except Exception:
            with self._lock:
                self._jobs.pop(request_id, None)
            raise
        job.inner.add_done_callback(lambda result: self._on_first(job, result))
        return job.handle

    # -- the two runs ---------------------------------------------------------------------------

    def _check(self, job: _Job, result: GenerationResult) -> Check:
        hit_guard = job.guard_binding and result.finish_reason is FinishReason.LENGTH
        return check(job.text, result.text, self.examples, job.target_lang, length_guard=hit_guard)

    def _on_first(self, job: _Job, result: GenerationResult) -> None:
        if not result.ok:
            self._resolve(job, result)  # the worker's retry / deadline rules apply
            return
        first = self._check(job, result)
        if not first.suspect:
            self._resolve(job, result)
            return
        for name in first.problems:
            self._count("checks", job.target_lang, name)
        with self._lock:
            cancelled = job.cancelled
        if cancelled or not self.retry:
            self._flag(job, result, first, retry="off" if not self.retry else "cancelled")
            return
        try:
            job.inner = self.inner.submit_translation(  # type: ignore[call-arg]
                request_id=job.request_id + RETRY_SUFFIX,
                text=job.text,
                source_lang=job.source_lang,
                target_lang=job.target_lang,
                deadline=job.deadline,
                max_new_tokens=job.cap,
                prompt_form=self.retry_form,
                # the same turn: passed on, though the base engine's history hook gives the
                # retry form no history (workers/context_engine.py)
                conversation_id=job.conversation_id,
            )
        except Exception as exc:  # the engine is stopping: the policy on what we have
            self._flag(job, result, first, retry=f"not submitted: {type(exc).__name__}: {exc}")
            return
        job.inner.add_done_callback(lambda second: self._on_retry(job, result, first, second))
        with self._lock:
            cancel_now = job.cancelled  # cancel() raced with the submit above
        if cancel_now:
            job.inner.cancel()

    def _on_retry(
        self, job: _Job, result: GenerationResult, first: Check, second: GenerationResult
    ) -> None:
        if second.finish_reason is FinishReason.CANCELLED:
            self._resolve(job, merged_runs(result, second, job.request_id))
            return
        if not second.ok:
            why = f"finished {second.finish_reason.value}: {second.error}"
            self._flag(job, result, first, retry=why)
            return
        checked = self._check(job, second)
        merged = merged_runs(result, second, job.request_id)
        if not checked.suspect:
            notes = {NOTE_KEY: "retried", f"{NOTE_KEY}.first": ",".join(first.problems)}
            self._answer(job, "retried", dataclasses.replace(merged, notes=notes))
            return
        if _severity(checked) < _severity(first):  # the retry is the better of two suspects
            self._flag(job, merged, checked, first=first, retry="suspect too")
        else:  # the first answer, with the work of both runs
            kept = dataclasses.replace(merged, text=result.text, finish_reason=result.finish_reason)
            self._flag(job, kept, first, first=first, retry="suspect too")

    # -- bookkeeping ----------------------------------------------------------------------------

    def _flag(
        self,
        job: _Job,
        result: GenerationResult,
        found: Check,
        *,
        first: Check | None = None,
        retry: str,
    ) -> None:
        """The policy on an answer still suspect: withhold it, or send it flagged."""
        outcome = "withheld" if self.policy == "withhold" else "flagged"
        notes = {
            NOTE_KEY: outcome,
            f"{NOTE_KEY}.first": ",".join((first or found).problems),
            f"{NOTE_KEY}.problems": ",".join(found.problems),
            f"{NOTE_KEY}.retry": retry,
        }
        if found.length_guard:
            notes[FINISH_REASON_KEY] = GUARD_REASON
        if outcome == "withheld":
            notes[CANDIDATE_KEY] = result.text
            error = f"unfaithful translation withheld: {','.join(found.problems)} (retry: {retry})"
            result = dataclasses.replace(
                result, text="", finish_reason=FinishReason.WITHHELD, error=error
            )
        self._answer(job, outcome, dataclasses.replace(result, notes=notes))

    def _count(self, kind: str, lang: str, label: str) -> None:
        with self._lock:
            (self.checks if kind == "checks" else self.outcomes)[(lang, label)] += 1
        if self._metrics is None:
            return
        if kind == "checks":
            self._metrics.faithful_checks_total.labels(lang=lang, check=label).inc()
        else:
            self._metrics.faithful_outcomes_total.labels(lang=lang, outcome=label).inc()

    def _answer(self, job: _Job, outcome: str, result: GenerationResult) -> None:
        self._count("outcomes", job.target_lang, outcome)
        self._resolve(job, result)

    def _resolve(self, job: _Job, result: GenerationResult) -> None:
        with self._lock:
            self._jobs.pop(job.request_id, None)
        job.handle.set_result(dataclasses.replace(result, request_id=job.request_id))

    def _cancel(self, request_id: str) -> None:
        with self._lock:
            job = self._jobs.get(request_id)
            if job is None:
                return
            job.cancelled = True
            inner = job.inner
        if inner is not None:
            inner.cancel()


def _severity(found: Check) -> int:
    return sum(_SEVERITY[name] for name in found.problems)


def _retry_form_of(engine: Any) -> str | None:
    """The retry form of the engine's prompt builder (an `Engine`, or one a wrapper holds)."""
    for candidate in (engine, getattr(engine, "engine", None)):
        prompts = getattr(candidate, "prompts", None)
        form = getattr(prompts, "retry_form", None)
        if isinstance(form, str):
            return form
    return None


def faithful(engine: TranslationEngine, **kwargs: Any) -> FaithfulEngine:
    """`engine` under the length guard and the faithfulness checks (on by default in `tolk
    worker`; `--no-faithful` leaves it out)."""
    return FaithfulEngine(engine, **kwargs)
