"""workers/stages/cascade/stage.py around scripted engines (the small model's answers, the large
model's scores and answers): an answer above its pair's threshold kept, one below deferred, one
the checks doubt deferred unscored, a deadline too short for deferral answered by the small
model flagged (never EXPIRED), a failed large run the same, the reply's metadata and the
metrics; early deferral (a small answer stopped once its total is under the threshold) and
its fallback. The real-weights run of the stage is at the end (Gemma 3 small, Qwen 0.5B
large)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from workers import reply_metadata as meta
from workers.engine.types import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    RequestHandle,
    TranslationRequest,
)
from workers.metrics import WorkerMetrics
from workers.stages.cascade.accounting import LargeRunTimes
from workers.stages.cascade.rules import CascadeThresholds
from workers.stages.cascade.stage import SUFFIX, CascadeEngine, CascadeSetup

SOURCE = "Your replacement device will be shipped tomorrow."
GOOD_DE = "Ihr Ersatzgerät wird morgen verschickt."
DOUBTFUL_DE = "Ihr Gerät wird bald geschickt."
LARGE_DE = "Ihr Ersatzgerät wird morgen versendet."
THRESHOLDS = CascadeThresholds("small", "large", "large_logprob", {"en-de": -1.0}, pooled=-1.0)


@dataclass
class Scripted:
    """Answers at once: `answer(text)` for translations, `score(answer)` for score requests
    (None: the scoring fails); records what it was asked."""

    answer: Callable[[TranslationRequest], tuple[str, FinishReason]]
    score: Callable[[str], float | None] = lambda _a: -0.5
    model_version: str = "scripted"
    languages: tuple[str, ...] = ("en", "de")
    translations: list[TranslationRequest] = field(default_factory=list)
    scored: list[str] = field(default_factory=list)
    started: bool = False

    def submit_translation(self, request: TranslationRequest) -> RequestHandle:
        self.translations.append(request)
        text, reason = self.answer(request)
        handle = RequestHandle(request.request_id, lambda _rid: None)
        result = GenerationResult(request.request_id, [1, 2, 3], text, reason, 10, 3)
        handle.set_result(result)
        return handle

    def score_request(self, text: str, source_lang: str, target_lang: str, answer: str,
                      *, request_id: str | None = None,
                      deadline: float | None = None) -> GenerationRequest:  # fmt: skip
        self.scored.append(answer)
        return GenerationRequest(request_id or "s", [0], score_from=0, deadline=deadline)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        value = self.score(self.scored[-1])
        handle = RequestHandle(request.request_id, lambda _rid: None)
        reason = FinishReason.STOP if value is not None else FinishReason.ERROR
        handle.set_result(
            GenerationResult(request.request_id, [1], "", reason, logprob=value, scored_tokens=5)
        )
        return handle

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def start(self) -> None:
        self.started = True

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        self.started = False


def _small(text: str = GOOD_DE) -> Scripted:
    return Scripted(lambda _r: (text, FinishReason.STOP))


def _large(score: Callable[[str], float | None] = lambda a: -0.5 if a == GOOD_DE else -2.0,
           reason: FinishReason = FinishReason.STOP) -> Scripted:  # fmt: skip
    return Scripted(lambda _r: (LARGE_DE, reason), score=score)


def _run(stage: CascadeEngine, deadline: float | None = None) -> GenerationResult:
    request = TranslationRequest("r1", SOURCE, "en", "de", deadline=deadline)
    return stage.submit_translation(request).result(timeout=1)


def test_an_answer_above_its_threshold_is_kept_with_its_score() -> None:
    small, large = _small(GOOD_DE), _large()
    result = _run(CascadeEngine(small, large=large, thresholds=THRESHOLDS))
    assert result.text == GOOD_DE and result.request_id == "r1" and not result.flagged
    assert result.notes[meta.CASCADE] == "small"
    assert result.notes[meta.CASCADE_SCORE] == "-0.500"
    assert large.scored == [GOOD_DE] and large.translations == []


def test_an_answer_below_its_threshold_goes_to_the_large_model() -> None:
    small, large = _small(DOUBTFUL_DE), _large()
    stage = CascadeEngine(small, large=large, thresholds=THRESHOLDS)
    result = _run(stage)
    assert result.text == LARGE_DE and result.request_id == "r1"
    assert result.notes[meta.CASCADE] == "deferred"
    assert result.notes[meta.CASCADE_REASON] == "score"
    assert result.notes[meta.CASCADE_SCORE] == "-2.000"
    (asked,) = large.translations
    assert asked.request_id == "r1" + SUFFIX and asked.prompt_form is None
    assert result.tokens_out == 6  # both runs' work
    assert stage.outcomes[("de", "deferred")] == 1


def test_an_answer_the_checks_doubt_is_deferred_without_a_score() -> None:
    small, large = _small("Ihre Bestellung 4711 wird morgen verschickt."), _large()  # 4711?
    result = _run(CascadeEngine(small, large=large, thresholds=THRESHOLDS))
    assert result.notes[meta.CASCADE] == "deferred"
    assert result.notes[meta.CASCADE_REASON] == "check"
    assert meta.CASCADE_SCORE not in result.notes
    assert large.scored == []


def test_a_deadline_too_short_for_deferral_sends_the_small_answer_flagged() -> None:
    now = [100.0]
    times = LargeRunTimes(score_s=0.3, translate_s=1.0)

    def slow_score(answer: str) -> float:
        now[0] += 0.5  # the scoring took 0.5 s
        return -2.0

    small, large = _small(DOUBTFUL_DE), _large(score=slow_score)
    stage = CascadeEngine(small, large=large, thresholds=THRESHOLDS, times=times,
                          clock=lambda: now[0])  # fmt: skip
    late = _run(stage, deadline=100.5)  # 0.5 s left: not enough to score and translate
    assert late.finish_reason is FinishReason.STOP and late.text == DOUBTFUL_DE
    assert late.flagged and late.notes[meta.CASCADE] == "deadline"
    assert late.notes[meta.CASCADE_REASON] == "late"
    assert large.scored == [] and large.translations == []
    # 1.4 s left: enough to start scoring, but the scoring took 0.5 s, leaving too little
    scored = _run(stage, deadline=101.4)
    assert scored.notes[meta.CASCADE] == "deadline" and scored.notes[meta.CASCADE_SCORE]
    assert large.scored == [DOUBTFUL_DE] and large.translations == []
    assert times.estimate("score") == pytest.approx(0.3 + 0.2 * (0.5 - 0.3))  # learnt
    now[0] = 200.0
    assert _run(stage, deadline=203.0).notes[meta.CASCADE] == "deferred"


def test_a_failed_or_expired_large_run_sends_the_small_answer_flagged() -> None:
    for reason, why in ((FinishReason.EXPIRED, "late"), (FinishReason.ERROR, "failed")):
        small, large = _small(DOUBTFUL_DE), _large(reason=reason)
        result = _run(CascadeEngine(small, large=large, thresholds=THRESHOLDS))
        assert result.ok and result.text == DOUBTFUL_DE and result.flagged
        assert result.notes[meta.CASCADE] == "deadline"
        assert result.notes[meta.CASCADE_REASON] == why
    small, large = _small(DOUBTFUL_DE), _large(score=lambda _a: None)  # the scoring fails
    result = _run(CascadeEngine(small, large=large, thresholds=THRESHOLDS))
    assert result.flagged and result.notes[meta.CASCADE_REASON] == "failed"


def test_a_failed_small_run_passes_through_and_the_small_signal_needs_its_scorer() -> None:
    small = Scripted(lambda _r: ("", FinishReason.EXPIRED))
    large = _large()
    result = _run(CascadeEngine(small, large=large, thresholds=THRESHOLDS))
    assert result.finish_reason is FinishReason.EXPIRED and meta.CASCADE not in result.notes
    own = CascadeThresholds("small", "large", "small_logprob", {}, pooled=-1.0)
    with pytest.raises(ValueError, match="small model's engine"):
        CascadeEngine(small, large=large, thresholds=own)
    scorer = _large(score=lambda _a: -0.2)
    kept = _run(CascadeEngine(_small(), large=large, thresholds=own, small_scorer=scorer))  # type: ignore[arg-type]
    assert kept.notes[meta.CASCADE] == "small" and scorer.scored and not large.scored


def test_metrics_start_stop_and_the_cache_key_note() -> None:
    worker_metrics = WorkerMetrics(registry=CollectorRegistry())
    metrics = worker_metrics.stages  # what the worker binds its stages to
    small, large = _small(DOUBTFUL_DE), _large()
    stage = CascadeEngine(small, large=large, thresholds=THRESHOLDS)
    stage.bind_metrics(metrics)
    stage.start()
    assert large.started and small.started
    _run(stage)
    stage.stop()
    assert not large.started
    reg = worker_metrics.registry
    assert (
        reg.get_sample_value("tolk_cascade_outcomes_total", {"lang": "de", "outcome": "deferred"})
        == 1.0
    )
    assert reg.get_sample_value("tolk_cascade_score_count", {"lang": "de"}) == 1.0
    assert stage.key_note.startswith("cascade=scripted,signal=large_logprob")


def test_a_deferred_request_is_charged_to_its_language_in_small_model_tokens() -> None:
    """Issue #44 item 3: the large model's tokens go on the language's fair share, scaled by
    what a large token costs in small ones (the prior until both models' runs were timed)."""
    charged: list[tuple[str, int, int]] = []
    times = LargeRunTimes(cost_ratio=4.0)
    small, large = _small(DOUBTFUL_DE), _large()
    stage = CascadeEngine(small, large=large, thresholds=THRESHOLDS, times=times,
                          charge=lambda *c: charged.append(c))  # fmt: skip
    _run(stage)
    assert charged == [("de", 40, 12)]  # the large run: 10 prompt + 3 output tokens, x4
    kept = CascadeEngine(_small(GOOD_DE), large=_large(), thresholds=THRESHOLDS, times=times,
                         charge=lambda *c: charged.append(c))  # fmt: skip
    _run(kept)
    assert len(charged) == 1  # nothing deferred, nothing charged beyond the small run


def test_the_cost_ratio_is_learnt_from_both_models_run_times() -> None:
    from workers.engine.types import Timings

    def run(total_s: float, tokens_in: int, tokens_out: int, cached: int = 0) -> GenerationResult:
        return GenerationResult("r", [1], "x", FinishReason.STOP, tokens_in, tokens_out,
                                cached_tokens=cached,
                                timings=Timings(queue_s=0.5, total_s=0.5 + total_s))  # fmt: skip

    times = LargeRunTimes(cost_ratio=4.0, weight=1.0)
    times.record_run("small", run(0.2, 60, 20, cached=50))  # 10 + 2 x 20 = 50 tokens in 0.2 s
    assert times.cost_ratio() == 4.0  # the prior until the large model ran too
    times.record_run("large", run(1.5, 10, 20))  # 50 tokens in 1.5 s
    assert times.cost_ratio() == pytest.approx(7.5)
    times.record_run("large", run(0.0, 10, 20))  # no time measured: ignored
    assert times.cost_ratio() == pytest.approx(7.5)


def test_a_scoring_refused_by_admission_sends_the_small_answer_flagged_late() -> None:
    small = _small(DOUBTFUL_DE)
    scorer = _large()
    scorer.submit = lambda request: _done(request, FinishReason.REJECTED)  # type: ignore[method-assign]
    own = CascadeThresholds("small", "large", "small_total", {}, pooled=-1.0)
    result = _run(CascadeEngine(small, large=_large(), thresholds=own, small_scorer=scorer))  # type: ignore[arg-type]
    assert result.flagged and result.notes[meta.CASCADE] == "deadline"
    assert result.notes[meta.CASCADE_REASON] == "late"


def _done(request: GenerationRequest, reason: FinishReason) -> RequestHandle:
    handle = RequestHandle(request.request_id, lambda _rid: None)
    handle.set_result(GenerationResult(request.request_id, [], "", reason))
    return handle


def test_the_small_signal_read_off_the_answer_needs_no_scoring() -> None:
    """An answer that comes with its tokens' log-probabilities (asked for by the stage) is
    decided on them at once: no scoring request."""
    own = CascadeThresholds("small", "large", "small_total", {"en-de": -4.0}, pooled=-4.0)
    for total, outcome in ((-3.0, "small"), (-6.0, "deferred")):
        small = WithLogprob(lambda _r: (GOOD_DE, FinishReason.STOP), logprob=total / 6)
        scorer, large = _large(), _large()
        stage = CascadeEngine(small, large=large, thresholds=own, small_scorer=scorer)  # type: ignore[arg-type]
        result = _run(stage)
        assert result.notes[meta.CASCADE] == outcome
        assert result.notes[meta.CASCADE_SCORE] == f"{total:.3f}"
        assert scorer.scored == []  # no second pass
        assert small.translations[0].logprobs  # the stage asked for them
        assert all(not r.logprobs for r in large.translations)  # not of the large model


@dataclass
class Yielding(Scripted):
    """A large model's engine that can be told to yield (`Engine.yields_to`)."""

    yields_to: Callable[[], bool] | None = None
    unfinished: bool = False

    def has_unfinished(self) -> bool:
        return self.unfinished


def test_the_served_large_engine_yields_to_the_small_ones_unfinished_work() -> None:
    """Built into the pipeline, the large model steps only while the small model's engine has
    nothing unfinished: the answers most requests get never share the cores with it."""
    from workers.serving.pipeline import ServingOptions, build_served_engine
    from workers.settings import Settings

    small, large = Yielding(lambda _r: (GOOD_DE, FinishReason.STOP)), Yielding(_large().answer)
    options = ServingOptions.of(Settings(), faithful=False, cascade=CascadeSetup(large, THRESHOLDS))
    build_served_engine(small, options, base=small)
    assert large.yields_to is not None and small.yields_to is None
    assert large.yields_to() is False
    small.unfinished = True
    assert large.yields_to() is True


@dataclass
class WithLogprob(Scripted):
    """Answers with its tokens' mean log-probability over 6 tokens."""

    logprob: float = -0.5

    def submit_translation(self, request: TranslationRequest) -> RequestHandle:
        result = super().submit_translation(request).result(timeout=0)
        handle = RequestHandle(request.request_id, lambda _rid: None)
        handle.set_result(dataclasses.replace(result, logprob=self.logprob, scored_tokens=6))
        return handle


@pytest.mark.slow
def test_gemmas_answer_log_probability_is_its_teacher_forced_score(gemma3: Any) -> None:
    """The packaged thresholds were calibrated on teacher-forced scores (`score_request`); the
    served cascade reads the same signal off the generation: both agree on real weights."""
    from workers.engine.engine import Engine, EngineConfig

    engine = Engine(gemma3, EngineConfig(kv_cache_tokens=4096))
    texts = [SOURCE, "Thank you for waiting.", "Wo ist meine Bestellung 4711?"]
    pairs = [("en", "de"), ("en", "de"), ("de", "en")]
    generated = engine.generate([
        engine.translation_request(t, s, g, logprobs=True)
        for t, (s, g) in zip(texts, pairs, strict=True)
    ])  # fmt: skip
    forced = engine.generate([
        engine.score_request(t, s, g, r.text)
        for t, (s, g), r in zip(texts, pairs, generated, strict=True)
    ])  # fmt: skip
    for gen, tf in zip(generated, forced, strict=True):
        assert gen.ok and gen.logprob is not None and tf.logprob is not None
        assert gen.scored_tokens == tf.scored_tokens
        assert gen.logprob == pytest.approx(tf.logprob, abs=0.02)


@pytest.mark.slow
def test_gemma_stopped_early_gives_the_verdict_of_its_whole_answer(gemma3: Any) -> None:
    """Early deferral on real weights: an answer stopped under a bound (half its whole
    total) is the start of the whole answer, its total so far between the two; a bound the
    whole answer stays above (by 0.5) leaves the answer whole."""
    from workers.engine.engine import Engine, EngineConfig

    engine = Engine(gemma3, EngineConfig(kv_cache_tokens=4096))
    turns = [(SOURCE, "en", "de"), ("Wo ist meine Bestellung 4711?", "de", "en"),
             ("Could you please send me a photo of the serial number?", "en", "de")]  # fmt: skip

    def answers(bounds: list[float | None]) -> list[GenerationResult]:
        return engine.generate([
            engine.translation_request(t, s, g, logprobs=True, stop_below=b)
            for (t, s, g), b in zip(turns, bounds, strict=True)
        ])  # fmt: skip

    wholes = answers([None] * len(turns))
    totals = [w.logprob * w.scored_tokens for w in wholes if w.logprob is not None]
    assert len(totals) == len(turns) and all(t < -1.0 for t in totals)
    for whole, early, total in zip(wholes, answers([t / 2 for t in totals]), totals, strict=True):
        assert early.finish_reason is FinishReason.BELOW and early.logprob is not None
        assert whole.token_ids[: len(early.token_ids)] == early.token_ids
        assert total <= early.logprob * early.scored_tokens < total / 2
    for whole, kept in zip(wholes, answers([t - 0.5 for t in totals]), strict=True):
        assert kept.ok and kept.token_ids == whole.token_ids


@pytest.mark.slow
def test_nothing_the_small_engine_ran_stays_counted_as_running(gemma3: Any) -> None:
    """The fair engine's admission hook counts what it admitted until it is observed. Served,
    the cascade's answers and the small model's scorings (`FairScoring`, through the fair
    engine) are observed; the warm-up's requests, sent to the Engine directly, are forgotten
    when they finish. Before, the scorings were sent to the Engine directly and never
    observed: the hook took them for a growing running batch and began refusing translations
    (5 of 60 REJECTED at 1 req/s in the first served run)."""
    import time

    from workers.engine.engine import EngineConfig
    from workers.fairness.policy import LanguagePolicy
    from workers.serving.fair_engine import build_fair_engine
    from workers.serving.pipeline import ServingOptions, build_served_engine
    from workers.settings import Settings
    from workers.stages.cascade.accounting import FairScoring

    policies = {lang: LanguagePolicy(1.0, 5.0, 64, 48) for lang in ("de", "en")}
    fair = build_fair_engine(gemma3, policies, config=EngineConfig(kv_cache_tokens=4096))
    assert fair.admission is not None
    fair.engine.warm(["de", "en"])
    assert fair.admission._typical_batch() == 1  # the warm-up's requests: forgotten
    own = CascadeThresholds("gemma3-270m", "large", "small_total", {}, pooled=-1e9)  # keep all
    options = ServingOptions.of(Settings(), faithful=False, cascade=CascadeSetup(_large(), own))
    served = build_served_engine(fair, options, base=fair.engine)
    stage = served.stage("cascade")
    assert isinstance(stage.scorer, FairScoring)
    served.start()
    try:
        texts = [SOURCE, "Thank you for waiting.", "The invoice is attached to this message."]
        for i, text in enumerate(texts * 2):
            deadline = time.monotonic() + 30
            request = TranslationRequest(f"q{i}", text, "en", "de", deadline=deadline)
            result = served.submit_translation(request).result(timeout=120)
            assert result.ok and result.notes[meta.CASCADE] == "small", result
            assert meta.CASCADE_SCORE in result.notes  # read off the answer
            # the fallback path: a scoring through the small model's fair engine
            scoring = stage.scorer.score_request(text, "en", "de", result.text, deadline=deadline)
            scored = stage.scorer.submit(scoring).result(timeout=120)
            assert scored.ok and scored.logprob is not None and scored.logprob < 0
        admitted = fair.admission.counts["admitted"]
    finally:
        served.stop()
    assert admitted >= 12  # the six translations and six scorings, each admitted
    assert fair.admission._typical_batch() == 1  # and each observed
    assert stage.times.cost_ratio() == 4.0  # no large run: the prior


def _serve_all(stage: CascadeEngine, texts: list[str]) -> list[GenerationResult]:
    """Each text en -> de through the started stage, all submitted at once."""
    stage.start()
    try:
        handles = [
            stage.submit_translation(TranslationRequest(f"r{i}", t, "en", "de"))
            for i, t in enumerate(texts)
        ]
        return [h.result(timeout=300) for h in handles]
    finally:
        stage.stop()


@pytest.mark.slow
def test_the_cascade_on_real_models_defers_by_the_large_models_score(gemma3: Any) -> None:
    """Gemma 3 270M answers, Qwen 0.5B scores every answer and translates the ones under a
    threshold set between the scores seen: each reply is the model's own that it names."""
    from tests.engine.test_scoring import private_qwen05
    from workers.engine.engine import Engine, EngineConfig

    small = Engine(gemma3, EngineConfig(kv_cache_tokens=4096))
    large = Engine(private_qwen05(), EngineConfig(kv_cache_tokens=4096))  # float32, its own
    texts = [SOURCE, "Thank you for waiting.", "The invoice is attached to this message."]
    # the scores themselves, to put a threshold between them
    answers = [r.text for r in small.generate(
        [small.translation_request(t, "en", "de") for t in texts])]  # fmt: skip
    pairs = zip(texts, answers, strict=True)
    scores = [r.logprob for r in large.generate(
        [large.score_request(t, "en", "de", a) for t, a in pairs])]  # fmt: skip
    assert all(s is not None and s < 0 for s in scores)
    ordered = sorted(s for s in scores if s is not None)
    middle = (ordered[0] + ordered[1]) / 2  # the lowest-scoring answer goes to the large model
    thresholds = CascadeThresholds("gemma3-270m", "qwen2.5-coder-0.5b", "large_logprob",
                                   {"en-de": middle}, pooled=middle)  # fmt: skip
    stage = CascadeEngine(small, large=large, thresholds=thresholds)
    results = _serve_all(stage, texts)
    outcomes = [r.notes[meta.CASCADE] for r in results]
    low = scores.index(ordered[0])
    assert outcomes.count("deferred") >= 1 and outcomes[low] == "deferred"
    for result, answer, outcome in zip(results, answers, outcomes, strict=True):
        assert result.ok and result.text
        if outcome == "small":
            assert result.text == answer


@pytest.mark.slow
def test_the_cascade_on_real_models_defers_early_by_the_small_models_total(gemma3: Any) -> None:
    """Early deferral end to end on real engines: Gemma 3 270M's answers carry their total
    log-probability; a threshold between the lowest two totals stops the lowest answer early
    (reason `early`) and the Qwen 0.5B's own translation goes out; the others are Gemma's whole
    answers."""
    from tests.engine.test_scoring import private_qwen05
    from workers.engine.engine import Engine, EngineConfig

    small = Engine(gemma3, EngineConfig(kv_cache_tokens=4096))
    large = Engine(private_qwen05(), EngineConfig(kv_cache_tokens=4096))
    texts = [SOURCE, "Thank you for waiting.", "The invoice is attached to this message."]
    whole = small.generate([small.translation_request(t, "en", "de", logprobs=True) for t in texts])
    totals = [(r.logprob or 0.0) * r.scored_tokens for r in whole]
    ordered = sorted(totals)
    middle = (ordered[0] + ordered[1]) / 2
    thresholds = CascadeThresholds("gemma3-270m", "qwen2.5-coder-0.5b", "small_total",
                                   {"en-de": middle}, pooled=middle)  # fmt: skip
    low = totals.index(ordered[0])
    (large_answer,) = large.generate([large.translation_request(texts[low], "en", "de")])
    stage = CascadeEngine(small, large=large, thresholds=thresholds, small_scorer=small)
    results = _serve_all(stage, texts)
    deferred = results[low]
    assert deferred.ok and deferred.notes[meta.CASCADE] == "deferred"
    assert deferred.notes[meta.CASCADE_REASON] == "early"
    assert deferred.text == large_answer.text
    small_tokens = deferred.tokens_out - large_answer.tokens_out  # the stopped small run's
    assert 0 < small_tokens <= whole[low].tokens_out
    for i, result in enumerate(results):
        if i != low:
            assert result.notes[meta.CASCADE] == "small" and result.text == whole[i].text


def test_the_worker_refuses_a_cascade_its_thresholds_were_not_calibrated_for(
    tmp_path: Any,
) -> None:
    """`tolk worker --cascade`: the large model's scores have its own scale, so thresholds
    calibrated with another scoring model refuse the start (with the command that calibrates),
    as do a cascade onto the served model itself and a thresholds file that is not one."""
    from pathlib import Path
    from types import SimpleNamespace

    from workers.engine.engine import EngineConfig
    from workers.worker_start import StartRefused, WorkerPlan, _cascade_setup

    def plan(cascade: str, thresholds: Path | None = None) -> WorkerPlan:
        return WorkerPlan(
            device="cpu", resolved_device="cpu", triton_kernels=False, cuda_graphs=False,
            quantize=None, compile_decode=None, auto=True, tm_examples=0, tm_dir=tmp_path,
            faithful=True, faithful_policy="withhold", protect_spans=False, cache=False,
            context=False, cascade=cascade, cascade_thresholds=thresholds,
        )  # fmt: skip

    gemma = SimpleNamespace(model="gemma3-270m")
    config = EngineConfig(model="gemma3-270m")
    by_large = tmp_path / "large.json"
    CascadeThresholds("gemma3-270m", "qwen2.5-coder-1.5b", "large_logprob", {}, -1.0).save(by_large)
    with pytest.raises(StartRefused, match="calibrate them: python -m bench.cascade") as refused:
        _cascade_setup(gemma, plan("qwen2.5-coder-0.5b", by_large), tmp_path, config)
    assert refused.value.option == "--cascade-thresholds"
    by_small = tmp_path / "small.json"
    CascadeThresholds("gemma3-270m", "qwen2.5-coder-1.5b", "small_total", {}, -9.0).save(by_small)
    smol = SimpleNamespace(model="smollm2-135m")  # scored by a small model it was not fit on
    with pytest.raises(StartRefused, match="calibrated with gemma3-270m"):
        _cascade_setup(smol, plan("qwen2.5-coder-1.5b", by_small), tmp_path, config)
    with pytest.raises(StartRefused, match="already serves"):
        _cascade_setup(gemma, plan("gemma3-270m"), tmp_path, config)
    (tmp_path / "t.json").write_text("[]")
    with pytest.raises(StartRefused, match="not a cascade thresholds file"):
        _cascade_setup(gemma, plan("smollm2-135m", tmp_path / "t.json"), tmp_path, config)


@pytest.mark.slow
def test_the_worker_builds_the_large_engine_on_the_small_ones_device(tmp_path: Any) -> None:
    """`tolk worker --cascade` builds the large model's engine from the small one's final
    configuration (the device resolved, not "auto"), with the large model's own weights."""
    from types import SimpleNamespace

    from workers.engine.engine import EngineConfig
    from workers.worker_start import WorkerPlan, _cascade_setup

    thresholds = tmp_path / "t.json"
    CascadeThresholds("gemma3-270m", "qwen2.5-coder-0.5b", "small_total", {}, -9.0).save(thresholds)
    plan = WorkerPlan(
        device="auto", resolved_device="cpu", triton_kernels=False, cuda_graphs=False,
        quantize=None, compile_decode=None, auto=False, tm_examples=0, tm_dir=tmp_path,
        faithful=True, faithful_policy="withhold", protect_spans=False, cache=False,
        context=False, cascade="qwen2.5-coder-0.5b", cascade_thresholds=thresholds,
    )  # fmt: skip
    small = EngineConfig(model="gemma3-270m", device="cpu", kv_cache_tokens=2048)
    setup = _cascade_setup(SimpleNamespace(model="gemma3-270m"), plan, tmp_path, small)
    try:
        assert setup.large.config.model == "qwen2.5-coder-0.5b"
        assert setup.large.config.device == "cpu" and setup.large.config.draft is None
        assert setup.large.config.release_pool_when_idle  # idle most of the time
        assert setup.thresholds.signal == "small_total" and setup.early  # on by default
        (result,) = setup.large.generate(
            [setup.large.translation_request("Thank you for waiting.", "en", "de")]
        )
        assert result.ok and result.text
    finally:
        del setup


@dataclass
class Stopping(Scripted):
    """A small model whose answers' tokens have these log-probabilities; with `stop_below` an
    answer ends BELOW at the first token whose running sum is under it, as the engine's does."""

    token_logprobs: tuple[float, ...] = (-0.5,) * 6

    def submit_translation(self, request: TranslationRequest) -> RequestHandle:
        self.translations.append(request)
        text, reason = self.answer(request)
        total, n = 0.0, 0
        for value in self.token_logprobs:
            total, n = total + value, n + 1
            if request.stop_below is not None and total < request.stop_below:
                text, reason = text[: 3 * n], FinishReason.BELOW
                break
        handle = RequestHandle(request.request_id, lambda _rid: None)
        handle.set_result(GenerationResult(request.request_id, [1] * n, text, reason, 10, n,
                                           logprob=total / n, scored_tokens=n))  # fmt: skip
        return handle


TOTAL = CascadeThresholds("small", "large", "small_total", {"en-de": -4.0}, pooled=-4.0)


def _stopping(*token_logprobs: float) -> Stopping:
    return Stopping(lambda _r: (GOOD_DE, FinishReason.STOP), token_logprobs=token_logprobs)


def test_an_answer_falling_under_its_threshold_is_deferred_before_it_ends() -> None:
    """Early deferral: the small answer stops at the token whose running total crosses the
    pair's threshold, and the large model answers; the verdict is the one the whole answer
    gets without the early stop, and an answer that stays above is kept whole."""
    small, large = _stopping(*(-1.5,) * 6), _large()
    stage = CascadeEngine(small, large=large, thresholds=TOTAL, small_scorer=_large())
    result = _run(stage)
    assert result.text == LARGE_DE and result.notes[meta.CASCADE] == "deferred"
    assert result.notes[meta.CASCADE_REASON] == "early"
    assert result.notes[meta.CASCADE_SCORE] == "-4.500"  # the total when it stopped
    assert small.translations[0].stop_below == -4.0
    assert result.tokens_out == 3 + 3  # three small tokens, not six, then the large answer
    (asked,) = large.translations
    assert asked.stop_below is None and not asked.logprobs
    whole = CascadeEngine(_stopping(*(-1.5,) * 6), large=_large(), thresholds=TOTAL,
                          small_scorer=_large(), early=False)  # fmt: skip
    late = _run(whole)
    assert late.notes[meta.CASCADE] == "deferred" and late.notes[meta.CASCADE_REASON] == "score"
    assert late.tokens_out == 6 + 3
    kept = _run(CascadeEngine(_stopping(*(-0.5,) * 6), large=_large(), thresholds=TOTAL,
                              small_scorer=_large()))  # fmt: skip
    assert kept.text == GOOD_DE and kept.notes[meta.CASCADE] == "small"


def test_an_early_deferral_that_fails_sends_the_whole_small_answer_flagged() -> None:
    """Issue #44 Done-when 4 after an early stop (scripted clock): the large run's deadline
    keeps back the time of a whole small answer; when the large run fails, or the deadline no
    longer allows it, the small model answers again without the stop, sent flagged."""
    now = [200.0]
    times = LargeRunTimes(translate_s=1.0, small_s=0.2)
    small, large = _stopping(*(-1.5,) * 6), _large(reason=FinishReason.ERROR)
    stage = CascadeEngine(small, large=large, thresholds=TOTAL, small_scorer=_large(),
                          times=times, clock=lambda: now[0])  # fmt: skip
    result = _run(stage, deadline=210.0)
    assert result.ok and result.text == GOOD_DE and result.flagged
    assert result.notes[meta.CASCADE] == "deadline"
    assert result.notes[meta.CASCADE_REASON] == "failed"
    assert large.translations[0].deadline == pytest.approx(209.8)  # 0.2 s kept back
    first, again = small.translations
    assert first.stop_below == -4.0
    assert again.request_id == "r1~small" and again.stop_below is None and not again.logprobs
    assert result.tokens_out == 3 + 6  # the partial and the whole small answer

    def slow_small(_r: TranslationRequest) -> tuple[str, FinishReason]:
        now[0] += 0.5  # the small run took 0.5 s: the large one no longer fits
        return GOOD_DE, FinishReason.STOP

    small = Stopping(slow_small, token_logprobs=(-1.5,) * 6)
    large = _large()
    stage = CascadeEngine(small, large=large, thresholds=TOTAL, small_scorer=_large(),
                          times=times, clock=lambda: now[0])  # fmt: skip
    now[0] = 300.0
    result = _run(stage, deadline=301.5)  # 1.5 s: room for small + large + small at the start
    assert small.translations[0].stop_below == -4.0
    assert result.ok and result.flagged and result.notes[meta.CASCADE_REASON] == "late"
    assert large.translations == [] and len(small.translations) == 2


def test_no_early_stop_without_room_for_the_fallback_or_with_a_mean_signal() -> None:
    """The small run stops early only when the deadline leaves time for it, the large run and
    a whole small answer again; a mean log-probability can climb back: never stopped early."""
    now = [100.0]
    times = LargeRunTimes(translate_s=1.0, small_s=0.2)
    small = _stopping(*(-1.5,) * 6)
    stage = CascadeEngine(small, large=_large(), thresholds=TOTAL, small_scorer=_large(),
                          times=times, clock=lambda: now[0])  # fmt: skip
    result = _run(stage, deadline=101.3)  # 0.2 + 1.0 + 0.2 s do not fit
    assert small.translations[0].stop_below is None
    assert result.notes[meta.CASCADE_REASON] == "score" and result.notes[meta.CASCADE] == "deferred"
    mean = CascadeThresholds("small", "large", "small_logprob", {"en-de": -1.0}, pooled=-1.0)
    small = _stopping(*(-1.5,) * 6)
    result = _run(CascadeEngine(small, large=_large(), thresholds=mean, small_scorer=_large()))
    assert small.translations[0].stop_below is None and small.translations[0].logprobs
    assert result.notes[meta.CASCADE] == "deferred"


def test_the_pipeline_builds_the_stage_with_the_workers_early_deferral_setting() -> None:
    """`--no-cascade-early` reaches the stage through `CascadeSetup.early`."""
    from workers.serving.pipeline import ServingOptions, build_served_engine
    from workers.settings import Settings

    for early in (True, False):
        small = Yielding(lambda _r: (GOOD_DE, FinishReason.STOP))
        setup = CascadeSetup(Yielding(_large().answer), TOTAL, early=early)
        served: Any = build_served_engine(
            small, ServingOptions.of(Settings(), faithful=False, cascade=setup), base=small
        )
        while not isinstance(served, CascadeEngine):
            served = served.inner
        assert served.early is early


def test_a_request_cancelled_before_its_small_run_stopped_early_answers_cancelled() -> None:
    """The caller cancels while the small run is in flight; the run then ends BELOW: the
    caller gets CANCELLED without the partial text, and the large model is never asked."""
    pending: list[RequestHandle] = []

    class Held(Stopping):
        def submit_translation(self, request: TranslationRequest) -> RequestHandle:
            self.translations.append(request)
            handle = RequestHandle(request.request_id, lambda _rid: None)
            pending.append(handle)
            return handle

    small, large = Held(lambda _r: (GOOD_DE, FinishReason.STOP)), _large()
    stage = CascadeEngine(small, large=large, thresholds=TOTAL, small_scorer=_large())
    handle = stage.submit_translation(TranslationRequest("r1", SOURCE, "en", "de"))
    handle.cancel()
    pending[0].set_result(GenerationResult("r1", [1, 1, 1], "Ihr", FinishReason.BELOW, 10, 3,
                                           logprob=-1.5, scored_tokens=3))  # fmt: skip
    result = handle.result(timeout=1)
    assert result.finish_reason is FinishReason.CANCELLED and result.text == ""
    assert large.translations == []
