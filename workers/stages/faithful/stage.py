"""`FaithfulEngine`: a `TranslationEngine` that caps each translation's length by its source and
checks every answer for leaked examples, length outliers and loops (issue #18).

Flow of one request:

1. The length guard: the source's tokens (`count_tokens`) give the pair's cap
   (`workers.stages.faithful.rules.LengthCaps`, fitted on data/ per tokenizer); the inner engine
   runs with
   `max_new_tokens` = the tighter of that cap and the language's own.
2. The answer is checked (`workers.stages.faithful.rules.check`): a copied few-shot example, a
   length ratio outside [0.3, 3], an n-gram loop, a stop at the guard's cap (the guard was
   tighter than `max_new_tokens` and generation reached it), or a number the source does not
   hold (`numbers.py`: an amount, a time or a count a customer would take as a promise), or
   an answer confidently in the source language or a third one (`language.py`: lingua among
   the pair's, the worker's and a few common languages; short answers never called), or a
   proper name of the source missing (`names.py`, the mildest problem).
   Nothing found: the answer goes out unchanged.
3. Something found: the text is translated once more under `<id>~faithful`, same deadline and
   cap, with the template's retry form (`prompts.json` `retry_form`, `short_mix8` for both
   templates: for Gemma 3 another example set, so not the same example to copy; for SmolLM2
   the same examples without the per-turn instruction of its default; zero-shot made the base
   model copy or answer the source, docs/PROMPTS.md; the builder passes it: `retry_form`).
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
   An answer whose only problems are `FLAG_ONLY` (a dropped name) goes out flagged under
   either policy: that check is right 4 times in 5, too few to keep an answer from a customer.

Every suspect answer's reply says so in `GenerationResult.notes` (-> the reply's `metadata`):
`tolk.faithful` = the outcome, `tolk.faithful.first` = what the first run's checks found
(`leak,ratio`), `tolk.faithful.problems` = what the answer still has (flagged / withheld),
`tolk.faithful.candidate` = the withheld text, and
`tolk.finish_reason` = `length_guard` when the answer stopped at the guard's cap (the reply
builder keeps that finer reason over its plain `length`). Counted per language once the worker
binds its metrics: `tolk_faithful_checks_total{lang, check}` (each detector firing on a first
run) and `tolk_faithful_outcomes_total{lang, outcome}`; always in `FaithfulEngine.checks` and
`.outcomes`.

Its place in the pipeline is workers/serving/pipeline.py's: inside span protection and the
cache, outside retrieved examples (the retry gets the same examples). Its rerun is a
`workers.stages.retry.RetryJob`'s (one shape for the three stages that retry). A failed run
(ERROR, EXPIRED, CANCELLED) passes through unchanged. Callbacks run on the inner engine's
thread: a few string comparisons, one lingua call (~1 ms) and at most one submit.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from workers import reply_metadata as meta
from workers.engine.prompts import prompt_examples
from workers.engine.types import (
    FinishReason,
    GenerationResult,
    RequestHandle,
    TranslationEngine,
    TranslationRequest,
)
from workers.stages.faithful.rules import Check, LengthCaps, check
from workers.stages.retry import RetryJob
from workers.stages.wrapper import EngineWrapper, merged_runs

log = logging.getLogger(__name__)

__all__ = [
    "CANDIDATE_KEY",
    "CHECKS",
    "GUARD_REASON",
    "NOTE_KEY",
    "OUTCOMES",
    "POLICIES",
    "FaithfulEngine",
]

NOTE_KEY = meta.FAITHFUL  # the reply metadata keys of this stage (workers/reply_metadata.py)
FINISH_REASON_KEY = meta.FINISH_REASON
GUARD_REASON = "length_guard"  # its value on an answer stopped at the guard's cap
OUTCOMES = ("retried", "flagged", "withheld")
POLICIES = ("withhold", "flag")  # what happens to an answer still suspect after the retry
CANDIDATE_KEY = meta.FAITHFUL_CANDIDATE
RETRY_SUFFIX = "~faithful"  # inner request id of the retry
DEFAULT_MAX_NEW_TOKENS = 256  # the engine's default cap when a request names none
_SEVERITY = {
    "leak": 4,
    "wrong_language": 4,
    "untranslated": 3,
    "number": 3,
    "dropped": 3,
    "loop": 2,
    "length_guard": 2,
    "ratio": 1,
    "name": 1,
}
# Problems retried for but never withheld: an answer that still has only these goes out flagged
# under either policy (the names check's precision is 0.80, and it calls 0.4-4 % of human
# translations: docs/PROMPTS.md, "Dropped names")
FLAG_ONLY = frozenset({"name"})
CHECKS = tuple(_SEVERITY)  # every check's name (the `check` label of the checks counter)


class _FaithfulMetrics(Protocol):
    faithful_checks_total: Any  # a prometheus Counter labelled (lang, check)
    faithful_outcomes_total: Any  # a prometheus Counter labelled (lang, outcome)


@dataclass(frozen=True, slots=True)
class _Guard:
    """What the stage keeps about one request (its `RetryJob.state`)."""

    guard_binding: bool  # the length guard's cap is tighter than the language's max_new_tokens


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
        # the template's retry form (the builder passes the engine's `prompts.retry_form`):
        # without one there is no other prompt to retry in, and a suspect answer goes to the
        # policy at once
        self.retry_form = retry_form
        self.retry = retry and retry_form is not None
        self.default_max_new_tokens = default_max_new_tokens
        self._metrics = metrics
        self._lock = threading.Lock()
        self.checks: Counter[tuple[str, str]] = Counter()  # (lang, check) -> count
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (lang, outcome) -> count

    # -- TranslationEngine -------------------------------------------------------------------

    def bind_metrics(self, metrics: _FaithfulMetrics) -> None:
        """Count in the worker's `tolk_faithful_*` counters from now on."""
        self._metrics = metrics

    def length_cap(self, text: str, source_lang: str, target_lang: str) -> int:
        """The length guard's cap of output tokens for this source."""
        cap = self.caps.cap(self.tokenizer_key, source_lang, target_lang)
        return cap.tokens(self.inner.count_tokens(text))

    def submit_translation(self, request: TranslationRequest) -> RequestHandle:
        """Queue one translation under the length guard; its answer is checked when done."""
        requested = request.max_new_tokens or self.default_max_new_tokens
        guard = self.length_cap(request.text, request.source_lang, request.target_lang)
        capped = dataclasses.replace(request, max_new_tokens=min(guard, requested))
        job = RetryJob(capped, _Guard(guard_binding=guard < requested))
        job.run(self.inner, lambda result: self._on_first(job, result))
        return job.handle

    # -- the two runs ---------------------------------------------------------------------------

    def _check(self, job: RetryJob, result: GenerationResult) -> Check:
        hit_guard = job.state.guard_binding and result.finish_reason is FinishReason.LENGTH
        r = job.request
        try:
            return check(
                r.text,
                result.text,
                self.examples,
                r.target_lang,
                length_guard=hit_guard,
                source_lang=r.source_lang,
                languages=self.languages,  # the engine's: more candidates of the language check
            )
        except Exception:  # a detector's bug must not lose the answer: it goes out unchecked
            log.exception("faithfulness checks failed on %s: answered unchecked", r.request_id)
            self._count("checks", r.target_lang, "check_failed")
            return Check()

    def _on_first(self, job: RetryJob, result: GenerationResult) -> None:
        if not result.ok:
            job.resolve(result)  # the worker's retry / deadline rules apply
            return
        first = self._check(job, result)
        if not first.suspect:
            job.resolve(result)
            return
        for name in first.problems:
            self._count("checks", job.request.target_lang, name)
        if job.cancelled or not self.retry:
            self._flag(job, result, first, retry="off" if not self.retry else "cancelled")
            return
        try:  # the same turn, same cap and deadline, in the retry form
            job.rerun(
                self.inner,
                RETRY_SUFFIX,
                lambda second: self._on_retry(job, result, first, second),
                prompt_form=self.retry_form,
            )
        except Exception as exc:  # the engine is stopping: the policy on what we have
            self._flag(job, result, first, retry=f"not submitted: {type(exc).__name__}: {exc}")

    def _on_retry(
        self, job: RetryJob, result: GenerationResult, first: Check, second: GenerationResult
    ) -> None:
        if job.rerun_ended(result, second, lambda ran, why: self._flag(job, ran, first, retry=why)):
            return
        checked = self._check(job, second)
        merged = merged_runs(result, second, job.request.request_id)
        merged = dataclasses.replace(merged, retries=merged.retries + 1)
        if not checked.suspect:
            notes = {NOTE_KEY: "retried", meta.FAITHFUL_FIRST: ",".join(first.problems)}
            answer = dataclasses.replace(merged, notes=notes, faithful="retried")
            self._answer(job, "retried", answer)
            return
        if _severity(checked) < _severity(first):  # the retry is the better of two suspects
            self._flag(job, merged, checked, first=first, retry="suspect too")
        else:  # the first answer, with the work of both runs
            kept = dataclasses.replace(merged, text=result.text, finish_reason=result.finish_reason)
            self._flag(job, kept, first, first=first, retry="suspect too")

    # -- bookkeeping ----------------------------------------------------------------------------

    def _flag(
        self,
        job: RetryJob,
        result: GenerationResult,
        found: Check,
        *,
        first: Check | None = None,
        retry: str,
    ) -> None:
        """The policy on an answer still suspect: withhold it, or send it flagged (always
        flagged when all it still has is `FLAG_ONLY`)."""
        withhold = self.policy == "withhold" and not FLAG_ONLY.issuperset(found.problems)
        outcome = "withheld" if withhold else "flagged"
        notes = {
            NOTE_KEY: outcome,
            meta.FAITHFUL_FIRST: ",".join((first or found).problems),
            meta.FAITHFUL_PROBLEMS: ",".join(found.problems),
            meta.FAITHFUL_RETRY: retry,
        }
        if found.length_guard:
            notes[FINISH_REASON_KEY] = GUARD_REASON
        if outcome == "withheld":
            notes[CANDIDATE_KEY] = result.text
            error = f"unfaithful translation withheld: {','.join(found.problems)} (retry: {retry})"
            result = dataclasses.replace(
                result, text="", finish_reason=FinishReason.WITHHELD, error=error
            )
        result = dataclasses.replace(
            result,
            notes=notes,
            faithful=outcome,
            flagged=outcome == "flagged",
            finish_detail=GUARD_REASON if found.length_guard else result.finish_detail,
        )
        self._answer(job, outcome, result)

    def _count(self, kind: str, lang: str, label: str) -> None:
        with self._lock:
            (self.checks if kind == "checks" else self.outcomes)[(lang, label)] += 1
        if self._metrics is None:
            return
        if kind == "checks":
            self._metrics.faithful_checks_total.labels(lang=lang, check=label).inc()
        else:
            self._metrics.faithful_outcomes_total.labels(lang=lang, outcome=label).inc()

    def _answer(self, job: RetryJob, outcome: str, result: GenerationResult) -> None:
        self._count("outcomes", job.request.target_lang, outcome)
        job.resolve(result)


def _severity(found: Check) -> int:
    return sum(_SEVERITY[name] for name in found.problems)
