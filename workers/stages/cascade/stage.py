"""`CascadeEngine`: the small model answers; the large model only where the small one is likely
wrong, if the request's deadline still allows it (issue #44, `tolk worker --cascade MODEL`).

Flow of one request:

1. The small model (the stages inside, down to the fair engine) translates it. With a total
   signal (`small_total`) it stops early (`TranslationRequest.stop_below`,
   `FinishReason.BELOW`) as soon as its answer's log-probability so far falls under the pair's
   threshold: the request is deferred (reason `early`), the verdict the whole answer would have
   had (a sum of log-probabilities only falls), without the rest of the small decoding that
   nobody would read; deferred requests are the longest ones, the tail of the latency. Only when
   the deadline leaves time for the small answer, the large one and the small one again.
2. A failed or cancelled small run passes through unchanged. Otherwise the answer is checked
   (`workers.stages.faithful.rules.check`: wrong language, an invented number, a dropped span or
   name, a copied example, a loop): a doubted answer is deferred without a score.
3. Else it is scored. The small model's own signals (`small_logprob`, `small_total`) come with
   its answer: the stage asks for the generated tokens' log-probabilities
   (`TranslationRequest.logprobs`; the sampler keeps each token's log-softmax, the LM head's
   screen off for those rows), the values teacher forcing gives for the same tokens. The
   large model's (`large_logprob`), or a small answer without them, take one prefill of
   `Engine.score_request` on the scoring engine, no decoding (the small model's through its
   fair engine, `FairScoring`). Below its pair's threshold (`CascadeThresholds.decide`) it is
   deferred; else the small answer goes out (`small`).
4. A deferred request is translated by the large model under `<id>~cascade`, with the same
   deadline and its own default prompt form. Its answer goes out (`deferred`), carrying the work
   of both runs.
5. Whenever the deadline leaves too little time for what is left (the scoring, then the large
   model's translation, each estimated by `LargeRunTimes` in accounting.py: a moving average
   of what they took, from priors), and when the large run fails or expires, the small answer
   goes out **flagged** (`deadline`): never an EXPIRED reply for a request the small model
   answered. After an early deferral there is no small answer yet: the small model answers
   again, whole (`<id>~small`), and the large run's deadline keeps back the time for that
   (`LargeRunTimes`' "small" estimate). A large run is charged to the language's fair share
   (accounting.py).

The reply says what happened (`workers/reply_metadata.py`): `tolk.cascade` = small / deferred /
deadline, `tolk.cascade.score` (when computed) and `tolk.cascade.reason` (score, early, check,
late, failed); the worker's metrics count `tolk_cascade_outcomes_total{lang, outcome}` and observe
`tolk_cascade_score{lang}`.

Its place (workers/serving/pipeline.py): innermost, directly around the fair engine of the
small model, so the faithfulness stage outside checks whichever answer goes out and the cache
keys answers by the cascade (`key_note`). The large model's engine is the stage's own: it
starts and stops with it, and it yields to the small model's (`Engine.yields_to`, set by the
builder): it takes a step only while the small engine has nothing unfinished, so the small
answers, most requests' latency, never share the cores with a large step, and a deferred run
fills the small model's gaps (a deadline it then misses sends the small answer, step 5).
Callbacks run on the engines' threads: a check (~1 ms) and at most one submit each.

One concern: the life of one request between the two models (the runs, the verdict, the
fallbacks and what the reply says of them); the rule and its calibration are rules.py, the
costs and the fair share accounting.py.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
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
from workers.stages.cascade.accounting import (
    LargeRunTimes,
    Scorer,
    SmallQueueCharge,
)
from workers.stages.cascade.rules import SCORER, CascadeThresholds, Deferral, signal_value
from workers.stages.faithful.rules import check
from workers.stages.retry import RetryJob
from workers.stages.wrapper import EngineWrapper, merged_runs

log = logging.getLogger(__name__)

__all__ = ["OUTCOMES", "CascadeEngine", "CascadeSetup"]

OUTCOMES = ("small", "deferred", "deadline")
SUFFIX = "~cascade"  # the large model's request id
SCORE_SUFFIX = "~score"
SMALL_SUFFIX = "~small"  # the small model's whole answer after an early deferral's failed run


class _CascadeMetrics(Protocol):
    cascade_outcomes_total: Any  # a prometheus Counter labelled (lang, outcome)
    cascade_score: Any  # a prometheus Histogram labelled (lang)


@dataclass(frozen=True, slots=True)
class CascadeSetup:
    """What `tolk worker --cascade` builds for the stage (workers/worker_start.py): the large
    model's engine and the thresholds; the pipeline's builder makes the stage of it."""

    large: Any  # workers.engine.engine.Engine
    thresholds: CascadeThresholds
    early: bool = True  # early deferral (module notes, step 1; `--no-cascade-early`: off)


@dataclass(slots=True)
class _Job:
    """What the stage keeps about one request (its `RetryJob.state`)."""

    small: GenerationResult | None = None
    deferral: Deferral | None = None
    started: float = 0.0  # when the current large-model run was submitted
    # the small run stopped early (`FinishReason.BELOW`): `small` is a partial answer, never
    # sent; a fallback needs the small model's whole answer first
    partial: bool = False


class CascadeEngine(EngineWrapper):
    """Wraps the small model's engine with the deferral to a large one (module notes)."""

    def __init__(
        self,
        inner: TranslationEngine,
        *,
        large: Any,  # the large model's Engine: submit_translation, score_request, submit
        thresholds: CascadeThresholds,
        small_scorer: Scorer | None = None,  # the small model's Engine (small_logprob)
        times: LargeRunTimes | None = None,
        examples: Sequence[Mapping[str, str]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics: _CascadeMetrics | None = None,
        charge: SmallQueueCharge | None = None,  # the small model's fair share (module notes)
        early: bool = True,  # stop a small answer whose total falls under the threshold
    ) -> None:
        by_small = SCORER[thresholds.signal] == "small"
        if by_small and small_scorer is None:
            raise ValueError(
                f"the {thresholds.signal} signal needs the small model's engine to score"
            )
        self.inner = inner
        self.large = large
        self.thresholds = thresholds
        self.scorer: Scorer = small_scorer if by_small else large  # type: ignore[assignment]
        self.times = times or LargeRunTimes()
        self.examples = list(examples) if examples is not None else prompt_examples()
        self.clock = clock
        self._metrics = metrics
        self.charge = charge
        self._by_small = by_small
        # early deferral needs a signal that only falls as the answer grows (a total)
        self.early = early and by_small and thresholds.signal.endswith("_total")
        self._lock = threading.Lock()
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (lang, outcome) -> count
        share = thresholds.defer_share
        self.key_note = (
            f"cascade={large.model_version},signal={thresholds.signal},"
            f"share={'' if share is None else f'{share:g}'}"
        )

    # -- TranslationEngine -------------------------------------------------------------------

    def start(self) -> None:
        self.large.start()
        self.inner.start()

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        self.inner.stop(drain=drain, timeout=timeout)
        self.large.stop(drain=drain, timeout=timeout)

    def bind_metrics(self, metrics: _CascadeMetrics) -> None:
        self._metrics = metrics

    def submit_translation(self, request: TranslationRequest) -> RequestHandle:
        if self._by_small:  # the small model's signal read off its own generation
            stop = self._stop_below(request)
            request = dataclasses.replace(request, logprobs=True, stop_below=stop)
        job = RetryJob(request, _Job())
        job.run(self.inner, lambda result: self._on_small(job, result))
        return job.handle

    # -- the runs -------------------------------------------------------------------------------

    def _stop_below(self, r: TranslationRequest) -> float | None:
        """The threshold at which the small run stops early (module notes, step 1), when the
        deadline leaves time for the small answer, the large one and, should the large run
        fail, the small answer again."""
        if not self.early or not self.times.fits(
            r.deadline, self.clock(), "small", "translate", "small"
        ):
            return None
        return self.thresholds.threshold(r.source_lang, r.target_lang)

    def _on_small(self, job: RetryJob, small: GenerationResult) -> None:
        state: _Job = job.state
        state.small = small
        r = job.request
        if small.finish_reason is FinishReason.BELOW:
            self._on_below(job, small)
            return
        if not small.ok or job.cancelled:
            job.resolve(small)
            return
        self.times.record("small", small.timings.total_s)
        self.times.record_run("small", small)
        if self._suspect(r, small):
            state.deferral = Deferral(True, "check", None, None)
            self._defer(job)
            return
        if self._by_small and small.logprob is not None and small.scored_tokens > 0:
            self._decide(job, small.logprob, small.scored_tokens)  # no second pass
            return
        if not self.times.fits(r.deadline, self.clock(), "score", "translate"):
            self._late(job, "late")
            return
        try:
            scoring = self.scorer.score_request(
                r.text, r.source_lang, r.target_lang, small.text,
                request_id=r.request_id + SCORE_SUFFIX, deadline=r.deadline,
            )  # fmt: skip
            state.started = self.clock()
            self.scorer.submit(scoring).add_done_callback(lambda s: self._on_score(job, s))
        except Exception as exc:  # the large engine is stopping, or the answer has no tokens
            log.warning("cascade: %s not scored (%s): the small answer", r.request_id, exc)
            self._late(job, "failed")

    def _on_score(self, job: RetryJob, scored: GenerationResult) -> None:
        state: _Job = job.state
        r = job.request
        if not self._by_small:
            self._charge_large(r.target_lang, scored)
        if not scored.ok or scored.logprob is None:
            self._late(job, "late" if _refused_for_time(scored) else "failed")
            return
        self.times.record("score", self.clock() - state.started)
        self._decide(job, scored.logprob, scored.scored_tokens)

    def _on_below(self, job: RetryJob, partial: GenerationResult) -> None:
        """The small answer's total fell under its pair's threshold before it was finished:
        deferred, as the whole answer would have been (its total can only fall further)."""
        state: _Job = job.state
        r = job.request
        state.partial = True
        if job.cancelled:
            job.resolve(_cancelled(partial))
            return
        self.times.record_run("small", partial)
        score = signal_value(self.thresholds.signal, partial.logprob or 0.0, partial.scored_tokens)
        if self._metrics is not None:
            self._metrics.cascade_score.labels(lang=r.target_lang).observe(score)
        limit = self.thresholds.threshold(r.source_lang, r.target_lang)
        state.deferral = Deferral(True, "early", score, limit)
        if not self.times.fits(r.deadline, self.clock(), "translate", "small"):
            self._late(job, "late")
            return
        self._defer(job)

    def _decide(self, job: RetryJob, logprob: float, tokens: int) -> None:
        """The threshold's verdict on a score: keep the small answer, or defer if it fits."""
        state: _Job = job.state
        r = job.request
        if self._metrics is not None:
            self._metrics.cascade_score.labels(lang=r.target_lang).observe(logprob)
        value = signal_value(self.thresholds.signal, logprob, tokens)
        state.deferral = self.thresholds.decide(r.source_lang, r.target_lang, value)
        if not state.deferral.defer:
            assert state.small is not None
            self._answer(job, "small", self._noted(state.small, "small", state.deferral))
            return
        if job.cancelled or not self.times.fits(r.deadline, self.clock(), "translate"):
            self._late(job, "late")
            return
        self._defer(job)

    def _defer(self, job: RetryJob) -> None:
        state: _Job = job.state
        if job.cancelled:
            small = state.small
            assert small is not None
            job.resolve(_cancelled(small) if state.partial else small)
            return
        deadline = job.request.deadline
        if state.partial and deadline is not None:  # keep back the time of a small fallback
            deadline -= self.times.estimate("small")
        try:  # the large model, its own prompt form, the same deadline and examples
            state.started = self.clock()
            job.rerun(
                self.large, SUFFIX, lambda big: self._on_large(job, big),
                prompt_form=None, logprobs=False, stop_below=None,  # no signal needed
                deadline=deadline,
            )  # fmt: skip
        except Exception as exc:
            rid = job.request.request_id
            log.warning("cascade: %s not deferred (%s): the small answer", rid, exc)
            self._late(job, "failed")

    def _on_large(self, job: RetryJob, big: GenerationResult) -> None:
        state: _Job = job.state
        small = state.small
        assert small is not None
        self._charge_large(job.request.target_lang, big)
        if big.finish_reason is FinishReason.CANCELLED:
            job.resolve(merged_runs(small, big, job.request.request_id))
            return
        if not big.ok:
            self._late(job, "late" if _refused_for_time(big) else "failed")
            return
        self.times.record("translate", self.clock() - state.started)
        self.times.record_run("large", big)
        merged = merged_runs(small, big, job.request.request_id)
        self._answer(job, "deferred", self._noted(merged, "deferred", state.deferral))

    # -- bookkeeping ----------------------------------------------------------------------------

    def _charge_large(self, lang: str, run: GenerationResult) -> None:
        """Charge what the large model spent on a request to its language's fair share in the
        small model's queue, in small-model tokens (`LargeRunTimes.cost_ratio`): a language
        whose requests are deferred often has used more of the machine, and waits its turn."""
        if self.charge is None or (run.tokens_in == 0 and run.tokens_out == 0):
            return
        ratio = self.times.cost_ratio()
        uncached = max(0, run.tokens_in - run.cached_tokens)
        try:
            self.charge(lang, round(uncached * ratio), round(max(0, run.tokens_out) * ratio))
        except Exception:  # bookkeeping must never lose the answer
            log.exception("cascade: charging %s failed", lang)

    def _suspect(self, r: TranslationRequest, small: GenerationResult) -> bool:
        try:
            found = check(
                r.text, small.text, self.examples, r.target_lang,
                source_lang=r.source_lang, languages=self.languages,
            )  # fmt: skip
        except Exception:  # a detector's bug: decide by the score alone
            log.exception("cascade: checks failed on %s", r.request_id)
            return False
        return found.suspect

    def _late(self, job: RetryJob, reason: str) -> None:
        """The small answer, flagged: deferral did not fit the deadline or failed. After an
        early deferral there is none yet: the small model answers again, whole."""
        state: _Job = job.state
        small = state.small
        assert small is not None
        if state.partial:
            self._small_again(job, reason)
            return
        score = state.deferral.score if state.deferral is not None else None
        notes = {**small.notes, meta.CASCADE: "deadline", meta.CASCADE_REASON: reason}
        if score is not None:
            notes[meta.CASCADE_SCORE] = f"{score:.3f}"
        self._answer(job, "deadline", dataclasses.replace(small, notes=notes, flagged=True))

    def _small_again(self, job: RetryJob, reason: str) -> None:
        """The fallback of an early deferral (module notes, step 5): the small model's whole
        answer, without the early stop, sent flagged; its failure (an expired deadline) is the
        reply."""
        state: _Job = job.state
        partial = state.small
        assert partial is not None

        def done(again: GenerationResult) -> None:
            merged = merged_runs(partial, again, job.request.request_id)
            if not again.ok or job.cancelled:
                job.resolve(merged)
                return
            state.small, state.partial = merged, False
            self._late(job, reason)

        if job.cancelled:
            job.resolve(_cancelled(partial))
            return
        try:
            job.rerun(self.inner, SMALL_SUFFIX, done, logprobs=False, stop_below=None)
        except Exception as exc:
            rid = job.request.request_id
            log.warning("cascade: %s not answered by the small model again (%s)", rid, exc)
            error = f"cascade fallback refused: {exc}"
            job.resolve(
                dataclasses.replace(partial, text="", finish_reason=FinishReason.ERROR, error=error)
            )

    @staticmethod
    def _noted(
        result: GenerationResult, outcome: str, deferral: Deferral | None
    ) -> GenerationResult:
        notes = {**result.notes, meta.CASCADE: outcome}
        if deferral is not None:
            if deferral.score is not None:
                notes[meta.CASCADE_SCORE] = f"{deferral.score:.3f}"
            notes[meta.CASCADE_REASON] = deferral.reason or "score"
        return dataclasses.replace(result, notes=notes)

    def _answer(self, job: RetryJob, outcome: str, result: GenerationResult) -> None:
        lang = job.request.target_lang
        with self._lock:
            self.outcomes[(lang, outcome)] += 1
        if self._metrics is not None:
            self._metrics.cascade_outcomes_total.labels(lang=lang, outcome=outcome).inc()
        job.resolve(result)


def _cancelled(partial: GenerationResult) -> GenerationResult:
    """A stopped small run as the caller's answer once it cancelled: its work, no text."""
    return dataclasses.replace(partial, text="", finish_reason=FinishReason.CANCELLED)


def _refused_for_time(result: GenerationResult) -> bool:
    """A run cut or refused by its deadline (the admission's REJECTED is its estimate of one)."""
    return result.finish_reason in (FinishReason.EXPIRED, FinishReason.REJECTED)
